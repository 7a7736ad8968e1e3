"""Checking, before a run starts, that every example fits the model's positions.

A prompt longer than the LM's positions (after merging at the run's K) fails at the step that
reads it: mid-training, or at the evaluation after training has finished. Tokenizing every
example up front (``KTMModel.encode_prompts(..., embed=False)``: no embedding, no encoder)
finds it first, and the error names where it came from (a data file's line) and the K that
would fit.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from ktm.core.allocate import RatioWarning
from ktm.core.fit import encode_fitted
from ktm.core.loss import check_fits, target_ids
from ktm.errors import KTMError
from ktm.tasks.base import Example


def where(example: Example, i: int, what: str) -> str:
    """``data.jsonl line 7`` for an example that records its file and line, else its index."""
    file, line = example.meta.get("file"), example.meta.get("line")
    if file is not None and line is not None:
        return f"{file} line {line}"
    return f"{what} example {i}" + (f" (line {line})" if line is not None else "")


def check_examples_fit(model, examples: Sequence[Example], what: str, *, merge: bool = True,
                       answer_tokens: int | None = None, new_tokens: int = 0,
                       fitted: bool = False) -> None:
    """Raise ``KTMError`` naming the first of ``examples`` that does not fit ``model``'s
    positions: its prompt followed by its own target (or by ``answer_tokens`` target tokens,
    a label's answer text), and by ``new_tokens`` generated ones (the last of them never read
    back). ``fitted``: each prompt as generation reads it, past the window at a ratio that fits
    (``ktm.core.fit``), refused only where none does. A model without a position limit checks
    nothing."""
    if not model.max_positions:
        return
    seen: set = set()
    for i, e in enumerate(examples):
        segments = e.segments if isinstance(e.segments, str) else tuple(e.segments)
        key = (segments, e.target if isinstance(e.target, str) else tuple(e.target))
        if key in seen:  # a training set draws each row many times
            continue
        seen.add(key)
        try:
            if fitted:
                with warnings.catch_warnings():  # generation says the ratio it reads at
                    warnings.simplefilter("ignore", RatioWarning)
                    _, (cp,) = encode_fitted(model, [segments], merge,
                                             [max(new_tokens - 1, 0)], embed=False)
            else:
                cp = model.encode_prompts([e.segments], merge, embed=False)[0]
            n = len(target_ids(model, e.target)) if answer_tokens is None else answer_tokens
            if n:
                check_fits(model, [cp], [n], "target tokens")
            if new_tokens:
                check_fits(model, [cp], [new_tokens], "new tokens", unread=1)
        except KTMError as err:
            raise KTMError(f"{where(e, i, what)}: {err}") from None
