"""Metrics against hand-computed values."""

from __future__ import annotations

import math

import pytest

from ktm.errors import KTMError
from ktm.evaluation.metrics import (
    accuracy,
    balanced_accuracy,
    length_reduction,
    normalised_performance,
    pareto_frontier,
    perplexity,
    pl_f1,
)


def test_accuracy_counts_none_as_wrong() -> None:
    assert accuracy(["a", None, "b", "b"], ["a", "a", "b", "a"]) == 0.5
    with pytest.raises(KTMError, match="3 predictions for 2"):
        accuracy(["a", "b", "c"], ["a", "b"])
    with pytest.raises(KTMError, match="no examples"):
        accuracy([], [])


def test_balanced_accuracy_is_mean_recall() -> None:
    golds = ["pos"] * 8 + ["neg"] * 2
    always_pos = ["pos"] * 10
    assert accuracy(always_pos, golds) == 0.8
    assert balanced_accuracy(always_pos, golds, ("pos", "neg")) == 0.5
    preds = ["pos"] * 6 + [None, "neg"] + ["neg", None]  # recall pos 6/8, neg 1/2
    assert balanced_accuracy(preds, golds, ("pos", "neg")) == pytest.approx((0.75 + 0.5) / 2)
    # A label with no gold example has no recall and is left out of the mean.
    assert balanced_accuracy(["pos", "neg"], ["pos", "pos"], ("pos", "neg")) == 0.5
    with pytest.raises(KTMError, match=r"\['maybe'\]"):
        balanced_accuracy(["pos"], ["maybe"], ("pos", "neg"))


def test_length_reduction_uses_totals() -> None:
    assert length_reduction(100, 25) == 0.75
    # Totals 100 -> 50, not the mean of per-example ratios (0.9 and 0.0 would give 0.45).
    assert length_reduction([90, 10], [40, 10]) == pytest.approx(0.5)
    with pytest.raises(KTMError, match="tokens_before=0"):
        length_reduction(0, 0)


def test_pl_f1_perplexity_and_normalised_performance() -> None:
    assert pl_f1(1.0, 0.5) == pytest.approx(2 * 0.5 / 1.5)
    assert pl_f1(0.0, 0.0) == 0.0 and pl_f1(0.8, 0.8) == pytest.approx(0.8)
    assert perplexity(2 * math.log(4.0), 2) == pytest.approx(4.0)
    assert perplexity(0.0, 5) == 1.0
    with pytest.raises(KTMError, match="n_tokens=0"):
        perplexity(1.0, 0)
    assert normalised_performance(8.0, 4.0) == 0.5 and normalised_performance(4.0, 4.0) == 1.0
    with pytest.raises(KTMError, match="ppl=0"):
        normalised_performance(0.0, 4.0)


POINTS = [(0.9, 0.1), (0.8, 0.5), (0.7, 0.5), (0.5, 0.9), (0.4, 0.2), (0.8, 0.5)]


def test_pareto_frontier_both_maximised() -> None:
    # (0.7, 0.5) and (0.4, 0.2) are dominated; the duplicate (0.8, 0.5) is kept once.
    assert pareto_frontier(POINTS) == [(0.9, 0.1), (0.8, 0.5), (0.5, 0.9)]


def test_pareto_frontier_with_a_minimised_axis() -> None:
    # (accuracy up, perplexity-like cost down): low second coordinate is better.
    assert pareto_frontier(POINTS, maximize=(True, False)) == [(0.9, 0.1)]
    both_down = pareto_frontier(POINTS, maximize=(False, False))
    assert both_down == [(0.9, 0.1), (0.4, 0.2)]
    with pytest.raises(KTMError, match="expected 2"):
        pareto_frontier([(1.0, 2.0, 3.0)])


def test_pareto_frontier_refuses_a_nan_point() -> None:
    # a NaN compares false with everything, so it was never dominated: always "on" the frontier
    with pytest.raises(KTMError, match=r"\(nan, 0.5\).*finite"):
        pareto_frontier([(0.9, 0.9), (float("nan"), 0.5)])


def test_pareto_frontier_ties_and_a_single_point() -> None:
    assert pareto_frontier([(0.5, 0.7)]) == [(0.5, 0.7)]
    # equal length reduction: the lower performance is dominated; exact ties are kept once
    assert pareto_frontier([(0.5, 0.6), (0.5, 0.7), (0.5, 0.7)]) == [(0.5, 0.7)]


@pytest.mark.parametrize("p, lr", [(float("nan"), 0.5), (0.5, -0.2), (1.5, 0.5), (0.5, 1.1)])
def test_pl_f1_refuses_values_outside_0_1(p, lr) -> None:
    # pl_f1(0.2, -0.1) was -0.4 and pl_f1(0.5, -0.5) a silent 0; NaN went through
    with pytest.raises(KTMError, match="expected .*in \\[0, 1\\]"):
        pl_f1(p, lr)


def test_perplexity_of_a_diverged_model_is_inf_not_an_overflow() -> None:
    """math.exp raises OverflowError past 709: an evaluation of a diverged run crashed."""
    assert perplexity(800.0 * 4, 4) == math.inf
    assert perplexity(2.0 * 4, 4) == pytest.approx(math.exp(2.0))
