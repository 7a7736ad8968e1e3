"""A tiny n-gram model of token surprisal: the ``surprisal`` signal of adaptive merging.

Byte Latent Transformer cuts its patches where a small entropy model finds the text hard to
predict. This is that model made tiny enough to ship beside a reader: unigram counts and hashed
bigram counts of the reader's pretraining text, stored as a safetensors file of two count
vectors (``surprisal.safetensors``; float32 counts, a few hundred KB). A token's surprisal is

    -log2 p(t | prev),  p(t | prev) = (c(prev, t) + a * p(t)) / (c(prev) + a)

with p(t) the unigram probability (add-one smoothed over the vocabulary) and ``a`` = 4: a
bigram seen often speaks for itself, a rare one falls back on how common the token is. Bigrams
share ``BUCKETS`` hashed counters; a collision adds a little noise, not an error.

``ktm pretrain`` counts it over its own sources and saves it with the reader when an allocator
needs it (``--mixed-signals`` with surprisal, or ``--allocator surprisal``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ktm.errors import KTMError
from ktm.util.fileio import save_safetensors_atomic

BUCKETS = 1 << 17
BACKOFF = 4.0


def bucket(prev: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
    """Hashed bigram index of (prev, cur) token ids (int64 tensors)."""
    return (prev * 1_000_003 + cur * 7919) % BUCKETS


class SurprisalTable:
    """Unigram and hashed-bigram counts over a vocabulary of ``vocab`` ids."""

    def __init__(self, unigram: torch.Tensor, bigram: torch.Tensor):
        if unigram.dim() != 1 or bigram.shape != (BUCKETS,):
            raise KTMError(f"a surprisal table holds a (vocab,) unigram and a ({BUCKETS},) "
                           f"bigram count vector, got {tuple(unigram.shape)} and "
                           f"{tuple(bigram.shape)}")
        self.unigram, self.bigram = unigram.double(), bigram.double()
        total = self.unigram.sum() + len(self.unigram)
        self.log_uni = ((self.unigram + 1) / total).log()

    @property
    def vocab(self) -> int:
        return len(self.unigram)

    @classmethod
    def count(cls, docs: Iterable[Sequence[int]], vocab: int) -> SurprisalTable:
        """Count unigrams and bigrams over token-id documents."""
        uni = torch.zeros(vocab, dtype=torch.float64)
        bi = torch.zeros(BUCKETS, dtype=torch.float64)
        for doc in docs:
            ids = torch.as_tensor(list(doc), dtype=torch.long)
            if len(ids) == 0:
                continue
            if int(ids.max()) >= vocab:
                raise KTMError(f"token id {int(ids.max())} is outside the vocabulary of {vocab}")
            uni.index_add_(0, ids, torch.ones(len(ids), dtype=torch.float64))
            if len(ids) > 1:
                bi.index_add_(0, bucket(ids[:-1], ids[1:]),
                              torch.ones(len(ids) - 1, dtype=torch.float64))
        return cls(uni, bi)

    def scores(self, ids: Sequence[int], prev: int | None = None) -> list[float]:
        """Surprisal in bits of each token of ``ids`` (the first given ``prev``, if any; else
        its unigram surprisal)."""
        if not ids:
            return []
        t = torch.as_tensor(list(ids), dtype=torch.long)
        if int(t.max()) >= self.vocab or int(t.min()) < 0:
            raise KTMError(f"token ids {int(t.min())}..{int(t.max())} are outside this "
                           f"surprisal table's vocabulary of {self.vocab}")
        before = torch.cat([torch.tensor([-1 if prev is None else prev]), t[:-1]])
        p_uni = self.log_uni[t].exp()
        has = before >= 0
        c_prev = torch.where(has, self.unigram[before.clamp(min=0)], torch.zeros(()))
        c_pair = torch.where(has, self.bigram[bucket(before.clamp(min=0), t)], torch.zeros(()))
        p = (c_pair + BACKOFF * p_uni) / (c_prev + BACKOFF)
        return (-(p.log() / math.log(2))).tolist()

    def save(self, path: str | Path) -> None:
        """Write the table atomically as safetensors (float32 counts)."""
        save_safetensors_atomic(path, {"unigram": self.unigram.float().contiguous(),
                                       "bigram": self.bigram.float().contiguous()},
                                {"format": "ktm-surprisal", "buckets": str(BUCKETS)})

    @classmethod
    def load(cls, path: str | Path) -> SurprisalTable:
        try:
            tensors = load_file(str(path))
        except (OSError, ValueError, SafetensorError) as e:
            raise KTMError(f"cannot read surprisal table {str(path)!r}: {e}") from e
        if set(tensors) != {"unigram", "bigram"}:
            raise KTMError(f"surprisal table {str(path)!r} holds {sorted(tensors)}: expected "
                           "unigram and bigram")
        return cls(tensors["unigram"], tensors["bigram"])
