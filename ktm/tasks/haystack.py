"""Long documents for question tasks (needles, variable tracking, code questions): text from a
source cut to a length in the model's tokens, with lines inserted at chosen depths.

A *source* is where the haystack's text comes from:

    stdlib    Python standard-library modules no project file imports (``ktm.tasks.corpus``:
              ``STDLIB_MODULES``), read from the running Python: evaluation-only text that needs
              no data folder (the default)
    code      CommitPackFT code of the held-out repositories (evaluation), of the training
              repositories (training)
    reviews   Amazon reviews of other categories (evaluation), Fashion reviews (training)
    a path    a text file or a folder of them, the user's own (both sides)

Evaluation-only text is never trained on: ``texts(source, train=True)`` refuses ``stdlib``.

A haystack is whole lines of the source's texts, joined in order from a seeded place until they
hold ``length`` tokens of the model's tokenizer (the lines inserted included); an inserted line
goes between two lines, at the line boundary nearest its depth (0: the start, 1: the end).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from functools import lru_cache

from ktm.errors import KTMError

SOURCES = ("stdlib", "code", "reviews")


@lru_cache(maxsize=8)
def _source_texts(source: str, train: bool) -> tuple[str, ...]:
    from ktm.tasks import corpus

    if source == "stdlib":
        if train:
            raise KTMError("haystack source 'stdlib' is evaluation-only text (the Python "
                           "standard library's modules no project file imports): expected "
                           "another source to train on (code, reviews or a path)")
        import importlib.util
        from pathlib import Path

        out = []
        for name in corpus.STDLIB_MODULES:  # whole modules: long documents
            spec = importlib.util.find_spec(name)
            try:
                out.append(Path(spec.origin).read_text(encoding="utf-8"))
            except (AttributeError, TypeError, OSError, UnicodeDecodeError):
                continue
        return tuple(out)
    if source in ("code", "reviews"):
        return tuple(corpus.source_texts(source) if train else corpus.heldout_texts(source))
    return tuple(corpus.path_texts(source))


def texts(source: str, train: bool = False) -> tuple[str, ...]:
    """The source's texts for the evaluation side, or for training (``train``)."""
    out = _source_texts(source, train)
    if not out:
        raise KTMError(f"haystack source {source!r} has no text: expected {', '.join(SOURCES)} "
                       "or a file or folder of text")
    return out


def lines_of(source: str, train: bool = False) -> tuple[str, ...]:
    """Every line of the source's texts in order, each ending in a line break, blank lines
    between texts."""
    out: list[str] = []
    for text in texts(source, train):
        lines = text.splitlines(keepends=True)
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"
        out += lines + ["\n"]
    return tuple(out)


class Tokens:
    """Token counts in a tokenizer's tokens (no special tokens): of a text, and of each
    prefix of a text up to given character offsets, from one tokenization (a fast tokenizer's
    offsets; a slow one's counts each prefix apart)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def before(self, text: str, offsets: Sequence[int]) -> list[int]:
        """Tokens of ``text[:o]`` for each ``o`` of ``offsets``: the tokens starting before
        ``o`` (a token that spans ``o``, such as a line break and the next line's indent,
        counts before it)."""
        if not getattr(self.tokenizer, "is_fast", False):
            return [self.count(text[:o]) for o in offsets]
        spans = self.tokenizer(text, add_special_tokens=False,
                               return_offsets_mapping=True)["offset_mapping"]
        starts = [a for a, _ in spans]
        return [bisect.bisect_left(starts, o) for o in offsets]


def cut(lines: Sequence[str], length: int, tokens: Tokens, rng: random.Random) -> str:
    """Consecutive lines (from a place drawn by ``rng``, wrapping around) holding at most
    ``length`` tokens as one text, as many as fit; a source shorter than ``length`` is an error
    naming both."""
    begin = rng.randrange(len(lines))
    take, estimate = [], 0
    # a line alone has at least the tokens it has inside a longer text: gather by the sum of
    # the lines' own counts, past the length, then count the joined text once
    while estimate < length + length // 4 + 8 and len(take) < len(lines):
        line = lines[(begin + len(take)) % len(lines)]
        take.append(line)
        estimate += tokens.count(line)
    text = "".join(take)
    ends = [0]
    for line in take:
        ends.append(ends[-1] + len(line))
    counts = tokens.before(text, ends)
    fits = max(i for i, n in enumerate(counts) if n <= length)
    if fits == len(take) and len(take) == len(lines) and counts[-1] < length:
        raise KTMError(f"the haystack source holds {counts[-1]} tokens, fewer than the "
                       f"{length} asked for: expected a longer source or a shorter length")
    return text[:ends[fits]]


def insert(text: str, inserts: Sequence[tuple[float, str]]) -> tuple[str, list[int]]:
    """``text`` with each (depth, line) inserted at the line boundary nearest its depth (by
    characters), and the character offset of each inserted line in the result. Lines at equal
    depths keep their given order."""
    bounds = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]
    if bounds[-1] != len(text):
        bounds.append(len(text))
    places = []
    for depth, _ in inserts:
        if not 0.0 <= depth <= 1.0:
            raise KTMError(f"depth must be in [0, 1] (0: the start, 1: the end), got {depth!r}")
        target = depth * len(text)
        j = bisect.bisect_left(bounds, target)
        if j > 0 and (j == len(bounds) or target - bounds[j - 1] <= bounds[j] - target):
            j -= 1
        places.append(bounds[j])
    order = sorted(range(len(inserts)), key=lambda k: (places[k], k))
    out, where, at, shift = [], [0] * len(inserts), 0, 0
    for k in order:
        line = inserts[k][1] if inserts[k][1].endswith("\n") else inserts[k][1] + "\n"
        out.append(text[at:places[k]])
        shift += places[k] - at
        where[k] = shift
        out.append(line)
        shift += len(line)
        at = places[k]
    out.append(text[at:])
    return "".join(out), where


def fit(lines: Sequence[str], length: int, extra: Sequence[str], tokens: Tokens,
        rng: random.Random) -> str:
    """A haystack that holds about ``length`` tokens once the ``extra`` lines are inserted."""
    room = length - sum(tokens.count(x if x.endswith("\n") else x + "\n") for x in extra)
    if room < 1:
        raise KTMError(f"length {length} leaves no room for the inserted lines: expected a "
                       "longer length")
    return cut(lines, room, tokens, rng)


def depths(n: int, depth: float | None) -> list[float]:
    """``n`` depths: all ``depth``, or (None) spread evenly over [0, 1], the start and the end
    included."""
    if depth is not None:
        return [depth] * n
    return [i / max(1, n - 1) for i in range(n)]
