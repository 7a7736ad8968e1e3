"""Mixed precision for a training step: fp32 trainable weights, the LM's bf16 compute.

LoRA's weights and the encoder's stay fp32 (AdamW's small updates round to nothing in bf16).
Left alone, PEFT casts each adapted layer's input to its adapter's fp32 and runs LoRA's two
matmuls in fp32: on a GPU those are fp32 GEMMs over every position's activations, without
tensor cores, and a copy of each adapted input in fp32 (on an H200, 8 x 4,096 tokens at
Qwen2.5-0.5B's shape: about a third of the step's kernel time,
``results/device/train_profile.py``). Under ``mixed_precision`` the forward runs under
``torch.autocast`` to the LM's dtype with PEFT's input cast off (``peft.helpers``), so LoRA's
matmuls read the bf16 activations as they are; the weights, their gradients and AdamW stay fp32,
as in any AMP step. Only for a bf16 LM: fp16 would need loss scaling, and an fp32 LM has nothing
to gain.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext

import torch
from peft.helpers import disable_input_dtype_casting


def mixed_precision(model) -> AbstractContextManager:
    """The context a training step's forward runs in (the backward runs outside it, as
    autocast asks): autocast to bf16 with PEFT's input cast off where the LM is bf16, else
    nothing."""
    if model.dtype != torch.bfloat16:
        return nullcontext()
    stack = ExitStack()
    stack.enter_context(torch.autocast(model.device.type, dtype=torch.bfloat16))
    stack.enter_context(disable_input_dtype_casting(model.peft))
    return stack
