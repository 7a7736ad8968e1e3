"""Turning generated text back into a class label, shared by every classification task."""

from __future__ import annotations

import string
import unicodedata
from collections.abc import Sequence


def parse_label(text: str, labels: Sequence[str]) -> str | None:
    """The first word of ``text``, lowercased and stripped of punctuation, if it is a label.

    Why only the first word: the model is trained to emit the label right after the cue and then
    stop; anything after it is noise, and guessing a label from later words would flatter a model
    that did not answer. ``None`` means "no valid answer" and metrics count it as wrong.
    """
    words = text.split()
    if not words:
        return None
    word = words[0].strip(string.punctuation).lower()
    wanted = {label.lower(): label for label in labels}
    return wanted.get(word)


def match_label(text: str, labels: Sequence[str]) -> str | None:
    """The whole answer, stripped, if it is exactly one of ``labels`` (case included), else None.

    For labels a user brings (``custom``), which may be several words or case-sensitive codes: the
    first-word rule above would never match "very good". The model is trained to stop (EOS) right
    after the label, so anything more or less than the label is a wrong answer.

    Compared as Unicode NFKC when not equal as given: a tokenizer that normalizes its input
    (NFC, NFKC) gives back "café" composed however the label spelled it, so a label with a
    combining accent was never matched.
    """
    answer = text.strip()
    if answer in labels:
        return answer
    folded = unicodedata.normalize("NFKC", answer)
    return next((lab for lab in labels if unicodedata.normalize("NFKC", lab) == folded), None)
