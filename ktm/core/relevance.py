"""How much each token of a document matters to a question: the ``question`` allocator's signal.

A prompt ``[Segment(document), Segment(question, compress=False)]`` asks its question right
after the document; the ``question`` allocator (``ktm.core.allocate``) reads the parts of the
document the question is about plain, and the rest merged. This module scores those parts,
lexically: the document is cut into *passages* (its lines, each at most ``PASSAGE`` tokens), and
a passage scores the inverse passage frequency of every question word it holds, each word once,
plus a bonus for each pair of question words that it holds side by side, in the question's
order (a name with its title, "secret code"):

    score(passage) = sum over distinct question words w in it of idf(w)
                     + PHRASE * sum over adjacent question-word pairs (a, b) found adjacent in it
                       of (idf(a) + idf(b)) / 2
    idf(w) = log(1 + passages / passages holding w)

BM25's weighting without its length normalisation: a passage is a line, and lines are about as
long as each other. Then relevance flows along rare words (in at most ``RARE`` passages) that
the question does not hold, up to ``FEEDBACK`` steps from the best passages (scoring at least
``TOP`` of the best): a passage sharing such a word with a relevant one scores at least
``DECAY`` of it (pseudo-relevance feedback; a question word scored every passage holding it
already). A question about a chain (``b = a``, ``c = b``, asked about ``a``'s value) so
reaches each link through the one before, and a fact's name leads to the lines that use it.

Words are tokens read as text, lowercased, with their spaces and punctuation stripped;
whitespace and punctuation tokens are no words. Each token gets its passage's score, and the
passages next to a scored one get ``CONTEXT`` of it each step away (the lines around a fact,
which a question about it often needs too). It reads the tokens a few times over, nothing next
to the prefill it plans (``compression_s`` in a result row holds it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

PASSAGE = 32  # the longest passage, in tokens: a longer line is cut into pieces of this length
PHRASE = 0.5  # the weight of an adjacent pair of question words, against one word's
CONTEXT = (0.5, 0.25)  # a scored passage's share given to the passages 1 and 2 away
FEEDBACK = 3  # steps relevance flows from the best passages along their rare words
RARE = 2  # a word in at most this many passages is rare
TOP = 0.5  # a passage scoring at least this share of the best is among the best
DECAY = 0.8  # the share of a passage's score a passage sharing a rare word with it gets


def word_of(tokenizer) -> Callable[[int], str | None]:
    """``word(id)``: the token's text, lowercased, stripped of spaces and punctuation at its
    ends (``"ĠAlice,"`` -> ``"alice"``); None for a token without a letter or digit. Read from the
    tokenizer's own decoding, once per id."""
    cache: dict[int, str | None] = {}

    def word(t: int) -> str | None:
        if t not in cache:
            text = tokenizer.decode([t]).strip().lower()
            core = text.strip("".join(c for c in text if not c.isalnum()))
            cache[t] = core if any(c.isalnum() for c in core) else None
        return cache[t]

    return word


def passages(ids: Sequence[int], ends_line: Callable[[int], bool],
             longest: int = PASSAGE) -> list[tuple[int, int]]:
    """(start, end) of each passage of ``ids``: cut after every token that ends a line
    (``ends_line(i)``), and every ``longest`` tokens within a line."""
    out, start = [], 0
    for i in range(len(ids)):
        if ends_line(i) or i + 1 - start >= longest:
            out.append((start, i + 1))
            start = i + 1
    if start < len(ids):
        out.append((start, len(ids)))
    return out


def lexical_scores(ids: Sequence[int], question: Sequence[int],
                   word: Callable[[int], str | None], ends_line: Callable[[int], bool]
                   ) -> list[float]:
    """Per token of ``ids``: its passage's score for the question ``question`` (token ids),
    spread to the neighbouring passages (module docstring); all zeros when the question has no
    word the document holds."""
    asked = [w for w in map(word, question) if w is not None]
    if not ids or not asked:
        return [0.0] * len(ids)
    cuts = passages(ids, ends_line)
    words = [[w for w in map(word, ids[a:b]) if w is not None] for a, b in cuts]
    df: dict[str, int] = {}
    for ws in words:
        for w in set(ws):
            df[w] = df.get(w, 0) + 1
    idf = {w: math.log(1 + len(cuts) / n) for w, n in df.items()}
    pairs = set(zip(asked, asked[1:]))
    score = []
    for ws in words:
        held = set(ws)
        s = sum(idf[w] for w in set(asked) & held)
        s += PHRASE * sum((idf[a] + idf[b]) / 2 for a, b in set(zip(ws, ws[1:])) & pairs)
        score.append(s)
    best = max(score)
    holding: dict[str, list[int]] = {}
    for i, ws in enumerate(words):
        for w in set(ws):
            if df[w] <= RARE:
                holding.setdefault(w, []).append(i)
    sources = [i for i, s in enumerate(score) if best > 0 and s >= TOP * best]
    used: set[str] = set(asked)
    for _ in range(FEEDBACK):
        reached = []
        for i in sources:
            for w in set(words[i]) - used:
                for j in holding.get(w, ()):
                    if j != i and DECAY * score[i] > score[j]:
                        score[j] = DECAY * score[i]
                        reached.append(j)
            used |= set(words[i])
        sources = reached
    spread = list(score)
    for i, s in enumerate(score):
        for d, share in enumerate(CONTEXT, start=1):
            for j in (i - d, i + d):
                if 0 <= j < len(score):
                    spread[j] = max(spread[j], share * s)
    out = [0.0] * len(ids)
    for (a, b), s in zip(cuts, spread):
        out[a:b] = [s] * (b - a)
    return out
