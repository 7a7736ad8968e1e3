"""Scores: accuracy, length reduction, perplexity, their PL-F1 trade-off, and Pareto frontiers.

Everything returns plain floats; formatting happens where results are printed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ktm.errors import KTMError


def _same_length(preds: Sequence[object], golds: Sequence[object]) -> None:
    if len(preds) != len(golds):
        raise KTMError(f"{len(preds)} predictions for {len(golds)} gold labels: expected equal")
    if not golds:
        raise KTMError("no examples to score: expected at least one prediction")


def accuracy(preds: Sequence[str | None], golds: Sequence[str]) -> float:
    """Share of exact matches; a ``None`` prediction (no valid label) counts as wrong."""
    _same_length(preds, golds)
    return sum(p == g for p, g in zip(preds, golds, strict=True)) / len(golds)


def balanced_accuracy(
    preds: Sequence[str | None], golds: Sequence[str], labels: Sequence[str]
) -> float:
    """Mean recall over the labels that occur in ``golds``; ``None`` predictions are wrong.

    Why: the Amazon test set is about 4:1 positive, so always answering "positive" scores 0.8
    accuracy but 0.5 balanced accuracy. Labels absent from ``golds`` have no recall and are
    skipped; a gold label outside ``labels`` is an error.
    """
    _same_length(preds, golds)
    stray = sorted(set(golds) - set(labels))
    if stray:
        raise KTMError(f"gold labels {stray} are not among labels {list(labels)}")
    recalls = []
    for label in labels:
        hits = [p == g for p, g in zip(preds, golds, strict=True) if g == label]
        if hits:
            recalls.append(sum(hits) / len(hits))
    return sum(recalls) / len(recalls)


Count = float | Sequence[float]  # a total, or per-example counts to sum (ints are fine)


def _total(x: Count) -> float:
    return float(sum(x)) if isinstance(x, Sequence) else float(x)


def length_reduction(tokens_before: Count, tokens_after: Count) -> float:
    """``1 - after / before`` on totals over the set (per-example lists are summed first).

    Totals rather than a mean of ratios, so a few short prompts cannot swing the number.
    """
    before, after = _total(tokens_before), _total(tokens_after)
    if before <= 0:
        raise KTMError(f"tokens_before={before}: expected a positive token count")
    return 1.0 - after / before


def pl_f1(performance: float, length_reduction: float) -> float:
    """Harmonic mean ``2PL / (P + L)`` of normalised performance P and length reduction L.

    0 when both are 0 (nothing kept, nothing gained). Both must lie in [0, 1]: a negative L
    (a prompt made longer) is clamped to 0 by the caller, since the mean is meaningless there.
    """
    for name, v in (("performance", performance), ("length_reduction", length_reduction)):
        if not 0.0 <= v <= 1.0:  # NaN fails this too
            raise KTMError(f"{name}={v}: expected a number in [0, 1]")
    total = performance + length_reduction
    return 0.0 if total == 0 else 2.0 * performance * length_reduction / total


def perplexity(nll_sum: float, n_tokens: int) -> float:
    """``exp(nll_sum / n_tokens)`` with the NLL summed in nats over the scored target tokens;
    ``inf`` past what a float holds (a diverged model's NLL above 709 nats per token)."""
    if n_tokens <= 0:
        raise KTMError(f"n_tokens={n_tokens}: expected a positive number of scored tokens")
    try:
        return math.exp(nll_sum / n_tokens)
    except OverflowError:
        return math.inf


def normalised_performance(ppl: float, ppl_min: float) -> float:
    """Perplexity as a 0..1 performance for PL-F1: ``ppl_min / ppl`` (1 for the best run).

    ``ppl_min`` is the lowest perplexity among the compared runs (usually the uncompressed model).
    For accuracy the analogue is ``acc / acc_best``.
    """
    if ppl <= 0 or ppl_min <= 0:
        raise KTMError(f"perplexities ppl={ppl}, ppl_min={ppl_min}: expected both positive")
    return ppl_min / ppl


def pareto_frontier(
    points: Sequence[Sequence[float]], maximize: Sequence[bool] = (True, True)
) -> list[tuple[float, ...]]:
    """The points no other point dominates, in input order, duplicates kept once.

    ``maximize[i]`` says whether a larger coordinate i is better (False: smaller is better, e.g.
    perplexity). A point is dominated when another is at least as good everywhere and strictly
    better somewhere.
    """
    dims = len(maximize)
    pts = [tuple(float(v) for v in p) for p in points]
    for p in pts:
        if len(p) != dims:
            raise KTMError(f"point {p} has {len(p)} coordinates: expected {dims} (len(maximize))")
        if not all(math.isfinite(v) for v in p):  # a NaN would never be dominated
            raise KTMError(f"point {p}: expected finite coordinates")
    # Flip minimised coordinates so "larger is better" everywhere.
    signed = [tuple(v if up else -v for v, up in zip(p, maximize, strict=True)) for p in pts]

    def dominates(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
        pairs = list(zip(a, b, strict=True))
        return all(x >= y for x, y in pairs) and any(x > y for x, y in pairs)

    frontier: list[tuple[float, ...]] = []
    for p, s in zip(pts, signed, strict=True):
        if p not in frontier and not any(dominates(o, s) for o in signed):
            frontier.append(p)
    return frontier
