"""An exponential moving average (EMA) of the trainable weights, the model a run hands out.

Small batches make the last iterate of a short run a noisy draw around where training is
heading (the 1x tree fine-tune reads 0.81 to 0.85 over three seeds; amazon's in-training
curve swings by 0.2). The average of the recent iterates is the usual cure, at no extra forward
or backward pass. After step t the average moves toward the weights with decay
``min(decay, (1 + t) / (10 + t))``: early steps are averaged over a short window, so a run never
hands out weights dominated by its start.

Written here rather than with ``torch.optim.swa_utils.AveragedModel``: that deep-copies the
whole module, i.e. the frozen base LM too (135M parameters for a few million trainable ones),
and its averaged copy is a second module the checkpoint and PEFT code do not know.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from ktm.errors import KTMError


def decay_at(decay: float, updates: int) -> float:
    """The decay of update number ``updates`` (0-based): short windows first, then ``decay``."""
    return min(decay, (1 + updates) / (10 + updates))


class WeightAverage:
    """An EMA of ``params`` (kept in fp32); ``applied()`` swaps it into the parameters."""

    def __init__(self, params: Sequence[torch.nn.Parameter], decay: float, updates: int = 0):
        if not 0.0 < decay < 1.0:
            raise KTMError(f"EMA decay must be in (0, 1), got {decay}")
        self.params, self.decay, self.updates = list(params), decay, updates
        self.shadow = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        d = decay_at(self.decay, self.updates)
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach().float(), 1.0 - d)
        self.updates += 1

    @torch.no_grad()
    def reset_to(self, params: Sequence[torch.Tensor]) -> None:
        """Set the average to these tensors (a resumed run's saved average)."""
        for s, p in zip(self.shadow, params):
            s.copy_(p.detach().float())

    @torch.no_grad()
    def copy_to_params(self) -> None:
        """Write the average into the parameters for good (the run's final model)."""
        for s, p in zip(self.shadow, self.params):
            p.copy_(s.to(p.dtype))

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The parameters hold the average inside the block and their own values after it."""
        live = [p.detach().clone() for p in self.params]
        try:
            self.copy_to_params()
            yield
        finally:
            with torch.no_grad():
                for p, v in zip(self.params, live):
                    p.copy_(v)
