"""Adaptive merging: a level per block, chosen to read a segment at a ratio the user sets.

A segment read at ratio r (``Segment(text, ratio=3.0)``: r tokens in per position the LM reads)
is cut into *units* of U tokens, U the model's largest merge level. Each unit is read at one
level: 1 (its tokens plain), or one of the model's merge levels (2, 4, 8, ...: that many tokens
per position). Every unit starts at the largest level; positions are then given out one
refinement at a time (a unit's level to the next smaller one) to the unit whose positions now
carry the most signal each, until the segment's budget of ``round(tokens / r)`` positions is
spent: water-filling towards equal signal per position.

    signal per unit:  s_u (e.g. the summed surprisal of its tokens)
    refine next:      argmax_u  s_u / positions_u, while its extra positions fit the budget

The signal is what a unit is worth: one small class per signal, registered by name, in
``ktm.core.signals`` (``SIGNALS``: adding a signal is adding a class there).

Positions stay consecutive whatever the levels, so the result runs on llama.cpp and vLLM too.
"""

from __future__ import annotations

import heapq
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from ktm.core.signals import FLOOR, dropping, signal_of
from ktm.errors import KTMError

# how far the achieved ratio may land from the target before the layout says so
RATIO_TOLERANCE = 0.05
# a quoting signal's plain lines (``Signal.quotes``), where they lie more than ``QUOTE_BEYOND``
# positions before the end of the prompt, are quoted after the last compressed segment instead,
# next to the question:
# a small LM finds a fact in a plain line a few hundred merged positions before its question,
# less often a thousand or more before (a needle read at ratio 4 by the question reader, left
# in place against quoted: 6 in 8 against 8 in 8 at 8,000 tokens, 1 in 8 against 7 in 8 at
# 16,384; at depth 0.75 of 16,384 tokens, some 500 to 1,000 positions before the question,
# quoted from 1,024 positions 3 in 5, from 512 and from 256 5 in 5;
# results/question/ablations.json)
QUOTE_BEYOND = 512


class RatioWarning(UserWarning):
    """A segment was read at a ratio more than ``RATIO_TOLERANCE`` from the one asked for
    (too short for its units to split closer)."""


@contextmanager
def quiet_ratio() -> Iterator[None]:
    """``RatioWarning`` silenced, as ``with quiet_ratio():`` or ``@quiet_ratio()``: a training
    run or an evaluation reads many short segments, and reports the ratio they were read at
    instead (``ratio_read``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RatioWarning)
        yield


def max_ratio(tokens: int, plain: int, unit: int) -> float:
    """The largest ratio a segment of ``tokens`` tokens, ``plain`` of them kept plain, is read
    at: every unit at the largest level ``unit``."""
    return tokens / max(1, plain + positions(tokens - plain, unit))


def positions(n: int, level: int) -> int:
    """Positions a unit of ``n`` tokens takes at ``level`` (1: plain)."""
    return -(-n // level)


def spread_order(n: int) -> list[int]:
    """A rank per unit that spreads ties over the segment (bit-reversed order: 0, n/2, n/4,
    3n/4, ...), so equal signals refine units evenly apart rather than from the start."""
    bits = max(1, (n - 1).bit_length())
    keys = [int(f"{i:0{bits}b}"[::-1], 2) for i in range(n)]
    order = sorted(range(n), key=lambda i: keys[i])
    rank = [0] * n
    for r, i in enumerate(order):
        rank[i] = r
    return rank


def spend(scores: Sequence[float], lengths: Sequence[int], levels: Sequence[int],
          budget: int, drop: bool = False) -> list[int]:
    """Each unit's level: all start at the largest of ``levels`` (which include 1), then the
    unit whose positions carry the most signal each is refined one level, while its extra
    positions fit in ``budget`` positions for all units together. Raises ``KTMError`` when even
    the largest level exceeds the budget.

    ``drop``: units may be left out (level 0) to pay for the budget: where the largest level
    leaves no room to read the *wanted* units plain (those scoring at least ``TOP`` of the
    best, their extra positions at most ``PLAIN_CAP`` of the budget), the least-scoring others
    are left out, evenly spread among equals, until it does (``left_out``); and the wanted
    units are refined before any other (a line's last, shorter unit too, whose positions carry
    less signal each than a full unit's next to it)."""
    ladder = sorted(set(levels), reverse=True)
    if ladder[-1] != 1:
        ladder.append(1)
    step = [0] * len(lengths)  # index into ladder
    used = sum(positions(n, ladder[0]) for n in lengths)
    rank = spread_order(len(lengths))
    want = wanted(scores) if drop else set()
    out = left_out(scores, lengths, ladder[0], budget, rank, want) if drop else set()
    used -= sum(positions(lengths[u], ladder[0]) for u in out)
    if used > budget:
        raise KTMError(f"{budget} positions cannot hold {len(lengths)} units at the largest "
                       f"level {ladder[0]} ({used} positions)")

    def entry(u: int) -> tuple[int, float, int, int]:
        per = scores[u] / positions(lengths[u], ladder[step[u]])
        return (u not in want, -per, rank[u], u)

    heap = [entry(u) for u in range(len(lengths)) if len(ladder) > 1 and u not in out]
    heapq.heapify(heap)
    while heap:
        u = heapq.heappop(heap)[-1]
        n, now = lengths[u], ladder[step[u]]
        extra = positions(n, ladder[step[u] + 1]) - positions(n, now)
        if used + extra > budget:
            continue  # this unit's next refinement does not fit; a cheaper one may
        used += extra
        step[u] += 1
        if step[u] + 1 < len(ladder):
            heapq.heappush(heap, entry(u))
    return [0 if u in out else ladder[s] for u, s in enumerate(step)]


# ``spend(drop=True)``: the units worth reading plain score at least this share of the best
TOP = 0.5
# ... and their plain reading takes at most this share of the budget's positions
PLAIN_CAP = 0.25


def wanted(scores: Sequence[float]) -> set[int]:
    """The units worth reading plain: scoring at least ``TOP`` of the best (none when no unit
    scores above the floor)."""
    best = max(scores, default=0.0)
    return {u for u, s in enumerate(scores) if best > FLOOR and s >= TOP * best}


def left_out(scores: Sequence[float], lengths: Sequence[int], unit: int, budget: int,
             rank: Sequence[int], wanted: set[int]) -> set[int]:
    """The units ``spend(drop=True)`` leaves out: the fewest least-scoring ones (among equal
    scores, those the spread order refines last) whose positions at the largest level
    ``unit`` pay for the rest at that level plus the ``wanted`` units' plain reading; a wanted
    unit only while the rest cannot pay for the others at the largest level."""
    cost = [positions(n, unit) for n in lengths]
    used = sum(cost)
    extra = min(sum(lengths[u] - cost[u] for u in wanted), int(PLAIN_CAP * budget))
    out: set[int] = set()
    for u in sorted(range(len(lengths)), key=lambda u: (u in wanted, scores[u], -rank[u])):
        if used <= budget - (0 if u in wanted else extra) or len(out) == len(lengths) - 1:
            break
        out.add(u)
        used -= cost[u]
    return out


@dataclass(frozen=True)
class Units:
    """A segment's merged pieces cut into units: (piece index, start, length) each."""

    cuts: tuple[tuple[int, int, int], ...]

    @classmethod
    def of(cls, pieces: Sequence[Sequence[int]], unit: int) -> Units:
        return cls(tuple((p, s, min(unit, len(ids) - s)) for p, ids in enumerate(pieces)
                         for s in range(0, len(ids), unit)))

    @property
    def lengths(self) -> list[int]:
        return [n for _, _, n in self.cuts]


def ratio_refusal(ratio: float, levels: Sequence[int], signal: str,
                  deeper: int | None = None) -> str | None:
    """Why a compressed segment cannot be read at ``ratio`` by a reader of merge ``levels``
    whose allocator is ``signal`` (None: it can): a ratio past the largest level needs a signal
    that leaves units out (``Signal.drops``), or is exactly the ``deeper`` level (merges merged
    again, ``ktm.core.encoder.deeper_level``)."""
    unit = max(levels)
    if ratio <= unit or signal_of(signal).drops or ratio == deeper:
        return None
    return (f"ratio {ratio:g} is more than this reader allows: its largest level merges K={unit} "
            f"tokens per position; expected a ratio <= {unit}, a reader with a larger K, or an "
            f"allocator that leaves text out ({', '.join(dropping())})")


def allocate(pieces: Sequence[Sequence[int]], plain: int, ratio: float, levels: Sequence[int],
             signal: str, token_scores: Sequence[float] | None = None,
             seed: int = 0) -> list[list[tuple[int, int]]]:
    """Levels for a segment read at ``ratio``: ``pieces`` are its merged pieces' token ids in
    order, ``plain`` the tokens of it kept plain anyway (a plain prefix or suffix), which count
    against its positions. Returns per piece its (units' token count, level) runs, consecutive
    units of one level joined. ``token_scores``: per token of the pieces, concatenated.

    A signal that drops (``Signal.drops``: the question's) may leave units out (level 0 in the
    runs: ``spend(drop=True)``), so its ratio may exceed the largest level. Raises ``KTMError``
    for another signal's ratio above the largest level; a segment too short for its ratio is
    read with every unit at the largest level."""
    unit = max(levels)
    units = Units.of(pieces, unit)
    total = sum(len(p) for p in pieces) + plain
    budget = round(total / ratio) - plain
    drop = signal_of(signal).drops
    refusal = ratio_refusal(ratio, levels, signal)
    if refusal is not None:
        raise KTMError(refusal)
    # a segment too short for the ratio (a partial unit, its plain tokens) is read with every
    # unit at the largest level: the closest it comes, which the layout then reports; a signal
    # that leaves units out does so below that only for a ratio past the largest level (not
    # for a ratio's rounding), or to pay for the units it reads plain
    fewest = 1 if ratio > unit else sum(positions(n, unit) for n in units.lengths)
    budget = max(budget, fewest)
    chosen = spend(signal_of(signal).unit_scores(token_scores, units.lengths, seed),
                   units.lengths, levels, budget, drop)
    runs: list[list[tuple[int, int]]] = [[] for _ in pieces]
    for (p, _, n), level in zip(units.cuts, chosen):
        if runs[p] and runs[p][-1][1] == level:
            runs[p][-1] = (runs[p][-1][0] + n, level)
        else:
            runs[p].append((n, level))
    return runs
