"""Int8 weights for decoding (``ktm.core.int8``): each weight off by at most half its row's step,
the kernel computing with exactly those weights, the LM's own layers untouched, and the settings
refused by name."""

import pytest
import torch
from helpers import PROMPTS, fresh_model, perturb
from torch import nn

from ktm import KTMError
from ktm.core.int8 import COMPUTE, Int8Linear, int8_swaps

# bf16 keeps 8 significant bits: the kernel's input and output are each rounded to within
# 2^-9 of their magnitude
BF16_STEP = 2.0**-8


@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_is_its_rounded_weight_times_its_scale(bias):
    torch.manual_seed(0)
    lin = nn.Linear(96, 40, bias=bias)
    with torch.no_grad():
        lin.weight[3] *= 1e-3  # rows of very different magnitudes keep their own steps
        lin.weight[7] = 0.0
    q = Int8Linear(lin)
    s = q.scale.double()
    w = lin.weight.detach().double()
    assert q.qweight.dtype == torch.int8 and q.scale.dtype == COMPUTE
    assert int(q.qweight.abs().max()) <= 127
    # each weight off by at most half a step of its row (no clipping), zero rows stay zero
    err = (q.qweight.double() * s[:, None] - w).abs()
    assert bool((err <= s[:, None] / 2 * (1 + 1e-6)).all())
    assert not q.qweight[7].any()
    # the kernel reads the input in bf16 and computes with exactly those weights
    x = torch.randn(5, 3, 96)
    y = q(x)
    assert y.shape == (5, 3, 40) and y.dtype == x.dtype
    ref = (x.to(COMPUTE).double() @ q.qweight.double().T) * s
    got = y.double() - (lin.bias.detach().double() if bias else 0)
    assert bool(((got - ref).abs() <= BF16_STEP * ref.abs() + 1e-9).all())


def test_a_prefill_reads_the_same_int8_weights_through_a_gemm():
    torch.manual_seed(0)
    lin = nn.Linear(96, 40)
    q = Int8Linear(lin)
    x = torch.randn(2, 50, 96)  # 100 rows: a prefill's
    w = q.qweight.double() * q.scale.double()[:, None]
    want = x.double() @ w.T + lin.bias.detach().double()
    torch.testing.assert_close(q(x).double(), want, rtol=1e-5, atol=1e-5)


def test_gpt2s_conv1d_is_held_as_the_linear_layer_it_is():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = Conv1D(40, 96)  # weight [in, out]
    nn.init.normal_(conv.weight, std=0.1)
    nn.init.normal_(conv.bias, std=0.1)
    q = Int8Linear(conv)
    assert (q.in_features, q.out_features) == (96, 40)
    x = torch.randn(3, 96)
    want = conv(x).double()
    step = q.scale.double()  # each output off by at most half a step per input, plus bf16's
    bound = (x.abs().double().sum(-1, keepdim=True) * step / 2 + BF16_STEP * want.abs()) * 1.01
    assert bool(((q(x).double() - want).abs() <= bound + 1e-6).all())


def test_int8_swaps_cover_every_plain_linear_layer_and_refuse_a_model_without_one():
    lm = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    swaps = int8_swaps(lm)
    assert sorted(swaps) == ["0", "2.0"] and all(type(m) is Int8Linear for m in swaps.values())
    with pytest.raises(KTMError, match="no linear layer"):
        int8_swaps(nn.Sequential(nn.ReLU()))


@torch.no_grad()
def test_an_int8_view_leaves_the_lm_and_its_native_view_as_they_are(tiny_model_dir):
    model = fresh_model(tiny_model_dir)
    perturb(model)
    model.requires_grad_(False)
    native = model.decode_lm()
    before = {n: p.clone() for n, p in model.peft.named_parameters()}
    model.runtime.weights = "int8"
    view = model.decode_lm()
    assert type(view.model.layers[0].self_attn.q_proj) is Int8Linear
    assert type(view.lm_head) is Int8Linear
    assert model.decode_lm() is view  # kept, not rebuilt per call
    lm = model.peft.get_base_model()
    assert type(lm.lm_head) is nn.Linear
    assert all(torch.equal(p, before[n]) for n, p in model.peft.named_parameters())
    model.runtime.weights = "native"
    assert model.decode_lm() is native  # kept beside the int8 view
    assert type(native.model.layers[0].self_attn.q_proj) is nn.Linear
    # a LoRA weight that changes makes both again
    next(p for n, p in model.peft.named_parameters() if "lora_B" in n).add_(0.01)
    model.runtime.weights = "int8"
    assert model.decode_lm() is not view


def test_int8_settings_are_refused_by_name(tiny_model_dir):
    model = fresh_model(tiny_model_dir)
    with pytest.raises(KTMError, match="weights must be one of"):
        model.runtime.weights = "int4"
    # a LoRA that trains is read unfolded, which int8 cannot
    model.runtime.weights = "int8"
    with pytest.raises(KTMError, match="LoRA trains"):
        model.generate(PROMPTS[0], max_new_tokens=2)
