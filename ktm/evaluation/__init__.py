"""Scoring models and reading results: task evaluation, metrics, readability R, label
scoring, and ``ktm report``'s tables, plots and curves.
"""
