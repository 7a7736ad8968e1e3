"""Where training starts: a trainable model from a ``ModelSpec`` (``ktm.core.config``), as
``ktm train``, ``pretrain`` and ``curriculum`` start (``--init``, ``--init-adapter``, the model
flags).

A checkpoint (``spec.checkpoint``) continues as saved, or grown where the settings given ask for
more capacity or an outer level (``ktm.training.growth``); any other setting that contradicts it
is refused. Without one, a fresh model of the settings given. ``init_adapter``: LoRA from a
checkpoint, with a fresh encoder. New weights (a fresh model's, a grown part's) come from
``seed``, so the same call gives the same model; the global generator is left as it was.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import torch

from ktm.core.checkpoint import (
    COMPRESSOR_RECORD,
    SETTING_ONLY,
    load_adapter_into,
    model_config,
    read_compressor_record,
)
from ktm.core.config import KTMConfig, ModelSpec
from ktm.errors import KTMError
from ktm.model import KTMModel, open_model
from ktm.readers import open_checkpoint, resolve_checkpoint
from ktm.training.growth import GROWABLE, grow
from ktm.util.flags import from_flags


def open_trainable(spec: ModelSpec, *, init_adapter: str | None = None,
                   seed: int = 0) -> KTMModel:
    """The trainable model ``spec`` names (see the module's docstring)."""
    if spec.checkpoint is not None and init_adapter:
        raise KTMError("give --init or --init-adapter, not both")
    if spec.checkpoint is not None:
        return _saved(spec, seed)
    with torch.random.fork_rng(devices=[]):  # a local generator state, restored afterwards
        torch.manual_seed(seed)
        model = open_model(spec)
    if init_adapter:
        path = resolve_checkpoint(init_adapter)
        warn_adapter_source(path, init_adapter)
        load_adapter_into(model, path)
    return model


def _saved(spec: ModelSpec, seed: int) -> KTMModel:
    """A checkpoint continued: grown where the settings ask for it, else as saved."""
    ckpt = open_checkpoint(spec.checkpoint)  # read once: the name or folder, or already opened
    spec, own, given = replace(spec, checkpoint=ckpt), ckpt.config, spec.settings
    if "inner_k" in given and given.get("k", own.k) > own.k:
        # a reader gaining an outer level (--k 8 --inner-k 4 2 on a K=4 reader of inner K 2)
        return grow(ckpt, replace(from_flags(KTMConfig, given, base=own), dtype=spec.dtype),
                    device=spec.device, seed=seed)
    ckpt.check_level(given.get("k"))
    want, clash = spec.against(own)
    if clash and set(clash) <= set(GROWABLE):
        return grow(ckpt, replace(want, dtype=spec.dtype), device=spec.device, seed=seed)
    return open_model(spec, trainable=True)


def warn_adapter_source(path: Path, name: str) -> None:
    """Say what ``--init-adapter`` takes when it is not a K-token merging checkpoint: a
    baseline's (``compressor.json``) or uncompressed fine-tuning's (K=1). Its LoRA
    learned to read prompts rewritten, or plain: a legitimate start for an adapter, which is why
    it is allowed, but also what a mixed-up folder looks like. What cannot work (another base
    model, a smaller rank) is refused by ``load_adapter_into``."""
    rec = read_compressor_record(path)
    if rec is not None:
        how = "merged" if rec["name"] in SETTING_ONLY else "rewritten"
        what = (f"the checkpoint of a --compressor {rec['name']} baseline ({COMPRESSOR_RECORD}): "
                f"its LoRA learned to read prompts {how} by {rec['name']}")
    elif model_config(path).k == 1:
        what = ("an uncompressed (K=1) checkpoint: its LoRA learned to read plain prompts, "
                "never merged ones")
    else:
        return
    warnings.warn(f"--init-adapter {name!r} is {what}. This run's LoRA starts from it anyway, "
                  "with a fresh encoder; expected a reader or a K-token merging checkpoint, "
                  "unless that is what you meant", UserWarning, stacklevel=2)
