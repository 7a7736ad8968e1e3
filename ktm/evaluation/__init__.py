"""Scoring models and reading results: task evaluation, metrics, readability R, label
scoring, ``ktm report``'s tables, plots and curves, and ``ktm eval`` as a library function
(``ktm.evaluation.runner.run(EvalConfig(...))``).
"""
