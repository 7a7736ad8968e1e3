"""LTSC: lossless token-sequence compression with learned meta-tokens.

``fit`` mines the compressed segments of the training prompts for repeated token subsequences,
greedily: each round takes the n-gram (2..``max_len`` tokens) with the largest saving
``(len - 1) * count`` (count = non-overlapping occurrences), replaces it everywhere with a new
meta-token, and recounts, until ``max_meta_tokens`` are chosen or nothing repeats
``min_count`` times. N-grams never span a meta-token, so every meta-token stands for plain ids.
The BOS a first segment opens with (``KTMModel.lead_ids``) is never mined and stays plain.

``encode`` applies the meta-tokens in the order they were learned, each left to right without
overlaps (exactly what mining did), so ``decode(encode(ids)) == ids`` for every input.

The LM gets one new input-embedding row per meta-token (``add_meta_tokens``),
initialised as the mean embedding of the sequence it replaces and trained with LoRA. The rows are
input-only: the LM head never predicts a meta-token. Compressed segments carry their ids in
``Segment.ids`` (no text maps to a meta-token); ``Segment.text`` keeps the original text.

``save_state``/``load_state`` keep the vocabulary and the trained rows beside a checkpoint
(``ltsc.json`` + ``ltsc_meta.safetensors``), which the ktm checkpoint itself does not hold.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view
from safetensors.torch import load_file
from torch import nn

from ktm.compressors.base import Compressor
from ktm.core.loss import ids_tensor
from ktm.core.prompt import Segment, as_segments
from ktm.errors import KTMError
from ktm.model import extend_input_embedding
from ktm.tasks.base import Example
from ktm.util.fileio import save_safetensors_atomic, write_json_atomic

SEP = -1  # between training sequences; marks (<= -2) stand for meta-token i as -(2 + i)
STATE_JSON, STATE_ROWS = "ltsc.json", "ltsc_meta.safetensors"
_CANDIDATES = 8  # top n-grams by overlapping count whose exact saving is checked each round


class MetaEmbedding(nn.Module):
    """The LM's input embedding (V rows, shared, not copied) plus trainable rows for ids >= V.

    forward: (...) ids -> (..., D) embeddings in the LM's dtype. The rows stay fp32 (trainable
    weights are fp32 whatever the LM's dtype) and are cast on the way out.
    """

    def __init__(self, base: nn.Module, meta: torch.Tensor):
        super().__init__()
        object.__setattr__(self, "base", base)  # registered in the LM already; not twice
        self.meta = nn.Parameter(meta.float())

    @property
    def weight(self) -> torch.Tensor:
        """The base table: device, dtype and base vocabulary size come from it."""
        return self.base.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        v = self.base.weight.shape[0]
        is_meta = ids >= v
        out = self.base(ids.clamp(max=v - 1))
        if bool(is_meta.any()):
            rows = self.meta[(ids - v).clamp(min=0)].to(out.dtype)
            out = torch.where(is_meta[..., None], rows, out)
        return out


def meta_rows(model) -> MetaEmbedding | None:
    """The model's meta-token rows, if LTSC gave it any."""
    ext = getattr(model, "input_extension", None)
    return ext if isinstance(ext, MetaEmbedding) else None


def add_meta_tokens(model, sequences: Sequence[Sequence[int]]) -> list[int]:
    """Append one trainable input-embedding row per token sequence; returns the new ids.

    Each row starts as the mean embedding of its sequence (LTSC meta-tokens). The rows are
    input-only (the LM head never predicts them) and train alongside LoRA.
    """
    if not sequences or not all(sequences):
        raise KTMError("add_meta_tokens needs non-empty token sequences, got an empty one")
    old = meta_rows(model)
    with torch.no_grad():
        rows = torch.stack([model.input_embedding(ids_tensor(s, model.device)).float().mean(0)
                            for s in sequences])
    base = old.base if old is not None else model.input_embedding
    if old is not None:
        rows = torch.cat([old.meta.detach(), rows])
    extend_input_embedding(model, MetaEmbedding(base, rows))
    start = base.weight.shape[0] + rows.shape[0] - len(sequences)
    return list(range(start, start + len(sequences)))


def _starts(seq: np.ndarray, gram: tuple[int, ...]) -> list[int]:
    """Left-to-right, non-overlapping start positions of ``gram`` in ``seq``."""
    n = len(gram)
    if len(seq) < n:
        return []
    hits = np.flatnonzero((sliding_window_view(seq, n) == np.asarray(gram)).all(axis=1))
    starts, free = [], 0
    for s in hits.tolist():
        if s >= free:
            starts.append(s)
            free = s + n
    return starts


def _replace(seq: np.ndarray, gram: tuple[int, ...], mark: int) -> np.ndarray:
    starts = _starts(seq, gram)
    if not starts:
        return seq
    keep = np.ones(len(seq), dtype=bool)
    for s in starts:
        keep[s + 1:s + len(gram)] = False
    seq = seq.copy()
    seq[starts] = mark
    return seq[keep]


def _best_gram(flat: np.ndarray, max_len: int, min_count: int) -> tuple[int, ...] | None:
    """The n-gram of plain ids with the largest exact saving ``(len - 1) * count``."""
    rng = np.random.default_rng(0)
    candidates: list[tuple[int, int, int]] = []  # (approx saving, length, window index)
    for n in range(2, max_len + 1):
        if len(flat) < n:
            break
        win = sliding_window_view(flat, n)
        valid = np.flatnonzero((win >= 0).all(axis=1))
        if not len(valid):
            break
        # a 64-bit hash per window finds repeats fast; the winner is re-counted exactly below
        mult = rng.integers(1, 2**62, size=n, dtype=np.uint64) | np.uint64(1)
        with np.errstate(over="ignore"):
            h = (win[valid].astype(np.uint64) * mult).sum(axis=1)
        _, first, counts = np.unique(h, return_index=True, return_counts=True)
        top = np.argsort(-counts, kind="stable")[:_CANDIDATES]
        candidates += [(int(counts[t]) * (n - 1), n, int(valid[first[t]])) for t in top
                       if counts[t] >= min_count]
    best, best_saving = None, 0
    for _, n, at in sorted(candidates, reverse=True)[:_CANDIDATES]:
        gram = tuple(int(x) for x in flat[at:at + n])
        count = len(_starts(flat, gram))
        if count >= min_count and (n - 1) * count > best_saving:
            best, best_saving = gram, (n - 1) * count
    return best


def mine(sequences: Sequence[Sequence[int]], max_meta_tokens: int, max_len: int = 8,
         min_count: int = 2) -> list[tuple[int, ...]]:
    """Greedy vocabulary of repeated subsequences, in the order they must be applied."""
    flat = np.concatenate([np.asarray(list(s) + [SEP], dtype=np.int64) for s in sequences])
    vocab: list[tuple[int, ...]] = []
    while len(vocab) < max_meta_tokens:
        gram = _best_gram(flat, max_len, min_count)
        if gram is None:
            break
        flat = _replace(flat, gram, -(2 + len(vocab)))
        vocab.append(gram)
    return vocab


class LTSC(Compressor):
    name: ClassVar[str] = "ltsc"

    def __init__(self, max_meta_tokens: int = 64, max_len: int = 8, min_count: int = 2):
        super().__init__()
        if max_meta_tokens < 1 or max_len < 2 or min_count < 2:
            raise KTMError("ltsc needs max_meta_tokens >= 1, max_len >= 2 and min_count >= 2, "
                           f"got {max_meta_tokens}, {max_len}, {min_count}")
        self.max_meta_tokens, self.max_len, self.min_count = max_meta_tokens, max_len, min_count
        self.vocab: list[tuple[int, ...]] = []
        self.meta_ids: list[int] = []

    def options(self) -> dict[str, Any]:
        return {"max_meta_tokens": self.max_meta_tokens, "max_len": self.max_len,
                "min_count": self.min_count, "meta_tokens": len(self.vocab)}

    def fit(self, examples: Sequence[Example], model) -> None:
        super().fit(examples, model)
        seqs = [self._ids(s.text, i == 0)[1] for e in examples
                for i, s in enumerate(as_segments(e.segments)) if s.compress]
        if not seqs:
            raise KTMError("ltsc found no compressed segments in the training examples")
        self.vocab = mine(seqs, self.max_meta_tokens, self.max_len, self.min_count)
        self.meta_ids = add_meta_tokens(model, self.vocab) if self.vocab else []

    def encode(self, ids: Sequence[int]) -> list[int]:
        """Plain ids -> ids with meta-tokens."""
        seq = np.asarray(list(ids), dtype=np.int64)
        for i, gram in enumerate(self.vocab):
            seq = _replace(seq, gram, -(2 + i))
        return [self.meta_ids[-2 - x] if x <= -2 else x for x in seq.tolist()]

    def decode(self, ids: Sequence[int]) -> list[int]:
        """Exact inverse of ``encode``."""
        expand = dict(zip(self.meta_ids, self.vocab))
        return [t for x in ids for t in expand.get(x, (x,))]

    def _ids(self, text: str, first: bool) -> tuple[list[int], list[int]]:
        """A segment's ids as (the BOS the tokenizer opens a prompt with, the rest). The BOS is
        never mined: in a meta-token with the text after it (every first segment starts with
        both), the LM would lose the token it always reads first (Llama 3, Gemma)."""
        ids = self.model.tokenize(text, first)
        n = len(self.model.lead_ids) if first else 0
        return ids[:n], ids[n:]

    def rewrite(self, texts: list[str], first: list[bool]) -> list[Segment]:
        out = []
        for t, f in zip(texts, first):
            lead, rest = self._ids(t, f)
            out.append(Segment(t, ids=tuple(lead + self.encode(rest))))
        return out

    def save_state(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        # rows first: a state file always comes with the rows it names
        if self.vocab:
            rows = meta_rows(self.model).meta.detach().cpu().contiguous()
            save_safetensors_atomic(d / STATE_ROWS, {"meta": rows})
        write_json_atomic(d / STATE_JSON, {**self.options(), "vocab": [list(g) for g in self.vocab],
                                           "meta_ids": self.meta_ids})

    def load_state(self, directory: str | Path, model) -> bool:
        d = Path(directory)
        if not (d / STATE_JSON).is_file():
            return False
        try:
            state = json.loads((d / STATE_JSON).read_text())
            self.vocab = [tuple(g) for g in state["vocab"]]
            rows = load_file(str(d / STATE_ROWS))["meta"] if self.vocab else None
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
            raise KTMError(f"LTSC state in {str(d)!r} is missing or corrupt: {e}") from e
        self.model = model
        self.meta_ids = add_meta_tokens(model, self.vocab) if self.vocab else []
        if self.meta_ids != state["meta_ids"]:
            raise KTMError(f"LTSC state in {str(d)!r} has meta ids from {state['meta_ids'][:1]}, "
                           f"but this model gives {self.meta_ids[:1]}: another base vocabulary")
        if rows is not None:
            with torch.no_grad():
                meta_rows(model).meta.copy_(rows.to(meta_rows(model).meta))
        return True
