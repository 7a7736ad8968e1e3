"""Task registry: a task is one file plus one line here."""

from __future__ import annotations

from typing import Any

from ktm.errors import KTMError
from ktm.tasks.amazon import AmazonTask
from ktm.tasks.base import Example, Task
from ktm.tasks.codeqa import CodeQATask
from ktm.tasks.commitpack import CommitPackTask
from ktm.tasks.custom import CustomTask
from ktm.tasks.needle import NeedleTask
from ktm.tasks.options import check_options
from ktm.tasks.tree import TreeTask
from ktm.tasks.vartrack import VarTrackTask

TASKS: dict[str, type] = {
    "tree": TreeTask,
    "amazon": AmazonTask,
    "commitpack": CommitPackTask,
    "custom": CustomTask,
    # questions about long documents (kind "qa"): a needle, a chain of assignments, code
    "needle": NeedleTask,
    "vartrack": VarTrackTask,
    "codeqa": CodeQATask,
}


def get_task(name: str, **kwargs: Any) -> Task:
    """Build the task registered as ``name`` with its constructor keyword arguments, each
    checked against the field's type (``ktm.tasks.options``)."""
    if name not in TASKS:
        raise KTMError(f"unknown task {name!r}: expected one of {', '.join(sorted(TASKS))}")
    return TASKS[name](**check_options(name, TASKS[name], kwargs))


__all__ = ["TASKS", "AmazonTask", "CodeQATask", "CommitPackTask", "CustomTask", "Example",
           "NeedleTask", "Task", "TreeTask", "VarTrackTask", "get_task"]
