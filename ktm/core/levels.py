"""A model's merge levels: whether it merges at all, the encoder that merges ``k`` tokens (its
own, or an inner level of a recursive one), and reading at another level for a while."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from ktm.core.encoder import level_encoder
from ktm.errors import KTMError


def merges(model) -> bool:
    """False for K=1 with nothing learnable: merging is the identity and is skipped."""
    return not model.encoder.config.is_identity


def encoder_at(model, k: int) -> nn.Module:
    """The encoder of ``model`` that merges ``k`` tokens: its own, or an inner level of a
    recursive one (``inner_k``), which is a whole encoder of that K."""
    levels = model.config.levels  # the config follows the encoder in use
    if k not in levels:
        raise KTMError(f"K={k} is not one of this model's merge levels: expected one of "
                       f"{sorted(levels)} (a recursive encoder, inner_k > 1, also merges at "
                       "its inner K)")
    return level_encoder(model.encoder, k)


@contextmanager
def merging_at(model, k: int) -> Iterator:
    """``model`` merges ``k`` tokens per block inside (``encoder_at``); the LoRA is shared, so
    one reader learns several K at once (``ktm pretrain --k-mix``)."""
    level = encoder_at(model, k)
    if level is model.encoder:
        yield model
        return
    outer = model.encoder
    model.encoder = level  # nn.Module re-registers it; the outer encoder comes back below
    try:
        yield model
    finally:
        model.encoder = outer
