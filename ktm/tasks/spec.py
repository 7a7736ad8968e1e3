"""``TaskSpec``: which task a command builds (its name, stage, prompt mode, data file) and how
many examples it draws; and what a result row records of the task as really built."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ktm.tasks import TASKS, get_task
from ktm.tasks.tree_gen import STAGES
from ktm.util.field_types import check_at_least
from ktm.util.provenance import plain


@dataclass(frozen=True)
class TaskSpec:
    task: str = field(default="tree", metadata={"choices": sorted(TASKS), "help": "the task"})
    stage: str = field(default="xmedium", metadata={"choices": list(STAGES),
                                                    "help": "tree stage (tree task only)"})
    prompt_mode: str = field(default="context", metadata={
        "choices": ["context", "paper"],
        "help": "context: the question plain | paper: all compressed"})
    data_path: str | None = field(default=None, metadata={
        "help": "a JSONL (.gz too) of the task's schema instead of its shipped file; required "
                "by custom (context, optional prompt, target)"})
    n_train: int = field(default=2000, metadata={"help": "training examples to draw"})
    n_eval: int = field(default=200, metadata={"help": "evaluation examples"})

    def __post_init__(self) -> None:
        # n_eval 0 failed at the evaluation after training
        check_at_least(self, 1, "n_train", "n_eval", flags=True)

    def build(self, options: Mapping[str, Any] | None = None):
        """The task, with its constructor ``options`` (``max_chars=400``, ``length=4096``...)."""
        kwargs: dict[str, Any] = {"prompt_mode": self.prompt_mode, **(options or {})}
        if self.task == "tree":
            kwargs["stage"] = self.stage
        if self.data_path:
            kwargs["data_path"] = self.data_path
        return get_task(self.task, **kwargs)


def task_settings(task) -> dict[str, Any]:
    """Every constructor setting of the task as it was really built (options included), and
    the data file it read (None: generated, e.g. trees without the data folder)."""
    return {"name": task.name, **{f.name: plain(getattr(task, f.name))
                                  for f in dataclasses.fields(task) if f.init},
            "file": plain(getattr(task, "path", None))}
