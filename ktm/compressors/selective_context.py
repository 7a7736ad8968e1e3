"""Selective Context: drop the lexical units the base LM finds least informative.

The self-information of token x_t is ``-log p(x_t | x_<t)`` under the base LM (LoRA adapters
switched off, so a trained checkpoint scores like the untrained base). A unit's self-information
is the sum over its tokens. Units are either single **tokens** or **words** (``unit="word"``, the
default): a word starts at a token that begins with whitespace or punctuation and runs until the
next such token, so a word is never cut in half. Neither is a character: the tokens of one
character split over bytes (a CJK character or an emoji in byte-level BPE, SentencePiece's byte
fallback) are one unit, and a combining mark stays in its base letter's word, so the rewrite
holds only characters of the text, never a U+FFFD or a character made of two others' bytes.

Units are dropped lowest self-information first until ``round(ratio * n)`` of the segment's n
tokens are gone; the last unit may overshoot by less than its own length. The first token has no
context to be scored in and is always kept. Each segment is scored on its own (a batch of
segments, left-padded, one forward pass), after the BOS the tokenizer puts before a text, if any.
"""

from __future__ import annotations

import math
import unicodedata
from typing import Any, ClassVar

import torch

from ktm.compressors.base import Compressor, check_ratio
from ktm.core.batch import pack
from ktm.core.loss import ids_tensor
from ktm.core.prompt import Segment
from ktm.errors import KTMError

UNITS = ("token", "word")
# logits held at once while scoring (elements): (B, L, V) for a long batch would not fit
LOGITS_BUDGET = 64 * 2**20
CHAR_TOKENS = 4  # most tokens one character spans: a UTF-8 character has at most 4 bytes


class SelectiveContext(Compressor):
    name: ClassVar[str] = "selective_context"

    def __init__(self, ratio: float = 0.5, unit: str = "word", batch_size: int = 8):
        super().__init__()
        self.ratio = check_ratio(ratio)
        if unit not in UNITS:
            raise KTMError(f"unit must be one of {UNITS}, got {unit!r}")
        if batch_size < 1:
            raise KTMError(f"batch_size must be >= 1, got {batch_size}")
        self.unit, self.batch_size = unit, batch_size

    def options(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "unit": self.unit}

    @torch.no_grad()
    def self_information(self, rows: list[list[int]]) -> list[list[float]]:
        """Per-token ``-log p`` for each id row; the first token of a row gets ``inf``."""
        model = self.model
        was_training = model.training
        model.eval()
        out: list[list[float]] = []
        try:
            with model.peft.disable_adapter():
                # read each segment after the BOS its tokenizer puts before a text (Llama 3,
                # Gemma): such a model has never read text without it
                lead = list(model.lead_ids)
                for batch in self._groups(rows):
                    p = pack([model.input_embedding(ids_tensor(lead + r, model.device))
                              for r in batch])
                    # logits only where a next token is scored: (N, V), N = sum(len(r) - 1)
                    keep = torch.zeros_like(p.mask, dtype=torch.bool)
                    for b, r in enumerate(batch):
                        keep[b, keep.shape[1] - len(r):-1] = True
                    logp = model.lm(p.embeds, p.mask, p.position_ids, keep=keep).float()
                    logp = logp.log_softmax(-1)
                    nexts = ids_tensor([t for r in batch for t in r[1:]], model.device)
                    nll = (-logp.gather(-1, nexts[:, None]).squeeze(-1)).tolist()
                    at = 0
                    for r in batch:
                        out.append([math.inf] + nll[at:at + len(r) - 1])
                        at += len(r) - 1
        finally:
            model.train(was_training)
        return out

    def _groups(self, rows: list[list[int]]):
        """Batches of at most ``batch_size`` rows whose (N, V) logits stay within a budget."""
        vocab = self.model.lm_config.vocab_size
        group: list[list[int]] = []
        for r in rows:
            size = sum(len(x) for x in group) + len(r)
            if group and (len(group) == self.batch_size or size * vocab > LOGITS_BUDGET):
                yield group
                group = []
            group.append(r)
        if group:
            yield group

    def units(self, ids: list[int]) -> list[list[int]]:
        """Positions of ``ids`` grouped into lexical units (whole characters, at least)."""
        runs = self.char_runs(ids)
        if self.unit == "token":
            return runs
        groups: list[list[int]] = []
        for run, piece in zip(runs, self.pieces(ids, runs)):
            head = piece[:1]
            starts = not groups or not head or head.isspace() or not (
                head.isalnum() or unicodedata.category(head).startswith("M"))
            if starts:
                groups.append(list(run))
            else:
                groups[-1].extend(run)
        return groups

    def char_runs(self, ids: list[int]) -> list[list[int]]:
        """Positions of ``ids`` in runs of whole characters: a token that ends inside a
        character (its text ends in U+FFFD) runs on to the token that completes it."""
        tokenizer = self.model.tokenizer
        whole = [not t.endswith("\ufffd") for t in tokenizer.batch_decode([[t] for t in ids])]
        runs, i = [], 0
        while i < len(ids):
            j = i + 1
            while (j < len(ids) and j - i < CHAR_TOKENS and not whole[i]
                   and tokenizer.decode(ids[i:j]).endswith("\ufffd")):
                j += 1
            runs.append(list(range(i, j)))
            i = j
        return runs

    def pieces(self, ids: list[int], runs: list[list[int]]) -> list[str]:
        """The text each run adds after the one before it. A token decoded alone loses the
        space a SentencePiece tokenizer (Llama 2, Mistral) writes as its first character; after
        its predecessor it keeps it. Where the pair adds nothing to its first run's text, the
        run alone."""
        decode = self.model.tokenizer.batch_decode
        texts = [[ids[i] for i in r] for r in runs]
        alone = decode(texts)
        pairs = decode([a + b for a, b in zip(texts, texts[1:])])
        out = alone[:1]
        for a, b, pair in zip(alone, alone[1:], pairs):
            out.append((pair[len(a):] if pair.startswith(a) else "") or b)
        return out

    def keep_mask(self, ids: list[int], info: list[float],
                  units: list[list[int]] | None = None) -> list[bool]:
        """Which token positions survive dropping ``ratio`` of them, least informative unit
        first (``units``: default ``self.units(ids)``)."""
        target = round(self.ratio * len(ids))
        keep = [True] * len(ids)
        dropped = 0
        units = self.units(ids) if units is None else units
        for unit in sorted(units, key=lambda u: sum(info[i] for i in u)):
            if dropped >= target or math.isinf(sum(info[i] for i in unit)):
                break
            for i in unit:
                keep[i] = False
            dropped += len(unit)
        return keep

    def rewrite(self, texts: list[str], first: list[bool]) -> list[Segment]:
        rows = [self.model.tokenize(t) for t in texts]
        scored = [r for r in rows if len(r) > 1]
        info = iter(self.self_information(scored))
        out = []
        for text, ids in zip(texts, rows):
            if len(ids) <= 1:
                out.append(Segment(text))
                continue
            keep = self.keep_mask(ids, next(info))
            kept = [t for t, k in zip(ids, keep) if k]
            out.append(Segment(self.model.tokenizer.decode(kept)))
        return out
