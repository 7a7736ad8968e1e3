"""Every merging option on a chosen device and dtype: what the block MLP guarantees holds there.

``KTM_TEST_DEVICE`` picks the device (default ``cpu``; ``cuda`` on a GPU machine, where a missing
GPU fails the tests instead of skipping them). Each option (the paper's block MLP, and the three
contextual ones with their new weights made non-zero) is checked in fp32 and in bf16 (the LM in
bf16, the trainable weights fp32 masters):

- K=1 with a zero MLP is the base LM (block encoder only);
- appending text never changes an earlier block's merged vector (causal merging);
- a batch equals its prompts one by one;
- step by step, cached decode equals a full re-run, and both equal the training forward's logits;
- save -> load gives identical merged vectors and logits;
- one training step lowers the loss.

Tensors are compared norm-wise, ||a - b|| / ||b||: to 1e-5 in fp32 (another kernel for another
shape may sum in another order), to 5e-2 in bf16 (8 bits of mantissa; 1e-2 seen on the CPU). A
wrong mask or a read past a block's segment is off by order 1.

    KTM_TEST_DEVICE=cuda python -m pytest -q tests/core/test_context_on_device.py
"""

import pytest
import torch
from helpers import DEVICE, NORM_TOL, PROMPTS, TARGETS, TEXT, close, perturb, require_device

from ktm.core.loss import target_ids, target_logits
from ktm.decode.generate import advance, prefill
from ktm.model import KTMModel, prompt_logits, trainable_parameters

OPTIONS = {"block": {}, "conv1": dict(context_blocks=1), "layers1": dict(context_layers=1),
           "layers1-query": dict(context_layers=1, context_pool="query"),
           "mixer1": dict(context_transformer=1)}
DTYPES = {d: NORM_TOL[d] for d in ("float32", "bfloat16")}


@pytest.fixture(scope="module", autouse=True)
def device_is_there():
    require_device()


def build(model_dir: str, option: str, dtype: str) -> KTMModel:
    """A K=4 reader (recursive 2x2, slot weights: the shipped layout) whose LoRA, block MLP and
    context weights are all non-zero, as after training."""
    torch.manual_seed(0)
    model = KTMModel.from_base(model_dir, k=4, inner_k=2, slot_weights=True, device=DEVICE,
                               dtype=dtype, **OPTIONS[option])
    perturb(model, seed=1)
    return model.eval()


@pytest.mark.parametrize("dtype", DTYPES)
@torch.no_grad()
def test_k1_with_a_zero_mlp_is_the_base_model(tiny_model_dir, dtype):
    model = KTMModel.from_base(tiny_model_dir, k=1, device=DEVICE, dtype=dtype).eval()
    ids = torch.tensor([model.tokenizer(TEXT)["input_ids"]], device=model.device)
    with model.peft.disable_adapter():
        want = model.peft.get_base_model()(ids).logits[0]
    close(prompt_logits(model, TEXT), want, DTYPES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("option", OPTIONS)
@torch.no_grad()
def test_merging_is_causal_and_a_batch_equals_its_rows(tiny_model_dir, option, dtype):
    model, tol = build(tiny_model_dir, option, dtype), DTYPES[dtype]
    assert model.device.type == torch.device(DEVICE).type
    short, long = model.encode_prompts([TEXT, TEXT + " And then some more words at the end."])
    n = short.embeds.shape[0] - 1  # the last block of the short prompt may be partial
    close(long.embeds[:n], short.embeds[:n], tol)
    together = model.encode_prompts(PROMPTS)
    for prompt, cp in zip(PROMPTS, together):
        close(cp.embeds, model.encode_prompts([prompt])[0].embeds, tol)
    rows = [target_logits(model, [p], [t]).logits for p, t in zip(PROMPTS, TARGETS)]
    close(target_logits(model, PROMPTS, TARGETS).logits, torch.cat(rows), tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("option", OPTIONS)
@torch.no_grad()
def test_cached_decode_equals_a_full_rerun_and_the_training_forward(tiny_model_dir, option,
                                                                     dtype):
    model, tol = build(tiny_model_dir, option, dtype), DTYPES[dtype]
    cps = model.encode_prompts(PROMPTS)
    targets = [target_ids(model, t) for t in TARGETS]
    want = target_logits(model, PROMPTS, TARGETS)
    cached, full = prefill(model, cps), prefill(model, cps, use_cache=False)
    for step in range(max(len(t) for t in targets)):
        close(cached.logits, full.logits, tol)
        for i, t in enumerate(targets):
            if step < len(t):
                close(cached.logits[i], want.logits[want.rows == i][step], tol)
        nxt = torch.tensor([t[step] if step < len(t) else 0 for t in targets],
                           device=model.device)
        advance(model, cached, nxt)
        advance(model, full, nxt)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("option", OPTIONS)
def test_save_load_is_identical_and_a_step_lowers_the_loss(tiny_model_dir, tmp_path, option,
                                                           dtype):
    from ktm.training.train import adamw

    model = build(tiny_model_dir, option, dtype)
    model.save(tmp_path / "ckpt")
    # loaded to train on, as it was saved: the same reading, bit for bit
    again = KTMModel.load(tmp_path / "ckpt", device=DEVICE, dtype=dtype, trainable=True).eval()
    frozen = KTMModel.load(tmp_path / "ckpt", device=DEVICE, dtype=dtype)
    with torch.no_grad():
        for a, b, c in zip(model.encode_prompts(PROMPTS), again.encode_prompts(PROMPTS),
                           frozen.encode_prompts(PROMPTS)):
            assert torch.equal(a.embeds, b.embeds)
            # loaded for inference, a low-precision encoder is read from its weights cast
            # once (ktm.core.encoder.cast_for_inference): equal up to that dtype's rounding
            close(c.embeds, a.embeds, DTYPES[dtype])
        want = target_logits(model, PROMPTS, TARGETS).logits
        assert torch.equal(want, target_logits(again, PROMPTS, TARGETS).logits)
        close(target_logits(frozen, PROMPTS, TARGETS).logits, want, DTYPES[dtype])
    model.train()
    loss = model(PROMPTS, TARGETS).loss
    loss.backward()
    adamw([p for _, p in trainable_parameters(model)], lr=2e-3).step()
    with torch.no_grad():
        after = model(PROMPTS, TARGETS).loss
    assert after.item() < loss.item() - 1e-3, (loss.item(), after.item())
