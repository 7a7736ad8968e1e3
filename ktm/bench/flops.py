"""Model FLOPs of a training step and model FLOPs utilisation (MFU), for ``ktm bench --mode train``.

The count follows PaLM's convention (Chowdhery et al. 2022, appendix B): 6 FLOPs per weight per
position read (forward 2, backward 4), plus the attention products, whatever the hardware really
executes. With the base LM frozen, backward computes no weight gradients for it, so the work the
hardware does is nearer 4 per weight: MFU by this convention is the usual, comparable figure, not
the hardware's utilisation.

    LM body:   6 * (weights outside the input embedding and the output head) * positions read
    attention: 6 * layers * hidden * positions^2 per sequence (QK^T and AV, causal half, x3)
    LM head:   6 * vocab * hidden * target tokens (logits are computed at target positions only)
    encoder:   6 * encoder weights * merged blocks (it trains whole)
"""

from __future__ import annotations

import torch

# dense bf16/fp16 matrix peak of a device, by a part of its name (datasheet, no sparsity)
PEAK_TFLOPS_16BIT = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.1, "L4": 121.0,
                     "A10G": 70.0, "RTX 4090": 165.2}


def peak_tflops(device: torch.device, dtype: torch.dtype) -> tuple[float | None, str | None]:
    """(datasheet dense 16-bit TFLOP/s, device name) of a CUDA device in bf16/fp16; (None, name)
    for another device or dtype, or a GPU not in the table: MFU is then not reported."""
    if device.type != "cuda":
        return None, None
    name = torch.cuda.get_device_name(device)
    if dtype not in (torch.bfloat16, torch.float16):
        return None, name
    # the longest matching key first: "H100" inside "H100 NVL" names the same chip
    for key in sorted(PEAK_TFLOPS_16BIT, key=len, reverse=True):
        if key in name:
            return PEAK_TFLOPS_16BIT[key], name
    return None, name


def lm_weight_counts(model) -> tuple[int, int, int, int]:
    """(body weights, layers, hidden size, vocabulary) of the base LM: the body is every weight
    but the input embedding table and the output head (which are counted per position above)."""
    lm = model.peft.get_base_model()
    skip = {id(lm.get_input_embeddings().weight)}
    head = lm.get_output_embeddings()
    if head is not None:
        skip.add(id(head.weight))
    body = sum(p.numel() for n, p in lm.named_parameters()
               if id(p) not in skip and "lora_" not in n)
    cfg = lm.config
    return body, cfg.num_hidden_layers, cfg.hidden_size, lm.get_input_embeddings().weight.shape[0]


def train_step_flops(model, encoder, batch: int, lm_positions: int, target_tokens: int,
                     blocks: int) -> float:
    """Model FLOPs of one training step: ``batch`` sequences of ``lm_positions`` positions each
    (merged prompt + target), ``target_tokens`` per sequence, ``blocks`` merged per sequence."""
    body, layers, hidden, vocab = lm_weight_counts(model)
    enc = sum(p.numel() for p in encoder.parameters()) if blocks else 0
    per_seq = (6 * body * lm_positions + 6 * layers * hidden * lm_positions ** 2
               + 6 * vocab * hidden * target_tokens + 6 * enc * blocks)
    return float(batch * per_seq)
