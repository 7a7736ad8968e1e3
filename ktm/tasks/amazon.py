"""Amazon Fashion review sentiment: positive when the star rating is above 3.5.

Data: ``amazon_reviews_fashion/amazon_fashion_2018_combined.jsonl.gz`` (2018 crawl; the paper used
the 2023 one, see its PROVENANCE.md). Rows carry ``text`` and ``rating``; the original 2018 schema
(``reviewText``, ``overall``) is read too; a rating outside 1-5 stars is an error. Reviews with
empty text are skipped, and text is cut to ``max_chars`` characters (default 1000) so one long
review cannot dominate a CPU run.

Target text: the prompt ends with ``"Label:"`` and the target is ``" positive"`` / ``" negative"``
with a leading space, because BPE tokenizers spell a word after a space as one " word" token; the
gold ``label`` is the bare word. ``amazon_reviews_other`` (other product categories) is held out
for cross-domain evaluation: it may be given as ``eval_path`` but is refused as training data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

from ktm.core.prompt import Segment
from ktm.errors import KTMError
from ktm.tasks.base import Example, PromptMode, TaskKind
from ktm.tasks.jsonl import read_jsonl, row_error, task_files
from ktm.tasks.labels import parse_label as _parse_label
from ktm.tasks.split import (
    cycle_balanced,
    cycle_shuffled,
    sample_without_replacement,
    split_indices,
)

DEFAULT_FILE = "amazon_reviews_fashion/amazon_fashion_2018_combined.jsonl.gz"
OTHER_CATEGORIES_FILE = "amazon_reviews_other/amazon_other_categories_2018.jsonl.gz"
EVAL_ONLY = ("amazon_reviews_other", "amazon_other_categories_2018.jsonl.gz")
SENTIMENT_LABELS: tuple[str, ...] = ("positive", "negative")
POSITIVE_ABOVE = 3.5  # ratings are whole stars, so 4 and 5 are positive
MIN_RATING, MAX_RATING = 1, 5  # a rating on another scale (0-10, 0-1) is an error, not a label


@dataclass(frozen=True)
class Review:
    text: str
    label: str
    line_no: int


def review_prompt(text: str, mode: PromptMode) -> tuple[Segment, ...]:
    """The paper's ``f"Review: {text}, Label:"``; "context" mode keeps ``", Label:"`` plain."""
    if mode == "paper":
        return (Segment(f"Review: {text}, Label:"),)
    return (Segment(f"Review: {text}"), Segment(", Label:", compress=False))


def _field(row: dict[str, Any], names: tuple[str, ...]) -> Any:
    for name in names:
        if name in row:
            return row[name]
    return None


def load_reviews(path: Path, max_chars: int | None, for_training: bool = True) -> list[Review]:
    """Non-empty reviews with their label; a row without text or rating is an error.

    Training rows that carry a non-Fashion ``category`` are refused: that field only exists in the
    evaluation-only other-categories file, so this catches a renamed copy of it.
    """
    out = []
    for line_no, row in read_jsonl(path):
        category = row.get("category")
        if for_training and category is not None and category != "AMAZON_FASHION":
            raise row_error(
                path, line_no,
                f"category {category!r} is from the evaluation-only set; expected Fashion reviews",
            )
        text = _field(row, ("text", "reviewText"))
        rating = _field(row, ("rating", "overall"))
        if text is None and "overall" in row:
            text = ""  # the 2018 5-core file omits reviewText on 16 rows: an empty review
        if not isinstance(text, str):
            raise row_error(path, line_no, f"field 'text' must be str, got {type(text).__name__}")
        if isinstance(rating, bool) or not isinstance(rating, int | float):
            got = type(rating).__name__
            raise row_error(path, line_no, f"field 'rating' must be a number, got {got}")
        if not MIN_RATING <= rating <= MAX_RATING:  # also NaN: another scale would mislabel
            raise row_error(path, line_no, f"field 'rating' is {rating}: expected 1 to 5 stars")
        text = text.strip()
        if not text:
            continue
        label = "positive" if rating > POSITIVE_ABOVE else "negative"
        out.append(Review(text[:max_chars] if max_chars else text, label, line_no))
    if not out:
        raise KTMError(f"{path} holds no non-empty review: expected rows with 'text' and 'rating'")
    return out


@dataclass
class AmazonTask:
    """Review -> "positive"/"negative", split by seed; eval keeps the natural label balance."""

    data_path: str | Path | None = None  # None: the shipped combined Fashion file
    prompt_mode: PromptMode = "context"
    test_size: int = 2000  # reviews held out from data_path (the paper held out 50k of 2.5M)
    max_chars: int | None = 1000  # review text is cut to this many characters; None keeps all
    split_seed: int = 42
    eval_path: str | Path | None = None  # evaluate on this file instead (e.g. other categories)
    # training draws as many negative as positive reviews (the test set keeps its natural balance)
    balance_train: bool = False
    name: str = field(default="amazon", init=False)
    kind: TaskKind = field(default="classification", init=False)
    labels: tuple[str, ...] = field(default=SENTIMENT_LABELS, init=False)
    # settings that change only the training examples: results differing in them are comparable
    TRAIN_ONLY: ClassVar[tuple[str, ...]] = ("balance_train",)

    def __post_init__(self) -> None:
        if not isinstance(self.balance_train, bool):
            raise KTMError(f"balance_train={self.balance_train!r}: expected true or false")
        self.path, self.eval_file = task_files(
            self, DEFAULT_FILE, EVAL_ONLY, "other product categories, cross-domain test")

    @cached_property
    def reviews(self) -> list[Review]:
        return load_reviews(self.path, self.max_chars)

    @cached_property
    def eval_reviews(self) -> list[Review]:
        if self.eval_file is not None:
            return load_reviews(self.eval_file, self.max_chars, for_training=False)
        return [self.reviews[i] for i in self._split[1]]

    @cached_property
    def train_reviews(self) -> list[Review]:
        return [self.reviews[i] for i in self._split[0]]

    @cached_property
    def _split(self) -> tuple[list[int], list[int]]:
        return split_indices(len(self.reviews), self.test_size, self.split_seed,
                             source=str(self.path), items="non-empty reviews")

    def parse_label(self, text: str) -> str | None:
        return _parse_label(text, SENTIMENT_LABELS)

    def label_target(self, label: str) -> str:
        """The answer text for ``label``: the word after a space (see the module docstring)."""
        return " " + label

    def train_examples(self, n: int, seed: int) -> list[Example]:
        """``n`` training reviews in reshuffled passes: the natural balance (about 4:1 positive),
        or with ``balance_train`` as many of each label."""
        pool = self.train_reviews
        if self.balance_train:
            groups = [[i for i, r in enumerate(pool) if r.label == lab] for lab in self.labels]
            order = cycle_balanced(n, groups, seed)
        else:
            order = cycle_shuffled(n, len(pool), seed)
        return [self._example(pool[i]) for i in order]

    def eval_examples(self, n: int, seed: int) -> list[Example]:
        """``min(n, available)`` distinct test reviews; score them with balanced accuracy."""
        pool = self.eval_reviews
        return [self._example(pool[i]) for i in sample_without_replacement(n, len(pool), seed)]

    def _example(self, review: Review) -> Example:
        return Example(
            segments=review_prompt(review.text, self.prompt_mode),
            target=self.label_target(review.label),
            label=review.label,
            meta={"line": review.line_no},
        )
