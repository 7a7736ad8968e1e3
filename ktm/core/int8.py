"""Int8 weights for decoding: each linear layer of the LM held as int8 with one scale per output
row, a quarter of fp32's bytes (what llama.cpp's Q8_0 files buy it).

A decode step reads every weight once for one token per row. On a CPU SmolLM2-135M's 211
matrices take 44 ms a token in fp32 on one core, 19 ms in int8 through torch's weight-only int8
kernel (``results/bench/cpu_matvec_layouts.json``). How a call is computed:
- one row inside a compiled CPU step (``ktm.decode.compiled``): the int8 -> float conversion
  written into the dot products, which inductor fuses, in the input's own dtype;
- a few rows (eager decoding, a batch): ``torch.ops.aten._weight_int8pack_mm``, which reads its
  input and writes its output in bf16 (its fp32 path is scalar code, 15x slower on a CPU);
- ``GEMM_ROWS`` rows or more (a prefill): the weight dequantized once into the input's dtype and
  the dtype's own GEMM (the int8 kernel is slower than it there).

What it costs in accuracy: each weight is rounded to one of 255 steps of its row's largest
magnitude (at most half a step off), and the bf16 kernel rounds its input and output.
``results/bench/compiled_parity_int8.json`` gives the largest logit difference against the
model's own weights on a real model, and where greedy tokens first differ. Held in int8: every
``nn.Linear`` (and GPT-2's ``Conv1D``) of the LM, projections and the output head; the input
embeddings, norms and other weights (fused MoE experts) stay in the model's dtype.

Why not torchao's ``Int8WeightOnlyConfig``: it calls the same kernel, and would bring a
dependency whose compiled extension is built against one torch release at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from ktm.errors import KTMError

WEIGHTS = ("native", "int8")
COMPUTE = torch.bfloat16  # what the kernel reads and writes (its fp32 path is scalar code)
GEMM_ROWS = 64  # rows from which a call dequantizes the weight and runs a GEMM (a prefill)


def check_weights(weights: str) -> str:
    if weights not in WEIGHTS:
        raise KTMError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    return weights


class Int8Linear(nn.Module):
    """A frozen ``nn.Linear`` in int8: ``y = (x @ q^T) * scale + bias``, ``q`` the weight rounded
    to int8 per output row, ``scale`` that row's largest magnitude / 127 in bf16, rounded up
    where bf16 rounded it down (so no weight is clipped, and each is off by at most half a
    step), the weights rounded against that bf16 scale, the one applied."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        w = linear.weight.detach().float()
        if not isinstance(linear, nn.Linear):  # transformers' Conv1D (GPT-2): [in, out]
            w = w.T.contiguous()
        top = w.abs().amax(dim=1).clamp(min=127 * torch.finfo(COMPUTE).tiny)
        scale = (top / 127).to(COMPUTE)
        scale = torch.where(scale.float() * 127 < top,
                            torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
        q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.bias = linear.bias  # shared, in the model's dtype
        self.out_features, self.in_features = w.shape
        self._conv1d = not isinstance(linear, nn.Linear)
        self._dtype = linear.weight.dtype

    @property
    def weight(self) -> torch.Tensor:
        """The weight it holds, dequantized, in the layer's own dtype and layout: for a model
        that reads a layer's weight itself (Jamba's Mamba reads ``dt_proj.weight``)."""
        w = (self.qweight.float() * self.scale.float()[:, None]).to(self._dtype)
        return w.T if self._conv1d else w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows >= GEMM_ROWS:  # a prefill: one dequantized copy, then the dtype's own GEMM
            w = self.qweight.to(x.dtype) * self.scale.to(x.dtype)[:, None]
            return nn.functional.linear(x, w, self.bias)
        if rows == 1 and x.device.type == "cpu" and torch.compiler.is_compiling():
            # a compiled step of one row: inductor fuses the int8 -> float conversion into the
            # dot products, in the input's own dtype (measured on the CPU: SmolLM2-135M's
            # step at 2,048 positions 30 ms against the kernel's 35; from two rows on, each
            # row reads the weights again and the kernel is faster)
            y = (x.unsqueeze(-2) * self.qweight.to(x.dtype)).sum(-1) * self.scale.to(x.dtype)
        else:
            flat = x.reshape(-1, self.in_features).to(COMPUTE)
            y = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scale)
            y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def linears(lm: nn.Module) -> dict[str, nn.Module]:
    """The plain ``nn.Linear`` layers of ``lm`` and transformers' ``Conv1D`` (GPT-2's, a linear
    layer with its weight stored [in, out]); subclasses, PEFT's wrappers included, are not (a
    view to quantize has its LoRA folded first)."""
    from transformers.pytorch_utils import Conv1D

    return {n: m for n, m in lm.named_modules() if type(m) in (nn.Linear, Conv1D)}


def check_kernel(device: torch.device) -> None:
    """Refuse by name a device where this torch has no weight-only int8 kernel."""
    x = torch.zeros(1, 32, dtype=COMPUTE, device=device)
    q = torch.zeros(8, 32, dtype=torch.int8, device=device)
    try:
        torch.ops.aten._weight_int8pack_mm(x, q, torch.ones(8, dtype=COMPUTE, device=device))
    except (NotImplementedError, RuntimeError) as e:
        raise KTMError(f"weights='int8' needs torch's weight-only int8 kernel "
                       f"(aten._weight_int8pack_mm) on {device}, which torch {torch.__version__} "
                       f"does not have there ({str(e).splitlines()[0]}); use weights='native'"
                       ) from None


@torch.no_grad()
def int8_swaps(lm: nn.Module) -> dict[str, Int8Linear]:
    """An ``Int8Linear`` copy of each linear layer of ``lm`` (``linears``), by name (what
    ``ktm.core.lora_fold.swapped_view`` puts in their place)."""
    found = linears(lm)
    if not found:
        raise KTMError(f"weights='int8': {type(lm).__name__} has no linear layer (nn.Linear or "
                       "Conv1D) to hold in int8")
    check_kernel(next(iter(found.values())).weight.device)
    return {n: Int8Linear(m) for n, m in found.items()}
