"""Wall-clock timing of device work: CUDA runs asynchronously, so the clock waits for it first."""

from __future__ import annotations

import time

import torch


def clock(device: torch.device) -> float:
    """``time.perf_counter()`` once every queued kernel on ``device`` has finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def timed(device: torch.device, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` and the seconds its device work took (``clock`` at both ends)."""
    t0 = clock(device)
    out = fn(*args, **kwargs)
    return out, clock(device) - t0
