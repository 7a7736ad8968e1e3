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

A model that does not train prefills through ``RowSwitch`` layers instead
(``ktm.core.lora_fold.rows_view``): the LoRA folded into a copy of the weight for the gated rows,
the base weight for the rest, so a row costs one matmul, not PEFT's three and the gate's
multiply (SmolLM2-135M at 2,048 positions, 64 plain, one CPU thread: the hooked forward 1.18 x
the base LM's time, the switched one 1.04 x; ``results/bench/row_switch.py``).
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
# the same rows for ``RowSwitch``: (whether most rows are gated, the flat indices of the others,
# the number of rows)
_SPLIT: ContextVar[tuple[bool, torch.Tensor, int] | None] = ContextVar("ktm_lora_split",
                                                                       default=None)
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
def gated(gate: torch.Tensor, by_row: bool = False) -> Iterator[None]:
    """The forwards inside run their LoRA at the rows where ``gate`` (B, L) is true.
    ``by_row``: they run ``RowSwitch`` layers, which read the rows split once here (the gate's
    hook reads the gate itself)."""
    token = _GATE.set(gate[..., None])
    split = None
    if by_row:  # one read of the gate a forward, not a layer
        flat = gate.reshape(-1)
        most = 2 * int(flat.sum()) >= flat.numel()
        split = _SPLIT.set((most, torch.nonzero(flat != most).reshape(-1), flat.numel()))
    try:
        yield
    finally:
        if split is not None:
            _SPLIT.reset(split)
        _GATE.reset(token)


class RowSwitch(nn.Module):
    """A projection that reads the gated rows through ``adapted`` (the LoRA folded in) and the
    rest through ``base``: the majority's module on every row, then the minority's rows read
    again through theirs and written over (a question's few plain lines after a long merged
    document cost a few rows more, not a second pass). Outside ``gated`` it refuses to run."""

    def __init__(self, adapted: nn.Module, base: nn.Module) -> None:
        super().__init__()
        self.adapted, self.base = adapted, base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        split = _SPLIT.get()
        if split is None:
            raise KTMError("a LoRA of scope 'merged' ran outside KTMModel.lm, which says which "
                           "rows are merged: expected every forward of such a model to go "
                           "through it")
        most, others, n = split
        if x.shape[:-1].numel() != n:
            raise KTMError(f"LoRA gate of {n} rows for an activation of shape "
                           f"{tuple(x.shape[:-1])}: expected one gate value per row read")
        majority, minority = (self.adapted, self.base) if most else (self.base, self.adapted)
        out = majority(x)
        if others.numel():
            rows = x.reshape(-1, x.shape[-1]).index_select(0, others)
            out.view(-1, out.shape[-1]).index_copy_(0, others, minority(rows))
        return out
