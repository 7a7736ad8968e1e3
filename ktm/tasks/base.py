"""The contract every task implements: examples in, a score out.

A task file defines one class and adds one line to ``ktm.tasks.TASKS``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from ktm.prompt import Segment

TaskKind = Literal["classification", "perplexity"]
PromptMode = Literal["paper", "context"]  # paper: whole prompt compressed; context: question plain


@dataclass(frozen=True)
class Example:
    """One prompt and the text the model should produce after it.

    ``target`` is what the loss covers (an EOS is appended by the model, not here). ``label`` is the
    gold class for classification tasks (usually equal to ``target``).
    """

    segments: tuple[Segment, ...]
    target: str
    label: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class Task(Protocol):
    name: str
    kind: TaskKind
    labels: tuple[str, ...]  # empty for perplexity tasks

    def train_examples(self, n: int, seed: int) -> list[Example]: ...

    def eval_examples(self, n: int, seed: int) -> list[Example]: ...

    # classification tasks: the target text that answers ``label`` (likelihood scoring reads it)
    def label_target(self, label: str) -> str: ...
