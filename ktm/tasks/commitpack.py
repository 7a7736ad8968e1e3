"""CommitPackFT-style code editing: given old Python code and a commit subject, write the new code.

Scored by perplexity of ``new_contents``. Data: ``commitpackft_style_python_mined.jsonl.gz`` in
``commitpackft_python/`` (real commits mined with CommitPackFT's rules, see its PROVENANCE.md).
Records are kept only when ``len(old_contents) + len(new_contents) <= max_chars`` (default 3000
characters, about 1,000 tokens, 977 of the 7,857 shipped records) so a CPU run fits; pass
``max_chars=None`` for all.
``heldout_repos_test.jsonl.gz`` (five repositories absent from the main file) is evaluation only:
give it as ``eval_path``; it is refused as training data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from ktm.errors import KTMError
from ktm.prompt import Segment
from ktm.tasks.base import Example, PromptMode, TaskKind
from ktm.tasks.jsonl import read_jsonl, task_files
from ktm.tasks.split import cycle_shuffled, sample_without_replacement, split_indices

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
    """Records whose old + new code is at most ``max_chars`` characters (all when None)."""
    out = [
        Commit(row["old_contents"], row["new_contents"], row["subject"], line_no)
        for line_no, row in read_jsonl(path, FIELDS)
        if max_chars is None or len(row["old_contents"]) + len(row["new_contents"]) <= max_chars
    ]
    if not out:
        raise KTMError(f"{path}: no record has old+new <= max_chars={max_chars}; raise max_chars")
    return out


@dataclass
class CommitPackTask:
    """Old code + instruction -> new code; split by seed, scored by perplexity."""

    data_path: str | Path | None = None  # None: the shipped mined file
    prompt_mode: PromptMode = "context"
    max_chars: int | None = 3000  # keep records with len(old) + len(new) <= this
    test_size: int = 100  # records held out from data_path
    split_seed: int = 42
    eval_path: str | Path | None = None  # evaluate on this file instead (e.g. HELDOUT_FILE)
    name: str = field(default="commitpack", init=False)
    kind: TaskKind = field(default="perplexity", init=False)
    labels: tuple[str, ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        self.path, self.eval_file = task_files(
            self, DEFAULT_FILE, EVAL_ONLY, "repositories held out for a cross-repository test")

    @cached_property
    def commits(self) -> list[Commit]:
        return load_commits(self.path, self.max_chars)

    @cached_property
    def _split(self) -> tuple[list[int], list[int]]:
        return split_indices(len(self.commits), self.test_size, self.split_seed)

    @cached_property
    def train_commits(self) -> list[Commit]:
        return [self.commits[i] for i in self._split[0]]

    @cached_property
    def eval_commits(self) -> list[Commit]:
        if self.eval_file is not None:
            return load_commits(self.eval_file, self.max_chars)
        return [self.commits[i] for i in self._split[1]]

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
