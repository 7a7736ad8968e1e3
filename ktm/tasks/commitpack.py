"""CommitPackFT-style code editing: given old Python code and a commit subject, write the new code.

Scored by perplexity of ``new_contents``. Data: ``commitpackft_style_python_mined.jsonl.gz`` in
``commitpackft_python/`` (real commits mined with CommitPackFT's rules, see its PROVENANCE.md).
Records are kept only when ``len(old_contents) + len(new_contents) <= max_chars`` (default 3000
characters, about 1,000 tokens, 977 of the 7,857 shipped records) so a CPU run fits; pass
``max_chars=None`` for all. Records with a blank ``new_contents`` are skipped (nothing to score).
``heldout_repos_test.jsonl.gz`` (five repositories absent from the main file) is evaluation only:
give it as ``eval_path``; it is refused as training data.

The train/test split is drawn over the whole file *before* the length filter, so a record's side
never depends on ``max_chars``: reader pretraining on the train side of the file (any length) can
never see a commit that a task run with any ``max_chars`` evaluates on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from ktm.core.prompt import Segment
from ktm.errors import KTMError
from ktm.tasks.base import Example, PromptMode, TaskKind
from ktm.tasks.jsonl import read_jsonl, task_files
from ktm.tasks.split import (
    cycle_shuffled,
    sample_without_replacement,
    split_indices,
    test_size_from_fraction,
)

DEFAULT_FILE = "commitpackft_python/commitpackft_style_python_mined.jsonl.gz"
HELDOUT_FILE = "commitpackft_python/heldout_repos_test.jsonl.gz"
EVAL_ONLY = ("heldout_repos_test.jsonl.gz",)
FIELDS = {"old_contents": str, "new_contents": str, "subject": str}
# The reference prompt, typo ("instrutions") included: a fine-tuned model sees it verbatim.
HEADER = "Update the old python code content based on the instrutions.\nOld Content: "


@dataclass(frozen=True)
class Commit:
    old: str
    new: str
    subject: str
    line_no: int


def commit_prompt(old: str, subject: str, mode: PromptMode) -> tuple[Segment, ...]:
    """The paper's prompt; "context" mode compresses the header and old code only."""
    tail = f"\nInstructions: {subject}\nNew Content:\n"
    if mode == "paper":
        return (Segment(HEADER + old + tail),)
    return (Segment(HEADER + old), Segment(tail, compress=False))


def load_commits(path: Path, max_chars: int | None) -> list[Commit]:
    """Records whose old + new code is at most ``max_chars`` characters (all when None).

    A record whose ``new_contents`` is blank (a deleted file) is skipped: there is no target to
    score (CommitPackFT keeps none; the shipped files have none).
    """
    return _fit(path, [Commit(row["old_contents"], row["new_contents"], row["subject"], line_no)
                       for line_no, row in read_jsonl(path, FIELDS)
                       if row["new_contents"].strip()], max_chars)


def _fit(path: Path, commits: list[Commit], max_chars: int | None) -> list[Commit]:
    out = [c for c in commits if max_chars is None or len(c.old) + len(c.new) <= max_chars]
    if not out:
        raise KTMError(f"{path}: no record has old+new <= max_chars={max_chars}; raise max_chars")
    return out


@dataclass
class CommitPackTask:
    """Old code + instruction -> new code; split by seed, scored by perplexity."""

    data_path: str | Path | None = None  # None: the shipped mined file
    prompt_mode: PromptMode = "context"
    max_chars: int | None = 3000  # keep records with len(old) + len(new) <= this
    test_fraction: float = 0.2  # share of data_path's records held out (before max_chars)
    test_size: int | None = None  # or an exact number of records held out (before max_chars)
    split_seed: int = 42
    eval_path: str | Path | None = None  # evaluate on this file instead (e.g. HELDOUT_FILE)
    name: str = field(default="commitpack", init=False)
    kind: TaskKind = field(default="perplexity", init=False)
    labels: tuple[str, ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        self.path, self.eval_file = task_files(
            self, DEFAULT_FILE, EVAL_ONLY, "repositories held out for a cross-repository test")

    @cached_property
    def all_commits(self) -> list[Commit]:
        """Every record of ``data_path``, before the length filter."""
        return load_commits(self.path, None)

    @cached_property
    def commits(self) -> list[Commit]:
        return _fit(self.path, self.all_commits, self.max_chars)

    @cached_property
    def _split(self) -> tuple[list[int], list[int]]:
        n = len(self.all_commits)
        size = self.test_size if self.test_size is not None else test_size_from_fraction(
            n, self.test_fraction)
        return split_indices(n, size, self.split_seed, source=str(self.path), items="records")

    def train_side(self) -> list[Commit]:
        """The train side of the split at every length: the text reader pretraining may use."""
        return [self.all_commits[i] for i in self._split[0]]

    @cached_property
    def train_commits(self) -> list[Commit]:
        return _fit(self.path, self.train_side(), self.max_chars)

    @cached_property
    def eval_commits(self) -> list[Commit]:
        if self.eval_file is not None:
            return load_commits(self.eval_file, self.max_chars)
        return _fit(self.path, [self.all_commits[i] for i in self._split[1]], self.max_chars)

    def train_examples(self, n: int, seed: int) -> list[Example]:
        """``n`` training records in reshuffled passes."""
        pool = self.train_commits
        return [self._example(pool[i]) for i in cycle_shuffled(n, len(pool), seed)]

    def eval_examples(self, n: int, seed: int) -> list[Example]:
        """``min(n, available)`` distinct held-out records."""
        pool = self.eval_commits
        return [self._example(pool[i]) for i in sample_without_replacement(n, len(pool), seed)]

    def _example(self, commit: Commit) -> Example:
        return Example(
            segments=commit_prompt(commit.old, commit.subject, self.prompt_mode),
            target=commit.new,
            meta={"line": commit.line_no},
        )
