"""Merging during generation: a long answer's oldest generated tokens merged K to a position.

A prompt is merged once, before it is read. An answer grows one token at a time, and with it
its KV cache. With ``GenerationConfig.merge_window`` W, once more than W generated tokens are
held plain, the oldest of them (a multiple of K, leaving about W / 2 plain) are merged by the
model's own encoder, as a prompt's text would be, and read again in their place:

    cache:  [prompt rows][merged answer rows][the last W generated tokens, plain]
    merge:  the oldest plain answer tokens t_1 .. t_m  ->  m / K merged rows, read over the
            cache before them (their KV depends on nothing after them); the plain tokens after
            keep their KV and positions

so an answer of N tokens holds about N / K + W positions instead of N. The merged rows sit at
the positions the model's prompt layout gives merged blocks: each block's last token's position
with spread positions, else consecutive from the first merged token's (the answer's later
tokens keep their own positions). The KV of the tokens after a merge was computed while the
merged tokens were still plain; that is what keeps a merge cheap (one short read, no re-read of
the window), and what the long-answer benchmark measures (``results/generation/``).

Torch runtime, full-attention caches, batches decoding together (every row has generated as
many tokens: the answer's columns line up at the cache's tail).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ktm.decode.generate import windowed_layers
from ktm.errors import KTMError


def check_window(model, window: int) -> None:
    """Refuse a window merging cannot use: a model that does not merge (K=1), or a window under
    two blocks (each merge leaves half the window plain, so at least one block must merge)."""
    if model.k < 2:
        raise KTMError(f"merge_window={window} merges generated tokens K to a position: this "
                       f"model reads at K={model.k}, expected a model with K >= 2")
    if window < 2 * model.k:
        raise KTMError(f"merge_window must be 0 (off) or at least 2K = {2 * model.k} generated "
                       f"tokens, got {window}")


def due(window: int, plain: int, k: int) -> int:
    """Generated tokens to merge now, of ``plain`` held plain: none up to ``window``; past it,
    the most whole blocks of ``k`` that leave at least half the window plain."""
    if plain <= window:
        return 0
    return (plain - window // 2) // k * k


def merge_generated(model, state, ids: torch.Tensor, plain: int) -> None:
    """Merge the oldest ``ids.shape[1]`` (a multiple of K) of the ``plain`` generated tokens at
    the tail of ``state``'s cache (``ids``: (B, m) their token ids) into m / K rows each, read
    over the cache before them; ``state`` (``DecodeState``) is updated in place: its cache, mask
    and, for a later step, nothing else (the positions of what follows are unchanged)."""
    k, m = model.k, ids.shape[1]
    if m == 0:
        return
    if m % k or m > plain:
        raise KTMError(f"{m} generated tokens to merge of {plain} plain: expected a multiple "
                       f"of K={k}, at most {plain}")
    if state.cache is None or state.hidden is not None or state.static_mask is not None:
        raise KTMError("merging generated tokens needs the eager KV cache (use_cache on, no "
                       "head-wise press, compile off)")
    layers = state.cache.layers
    kinds = windowed_layers(state.cache)
    if kinds:
        raise KTMError("merging generated tokens needs full-attention KV cache layers, this "
                       f"model's cache has {kinds}")
    total = state.mask.shape[1]
    start = total - plain  # the first plain generated token's column
    c = m // k
    # the merged rows' positions: the merged tokens' own, laid out as the prompt's merged blocks
    first = state.pos[:, -1:] - (plain - 1)  # (B, 1) the first plain token's position
    steps = torch.arange(c, device=first.device)[None]
    pos = first + (steps * k + k - 1 if model.config.spread_positions else steps)
    rows = model._prompt_encoder().merge_segments([(row, k) for row in ids.tolist()])
    embeds = torch.stack(rows).to(model.dtype)  # (B, c, D)
    before = DynamicCache(config=model.lm_config)
    for i, layer in enumerate(layers):
        before.update(layer.keys[:, :, :start], layer.values[:, :, :start], i)
    mask = torch.cat([state.mask[:, :start], state.mask.new_ones(state.mask.shape[0], c)], 1)
    model.lm(embeds, mask, pos, before, keep=1, via=state.via,
             gate=torch.ones(embeds.shape[:2], dtype=torch.bool, device=embeds.device))
    for layer, read in zip(layers, before.layers, strict=True):
        keys = torch.cat([read.keys, layer.keys[:, :, start + m:]], 2)
        values = torch.cat([read.values, layer.values[:, :, start + m:]], 2)
        layer.keys, layer.values = keys, values  # a RoomyLayer grows new room at its next step
    state.mask = torch.cat([mask, state.mask[:, start + m:]], 1)
