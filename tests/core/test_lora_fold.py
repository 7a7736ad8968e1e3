"""Decoding through the LM with its LoRA folded into separate weights (``ktm.core.lora_fold``):
the same tokens and logits as PEFT's LoRA layers, and the base weights, training and saving
never touched by it."""

import pytest
import torch
from helpers import PROMPTS, TARGETS, fresh_model, perturb
from safetensors.torch import load_file

from ktm import Segment
from ktm.core.checkpoint import ADAPTER_WEIGHTS
from ktm.decode.generate import generate_ids, prefill
from ktm.model import KTMModel, trainable_parameters
from ktm.tasks.base import Example
from ktm.training.train import adamw, train_step

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# The folded layer computes x (W + s B A)^T, PEFT's x W^T + s (x A^T) B^T: the same number,
# rounded in another order. On the 2-layer test model the logits then differ by about 10 units
# in the last place (eps) of the largest logit in fp32 and about 2 in bf16 (measured: 9.3 and
# 1.7); the bounds leave a few times that, far below the smallest gap between the best two
# logits (0.09 of logits up to 4.2), so greedy tokens must agree exactly.
ULPS = {torch.float32: 64, torch.bfloat16: 8}


def lora_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.peft.named_parameters() if "lora_" in n}


def base_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.peft.named_parameters() if "lora_" not in n}


def assert_bit_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    bad = [n for n in a if not torch.equal(a[n], b[n])]
    assert not bad, f"{len(bad)} tensors changed, e.g. {bad[:3]}"


def first_logits(model, fold: bool) -> tuple[torch.Tensor, object]:
    model.fold_lora = fold
    with torch.no_grad():
        state = prefill(model, model.encode_prompts(PROMPTS))
    return state.logits.float(), state.via


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_logits_and_greedy_tokens_equal_peft_lora(tiny_model_dir, device, dtype):
    model = fresh_model(tiny_model_dir, device=device, dtype=dtype)
    perturb(model)
    folded, view = first_logits(model, True)
    plain, none = first_logits(model, False)
    assert view is not None and none is None
    q = view.model.layers[0].self_attn.q_proj
    assert type(q) is torch.nn.Linear and q.weight.dtype == dtype and q.weight.device.type == device
    scale = float(plain.abs().max())
    torch.testing.assert_close(folded, plain, rtol=0,
                               atol=ULPS[dtype] * torch.finfo(dtype).eps * scale)
    if dtype == torch.float32:  # in bf16 a near tie may break the other way over 12 tokens
        model.fold_lora = True
        tokens = generate_ids(model, PROMPTS, max_new_tokens=12)
        model.fold_lora = False
        assert tokens == generate_ids(model, PROMPTS, max_new_tokens=12)


def test_folding_is_the_default_for_a_frozen_model_only(tiny_model_dir, tmp_path):
    model = fresh_model(tiny_model_dir)
    perturb(model)
    assert model.fold_lora is None and model.decode_lm() is None  # its LoRA trains
    model.save(tmp_path / "ckpt")
    loaded = KTMModel.load(tmp_path / "ckpt")  # trainable=False
    assert loaded.decode_lm() is not None
    assert KTMModel.load(tmp_path / "ckpt", trainable=True).decode_lm() is None
    # the fold is no module of the model: nothing new to save, move or train
    assert set(loaded.state_dict()) == set(KTMModel.load(tmp_path / "ckpt").state_dict())
    assert not any(p.requires_grad for p in loaded.decode_lm().parameters())


def test_folded_batch_equals_each_prompt_alone_and_cached_equals_rerun(ktm_model):
    perturb(ktm_model)
    ktm_model.requires_grad_(False)
    batch = generate_ids(ktm_model, PROMPTS, max_new_tokens=10)
    assert batch == [generate_ids(ktm_model, [p], max_new_tokens=10)[0] for p in PROMPTS]
    assert batch == generate_ids(ktm_model, PROMPTS, max_new_tokens=10, use_cache=False)
    assert ktm_model.decode_lm() is not None


def test_a_changed_lora_is_folded_again(ktm_model):
    perturb(ktm_model)
    ktm_model.fold_lora = True
    before, view = first_logits(ktm_model, True)
    assert ktm_model.decode_lm() is view  # unchanged weights: the same fold
    with torch.no_grad():
        ktm_model.peft.get_base_model().model.layers[1].mlp.down_proj.lora_B["default"] \
            .weight.mul_(3)
    after, again = first_logits(ktm_model, True)
    assert again is not view and not torch.equal(after, before)
    plain, _ = first_logits(ktm_model, False)
    torch.testing.assert_close(after, plain, rtol=0,
                               atol=64 * torch.finfo(torch.float32).eps * float(plain.abs().max()))


def test_disabled_adapter_reads_the_base_model_not_the_fold(ktm_model):
    """The uncompressed baselines and distillation's teacher read the base LM through PEFT's
    ``disable_adapter``: the fold must step aside, and be used again afterwards."""
    perturb(ktm_model)
    folded = generate_ids(ktm_model, PROMPTS, max_new_tokens=8)  # its LoRA trains: no fold
    ktm_model.fold_lora = True
    with ktm_model.peft.disable_adapter():
        assert ktm_model.decode_lm() is None
        base = generate_ids(ktm_model, PROMPTS, max_new_tokens=8)
    assert base != folded
    assert ktm_model.decode_lm() is not None
    assert generate_ids(ktm_model, PROMPTS, max_new_tokens=8) == folded


def _window() -> list[Example]:
    return [Example((Segment(p) if isinstance(p, str) else tuple(p)), t)
            for p, t in zip(PROMPTS, TARGETS)]


def _train(model, steps: int, generate_between: bool) -> None:
    opt = adamw([p for _, p in trainable_parameters(model)], lr=1e-2)
    for _ in range(steps):
        model.train()
        train_step(model, opt, _window(), batch_size=2)
        model.eval()
        if generate_between:
            assert model.decode_lm() is not None
            generate_ids(model, PROMPTS, max_new_tokens=4)
            with model.peft.disable_adapter():  # the baselines' and the teacher's reading
                generate_ids(model, PROMPTS, max_new_tokens=2)


def test_generating_between_training_steps_changes_neither_training_nor_base(
        tiny_model_dir, tmp_path):
    """Folded generation after every step (the LoRA changing each time): the LoRA still trains,
    to exactly the weights of a run that never generated, the adapter file holds them, and
    the base weights end bit-identical to where they started."""
    plain = fresh_model(tiny_model_dir)
    perturb(plain)
    _train(plain, 4, generate_between=False)

    model = fresh_model(tiny_model_dir)
    perturb(model)
    base, start = base_weights(model), lora_weights(model)
    model.fold_lora = True  # fold even while it trains: the worst case for the base weights
    _train(model, 4, generate_between=True)

    trained = lora_weights(model)
    assert all(not torch.equal(trained[n], start[n]) for n in start)
    assert_bit_identical(trained, lora_weights(plain))
    assert_bit_identical(base_weights(model), base)
    assert not any(getattr(m, "merged", False) for m in model.peft.modules())
    model.save(tmp_path / "ckpt")
    saved = load_file(tmp_path / "ckpt" / ADAPTER_WEIGHTS)  # PEFT drops the adapter's name
    assert_bit_identical(saved, {n.replace(".default.", "."): p for n, p in trained.items()})


def test_base_weights_are_bit_identical_after_many_fold_and_train_switches(ktm_model):
    perturb(ktm_model)
    base = base_weights(ktm_model)
    params = [p for _, p in trainable_parameters(ktm_model)]
    opt = adamw(params, lr=1e-2)
    for i in range(12):
        for p in params:  # trains: decoding reads PEFT's layers
            p.requires_grad_(True)
        ktm_model.train()
        train_step(ktm_model, opt, _window()[:2], batch_size=2)
        ktm_model.eval()
        for p in params:  # frozen: decoding folds
            p.requires_grad_(False)
        assert ktm_model.decode_lm() is not None
        generate_ids(ktm_model, PROMPTS[i % 3:i % 3 + 1], max_new_tokens=3)
    assert_bit_identical(base_weights(ktm_model), base)
