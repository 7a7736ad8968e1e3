"""Turning generated text back into a class label, shared by every classification task."""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence


def _is_mark(char: str) -> bool:
    """Punctuation or a symbol in any script (Unicode categories P* and S*: "…", "«", "。",
    "*", an emoji; every ASCII ``string.punctuation`` character is one), or an invisible format
    character (Cf: a zero-width space, a byte-order mark)."""
    category = unicodedata.category(char)
    return category[0] in "PS" or category == "Cf"


def strip_marks(word: str) -> str:
    """``word`` without the punctuation, symbols and format characters around it."""
    start, end = 0, len(word)
    while start < end and _is_mark(word[start]):
        start += 1
    while end > start and _is_mark(word[end - 1]):
        end -= 1
    return word[start:end]


def parse_label(text: str, labels: Sequence[str]) -> str | None:
    """The first word of ``text``, lowercased and stripped of punctuation and symbols (any
    script's: "«true»", "true…", "**true**" are "true"), if it is a label.

    Why only the first word: the model is trained to emit the label right after the cue and then
    stop; anything after it is noise, and guessing a label from later words would flatter a model
    that did not answer. ``None`` means "no valid answer" and metrics count it as wrong.
    """
    words = text.split()
    if not words:
        return None
    word = strip_marks(words[0]).lower()
    wanted = {label.lower(): label for label in labels}
    return wanted.get(word)


def match_label(text: str, labels: Sequence[str]) -> str | None:
    """The whole answer, stripped, if it is exactly one of ``labels`` (case included), else None.

    For labels a user brings (``custom``), which may be several words or case-sensitive codes: the
    first-word rule above would never match "very good". The model is trained to stop (EOS) right
    after the label, so anything more or less than the label is a wrong answer.

    Compared as Unicode NFKC, format characters dropped (``drop_format``), when not equal as
    given: a tokenizer that normalizes its input (NFC, NFKC) gives back "café" composed however
    the label spelled it, so a label with a combining accent was never matched.
    """
    answer = text.strip()
    if answer in labels:
        return answer
    folded = _folded(answer)
    return next((lab for lab in labels if _folded(lab) == folded), None)


def drop_format(text: str) -> str:
    """``text`` without Unicode format characters (category Cf: zero-width space, word joiner,
    byte-order mark, soft hyphen, bidi marks): invisible, not whitespace to ``strip()``, and
    easily pasted into a label, where they made "yes" and "yes\u200b" two classes."""
    return "".join(c for c in text if unicodedata.category(c) != "Cf")


def _folded(text: str) -> str:
    return unicodedata.normalize("NFKC", drop_format(text).strip())
