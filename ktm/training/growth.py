"""Growing a checkpoint: a trainable model that starts as a saved one, with more capacity.

Two kinds, both the saved function at the start and more room to train:

- **capacity**: the adapter grown to a larger LoRA rank (``ktm.core.checkpoint.grow_lora``), the
  encoder MLP widened and / or reading the blocks before each block
  (``ktm.core.encoder.grow_encoder``);
- **an outer level**: a K=4 reader of inner K 2 becomes the inner levels of a K=8 encoder whose
  new level starts as the mean of two of its merges (a zero last MLP layer), so it reads K=4 and
  K=2 exactly as before and K=8 from the start.

``grow(checkpoint, want)`` picks the kind from how ``want`` differs from the checkpoint's own
config and refuses any other change, naming it. ``ktm train`` / ``ktm pretrain --init CKPT``
with the matching model flags call it.
"""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

import torch

from ktm.core.checkpoint import Checkpoint, load_adapter_into
from ktm.core.config import KTMConfig, setting
from ktm.core.encoder import EncoderConfig, grow_encoder
from ktm.errors import KTMError
from ktm.model import KTMModel
from ktm.readers import open_checkpoint

# the settings a capacity growth may change (LoRA as lora_r / lora_alpha), and the rows the
# LoRA adapts (the same weights trained on at other rows: ``ktm.core.lora_scope``)
GROWABLE = ("lora_r", "lora_alpha", "mlp_ratio", "context_blocks", "context_layers",
            "context_transformer", "context_pool", "lora_scope")
# settings of the run, not of the saved function: free to differ in either kind
FREE = ("base_model", "dtype", "plain_suffix", "align_lines", "spread_positions", "ratio",
        "allocator")


def changed(own: KTMConfig, want: KTMConfig) -> list[str]:
    """The settings ``want`` changes from ``own`` (LoRA's as ``lora_<field>``), run settings
    (``FREE``) left out."""
    out = [f.name for f in fields(KTMConfig)
           if f.name not in (*FREE, "lora") and getattr(own, f.name) != getattr(want, f.name)]
    out += [f"lora_{f.name}" for f in fields(own.lora)
            if getattr(own.lora, f.name) != getattr(want.lora, f.name)]
    return out


def grow(checkpoint: str | Path | Checkpoint, want: KTMConfig, *, device: str = "cpu",
         seed: int = 0) -> KTMModel:
    """A trainable model from ``checkpoint`` (a folder, a shipped reader's name, or one already
    read: ``ktm.readers.open_checkpoint``) grown to ``want``: an outer level when ``want.k`` is
    above the checkpoint's K, else capacity (see the module). The new units' initial weights
    come from ``seed``; the global RNG is left as it was. A change neither kind allows raises
    ``KTMError`` naming it."""
    ckpt = open_checkpoint(checkpoint)
    checkpoint, own = ckpt.name, ckpt.config
    if want.k > own.k:
        return _outer(ckpt, want, device, seed)
    diff = changed(own, want)
    if want.k != own.k:
        raise KTMError(f"growing {checkpoint!r} needs its own K={own.k}, not "
                       f"K={want.k}")
    if not set(diff) <= set(GROWABLE):
        bad = ", ".join(f"{d}={setting(want, d)!r} (saved {setting(own, d)!r})"
                        for d in diff if d not in GROWABLE)
        raise KTMError(f"growing {checkpoint!r} changes only {', '.join(GROWABLE)}: "
                       f"expected the rest as saved, got {bad}")
    if want.mlp_ratio < own.mlp_ratio:
        raise KTMError(f"mlp_ratio {want.mlp_ratio!r} (--mlp-ratio) is below checkpoint "
                       f"{checkpoint!r}'s {own.mlp_ratio!r}: expected a wider encoder (a "
                       "narrower one cannot hold it)")
    for name in ("context_blocks", "context_layers", "context_transformer", "context_pool"):
        theirs, ours = getattr(own, name), getattr(want, name)
        if name == "context_pool":  # a block encoder's pool is unused: any is a growth
            theirs = theirs if own.context_layers else 0
        if theirs and ours != theirs:
            raise KTMError(f"{name} {ours!r} (--{name.replace('_', '-')}) differs from "
                           f"checkpoint {checkpoint!r}'s {theirs!r}: only a block encoder "
                           f"({'context_layers' if name == 'context_pool' else name}=0) "
                           "gains context")
    model = _built(want, device, seed)
    enc = model.encoder.config
    theirs = EncoderConfig(enc.hidden_size, **own.encoder_kwargs())
    state = ckpt.encoder_state(theirs)
    if theirs != enc:
        state = grow_encoder(state, model.encoder.state_dict())
    model.encoder.load_state_dict(state)
    load_adapter_into(model, ckpt)
    return model.train()


def _outer(ckpt: Checkpoint, want: KTMConfig, device: str, seed: int) -> KTMModel:
    path, own = ckpt.path, ckpt.config
    if want.levels[1:] != own.levels:
        raise KTMError(f"K={want.k} with inner K {list(want.levels[1:])}: growing reader "
                       f"{str(path)!r} (K={own.k}, levels {list(own.levels)}) by an outer level "
                       f"needs inner_k {tuple(own.levels)} "
                       f"(--inner-k {' '.join(map(str, own.levels))})")
    if own.context_blocks or own.context_layers or own.context_transformer:
        raise KTMError(f"reader {str(path)!r} merges with context: only a block encoder gains "
                       "an outer level")
    keep = replace(want, k=own.k, inner_k=own.inner_k)
    other = changed(own, keep)
    if other:
        raise KTMError(f"growing reader {str(path)!r} by an outer level keeps its other "
                       f"settings: expected only k and inner K to change, got "
                       f"{', '.join(other)}")
    model = _built(want, device, seed)
    saved = ckpt.encoder_state(EncoderConfig(model.encoder.config.hidden_size,
                                             **own.encoder_kwargs()))
    state = model.encoder.state_dict()
    state.update({f"inner.{key}": value for key, value in saved.items()})
    model.encoder.load_state_dict(state)
    load_adapter_into(model, ckpt)
    return model.train()


def _built(want: KTMConfig, device: str, seed: int) -> KTMModel:
    with torch.random.fork_rng(devices=[]):  # the new units' init comes from the run's seed
        torch.manual_seed(seed)
        return KTMModel.from_base(want.base_model, config=want, device=device)

