"""The compiled decode step (``ktm.decode.compiled``): the same tokens and logits as eager
decoding, one compile per shape, and the settings refused by name."""

import pytest
import torch
from helpers import DEVICE, DTYPE, PROMPTS, close, fresh_model, perturb, require_device

from ktm import KTMError
from ktm.decode import compiled
from ktm.decode.generate import GenerationConfig, decode_steps

# one worker compiles the Llama layer's graphs for every test of this group (tests/decode/
# test_compiled.py, tests/training/test_compiled_training.py, the server's compiled step), in
# turn: a test reuses what an earlier one compiled, where on two workers both compiled it at once
pytestmark = pytest.mark.xdist_group("compile")

# int8 weights' logits against the native ones, as a share of their largest magnitude: each
# weight is off by up to half of 1/127 of its row's largest, and the kernel rounds its input
# and output to bf16 (measured on the 2-layer test model, perturbed, in fp32: at most 0.029)
INT8_BOUND = 0.06


def _decode(model, prompts, n: int):
    """(tokens per step, logits per step) of a greedy decode through the runtime."""
    cfg = GenerationConfig(max_new_tokens=n, stop_at_eos=False)
    runtime = model.runtime
    with torch.no_grad():
        state = runtime.prefill(model.encode_prompts(prompts), [cfg] * len(prompts))
        logits, tokens = [], []
        # at each yield the state's logits are still those its token was picked from
        for tok in decode_steps(model, None, cfg, state=state):
            tokens.append(tok)
            logits.append(state.logits.clone())
    return torch.stack(tokens, 1), logits, state


@torch.no_grad()
def test_compiled_decode_equals_eager_and_compiles_once_per_shape(tiny_model_dir):
    require_device()
    model = fresh_model(tiny_model_dir, device=DEVICE, dtype=DTYPE)
    perturb(model)
    model.requires_grad_(False)
    model.runtime.compile = "off"
    eager_tokens, eager_logits, eager_state = _decode(model, PROMPTS, 10)
    assert eager_state.static_mask is None
    model.runtime.compile = "on"
    tokens, logits, state = _decode(model, PROMPTS, 10)
    assert state.static_mask is not None and state.static_mask.shape[1] == compiled.MIN_BUCKET
    _same_up_to_a_near_tie(tokens, logits, eager_tokens, eager_logits)
    assert model.runtime.compiles >= 1
    before = model.runtime.compiles
    # other prompts of the same batch size and bucket: the step is not compiled again
    again, again_logits, again_state = _decode(model, [PROMPTS[2], PROMPTS[0], PROMPTS[1]], 6)
    assert model.runtime.compiles == before
    # ... and reads the same static cache (CUDA graphs replay over the buffers they recorded),
    # so the earlier batch, whose cache was taken over, is refused rather than read over it
    assert again_state.cache is state.cache
    with pytest.raises(KTMError, match="taken over by a later batch"):
        model.runtime.advance(state, tokens[:, -1])
    _same_up_to_a_near_tie(again, again_logits,
                           *_decode_eager(model, [PROMPTS[2], PROMPTS[0], PROMPTS[1]], 6))
    assert model.runtime.record()["compiled"] == {"mode": "on", "compiles": before}
    # a batch decoded without a cache stays eager under "on"
    assert model.generate(PROMPTS[0], max_new_tokens=3, use_cache=False) == model.generate(
        PROMPTS[0], max_new_tokens=3)


@torch.no_grad()
def test_compiled_prefill_fills_the_cache_as_eager_for_every_length(tiny_model_dir):
    """The prefill compiled once with dynamic shapes: a left-padded batch and prompts of other
    lengths read into the same keys, values and logits as the eager forward, and a second
    batch of other lengths compiles nothing new."""
    from ktm.core.batch import pack
    from ktm.decode.generate import kv_cache

    require_device()
    ktm_model = fresh_model(tiny_model_dir, device=DEVICE, dtype=DTYPE)
    perturb(ktm_model)
    step = compiled.CompiledStep(ktm_model.lm_config, ktm_model.device)
    lm = ktm_model.peft
    for i, prompts in enumerate([PROMPTS, [PROMPTS[2] + " and a few more words", PROMPTS[0]]]):
        cps = ktm_model.encode_prompts(prompts)
        p = pack([cp.embeds for cp in cps], [cp.positions for cp in cps])
        eager, comp = kv_cache(ktm_model), kv_cache(ktm_model)
        want = ktm_model.lm(p.embeds, p.mask, p.position_ids, eager, keep=1)[:, -1]
        got = step.prefill(lm, p.embeds, p.mask, p.position_ids, comp)
        close(got, want)
        for a, b in zip(comp.layers, eager.layers):
            assert a.keys.shape == b.keys.shape
            close(a.keys, b.keys)
            close(a.values, b.values)
        if i == 0:
            first = step.compiles
    assert step.compiles == first


@torch.no_grad()
def test_a_compiled_prefill_before_eager_steps_keeps_no_room(ktm_model, monkeypatch):
    """Where ``auto`` compiles the prefill but not the decode step (here: the CPU made to look
    like a device where only prefills pay), the prefill fills plain ``DynamicLayer``s, the
    layers it was checked against, and the eager steps after it pick eager's tokens."""
    from transformers.cache_utils import DynamicLayer

    monkeypatch.setitem(compiled.PREFILL_PAYS, "cpu", 1 << 16)
    ktm_model.runtime.compile = "auto"
    tokens, logits, state = _decode(ktm_model, PROMPTS, 5)
    assert state.static_mask is None
    assert all(type(layer) is DynamicLayer for layer in state.cache.layers)
    _same_up_to_a_near_tie(tokens, logits, *_decode_eager(ktm_model, PROMPTS, 5))


def _decode_eager(model, prompts, n: int) -> torch.Tensor:
    mode, model.runtime.compile = model.runtime.compile, "off"
    try:
        return _decode(model, prompts, n)[:2]
    finally:
        model.runtime.compile = mode


def _same_up_to_a_near_tie(tokens, logits, want_tokens, want_logits,
                           bound: float | None = None) -> None:
    """Row by row, greedy tokens equal and logits close (the dtype's tolerance; ``bound``: within
    that share of the wanted logits' largest magnitude) up to the first step whose eager top-2
    margin is within twice that step's largest logit difference, where a rounding may tip the
    pick (in fp32 on the CPU: none, the tokens are equal throughout)."""
    scale = max(float(x.abs().max()) for x in want_logits)
    for r in range(tokens.shape[0]):
        for i in range(tokens.shape[1]):
            got, want = logits[i][r].double(), want_logits[i][r].double()
            if bound is None:
                close(got, want)
            else:
                assert float((got - want).abs().max()) <= bound * scale
            if tokens[r, i] != want_tokens[r, i]:
                top = want.topk(2).values
                assert top[0] - top[1] <= 2 * (got - want).abs().max(), (
                    f"row {r} step {i}: {int(tokens[r, i])} against eager's "
                    f"{int(want_tokens[r, i])} with a margin of {float(top[0] - top[1]):.3g}")
                break


def test_compile_settings_are_checked(ktm_model):
    with pytest.raises(KTMError, match="compile must be one of"):
        ktm_model.runtime.compile = "fast"
    # auto: where measured to pay; on CUDA, for batches of up to 64k cache positions
    assert not compiled.resolve("auto", torch.device("cpu"), 512)
    assert compiled.resolve("on", torch.device("cpu"))
    assert not compiled.resolve("off", torch.device("cuda"), 512)
    assert compiled.resolve("auto", torch.device("cuda"), compiled.positions(1, 4096, 128))
    assert compiled.resolve("auto", torch.device("cuda"), compiled.positions(16, 2048, 16))
    assert not compiled.resolve("auto", torch.device("cuda"), compiled.positions(16, 4096, 16))
    assert not compiled.resolve("auto", torch.device("cuda"))  # size not known
    assert not compiled.resolve("auto", torch.device("mps"), 512)  # never measured
    # the prefill: on CUDA up to 1,024 positions (batch x longest prompt), never on the CPU
    assert compiled.resolve_prefill("on", torch.device("cpu"), 4096)
    assert not compiled.resolve_prefill("off", torch.device("cuda"), 256)
    assert not compiled.resolve_prefill("auto", torch.device("cpu"), 256)
    assert compiled.resolve_prefill("auto", torch.device("cuda"), 1024)
    assert not compiled.resolve_prefill("auto", torch.device("cuda"), 4096)
    ktm_model.runtime.compile = "auto"  # on the CPU: eager
    state = ktm_model.runtime.prefill(ktm_model.encode_prompts(PROMPTS[:1]),
                                      [GenerationConfig(max_new_tokens=4)])
    assert state.static_mask is None
    assert [compiled.bucket(n) for n in (1, 256, 257, 320, 2048, 2049, 2100, 4000)] == [
        256, 256, 320, 320, 2048, 2560, 2560, 4096]


@torch.no_grad()
def test_batches_a_static_cache_cannot_hold_are_refused_by_name(ktm_model):
    cfg = GenerationConfig(max_new_tokens=4)
    state = ktm_model.runtime.prefill(ktm_model.encode_prompts(PROMPTS[:2]), [cfg, cfg])
    assert compiled.refusal(state) is None
    state.hidden = torch.zeros(1, 4, dtype=torch.long)  # a head-wise press's hidden keys
    assert "head-wise" in compiled.refusal(state)
    with pytest.raises(KTMError, match="head-wise.*compile='off'"):
        compiled.CompiledStep(ktm_model.lm_config, ktm_model.device).start(state, 4)
    state.cache = None
    assert "without a KV cache" in compiled.refusal(state)


@torch.no_grad()
def test_auto_compiles_a_batch_alone_where_it_pays_but_not_the_servers(ktm_model, monkeypatch):
    """Where ``auto`` pays (here: the CPU made to look like a measured GPU), a batch alone goes
    onto the static cache and a rebatched one (the server's) stays eager; ``on`` takes both,
    the server's padded to a power of two."""
    monkeypatch.setitem(compiled.PAYS, "cpu", 1 << 16)
    runtime, cfgs = ktm_model.runtime, [GenerationConfig(max_new_tokens=4)] * 3
    prompts = ktm_model.encode_prompts(PROMPTS[:3])
    step = torch.zeros(3, dtype=torch.long)
    runtime.compile = "auto"
    assert runtime.prefill(prompts, cfgs).static_mask is not None
    served = runtime.prefill(prompts, cfgs, joinable=True)
    runtime.advance(served, step)
    assert served.static_mask is None
    runtime.compile = "on"
    served = runtime.prefill(prompts, cfgs, joinable=True)
    assert served.static_mask is None  # static at its first step, not while it may join
    runtime.advance(served, step)
    assert served.static_mask.shape[0] == 4 and served.logits.shape[0] == 3
    runtime.keep(served, [2, 0])
    assert served.static_mask is None and served.mask.shape[0] == 2
    runtime.advance(served, step[:2])
    assert served.static_mask.shape[0] == 2


@torch.no_grad()
def test_rows_joining_and_leaving_a_compiled_batch_decode_as_eager(ktm_model):
    """The server's pattern: a batch of two, a row joining at step 2 (its prefill the same shape
    as the running batch's), one leaving at step 4; greedy tokens equal eager decoding's."""
    from ktm.decode.generate import Decoding

    def run(mode: str) -> tuple[list[list[int]], list[int]]:
        runtime, cfg = ktm_model.runtime, GenerationConfig(max_new_tokens=6, stop_at_eos=False)
        runtime.compile = mode

        def rows(prompts):
            state = runtime.prefill(ktm_model.encode_prompts(prompts), [cfg] * len(prompts),
                                    joinable=True)
            return Decoding(runtime, state, [cfg] * len(prompts), [None] * len(prompts))

        batch, out, static = rows(PROMPTS[:2]), [], []
        for i in range(6):
            if i == 2:
                batch.join(rows([PROMPTS[2], PROMPTS[0]]))
            if i == 4:
                batch.keep([3, 0, 2])
            tokens, _ = batch.pick()
            out.append(tokens.tolist())
            batch.advance(tokens)
            mask = batch.state.static_mask
            static.append(0 if mask is None else mask.shape[0])
        return out, static

    compiled_tokens, static = run("on")
    assert static == [2, 2, 4, 4, 4, 4]  # each step on a static cache, rows padded
    eager_tokens, static = run("off")
    assert static == [0] * 6 and compiled_tokens == eager_tokens


def _int8_against_native(tiny_model_dir):
    """A perturbed tiny model on int8 weights, with its native greedy decodes of a batch and
    of one row."""
    require_device()
    model = fresh_model(tiny_model_dir, device=DEVICE, dtype=DTYPE)
    perturb(model)
    model.requires_grad_(False)
    model.runtime.compile = "off"
    native = _decode(model, PROMPTS, 10)[:2], _decode(model, PROMPTS[:1], 10)[:2]
    model.runtime.weights = "int8"
    return model, native


@torch.no_grad()
def test_int8_weights_follow_native_up_to_a_near_tie(tiny_model_dir):
    """Int8 linear layers (``ktm.core.int8``, the bf16 kernel): logits within INT8_BOUND of the
    native ones' largest magnitude and greedy tokens equal up to a near-tie of that size."""
    from ktm.core.int8 import Int8Linear

    model, (batch, one) = _int8_against_native(tiny_model_dir)
    tokens, logits, _ = _decode(model, PROMPTS, 10)
    assert type(model.decode_lm().lm_head) is Int8Linear
    _same_up_to_a_near_tie(tokens, logits, *batch, bound=INT8_BOUND)
    _same_up_to_a_near_tie(*_decode(model, PROMPTS[:1], 10)[:2], *one, bound=INT8_BOUND)


@pytest.mark.sweep  # two more graphs from an empty compile cache: a minute on two cores
@torch.no_grad()
def test_int8_weights_compiled_follow_native_up_to_a_near_tie(tiny_model_dir):
    """The same compiled (a batch, and one row: the fused fp32 dot products). The compiled
    batch is held to the same bound as the rest, not to eager int8's logits: which kernel
    inductor picks for it depends on the CPU (on an AMD EPYC its logits are 4e-4 from eager
    int8's, norm-wise, where on others they are eager's to fp32's rounding)."""
    model, (batch, one) = _int8_against_native(tiny_model_dir)
    model.runtime.compile = "on"
    _same_up_to_a_near_tie(*_decode(model, PROMPTS, 10)[:2], *batch, bound=INT8_BOUND)
    _same_up_to_a_near_tie(*_decode(model, PROMPTS[:1], 10)[:2], *one, bound=INT8_BOUND)


def test_packed_gqa_attention_equals_transformers_sdpa():
    """One query over grouped KV heads read as the group's queries (bool and float masks, a
    mask longer than the keys); any other case is transformers' own function."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    k, v = (torch.randn(2, 2, 10, 8, generator=g) for _ in range(2))
    keep = torch.rand(2, 1, 1, 12, generator=g) > 0.3
    keep[..., 0] = True
    masks = [keep, torch.zeros(2, 1, 1, 12).masked_fill(~keep, float("-inf")), None]
    for q_len in (1, 4):
        q = torch.randn(2, 6, q_len, 8, generator=g)
        for mask in masks if q_len == 1 else [None]:
            got, _ = compiled.packed_gqa_attention(module, q, k, v, mask, scaling=0.3)
            want, _ = sdpa_attention_forward(module, q, k, v,
                                             None if mask is None else mask[..., :10],
                                             scaling=0.3)
            assert got.shape == want.shape == (2, q_len, 6, 8)
            close(got, want)


def test_packed_attention_is_set_for_the_block_only(ktm_model):
    lm = ktm_model.peft.get_base_model()
    assert lm.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="inside"):
        with compiled.packed_attention(lm, torch.device("cpu")):
            assert lm.config._attn_implementation == compiled.PACKED
            raise RuntimeError("inside")
    assert lm.config._attn_implementation == "sdpa"
    with compiled.packed_attention(lm, torch.device("cuda")):  # not measured there: unchanged
        assert lm.config._attn_implementation == "sdpa"


def test_packed_attention_leaves_a_model_that_tests_the_attention_name_alone(ktm_model):
    """Falcon's attention does not call transformers' attention registry: it tests the name
    and under another takes its eager path, which reads a float mask, not SDPA's boolean one
    (decoded through the packed attention, a tiny Falcon's greedy tokens differed from eager's).
    Such a model keeps SDPA; one behind PEFT's wrapper is judged by its base model."""
    import transformers as T
    from helpers import tiny_config

    falcon = T.FalconForCausalLM(tiny_config("falcon", 64)).eval()
    falcon.config._attn_implementation = "sdpa"
    with compiled.packed_attention(falcon, torch.device("cpu")):
        assert falcon.config._attn_implementation == "sdpa"
    lm = ktm_model.peft.get_base_model()
    with compiled.packed_attention(ktm_model.peft, torch.device("cpu")):
        assert lm.config._attn_implementation == compiled.PACKED
    assert lm.config._attn_implementation == "sdpa"


@torch.no_grad()
def test_every_new_shape_compiles_past_torchs_own_limit(tiny_model_dir):
    """torch runs a function's new shape eagerly, without a word, once it has compiled 8 graphs
    of it (a server makes more: rows x buckets). Made to fail instead, at a limit of 1: each
    new shape of the step and the prefill still compiles, and decodes as eager."""
    import torch._dynamo.config as dynamo

    require_device()
    torch._dynamo.reset()  # graphs other tests made would be reused, not compiled
    model = fresh_model(tiny_model_dir, device=DEVICE, dtype=DTYPE)
    model.requires_grad_(False)
    model.runtime.compile = "on"
    # torch's own patch, not pytest's monkeypatch: torch's settings are not module attributes,
    # and monkeypatch would delete them on undo
    limit = dynamo.recompile_limit
    with dynamo.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        for rows in (1, 2, 3):
            before = model.runtime.compiles
            tokens, logits, _ = _decode(model, PROMPTS[:rows], 3)
            assert model.runtime.compiles > before
            _same_up_to_a_near_tie(tokens, logits, *_decode_eager(model, PROMPTS[:rows], 3))
    assert dynamo.recompile_limit == limit and not dynamo.fail_on_recompile_limit_hit
