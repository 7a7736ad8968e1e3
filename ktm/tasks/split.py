"""Deterministic train/test splits of a list of items, by seed."""

from __future__ import annotations

import math
import random

from ktm.errors import KTMError


def split_indices(n: int, test_size: int, seed: int, source: str | None = None,
                  items: str = "items") -> tuple[list[int], list[int]]:
    """Shuffle ``range(n)`` with ``random.Random(seed)``; the first ``test_size`` are the test set.

    Both parts come back sorted, so iteration order does not depend on the shuffle. ``source``
    (a file) and ``items`` (what it holds) name what is too small when the split cannot be made:
    it may be a user's own copy of the data.
    """
    if not 0 < test_size < n:
        problem = (f"test_size={test_size} with {n} items: expected 0 < test_size < {n} so both "
                   "train and test are non-empty")
        if source is None:
            raise KTMError(problem)
        raise KTMError(f"{source} has {n} {items}: {problem}; lower test_size or give more "
                       f"{items}")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return sorted(order[test_size:]), sorted(order[:test_size])


def test_size_from_fraction(n: int, fraction: float) -> int:
    """``ceil(fraction * n)`` clipped to ``[1, n - 1]``; a fraction outside (0, 1) is an error."""
    if not 0.0 < fraction < 1.0:
        raise KTMError(f"test_fraction={fraction}: expected a number strictly between 0 and 1")
    return min(max(1, math.ceil(fraction * n)), n - 1)


def sample_without_replacement(n: int, size: int, seed: int) -> list[int]:
    """``min(n, size)`` distinct indices of ``range(size)``, in a seed-determined order."""
    if n < 0:
        raise KTMError(f"n={n}: expected a non-negative number of examples")
    return random.Random(seed).sample(range(size), min(n, size))


def cycle_shuffled(n: int, size: int, seed: int) -> list[int]:
    """``n`` indices of ``range(size)``: reshuffled full passes, so each item appears once per pass.

    Why passes instead of independent draws: with a small pool, independent draws would repeat some
    items and skip others within what the user thinks of as one epoch.
    """
    if n < 0:
        raise KTMError(f"n={n}: expected a non-negative number of examples")
    if size == 0:
        raise KTMError("no training items to sample from: expected a non-empty training set")
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < n:
        order = list(range(size))
        rng.shuffle(order)
        out.extend(order[: n - len(out)])
    return out


def cycle_balanced(n: int, groups: list[list[int]], seed: int) -> list[int]:
    """``n`` items with equal counts from each non-empty group (the first ``n % len`` groups get
    one more), each group in its own reshuffled passes, the result shuffled.

    For classification with a skewed training set (Amazon reviews are about 4:1 positive), where
    the model otherwise learns the majority answer first and balanced accuracy suffers.
    """
    groups = [g for g in groups if g]
    if not groups:
        raise KTMError("no training items to sample from: expected a non-empty training set")
    rng = random.Random(seed)
    out: list[int] = []
    for i, group in enumerate(groups):
        share = n // len(groups) + (i < n % len(groups))
        out.extend(group[j] for j in cycle_shuffled(share, len(group), rng.randrange(2**32)))
    rng.shuffle(out)
    return out
