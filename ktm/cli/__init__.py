"""The ``ktm`` command line: each command's flags are built from its config dataclass; the demo.
"""
