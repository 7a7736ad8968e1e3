"""Continuous-batching primitives: dropping, joining and KV-prefix rows never change outputs."""

import pytest
import torch
from helpers import PROMPTS, decode_rejoining, perturb

from ktm import KTMError, Segment
from ktm.decode.batched import can_rebatch, keep_rows, prefill_from_kv, row_kv
from ktm.decode.generate import advance, generate_ids, prefill

LONG = [Segment("def add(a, b):\n    return a + b\n# Update the old python code content"),
        Segment(" Hello world, my name is", compress=False)]


@torch.no_grad()
def test_rows_dropped_and_joined_mid_decode_equal_each_alone(ktm_model):
    perturb(ktm_model)
    prompts = PROMPTS + [LONG]
    alone = generate_ids(ktm_model, prompts, max_new_tokens=8, stop_at_eos=False)
    assert can_rebatch(ktm_model)
    assert decode_rejoining(ktm_model, ktm_model.encode_prompts(prompts), [0, 1], 8) == alone


@torch.no_grad()
def test_dropping_rows_trims_padding_no_row_needs(ktm_model):
    cps = ktm_model.encode_prompts([LONG, "Hello world"])
    state = prefill(ktm_model, cps)
    assert state.mask.shape[1] == cps[0].tokens_out
    keep_rows(state, [1])
    assert state.mask.shape[1] == cps[1].tokens_out and bool(state.mask.all())
    assert state.cache.layers[0].keys.shape[2] == cps[1].tokens_out


@torch.no_grad()
@pytest.mark.parametrize("reuse", [1, 5, "all-1"])
def test_prefill_from_a_stored_kv_prefix_equals_full_prefill(ktm_model, reuse):
    perturb(ktm_model)
    full = ktm_model.encode_prompts([LONG])[0]
    n = full.tokens_out - 1 if reuse == "all-1" else reuse
    donor = prefill(ktm_model, ktm_model.encode_prompts(["Hello world", LONG]))
    stored = row_kv(donor, 1, n)
    assert stored[0][0].shape[-2] == n
    a = prefill(ktm_model, [full])
    b = prefill_from_kv(ktm_model, stored, full.embeds[n:])
    torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=1e-5)
    for _ in range(4):
        tok = a.logits.argmax(-1)
        assert torch.equal(b.logits.argmax(-1), tok)
        advance(ktm_model, a, tok)
        advance(ktm_model, b, tok)


def test_uncached_states_are_not_rebatched(ktm_model):
    state = prefill(ktm_model, ktm_model.encode_prompts(PROMPTS[:2]), use_cache=False)
    with pytest.raises(KTMError, match="KV cache"):
        keep_rows(state, [0])


@torch.no_grad()
def test_merge_cache_reuses_merged_segments(ktm_model, monkeypatch):
    perturb(ktm_model)
    want = ktm_model.encode_prompts(PROMPTS)
    cache: dict = {}
    calls = []
    forward = ktm_model.encoder.forward
    monkeypatch.setattr(ktm_model.encoder, "forward", lambda *a: calls.append(a) or forward(*a))
    first = ktm_model.encode_prompts(PROMPTS + PROMPTS[:1], cache=cache)
    # one encoder call (the pieces laid end to end), the repeated prompt's tokens in it once
    assert len(calls) == 1
    assert int(calls[0][1].sum()) == sum(sum(p.mergeable) for p in want)
    again = ktm_model.encode_prompts(PROMPTS, cache=cache)
    assert len(calls) == 1  # everything came from the cache
    for w, f, a in zip(want, first, again):
        torch.testing.assert_close(f.embeds, w.embeds, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(a.embeds, w.embeds, atol=1e-6, rtol=1e-5)
        assert (a.tokens_in, a.tokens_out, a.mergeable) == (w.tokens_in, w.tokens_out,
                                                            w.mergeable)


@torch.no_grad()
def test_k1_generation_equals_transformers_generate(tiny_model_dir):
    """The position ids of decode steps match transformers' own generate on the base model."""
    from transformers import AutoModelForCausalLM

    from ktm.model import KTMModel

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    model = KTMModel.from_base(tiny_model_dir, k=1)
    for text in (PROMPTS[0], "Hello world"):
        ids = torch.tensor([model.tokenize(text, first=True)])
        want = base.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=10, min_new_tokens=10, pad_token_id=0)
        got = generate_ids(model, text, max_new_tokens=10, stop_at_eos=False)
        assert got == [want[0, ids.shape[1]:].tolist()]
