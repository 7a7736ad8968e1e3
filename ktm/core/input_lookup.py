"""The id -> embedding lookup ktm feeds the LM through: what the LM's own forward makes of ids.

ktm never passes ``input_ids``: it looks ids up itself, merges the rows and passes
``inputs_embeds``. Most families treat both the same (a scale inside the embedding module, as
Gemma's, or one applied to ``inputs_embeds`` too, as Granite's, is seen either way), but a few
multiply only the rows they look up themselves: Falcon-H1's forward scales ``embed_tokens(ids)``
by ``embedding_multiplier`` and passes ``inputs_embeds`` through as given. For those the lookup
applies the same multiplier, so K=1 is the base model exactly. ``check_ids_equal_embeds`` tries
it on a few ids and refuses a model that still reads its ids otherwise.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from ktm.errors import KTMError

# model_type -> the config field its forward multiplies looked-up ids by (and not inputs_embeds)
ID_ONLY_SCALES = {"falcon_h1": "embedding_multiplier"}


class ScaledLookup(nn.Module):
    """The LM's embedding table (shared, not copied or registered twice) times ``scale``."""

    def __init__(self, table: nn.Module, scale: float):
        super().__init__()
        object.__setattr__(self, "base", table)  # registered in the LM already; not twice
        self.scale = scale

    @property
    def weight(self) -> torch.Tensor:
        """The table: device, dtype and vocabulary size come from it."""
        return self.base.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.base(ids) * self.scale


def input_lookup(lm: PreTrainedModel) -> nn.Module:
    """The module ktm looks ids up with: the LM's input embedding, times the multiplier its
    forward gives only looked-up ids (``ID_ONLY_SCALES``), if any."""
    table = lm.get_input_embeddings()
    field = ID_ONLY_SCALES.get(getattr(lm.config, "model_type", None))
    scale = float(getattr(lm.config, field, 1.0) or 1.0) if field else 1.0
    return table if scale == 1.0 else ScaledLookup(table, scale)


def check_ids_equal_embeds(lm: PreTrainedModel) -> None:
    """Refuse a model that reads ids otherwise than ``input_lookup``'s rows of them: ktm feeds
    only embeddings, so its K=1 (and every plain token) would not be the base model. Tried, not
    looked up: a few ids go through the LM as ids and as looked-up rows, and must agree."""
    lookup = input_lookup(lm)
    vocab = lookup.weight.shape[0]
    device = lookup.weight.device
    ids = (torch.arange(4, device=device) * 7 + 3)[None] % vocab
    was_training = lm.training
    lm.eval()
    try:
        with torch.no_grad():
            by_ids = lm(input_ids=ids, use_cache=False).logits.float()
            by_rows = lm(inputs_embeds=lookup(ids), use_cache=False).logits.float()
    finally:
        lm.train(was_training)
    gap = float((by_ids - by_rows).abs().max())
    if not gap <= 1e-3 * max(1.0, float(by_ids.abs().max())):
        model_type = getattr(lm.config, "model_type", "?")
        raise KTMError(f"{type(lm).__name__} ({model_type!r}) reads token ids otherwise than "
                       f"their embedding rows (logits differ by up to {gap:.3g}): its forward "
                       "transforms looked-up ids in a way inputs_embeds skip, and ktm feeds "
                       "the LM only embeddings, so even K=1 would not be this model; expected "
                       "a causal LM whose forward reads inputs_embeds as its own lookup of the "
                       "ids")
