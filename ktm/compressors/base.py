"""The compressor contract: a baseline rewrites the compressed segments of each example.

    fit(train_examples, model)        bind to the model; learn what the method needs (LTSC)
    compress_batch(examples)          same examples, ``compress=True`` segments rewritten

Plain segments (the question, the answer cue) are never touched. Each compressed example's
``meta`` records ``tokens_before`` (the original prompt under the model's tokenizer) and
``tokens_after`` (what the LM will read), so length reduction is always measured against the
uncompressed prompt. ``compress_examples`` also times the rewrite: compression overhead in ms
per 1k input tokens.

A method is one file plus one line in ``ktm.compressors.COMPRESSORS``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

from ktm.core.prompt import Segment, as_segments
from ktm.core.question import question_text
from ktm.errors import KTMError
from ktm.tasks.base import Example

# hard (text) methods are read by the plain LM: K=1 without MLP means no merging at all
PLAIN_LM: dict[str, Any] = {"k": 1, "use_mlp": False}


def count_tokens(model, segments: Sequence[Segment]) -> int:
    """Prompt tokens the model reads for ``segments`` before any merging (specials included)."""
    return sum(len(s.ids) if s.ids is not None else len(model.tokenize(s.text, i == 0))
               for i, s in enumerate(as_segments(tuple(segments))))


def check_ratio(ratio: float) -> float:
    if not 0.0 <= ratio < 1.0:
        raise KTMError(f"ratio must be in [0, 1) (the share of tokens to drop), got {ratio!r}")
    return float(ratio)


class Compressor:
    """Base class: subclasses implement ``rewrite`` (or override ``compress_batch``).

    ``model_kwargs`` are the encoder settings the method needs (``k``, ``use_mlp``), applied by
    ``ktm.compressors.apply.apply_compressor``; ``rewrites_prompts=False`` marks a method that is
    only a model setting (mean pooling).
    """

    name: ClassVar[str] = "base"
    model_kwargs: ClassVar[dict[str, Any]] = PLAIN_LM
    rewrites_prompts: ClassVar[bool] = True
    # a method that reads the question: ``rewrite`` then gets ``questions``, each compressed
    # text's, the text of its prompt's plain segments after the last compressed one
    question_aware: bool = False

    def __init__(self) -> None:
        self.model = None

    def options(self) -> dict[str, Any]:
        """The method's settings, for result rows (JSON-plain values only)."""
        return {}

    def fit(self, examples: Sequence[Example], model) -> None:
        self.model = model

    def rewrite(self, texts: list[str], first: list[bool]) -> list[Segment]:
        """New segments for compressed texts; ``first[i]``: text i opens its prompt."""
        raise NotImplementedError

    def compress(self, example: Example) -> Example:
        return self.compress_batch([example])[0]

    def compress_batch(self, examples: Sequence[Example]) -> list[Example]:
        if self.model is None:
            raise KTMError(f"compressor {self.name!r} is not fitted: call fit(examples, model)")
        prompts = [as_segments(e.segments) for e in examples]
        where = [(r, i) for r, segs in enumerate(prompts) for i, s in enumerate(segs) if s.compress]
        asked = {}
        if self.question_aware:
            asked["questions"] = [question_text(prompts[r]) for r, _ in where]
        new = self.rewrite([prompts[r][i].text for r, i in where], [i == 0 for _, i in where],
                           **asked)
        rows = [list(segs) for segs in prompts]
        for (r, i), seg in zip(where, new, strict=True):
            rows[r][i] = seg
        return [self._with_counts(e, segs, rows[r]) for r, (e, segs) in
                enumerate(zip(examples, prompts))]

    def _with_counts(self, e: Example, before: Sequence[Segment],
                     after: Sequence[Segment]) -> Example:
        after = tuple(s for s in after if s.text)
        if not after:  # everything was dropped: keep one token's worth so the prompt is valid
            after = (replace(before[0], text=before[0].text[:1], ids=None),)
        n_before = e.meta.get("tokens_before", count_tokens(self.model, before))
        meta = {**e.meta, "tokens_before": n_before,
                "tokens_after": count_tokens(self.model, after), "compressor": self.name}
        return replace(e, segments=after, meta=meta)

    # compressors with learned state (LTSC) override these; the rest have nothing to keep
    def save_state(self, directory: str | Path) -> None:
        return None

    def load_state(self, directory: str | Path, model) -> bool:
        """Restore fitted state from ``directory``; False when there is none to restore."""
        return False


@dataclass
class CompressionStats:
    """Totals over a set of compressed examples; the overhead is the rewrite's wall time."""

    n: int
    tokens_before: int  # original prompt tokens, summed
    tokens_after: int  # prompt tokens the LM reads after the rewrite (before any K-merging)
    seconds: float

    @property
    def ms_per_1k_tokens(self) -> float:
        return 1e6 * self.seconds / self.tokens_before if self.tokens_before else 0.0

    @property
    def length_reduction(self) -> float:
        return 1.0 - self.tokens_after / self.tokens_before if self.tokens_before else 0.0

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "ms_per_1k_tokens": self.ms_per_1k_tokens,
                "length_reduction": self.length_reduction}


def compress_examples(compressor: Compressor, examples: Sequence[Example],
                      batch_size: int = 16) -> tuple[list[Example], CompressionStats]:
    """Rewrite ``examples`` in batches; returns them with exact token counts and the overhead."""
    if batch_size < 1:
        raise KTMError(f"batch_size must be >= 1, got {batch_size}")
    out: list[Example] = []
    t0 = time.perf_counter()
    for i in range(0, len(examples), batch_size):
        out += compressor.compress_batch(examples[i:i + batch_size])
    seconds = time.perf_counter() - t0
    stats = CompressionStats(len(out), sum(e.meta["tokens_before"] for e in out),
                             sum(e.meta["tokens_after"] for e in out), seconds)
    return out, stats
