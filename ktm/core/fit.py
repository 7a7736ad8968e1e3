"""Fitting a prompt to the model's window: a merged reading too long for the LM's positions is
read again at the ratio that fits, instead of refused.

A prompt's compressed segments are read at their ratio (the reader's own, or uniform K). When
that reading and the tokens still to come (the new tokens of a generation) run past the model's
positions, every compressed segment without levels of its own is read at a ratio that leaves
room for them: the plain segments (the question, the chat template) stay plain, and the
allocator spends the fewer positions where its signal is highest (the question's lines stay
plain under the question allocator). Past its largest level a reader reads at its deeper level
(its merges merged again) rather than leave units out: whole, or, under the question
allocator, all but the question's lines; the prompt then takes fewer positions than the
window, and its prefill less time. Only past that level does an allocator
that leaves units out (the question allocator) leave out what it needs least; any other goes no
deeper. ``RatioWarning`` says the ratio it was read at;
the ``CompressedPrompt`` carries it (``squeezed``, a result row's ``ratio_read``). A prompt
that even the densest reading cannot fit is refused, naming the longest that fits.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import replace

from ktm.core.allocate import RatioWarning
from ktm.core.batch import CompressedPrompt
from ktm.core.encoder import deeper_level
from ktm.core.prompt import Segment
from ktm.core.signals import signal_of
from ktm.errors import KTMError

TRIES = 8  # re-measurings before a fit is given up (each lands closer: units round)


def encode_fitted(model, prompts: Sequence[Sequence[Segment]], merge: bool, room: Sequence[int],
                  cache=None, embed: bool = True, layout=None
                  ) -> tuple[list[tuple[Segment, ...]], list[CompressedPrompt]]:
    """(prompts, their ``CompressedPrompt``s), each prompt read so that ``room[i]`` positions
    are left after it within the model's window: as given where it fits, else at the ratio
    that fits (``fit``). ``cache``, ``embed`` and ``layout``: as
    ``KTMModel.encode_prompts``'s."""
    prompts = [tuple(p) for p in prompts]
    limit = model.max_positions
    if not (limit and merge):
        return prompts, model.encode_prompts(prompts, merge, cache, embed, layout)
    # a prompt whose tokens may run past the window is laid out first (no encoder, no rows)
    # and fitted, so that it is merged once, at the ratio it is read at
    longer = [i for i, p in enumerate(prompts)
              if fittable(p) and _tokens(model, p) + room[i] > limit]
    if longer:
        laid = model.encode_prompts([prompts[i] for i in longer], merge, None, False, layout)
        for i, cp in zip(longer, laid):
            if _over(cp, room[i], limit, prompts[i]):
                prompts[i] = fit(model, prompts[i], room[i], cp, layout)
    prefixes = model.encode_prompts(prompts, merge, cache, embed, layout)
    # past the window with a ratio to raise (quoted lines can add positions to a shorter one);
    # not where the plain part and the new tokens alone fill it (no ratio helps, and
    # ``check_fits`` says which to shorten)
    over = [i for i, cp in enumerate(prefixes) if _over(cp, room[i], limit, prompts[i])]
    if not over:
        return prompts, prefixes
    for i in over:
        prompts[i] = fit(model, prompts[i], room[i], prefixes[i], layout)
    again = model.encode_prompts([prompts[i] for i in over], merge, cache, embed, layout)
    for i, cp in zip(over, again):
        prefixes[i] = cp
    return prompts, prefixes


def _over(cp: CompressedPrompt, room: int, limit: int, prompt: Sequence[Segment]) -> bool:
    """Whether a reading runs past the window in a way a higher ratio can mend."""
    return (cp.next_position + room > limit and cp.positions is None and fittable(prompt)
            and limit - room - _fixed(cp) >= 1)


def _tokens(model, prompt: Sequence[Segment]) -> int:
    """About how many tokens ``prompt`` has (its segments tokenized one by one)."""
    return sum(len(s.ids) if s.ids is not None else len(model.tokenize(s.text))
               for s in prompt)


def fittable(prompt: Sequence[Segment]) -> bool:
    """Whether a prompt has a compressed segment whose ratio ``fit`` may raise."""
    return any(s.compress and s.levels is None for s in prompt)


def fit(model, prompt: tuple[Segment, ...], room: int, cp: CompressedPrompt, layout=None
        ) -> tuple[Segment, ...]:
    """``prompt`` (read as ``cp``, with ``layout``) with its compressed segments read at the
    ratio that leaves ``room`` positions within the model's window. Raises ``KTMError`` when
    none does."""
    limit = model.max_positions - room
    squeezed_in = cp.squeezed[0]
    fixed = _fixed(cp)
    free = limit - fixed
    enc = model._prompt_encoder(layout)
    deep = deeper_level(model.encoder)
    largest = max(enc.merge_levels)
    # a signal that leaves units out has no densest reading; any other reads at most its
    # deepest level (``PromptEncoder.densest``)
    densest = float("inf") if signal_of(enc.allocator).drops else enc.densest()
    if free < 1 or squeezed_in / free > densest:
        longest = cp.tokens_in - squeezed_in + max(0, free) * densest
        raise KTMError(
            f"prompt of {cp.tokens_in} tokens cannot fit the model's {model.max_positions} "
            f"positions with {room} after it, even read at its densest ({densest:g} tokens a "
            f"position; {fixed} positions plain): expected at most about {int(longest)} tokens "
            "in all, or fewer plain ones")
    ratio = squeezed_in / free
    for _ in range(TRIES):
        ratio = _allowed(ratio, largest, deep, densest)
        fitted = tuple(replace(s, ratio=max(ratio, s.ratio or 0.0))
                       if s.compress and s.levels is None else s for s in prompt)
        got = model.encode_prompts([fitted], embed=False, layout=layout)[0]
        if got.next_position <= limit:
            warnings.warn(
                f"a prompt of {cp.tokens_in} tokens ({cp.next_position} positions) was read at "
                f"ratio {got.squeezed[0] / max(1, got.squeezed[1]):.2f} on its compressed "
                f"segments, {got.next_position} positions, to leave {room} of the model's "
                f"{model.max_positions} after it", RatioWarning, stacklevel=3)
            return fitted
        if ratio >= densest:
            break
        # the units round: ask for as many fewer positions as the reading went over
        ratio *= got.squeezed[1] / max(1, got.squeezed[1] - (got.next_position - limit))
    raise KTMError(f"prompt of {cp.tokens_in} tokens could not be read within the model's "
                   f"{model.max_positions} positions with {room} after it: read at ratio "
                   f"{ratio:.2f} it takes {got.next_position}; expected a shorter prompt")


def _fixed(cp: CompressedPrompt) -> int:
    """Positions of a reading that no ratio changes: its plain segments'."""
    return cp.next_position - cp.squeezed[1]


def _allowed(ratio: float, largest: int, deep: tuple | None, densest: float) -> float:
    """``ratio``, or the one the reader reads at instead: past its largest level, its deeper
    level (under the question allocator the question's lines plain), before any unit is left
    out; past that, an allocator that leaves units out leaves them out."""
    if ratio <= largest or deep is None:
        return ratio
    if ratio <= deep[0] or densest != float("inf"):
        return float(deep[0])
    return ratio
