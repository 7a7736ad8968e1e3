"""Wall-clock timing of device work: CUDA runs asynchronously, so the clock waits for it first."""

from __future__ import annotations

import time

import torch


def clock(device: torch.device) -> float:
    """``time.perf_counter()`` once every queued kernel on ``device`` has finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
