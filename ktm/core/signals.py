"""The allocator's signals: what each unit of a segment read at a ratio is worth.

A segment read at a ratio spends its positions on the units whose positions carry the most
signal each (``ktm.core.allocate``). Each signal is one small class here, registered by its
name (``SIGNALS``; ``KTMConfig.allocator`` and pretraining's ``--mixed-signals`` take these
names): what it scores (per token, summed per unit, or per unit directly), whether it may leave
units out to pay for the ones it reads plain (``drops``), and whether its plain lines far from
the question are quoted next to it (``quotes``). Adding a signal is adding a class to this file.

    surprisal  a token's surprisal under a small n-gram table built from the reader's
               pretraining text and shipped with it (``ktm.core.surprisal``): Byte Latent
               Transformer's entropy model, made tiny
    rules      content tokens count 1, a token seen in the last 32 tokens 0.5, punctuation 0.3,
               whitespace 0 (needs only the tokenizer)
    recency    later units are worth more (the recent text a continuation reads most closely)
    even       every unit alike: the positions spread evenly (a uniform-K reading at any r)
    random     a seeded draw per unit (a control, and pretraining's varied layouts)
    lm         a token's surprisal under the base LM itself reading the segment plain: the
               oracle the cheap signals are measured against (it costs a plain forward, more
               than the merged prefill it plans)
    attention  the attention a token gets from the segment's last ``ATTENTION_WINDOW`` tokens
               under the base LM reading it plain, averaged over layers, heads and those
               queries: what SnapKV-like KV presses keep, as an oracle of the same cost
    question   how much a token matters to the prompt's question (``ktm.core.question``; the
               question's words in each line of the segment, ``ktm.core.relevance``): the
               lines a question asks about are read plain. To pay for them where the ratio
               leaves no room, it may leave the least relevant units out, so its ratio may
               exceed the largest level; its plain lines far from the question are quoted
               next to it
    scope      ``question``'s scores, and the lines that open the blocks a scored line sits in
               (each line above it indented less than the line below it: a ``def`` or
               ``class`` line, a list's or a heading's first line) get ``SCOPE`` of it: a
               line's enclosing function, asked "which function is this line in", is read plain
               beside it. Text without indentation reads as ``question`` reads it

This module imports nothing of ktm's but its errors (``ktm.core.config`` reads the names here).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import ClassVar

from ktm.errors import KTMError

# the attention signal's queries: a segment's last tokens (SnapKV's observation window)
ATTENTION_WINDOW = 32
FLOOR = 1e-6  # every unit's signal floor: a unit of zero signal still ranks by the spread order
SCOPE = 0.9  # the share of a scored line's score the lines opening its blocks get (``scope``)


class Signal:
    """One allocator signal. A subclass sets ``name`` (and ``drops`` / ``quotes`` where they
    hold) and scores either per token (``token_scores``, summed per unit) or per unit
    (``per_unit``)."""

    name: ClassVar[str]
    # may leave the least-scoring units out to pay for the ones it reads plain
    # (``ktm.core.allocate.spend``'s drop): its ratio may then exceed the largest level
    drops: ClassVar[bool] = False
    # its plain lines far before the question are quoted next to it (``ktm.core.prefix``)
    quotes: ClassVar[bool] = False

    def token_scores(self, scorer: Scorer, ids: list[int], question: Sequence[int]
                     ) -> list[float] | None:
        """Per token of ``ids`` (``question``: the prompt's question's ids); None for a
        signal that scores units by place alone."""
        return None

    def per_unit(self, lengths: Sequence[int], seed: int) -> list[float] | None:
        """A score per unit (``lengths``: each unit's tokens) for a signal that reads no
        token; None: the units sum their tokens' scores."""
        return None

    def unit_scores(self, token_scores: Sequence[float] | None, lengths: Sequence[int],
                    seed: int = 0) -> list[float]:
        """The signal per unit: ``per_unit``'s, else the sum of its tokens' scores plus
        ``FLOOR``."""
        direct = self.per_unit(lengths, seed)
        if direct is not None:
            return direct
        if token_scores is None:
            raise KTMError(f"signal {self.name!r} needs per-token scores")
        out, i = [], 0
        for length in lengths:
            out.append(sum(token_scores[i:i + length]) + FLOOR)
            i += length
        return out


SIGNALS: dict[str, Signal] = {}


def register(cls: type[Signal]) -> type[Signal]:
    """Class decorator: ``cls`` is the signal named ``cls.name``."""
    if cls.name in SIGNALS:
        raise KTMError(f"allocator signal {cls.name!r} is registered twice")
    SIGNALS[cls.name] = cls()
    return cls


def signal_of(name: str) -> Signal:
    """The signal named ``name``; ``KTMError`` naming the known ones otherwise."""
    try:
        return SIGNALS[name]
    except (KeyError, TypeError):
        raise KTMError(f"allocator must be one of {', '.join(SIGNALS)}, got {name!r}") from None


def dropping() -> tuple[str, ...]:
    """The signals that may leave units out (``Signal.drops``)."""
    return tuple(n for n, s in SIGNALS.items() if s.drops)


@register
class Surprisal(Signal):
    name = "surprisal"

    def token_scores(self, scorer, ids, question):
        if scorer.table is None:
            others = ", ".join(n for n in SIGNALS if n != self.name)
            raise KTMError("the surprisal allocator needs the reader's surprisal table, and "
                           "this model has none: expected a reader pretrained by ktm pretrain "
                           f"with --mixed-signals surprisal (which builds it), or another "
                           f"allocator ({others})")
        return scorer.table.scores(ids)


@register
class Rules(Signal):
    name = "rules"

    def token_scores(self, scorer, ids, question):
        return rule_scores(ids, scorer.kinds())


@register
class Recency(Signal):
    name = "recency"

    def per_unit(self, lengths, seed):
        return [(u + 1) / len(lengths) for u in range(len(lengths))]


@register
class Even(Signal):
    name = "even"

    def per_unit(self, lengths, seed):
        return [1.0] * len(lengths)


@register
class Random(Signal):
    name = "random"

    def per_unit(self, lengths, seed):
        rng = random.Random(seed)
        return [rng.random() for _ in lengths]


class _ModelRead(Signal):
    """A signal the model computes by reading the segment plain (``Scorer.reads``)."""

    def token_scores(self, scorer, ids, question):
        read = scorer.reads.get(self.name)
        if read is None:
            raise KTMError(f"the {self.name} allocator reads the segment with the model's own "
                           "LM: expected a scorer made by a KTMModel")
        return read(ids)


@register
class LM(_ModelRead):
    name = "lm"


@register
class Attention(_ModelRead):
    name = "attention"


@register
class Question(Signal):
    name = "question"
    drops = quotes = True

    def token_scores(self, scorer, ids, question):
        """How much each token matters to ``question`` (``ktm.core.relevance``); all equal
        without a question, so that a prompt without one is read evenly."""
        from ktm.core.relevance import lexical_scores

        word, breaks = scorer.words()
        return lexical_scores(ids, question, word, lambda i: breaks.ends_line(ids, i))


@register
class Scope(Question):
    name = "scope"

    def token_scores(self, scorer, ids, question):
        """``question``'s scores, each line's passed up to the lines opening its blocks."""
        from ktm.core.relevance import passages

        scores = super().token_scores(scorer, ids, question)
        _, breaks = scorer.words()
        lines = passages(ids, lambda i: breaks.ends_line(ids, i), longest=len(ids) + 1)
        depth = []  # each line's indentation (None: blank); a break token may hold the next
        for a, b in lines:  # line's leading spaces ("\n    ")
            lead = scorer.tokenizer.decode([ids[a - 1]]).rsplit("\n", 1)[-1] if a else ""
            text = (lead + scorer.tokenizer.decode(ids[a:b])).expandtabs(4)
            depth.append(len(text) - len(text.lstrip(" ")) if text.strip() else None)
        line = [max(scores[a:b], default=0.0) for a, b in lines]
        out = list(line)
        for i, s in enumerate(line):
            if s <= 0 or depth[i] is None:
                continue
            at, j = depth[i], i - 1
            while j >= 0 and at > 0:  # up through the blocks it sits in
                if depth[j] is not None and depth[j] < at:
                    out[j], at = max(out[j], SCOPE * s), depth[j]
                j -= 1
        for (a, b), old, new in zip(lines, line, out):
            if new > old:
                scores[a:b] = [new] * (b - a)
        return scores


def rule_scores(ids: Sequence[int], kinds: Callable[[int], str], window: int = 32
                ) -> list[float]:
    """Per token: 0 for whitespace, 0.3 for punctuation, 0.5 for a token seen in the last
    ``window`` tokens, 1 for other content. ``kinds(id)`` is "space", "punct" or "word"."""
    out, seen = [], {}
    for i, t in enumerate(ids):
        kind = kinds(t)
        if kind == "space":
            out.append(0.0)
        elif kind == "punct":
            out.append(0.3)
        else:
            out.append(0.5 if i - seen.get(t, -window - 1) <= window else 1.0)
        seen[t] = i
    return out


def token_kinds(tokenizer) -> Callable[[int], str]:
    """``kinds(id)`` for ``rule_scores``, read from the tokenizer's own decoding once per id."""
    cache: dict[int, str] = {}

    def kinds(t: int) -> str:
        if t not in cache:
            text = tokenizer.decode([t])
            cache[t] = ("space" if not text.strip() else
                        "punct" if not any(c.isalnum() for c in text) else "word")
        return cache[t]

    return kinds


class Scorer:
    """What a model's signals read, held once per model: its tokenizer (and what is read from
    it, lazily), its surprisal ``table`` (a ``ktm.core.surprisal.SurprisalTable``) and its own
    plain readings (``lm(ids)``, ``attention(ids)``). ``scorer(signal, ids, question)``: the
    signal's per-token scores, None for a signal that reads no token."""

    def __init__(self, tokenizer, table=None, lm: Callable[[list[int]], list[float]] | None
                 = None, attention: Callable[[list[int]], list[float]] | None = None):
        self.tokenizer, self.table = tokenizer, table
        self.reads = {"lm": lm, "attention": attention}
        self._kinds = self._words = None

    def __call__(self, signal: str, ids: list[int], question: Sequence[int] = ()
                 ) -> list[float] | None:
        return signal_of(signal).token_scores(self, ids, question)

    def kinds(self) -> Callable[[int], str]:
        if self._kinds is None:
            self._kinds = token_kinds(self.tokenizer)
        return self._kinds

    def words(self):
        """(word of a token, the tokenizer's line breaks), for the question signal."""
        if self._words is None:
            from ktm.core.relevance import word_of
            from ktm.core.tokens import line_break_ids

            self._words = (word_of(self.tokenizer), line_break_ids(self.tokenizer))
        return self._words
