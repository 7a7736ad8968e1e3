"""The contract every task implements: examples in, a score out.

A task file defines one class and adds one line to ``ktm.tasks.TASKS``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from ktm.core.prompt import Segment, as_segments
from ktm.errors import KTMError

# qa: an open question about a long document, scored by whether the greedy answer holds every
# asked value (``Example.meta["answers"]``)
TaskKind = Literal["classification", "perplexity", "qa"]
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


def check_examples(examples: Any) -> None:
    """Refuse training data that would fail only at the step that reads it (a run folder
    half-written by then): not an indexable sequence (a generator), empty, or an item that is not
    an ``Example`` whose segments make a prompt and whose target is text or token ids. A stream
    (``is_stream``, reader pretraining) is open-ended: only its first item is read."""
    if not (hasattr(examples, "__len__") and hasattr(examples, "__getitem__")):
        raise KTMError(f"examples must be a sequence of Example (a list), got "
                       f"{type(examples).__name__}: wrap an iterable in list(...)")
    if not len(examples):
        raise KTMError("no training examples: expected at least one")
    n = 1 if getattr(examples, "is_stream", False) else len(examples)
    for i in range(n):
        e = examples[i]
        if not isinstance(e, Example):
            raise KTMError(f"examples[{i}] is a {type(e).__name__} ({e!r:.60}): expected "
                           "ktm.tasks.base.Example(segments, target)")
        try:
            as_segments(e.segments)
            if not isinstance(e.target, str):
                [operator.index(t) for t in e.target]
        except (KTMError, TypeError) as err:
            raise KTMError(f"examples[{i}] is malformed: {err} (expected segments making a "
                           "prompt and a str target or token ids)") from None


def qa_prompt(document: str, question: str, mode: PromptMode) -> tuple[Segment, ...]:
    """A question task's prompt: the document merged, the question after it plain and marked
    (``ktm.core.question.asking``; "paper": both merged, as one segment)."""
    if mode == "paper":
        return (Segment(document + question),)
    return (Segment(document), Segment(question, question=True))


def bind(task, model) -> None:
    """Give a task that counts lengths in tokens (``qa`` tasks: needles of 1,024 tokens) the
    model's tokenizer, before it draws examples; other tasks need none."""
    if hasattr(task, "bind"):
        task.bind(model.tokenizer)


class Task(Protocol):
    name: str
    kind: TaskKind
    labels: tuple[str, ...]  # empty for perplexity tasks

    def train_examples(self, n: int, seed: int) -> list[Example]: ...

    def eval_examples(self, n: int, seed: int) -> list[Example]: ...

    # classification tasks: the target text that answers ``label`` (likelihood scoring reads it)
    def label_target(self, label: str) -> str: ...
