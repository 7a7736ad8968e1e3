"""Mixed precision in a training step (``ktm.training.precision``): on a bf16 LM, LoRA's
matmuls read the bf16 activations under autocast (not a fp32 copy), while its weights and their
gradients stay fp32 and match the fp32-LoRA step within bf16's tolerance; an fp32 LM's step is
untouched."""

from contextlib import nullcontext

import torch
from helpers import DEVICE, PROMPTS, close, fresh_model, perturb, require_device

from ktm.core.config import LoraSettings
from ktm.core.prompt import Segment
from ktm.model import trainable_parameters
from ktm.tasks.base import Example
from ktm.training.precision import mixed_precision
from ktm.training.train import adamw, train_step

TARGETS = [" yes", " no", " EF"]


def _lora_a_dtypes(model) -> tuple[list, list]:
    """Hooks that record the input and output dtype of every LoRA ``A`` matmul."""
    seen, hooks = [], []
    for name, mod in model.peft.named_modules():
        if name.endswith("lora_A.default"):
            hooks.append(mod.register_forward_hook(
                lambda m, args, out: seen.append((args[0].dtype, out.dtype))))
    return seen, hooks


def _step(model, on: bool):
    model.zero_grad(set_to_none=True)
    with mixed_precision(model) if on else nullcontext():
        out = model(PROMPTS, TARGETS)
    out.loss.backward()
    return out.loss.detach().float(), {n: p.grad.clone() for n, p in trainable_parameters(model)
                                       if p.grad is not None}


def test_a_bf16_step_runs_lora_in_bf16_and_keeps_fp32_weights(tiny_model_dir):
    require_device()
    model = fresh_model(tiny_model_dir, lora=LoraSettings(dropout=0.0), device=DEVICE,
                        dtype=torch.bfloat16)
    perturb(model)  # LoRA's B starts at zero, and with it A's gradient
    model.train()
    seen, hooks = _lora_a_dtypes(model)
    want, want_grads = _step(model, on=False)
    assert seen and all(d == (torch.float32, torch.float32) for d in seen)  # PEFT's fp32 copy
    seen.clear()
    got, grads = _step(model, on=True)
    assert seen and all(d == (torch.bfloat16, torch.bfloat16) for d in seen)
    close(got, want, 5e-2)
    assert grads.keys() == want_grads.keys() and grads
    for name, g in grads.items():
        assert g.dtype == torch.float32, name  # the weights and their gradients stay fp32
        close(g, want_grads[name], 5e-2)
    # the loop's step reads the same way, and its update lands on the fp32 weights
    seen.clear()
    before = {n: p.detach().clone() for n, p in trainable_parameters(model)}
    opt = adamw([p for _, p in trainable_parameters(model)], lr=1e-3)
    window = [Example(tuple(p) if isinstance(p, list) else (Segment(p),), t)
              for p, t in zip(PROMPTS, TARGETS)]
    stats = train_step(model, opt, window, len(window))
    assert seen and all(d == (torch.bfloat16, torch.bfloat16) for d in seen)
    assert torch.isfinite(torch.tensor(stats.loss_sum))
    moved = [n for n, p in trainable_parameters(model) if not torch.equal(p, before[n])]
    assert moved and all(p.dtype == torch.float32 for _, p in trainable_parameters(model))
    for h in hooks:
        h.remove()


def test_an_fp32_step_is_untouched(tiny_model_dir):
    model = fresh_model(tiny_model_dir, lora=LoraSettings(dropout=0.0))
    perturb(model)
    model.train()
    seen, hooks = _lora_a_dtypes(model)
    want, want_grads = _step(model, on=False)
    got, grads = _step(model, on=True)
    assert all(d == (torch.float32, torch.float32) for d in seen)
    assert torch.equal(got, want)
    for name, g in grads.items():
        assert torch.equal(g, want_grads[name]), name
    for h in hooks:
        h.remove()
