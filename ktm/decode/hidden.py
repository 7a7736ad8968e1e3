"""Keys a head-wise KV press hid: kept in the cache, never attended.

kvpress's head-wise presses (AdaKV, CriticalAdaKV, KVzip) keep every position in the cache and
mark, per layer and head, the keys attention must skip (``masked_key_indices`` on each attention
module, read by kvpress's attention patch while decoding). kvpress leaves them on the modules,
where the next read of any prompt would find them, and for one batch of prompts pressed
together. ktm presses rows one by one and batches them, so it takes them off the modules after
each press (``hidden_keys``) and carries them with the batch they belong to
(``DecodeState.hidden``, one row per hidden key: [row, layer, head, position]), moved along as
rows join (``shift_hidden``) and leave (``keep_hidden``), and put back only around each read of
that batch (``hiding``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ktm.errors import KTMError


def attention_layers(lm) -> list:
    """The attention modules a press hooks, as kvpress finds them (``model.model.layers``)."""
    inner = getattr(lm, "model", None)
    inner = getattr(inner, "language_model", inner)
    layers = getattr(inner, "layers", None)
    if layers is None or not all(hasattr(x, "self_attn") for x in layers):
        raise KTMError(f"a KV press needs a decoder whose layers each have self_attn "
                       f"(model.model.layers), as kvpress does; {type(lm).__name__} has none")
    return [x.self_attn for x in layers]


def hidden_keys(lm) -> torch.Tensor | None:
    """(N, 4) [row, layer, head, position] of the keys a head-wise press (AdaKV, CriticalAdaKV,
    KVzip) left in ``lm``'s cache but hid from attention (kvpress's ``masked_key_indices`` on
    each attention layer), taken off the layers; None: none hidden.

    kvpress keeps them on the modules, where the next read of any prompt would find them; ktm
    carries them with the batch they belong to (``DecodeState.hidden``) instead."""
    parts = []
    for layer, module in enumerate(attention_layers(lm)):
        idx = getattr(module, "masked_key_indices", None)
        module.masked_key_indices = None
        if idx is not None and len(idx[0]):
            b, h, s = (t.to(torch.long) for t in idx)
            parts.append(torch.stack([b, torch.full_like(b, layer), h.to(b.device),
                                      s.to(b.device)], 1))
    return torch.cat(parts) if parts else None


@contextmanager
def hiding(lm, hidden: torch.Tensor | None) -> Iterator[None]:
    """Reads inside attend to none of ``hidden``'s keys (``hidden_keys``; None: every key),
    through kvpress's attention patch; nothing stays on ``lm``'s layers after."""
    if hidden is None:
        yield
        return
    modules = attention_layers(lm)
    for layer, module in enumerate(modules):
        sel = hidden[hidden[:, 1] == layer]
        module.masked_key_indices = (sel[:, 0], sel[:, 2], sel[:, 3]) if len(sel) else None
    try:
        yield
    finally:
        for module in modules:
            module.masked_key_indices = None


def shift_hidden(hidden: torch.Tensor | None, rows: int = 0, positions: int = 0
                 ) -> torch.Tensor | None:
    """``hidden`` with its rows and positions moved on (a batch joined below, left padding)."""
    if hidden is None:
        return None
    return hidden + torch.tensor([rows, 0, 0, positions], device=hidden.device)


def keep_hidden(hidden: torch.Tensor | None, rows: list[int], batch: int, cut: int
                ) -> torch.Tensor | None:
    """``hidden`` of the ``rows`` a batch of ``batch`` keeps, renumbered, its first ``cut``
    positions (padding) gone."""
    if hidden is None:
        return None
    new = torch.full((batch,), -1, dtype=torch.long, device=hidden.device)
    new[torch.tensor(rows, dtype=torch.long, device=hidden.device)] = torch.arange(
        len(rows), device=hidden.device)
    h = hidden[new[hidden[:, 0]] >= 0].clone()
    h[:, 0] = new[h[:, 0]]
    h[:, 3] -= cut
    return h if len(h) else None
