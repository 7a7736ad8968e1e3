"""A LoRA that adapts only the merged rows: every plain token is read by the base LM as it is.

With ``LoraSettings.scope == "merged"`` each LoRA layer adds its update ``s B A x`` at the rows
the encoder wrote (merged blocks) and nothing at the rest: a question, a part of a document kept
plain, the answer being generated. Those are then read exactly as the base model reads them,
while they attend to the merged rows' keys and values, which the adapter shapes. A plain island
inside a merged document is then copied as faithfully as the base model copies it: measured on
a needle in 1,024 tokens of held-out code, the same shipped K=4 reader (untrained for it) found it
17 times in 20 with its LoRA on every row and 20 in 20 with it on the merged rows only
(``results/question/ablations.json``).

How: one forward hook on each LoRA layer's ``B`` multiplies its output, (B, L, F), by the
batch's gate, (B, L, 1): 1 at a merged row, 0 at a plain one, held in a context variable while
``KTMModel.lm`` runs the forward (``gated``). PEFT offers per-sample adapters
(``adapter_names``), not per-position ones, hence the hook. A forward of plain rows only (a
decode step, a plain prompt) skips the adapter altogether: ``ktm.core.lora_fold.base_view`` is
the LM with each LoRA layer's base module in its place (no weight copied).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from ktm.errors import KTMError

# (B, L, 1) of the forward running now: 1 where the LoRA adapts, 0 where it does not
_GATE: ContextVar[torch.Tensor | None] = ContextVar("ktm_lora_gate", default=None)
_HOOKED = "_ktm_lora_gate_hook"


def _apply_gate(module: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
    gate = _GATE.get()
    if gate is None:
        raise KTMError("a LoRA of scope 'merged' ran outside KTMModel.lm, which says which rows "
                       "are merged: expected every forward of such a model to go through it")
    if out.shape[:-1] != gate.shape[:-1]:
        raise KTMError(f"LoRA gate of shape {tuple(gate.shape[:-1])} for an activation of shape "
                       f"{tuple(out.shape[:-1])}: expected one gate value per row read")
    return out * gate.to(out.dtype)


def gate_lora(peft_model: nn.Module) -> None:
    """Make every LoRA layer of ``peft_model`` adapt only the rows ``gated`` marks (once per
    layer: a second call adds nothing)."""
    for module in peft_model.modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        for b in module.lora_B.values():
            if getattr(b, _HOOKED, None) is None:
                setattr(b, _HOOKED, b.register_forward_hook(_apply_gate))


@contextmanager
def gated(gate: torch.Tensor) -> Iterator[None]:
    """The forwards inside run their LoRA at the rows where ``gate`` (B, L) is true."""
    token = _GATE.set(gate[..., None])
    try:
        yield
    finally:
        _GATE.reset(token)
