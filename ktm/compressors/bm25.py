"""A plain lexical retriever: each compressed segment's lines ranked by BM25 against the prompt's
question, the best read plain, in their order, within a budget of tokens; the rest dropped.

The simplest thing a user could do instead of merging, with nothing trained: as a KV press or
truncation, it keeps part of the text as written. ``ratio``: the share of a segment's tokens
dropped (as ``truncate``'s); ``keep``: or at most this many tokens kept (0: use ``ratio``).
Lines are ranked by Okapi BM25 (``rank_bm25``; each line a document, words the text's
``\\w+`` runs lower-cased, so ``secret_code`` and ``secret code`` differ as a lexical index
reads them), ties and a question that matches no line broken toward the document's end (the
lines nearest the question), and taken best first while they fit. A line longer than the whole
budget is cut to its first tokens where it is the best one and nothing else fits.
"""

from __future__ import annotations

import re
from typing import ClassVar

from rank_bm25 import BM25Okapi

from ktm.compressors.truncate import Truncate
from ktm.core.prompt import Segment

WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def ranked(lines: list[str], question: str) -> list[int]:
    """The indices of ``lines``, best first by BM25 against ``question``, later lines first
    among equals (all equal where the question holds no word)."""
    asked = words(question)
    scores = ([0.0] * len(lines) if not asked else
              BM25Okapi([words(line) or [""] for line in lines]).get_scores(asked).tolist())
    return sorted(range(len(lines)), key=lambda i: (-scores[i], -i))


def best_lines(lines: list[str], question: str, sizes: list[int], budget: int) -> list[int]:
    """The indices of the lines kept, in order: ``ranked``, taken while their ``sizes`` fit
    ``budget``."""
    kept, room = [], budget
    for i in ranked(lines, question):
        if sizes[i] <= room:
            kept.append(i)
            room -= sizes[i]
    return sorted(kept)


class BM25Lines(Truncate):
    """Truncation's budget (``ratio``, ``keep``), spent on the lines the question asks about."""

    name: ClassVar[str] = "bm25"
    question_aware = True

    def __init__(self, ratio: float = 0.7, keep: int = 0):
        super().__init__(ratio, keep)

    def rewrite(self, texts: list[str], first: list[bool], questions: list[str]
                ) -> list[Segment]:
        out = []
        for text, opens, question in zip(texts, first, questions, strict=True):
            n = len(self.model.tokenize(text, opens))
            budget = self.keep if self.keep else n - round(self.ratio * n)
            lines = text.splitlines(keepends=True)
            sizes = [len(self.model.tokenize(line)) for line in lines]
            kept = "".join(lines[i] for i in best_lines(lines, question, sizes, budget))
            ids = self.model.tokenize(kept, opens)[:budget] if kept else []
            if not ids and lines:  # not one line fits: the best one's first tokens
                best = ranked(lines, question)[0]
                ids = self.model.tokenize(lines[best], opens)[:max(1, budget)]
            out.append(Segment(self.model.tokenizer.decode(ids), ids=tuple(ids)))
        return out
