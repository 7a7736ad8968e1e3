"""Your own data: compress a context, answer a plain prompt about it, no code to write.

Data: ``data_path`` (required), a JSONL (or .jsonl.gz) file, one object per line::

    {"context": "<long text to merge>", "prompt": "<optional question>", "target": "<answer>"}

The field names are options (``context_field``, ``prompt_field``, ``target_field``). ``context``
and ``target`` are required non-empty strings; ``prompt`` may be absent, null or empty. Strings
are data, read verbatim: a ``"\r\n"`` inside one stays (README, Data, "Line ends").

Layout, in "context" mode (the default)::

    [context, merged] [ "\\n" + prompt + "\\n", plain ] -> target

and without a prompt just ``[context, merged] ["\\n", plain]``: the plain newline tells the
model where the merged context ends, and the target starts a line, so a label is spelled as a bare
word (no leading space, as tree's answers after ``"Answer: "``). "paper" mode merges it all as one
segment. Nothing else is added: no header, no cue words the user did not write.

Split: ``test_fraction`` (or exactly ``test_size``) of the rows held out by ``split_seed``, as
commitpack does; with ``eval_path`` every row of ``data_path`` trains and ``eval_path`` is scored.

Metric: ``accuracy`` treats each stripped target as a label (exact match of the stripped
generated answer; balanced accuracy over the training labels; ``--scoring likelihood`` works);
Unicode-equivalent spellings ("café" composed, or "e" + a combining accent) and spellings that
differ only by invisible format characters (a zero-width space, a BOM) are one label,
spelled as the training rows spell it most often;
``perplexity`` scores the target text as given. ``auto`` picks accuracy when the training rows
have at most ``AUTO_MAX_LABELS`` distinct targets and every evaluation target is one of them,
else perplexity; the result row records the choice as ``metric``.
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from ktm.core.prompt import Segment
from ktm.errors import KTMError
from ktm.tasks.amazon import EVAL_ONLY as AMAZON_EVAL_ONLY
from ktm.tasks.base import Example, PromptMode, TaskKind
from ktm.tasks.commitpack import EVAL_ONLY as COMMITPACK_EVAL_ONLY
from ktm.tasks.jsonl import read_jsonl, refuse_eval_only, resolve_data_path, row_error
from ktm.tasks.labels import drop_format, match_label
from ktm.tasks.split import (
    cycle_shuffled,
    sample_without_replacement,
    split_indices,
    test_size_from_fraction,
)

Metric = Literal["auto", "accuracy", "perplexity"]
AUTO_MAX_LABELS = 20  # more distinct targets than this is free text, not a label set


@dataclass(frozen=True)
class Row:
    context: str
    prompt: str
    target: str
    line_no: int
    file: str = ""  # the data file it was read from, for errors naming its line


def custom_prompt(context: str, prompt: str, mode: PromptMode) -> tuple[Segment, ...]:
    """The context merged, then the prompt (if any) plain, between newlines (module docstring)."""
    tail = f"\n{prompt}\n" if prompt else "\n"
    if mode == "paper":
        return (Segment(context + tail),)
    return (Segment(context), Segment(tail, compress=False))


def load_rows(path: Path, context: str, prompt: str, target: str) -> list[Row]:
    """Every row of ``path``; a missing, non-string or empty context or target is an error."""
    out = []
    for line_no, row in read_jsonl(path, {context: str, target: str}):
        for name in (context, target):
            if not drop_format(row[name]).strip():  # invisible characters alone are empty
                raise row_error(path, line_no, f"field {name!r} must be a non-empty string")
        question = _optional_str(path, line_no, row, prompt)
        out.append(Row(row[context], question, row[target], line_no, str(path)))
    if not out:
        raise KTMError(f"{path} holds no rows: expected JSON objects with {context!r} and "
                       f"{target!r}")
    return out


def label_key(target: str) -> str:
    """What makes two targets one label: the same stripped text in Unicode's composed form (NFC),
    without format characters (``drop_format``: a zero-width space, a BOM), so "café" typed
    composed and with a combining accent, or "yes" and "yes" with an invisible zero-width space
    pasted in, is one class, not two that split its rows (a model answering either spelling is
    right: ``match_label``)."""
    return unicodedata.normalize("NFC", drop_format(target).strip())


def _optional_str(path: Path, line_no: int, row: dict[str, Any], name: str) -> str:
    value = row.get(name)
    if value is not None and not isinstance(value, str):
        raise row_error(path, line_no, f"field {name!r} must be str or absent, got "
                        f"{type(value).__name__}")
    return value or ""


@dataclass
class CustomTask:
    """Context (merged) + optional prompt (plain) -> target, from the user's JSONL."""

    data_path: str | Path | None = None  # required: the user's JSONL
    prompt_mode: PromptMode = "context"
    context_field: str = "context"
    prompt_field: str = "prompt"
    target_field: str = "target"
    metric: Metric = "auto"
    test_fraction: float = 0.2  # share of data_path's rows held out
    test_size: int | None = None  # or an exact number of rows held out
    split_seed: int = 42
    eval_path: str | Path | None = None  # evaluate on this file; data_path then all trains
    name: str = field(default="custom", init=False)

    def __post_init__(self) -> None:
        if self.data_path is None:
            raise KTMError("task 'custom' needs the option data_path: your JSONL, e.g. "
                           "--task-option data_path=my.jsonl (or --data-path my.jsonl)")
        if self.prompt_mode not in ("paper", "context"):
            raise KTMError(f"prompt_mode={self.prompt_mode!r}: expected 'paper' or 'context'")
        if self.metric not in ("auto", "accuracy", "perplexity"):
            raise KTMError(f"metric={self.metric!r}: expected 'auto', 'accuracy' or 'perplexity'")
        test_size_from_fraction(2, self.test_fraction)  # validates the fraction early
        self.path = resolve_data_path(self.data_path, "")
        # the shipped evaluation-only sets stay evaluation-only, whatever the task reads them as
        refuse_eval_only(self.path, AMAZON_EVAL_ONLY + COMMITPACK_EVAL_ONLY,
                         "a shipped held-out set")
        self.eval_file = None if self.eval_path is None else resolve_data_path(self.eval_path, "")

    def _load(self, path: Path) -> list[Row]:
        return load_rows(path, self.context_field, self.prompt_field, self.target_field)

    @cached_property
    def rows(self) -> list[Row]:
        return self._load(self.path)

    @cached_property
    def _split(self) -> tuple[list[int], list[int]]:
        n = len(self.rows)
        if self.eval_file is not None:
            return list(range(n)), []
        size = self.test_size if self.test_size is not None else test_size_from_fraction(
            n, self.test_fraction)
        return split_indices(n, size, self.split_seed, source=str(self.path), items="rows")

    @cached_property
    def train_rows(self) -> list[Row]:
        return [self.rows[i] for i in self._split[0]]

    @cached_property
    def eval_rows(self) -> list[Row]:
        if self.eval_file is not None:
            return self._load(self.eval_file)
        return [self.rows[i] for i in self._split[1]]

    @cached_property
    def chosen_metric(self) -> str:
        """``metric``, with ``auto`` decided from the data (module docstring)."""
        seen = self._spellings
        unseen = sorted({label_key(r.target) for r in self.eval_rows} - seen.keys())
        if self.metric == "accuracy" and unseen:
            raise KTMError(f"metric='accuracy' but evaluation targets {unseen[:5]} never occur "
                           "in training: expected every evaluation label among the training "
                           "targets (or metric='perplexity')")
        if self.metric != "auto":
            return self.metric
        return "accuracy" if len(seen) <= AUTO_MAX_LABELS and not unseen else "perplexity"

    @property
    def kind(self) -> TaskKind:
        return "classification" if self.chosen_metric == "accuracy" else "perplexity"

    @cached_property
    def _spellings(self) -> dict[str, str]:
        """Each distinct training label (``label_key``) -> its spelling: the one the training
        rows use most often (ties: the first in sorted order)."""
        counts = Counter(r.target.strip() for r in self.train_rows)
        out: dict[str, str] = {}
        for spelling, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
            out.setdefault(label_key(spelling), spelling)
        return out

    @cached_property
    def labels(self) -> tuple[str, ...]:
        """The distinct training labels as spelled (``_spellings``), sorted; empty when scored
        by perplexity."""
        if self.kind != "classification":
            return ()
        return tuple(sorted(self._spellings.values()))

    def parse_label(self, text: str) -> str | None:
        return match_label(text, self.labels)

    def label_target(self, label: str) -> str:
        """The answer text for ``label``: the label itself (the plain segment ends a line)."""
        return label

    def train_examples(self, n: int, seed: int) -> list[Example]:
        """``n`` training rows in reshuffled passes."""
        pool = self.train_rows
        return [self._example(pool[i]) for i in cycle_shuffled(n, len(pool), seed)]

    def eval_examples(self, n: int, seed: int) -> list[Example]:
        """``min(n, available)`` distinct evaluation rows."""
        pool = self.eval_rows
        return [self._example(pool[i]) for i in sample_without_replacement(n, len(pool), seed)]

    def _example(self, row: Row) -> Example:
        label = self._spellings[label_key(row.target)] if self.kind == "classification" else None
        return Example(
            segments=custom_prompt(row.context, row.prompt, self.prompt_mode),
            target=row.target if label is None else self.label_target(label),
            label=label,
            meta={"line": row.line_no, "file": row.file},
        )
