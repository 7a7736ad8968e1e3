"""One name -> a KTMModel: a ktm checkpoint or shipped reader as trained, else a base model (an
embedded name or HF folder) with an untrained merger that is plain mean pooling at K."""

from __future__ import annotations

from pathlib import Path

import torch

from ktm.models import parse_dtype

DEFAULT_K = 4


def load_any(model: str, k: int | None = None, device: str = "cpu",
             dtype: str | torch.dtype = "float32"):
    """``k``: a base model's K (default 4); for a checkpoint, if given, it must match."""
    from ktm.model import KTMModel
    from ktm.readers import READERS

    dt = parse_dtype(dtype)
    if (Path(model) / "ktm_config.json").is_file() or model in READERS:
        return KTMModel.load(model, k=k, device=device, dtype=dt)
    k = DEFAULT_K if k is None else k  # not ``k or``: K=0 is an error, not the default
    return KTMModel.from_base(model, k=k, use_mlp=False, device=device, dtype=dt)
