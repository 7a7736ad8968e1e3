"""Continuous batching on ``ktm.decode.generate``'s ``DecodeState``: rows leave, rows join, and
a row can start from a stored KV prefix.

``decode_steps`` is ``prefill`` then (pick a token, ``advance``) per step. The server's engine
runs the same ``prefill`` and ``advance`` and, between steps, ``keep_rows`` drops finished rows
and ``join`` appends newly prefilled ones, left-padding the shorter KV cache:

    row i: [pad ...][prefix][generated]    mask (B, T); position ids count real positions only

so a row's outputs do not depend on its batch-mates. Only the cached path is rebatched, and only
with plain full-attention cache layers (a sliding-window layer keeps a rolling buffer).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ktm.decode.generate import DecodeState, eval_mode
from ktm.decode.hidden import keep_hidden, shift_hidden
from ktm.errors import KTMError

# one (keys, values) pair per layer, each (B, H, T, Dh)
KV = list[tuple[torch.Tensor, torch.Tensor]]


def can_rebatch(model) -> bool:
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.lm_config).layers)


def _layers(state: DecodeState) -> list[DynamicLayer]:
    if state.cache is None:
        raise KTMError("rows can be dropped or joined only while decoding with the KV cache")
    layers = state.cache.layers
    if not all(type(layer) is DynamicLayer for layer in layers):
        raise KTMError("rows can be dropped or joined only with full-attention KV cache layers, "
                       f"this model has {sorted({type(x).__name__ for x in layers})}")
    return layers


def _pad_left(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


@torch.no_grad()
def prefill_from_kv(model, past: KV, embeds: torch.Tensor,
                    positions: torch.Tensor | None = None,
                    merged: torch.Tensor | None = None) -> DecodeState:
    """One row whose first P positions are already in ``past`` ((1, H, P, Dh) per layer):
    read only the rest of its prefix, ``embeds`` (S, D), at ``positions`` (S,), by default
    P .. P+S-1 (a spread-positions prefix passes its own); ``merged`` (S,) its merged rows
    (None: none)."""
    p, s = past[0][0].shape[-2], embeds.shape[0]
    cache = DynamicCache(config=model.lm_config)
    if len(cache.layers) != len(past):
        raise KTMError(f"stored KV has {len(past)} layers, the model has {len(cache.layers)}")
    for i, (k, v) in enumerate(past):
        cache.update(k, v, i)
    mask = torch.ones(1, p + s, dtype=torch.long, device=model.device)
    pos = (torch.arange(p, p + s, device=model.device) if positions is None else positions)[None]
    via = model.decode_lm()
    with eval_mode(model):
        logits = model.lm(embeds[None], mask, pos, cache, keep=1, via=via,
                          gate=None if merged is None else merged[None])[:, -1]
    return DecodeState(embeds[None], mask, pos, cache, logits, via)


def keep_rows(state: DecodeState, rows: list[int]) -> None:
    """Drop every row not in ``rows`` (their KV is freed), and padding no row needs any more."""
    layers = _layers(state)
    idx = torch.tensor(rows, dtype=torch.long, device=state.mask.device)
    mask = state.mask[idx]
    cut = mask.shape[1] - int(mask.sum(1).max()) if rows else 0
    state.hidden = keep_hidden(state.hidden, rows, state.mask.shape[0], cut)
    state.mask = mask[:, cut:]
    state.embeds, state.pos = state.embeds[idx, -1:], state.pos[idx, -1:]
    state.logits = state.logits[idx]
    for layer in layers:
        layer.keys, layer.values = layer.keys[idx, :, cut:], layer.values[idx, :, cut:]


def join(a: DecodeState, b: DecodeState) -> DecodeState:
    """``a``'s rows then ``b``'s, the shorter left-padded; ``a`` is reused (its cache grows)."""
    la, lb = _layers(a), _layers(b)
    t = max(a.mask.shape[1], b.mask.shape[1])
    pa, pb = t - a.mask.shape[1], t - b.mask.shape[1]
    for x, y in zip(la, lb):
        x.keys = torch.cat([_pad_left(x.keys, pa, 2), _pad_left(y.keys, pb, 2)])
        x.values = torch.cat([_pad_left(x.values, pa, 2), _pad_left(y.values, pb, 2)])
    # with the cache, advance needs only each row's last position (and reads no embeds)
    hidden = [h for h in (shift_hidden(a.hidden, 0, pa),
                          shift_hidden(b.hidden, a.mask.shape[0], pb)) if h is not None]
    return DecodeState(torch.cat([a.embeds[:, -1:], b.embeds[:, -1:]]),
                       torch.cat([_pad_left(a.mask, pa, 1), _pad_left(b.mask, pb, 1)]),
                       torch.cat([a.pos[:, -1:], b.pos[:, -1:]]), a.cache,
                       torch.cat([a.logits, b.logits]), a.via,
                       hidden=torch.cat(hidden) if hidden else None)


def row_kv(state: DecodeState, row: int, n: int) -> KV:
    """A copy of the KV of ``row``'s first ``n`` real positions, (1, H, n, Dh) per layer."""
    start = state.mask.shape[1] - int(state.mask[row].sum())
    return [(layer.keys[row:row + 1, :, start:start + n].clone(),
             layer.values[row:row + 1, :, start:start + n].clone()) for layer in _layers(state)]
