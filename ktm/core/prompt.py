"""Prompts as sequences of segments, each either merged by the encoder or kept as plain tokens.

A plain string is one compressed segment. Keeping the question and the answer cue plain while
compressing a long context is the usual mixed layout:

    [Segment(document), Segment("Question: ...? Answer:", question=True)]

(``question=True`` says what the prompt asks, ``ktm.core.question``; ``compress=False`` is plain
text the rule there may take for the question.)

A compressed segment is merged at the model's K, or read at a ratio (``Segment(document,
ratio=3.0)``: three tokens per position on average, the positions spent where the text needs
them; ``ktm.core.allocate``), or at levels given block by block (``levels``).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ktm.core.config import check_ratio
from ktm.errors import KTMError
from ktm.util.field_types import check_field_types


@dataclass(frozen=True)
class Segment:
    """Prompt text, merged by the encoder when ``compress``.

    ``ids`` gives the segment's token ids directly instead of tokenizing ``text`` (LTSC writes
    meta-token ids that no text maps to); ``text`` then stays the original text, for display.

    ``ratio``: read the segment at this many tokens per position (>= 1), each unit of the
    model's largest K tokens at its own level (1: plain, or a merge level), chosen by the
    model's allocator (``KTMConfig.allocator``). ``levels``: the level of each unit given
    directly (tests, oracles, pretraining's varied layouts). None of either: merged at the
    model's K, as always.

    ``question``: this segment is what the prompt asks (``ktm.core.question``): read plain
    (``compress`` is then False), and the question allocator reads the document with it in view.
    Unmarked, a prompt's question is its plain segments after the last compressed one.
    """

    text: str
    compress: bool = True
    ids: tuple[int, ...] | None = None
    ratio: float | None = None
    levels: tuple[int, ...] | None = None
    question: bool = False

    def __post_init__(self) -> None:
        # what the tokenizer or the embedding table would otherwise refuse deep inside
        if not isinstance(self.text, str):
            raise KTMError(f"Segment text must be a str, got {type(self.text).__name__} "
                           f"{self.text!r:.60}")
        check_field_types(self)
        if self.ids is not None:
            if isinstance(self.ids, (str, bytes)) or not isinstance(self.ids, Iterable):
                raise KTMError(f"Segment ids must be a sequence of token ids, got "
                               f"{self.ids!r:.60}")
            # a tuple as annotated: a list left the frozen Segment unhashable
            object.__setattr__(self, "ids", tuple(self.ids))
            for i in self.ids:
                try:
                    if isinstance(i, bool) or operator.index(i) < 0:
                        raise TypeError
                except TypeError:
                    raise KTMError(f"Segment ids must be token ids (integers >= 0), got {i!r}"
                                   ) from None
        if self.question:
            if self.ratio is not None or self.levels is not None:
                raise KTMError("a question Segment is read plain: expected no ratio or levels, "
                               f"got ratio={self.ratio!r}, levels={self.levels!r:.60}")
            object.__setattr__(self, "compress", False)
        if (self.ratio is not None or self.levels is not None) and not self.compress:
            raise KTMError("Segment ratio and levels say how a compressed segment is merged: "
                           "expected compress=True")
        if self.ratio is not None and self.levels is not None:
            raise KTMError("give a Segment ratio or its levels, not both")
        if self.ratio is not None:
            object.__setattr__(self, "ratio", check_ratio(self.ratio, "Segment ratio"))
        if self.levels is not None:
            if isinstance(self.levels, (str, bytes)) or not isinstance(self.levels, Iterable):
                raise KTMError(f"Segment levels must be a sequence of integers >= 1, got "
                               f"{self.levels!r:.60}")
            object.__setattr__(self, "levels", tuple(self.levels))
            bad = next((v for v in self.levels
                        if isinstance(v, bool) or not isinstance(v, int) or v < 1), None)
            if bad is not None or not self.levels:
                raise KTMError(f"Segment levels must be integers >= 1 (1: plain), one per unit, "
                               f"got {self.levels!r:.60}")


PromptLike = str | Segment | Sequence[Segment]


def as_segments(prompt: PromptLike) -> tuple[Segment, ...]:
    """Normalise a prompt to a non-empty tuple of segments; an all-empty prompt is an error."""
    if isinstance(prompt, str):
        segments: tuple[Segment, ...] = (Segment(prompt),)
    elif isinstance(prompt, Segment):
        segments = (prompt,)
    elif isinstance(prompt, Sequence) and all(isinstance(s, Segment) for s in prompt):
        segments = tuple(prompt)
    else:
        raise KTMError(
            "prompt must be a str, a Segment or a sequence of Segments, "
            f"got {type(prompt).__name__}"
        )
    # a segment given as token ids counts as content even when its display text is empty
    kept = tuple(s for s in segments if s.text or s.ids)
    if not kept:
        raise KTMError("prompt is empty: expected at least one non-empty segment")
    return kept


def split_prompts(prompts: PromptLike | Sequence[PromptLike]
                  ) -> tuple[list[tuple[Segment, ...]], bool]:
    """One prompt or a list of prompts -> (normalised prompts, whether a single one was given)."""
    single = isinstance(prompts, (str, Segment)) or (
        isinstance(prompts, Sequence) and len(prompts) > 0 and isinstance(prompts[0], Segment)
    )
    if single:
        items = [prompts]
    elif isinstance(prompts, Iterable):
        items = list(prompts)
    else:
        raise KTMError("prompts must be a str, a Segment, a sequence of Segments, or a list of "
                       f"those, got {type(prompts).__name__} {prompts!r:.60}")
    if not items:
        raise KTMError("no prompts given: expected at least one prompt")
    return [as_segments(p) for p in items], single


def prompt_text(prompt: PromptLike) -> str:
    """The prompt as one plain string (what an uncompressed model would read)."""
    return "".join(s.text for s in as_segments(prompt))
