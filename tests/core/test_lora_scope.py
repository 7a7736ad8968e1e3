"""A LoRA of scope "merged" (``ktm.core.lora_scope``): the adapter at the merged rows only, every
plain token read by the base LM as it is."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_one_step_lowers, close, fresh_model, perturb

from ktm import KTMError, LoraSettings, Segment
from ktm.core.batch import pack
from ktm.model import KTMModel, prompt_logits

DOC = "The quick brown fox jumps over the lazy dog. Hello world, my name is ktm."
PROMPT = [Segment(DOC), Segment(" Hello world, my name", compress=False)]


@pytest.fixture
def gated(tiny_model_dir) -> KTMModel:
    model = fresh_model(tiny_model_dir, lora=LoraSettings(scope="merged"), plain_prefix=1)
    perturb(model)
    return model.eval()


def test_plain_prompt_reads_as_the_base_model(gated):
    with torch.no_grad():
        got = prompt_logits(gated, PROMPT, merge=False)
        with gated.peft.disable_adapter():
            want = prompt_logits(gated, PROMPT, merge=False)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_plain_rows_read_the_merged_rows_kv_with_base_weights(gated, tiny_model_dir):
    """The reference: the merged rows read with the LoRA on (an "all" model with the same
    weights), their KV cached, then the plain rows read on with the adapter off."""
    cp = gated.compress(PROMPT)
    n = int(cp.merged_rows.nonzero().max()) + 1  # the merged rows, then the plain question
    assert not cp.merged_rows[0] and cp.merged_rows[1:n].all() and not cp.merged_rows[n:].any()
    full = fresh_model(tiny_model_dir, plain_prefix=1)
    full.load_state_dict(gated.state_dict())
    full.eval()
    with torch.no_grad():
        got = prompt_logits(gated, PROMPT)
        p = pack([cp.embeds], [cp.positions])
        from ktm.decode.generate import kv_cache

        cache = kv_cache(full)
        with full.peft.disable_adapter():  # the sink, plain
            first = full.lm(p.embeds[:, :1], p.mask[:, :1], p.position_ids[:, :1], cache)
        mid = full.lm(p.embeds[:, 1:n], p.mask[:, :n], p.position_ids[:, 1:n], cache)
        with full.peft.disable_adapter():
            rest = full.lm(p.embeds[:, n:], p.mask, p.position_ids[:, n:], cache)
    close(got, torch.cat([first, mid, rest], 1)[0])
    # and the adapter did change what the merged rows wrote (else the test proves nothing)
    with torch.no_grad(), gated.peft.disable_adapter():
        base = gated.lm(p.embeds, p.mask, p.position_ids)[0]
    assert (base[n:] - got[n:]).abs().max() > 1e-3


@pytest.mark.parametrize("fold", [False, True], ids=["hooked", "switched-by-row"])
def test_cached_decode_equals_rereading_and_batch_equals_singles(gated, fold):
    gated.fold_lora = fold
    prompts = [PROMPT, [Segment(DOC[:30]), Segment(" fox", compress=False)],
               [Segment("Hello world, my name is"), Segment(" ktm", compress=False),
                Segment(DOC[10:40])]]
    cached = gated.generate(prompts, max_new_tokens=6)
    again = gated.generate(prompts, max_new_tokens=6, use_cache=False)
    singles = [gated.generate(p, max_new_tokens=6) for p in prompts]
    assert cached == again == singles


def test_a_model_that_does_not_train_prefills_folded_at_the_merged_rows(gated):
    """The rows view (``RowSwitch``) reads the merged rows through the LoRA folded in and the
    plain ones through the base weights: the hooked PEFT forward's logits, whichever rows are
    the majority, and nothing but base weights when no row is merged."""
    from ktm.core.lora_scope import RowSwitch

    long_plain = [Segment(DOC[:24]), Segment(" " + DOC * 2, compress=False)]
    for prompt in (PROMPT, long_plain):
        cp = gated.encode_prompts([prompt])[0]
        p = pack([cp.embeds], [cp.positions], [cp.merged_rows])
        with torch.no_grad():
            hooked = gated.lm(p.embeds, p.mask, p.position_ids, gate=p.gate)
            gated.fold_lora = True
            switched = gated.lm(p.embeds, p.mask, p.position_ids, gate=p.gate,
                                via=gated.decode_lm())
            gated.fold_lora = None
        assert gated._rows_lm() is None  # its LoRA trains: the hooked forward by default
        close(switched, hooked)
    merged = int(p.gate.sum())
    assert 0 < merged < p.gate.numel() / 2  # the second prompt: plain rows the majority
    gated.fold_lora = True
    view = gated._rows_lm()
    assert any(isinstance(m, RowSwitch) for m in view.modules())
    with pytest.raises(KTMError, match="outside KTMModel.lm"):
        view(inputs_embeds=p.embeds, attention_mask=p.mask)
    with pytest.raises(KTMError, match="not switched by row"):
        gated._folded.get(gated.peft.get_base_model(), "int8", mode="rows")


def test_decoding_reads_through_the_base_lm(gated):
    from peft.tuners.tuners_utils import BaseTunerLayer

    view = gated.decode_lm()
    assert view is not None and not any(isinstance(m, BaseTunerLayer) for m in view.modules())


def test_a_short_training_run_lowers_the_loss_and_trains_the_lora(gated):
    gated.requires_grad_(False)
    for _, p in gated.peft.named_parameters():
        p.requires_grad_("lora_" in _)
    gated.encoder.requires_grad_(True)

    def loss_of():
        return gated([PROMPT], [" is ktm."]).loss

    gated.train()
    loss_of().backward()
    lora = [p.grad for n, p in gated.peft.named_parameters() if "lora_B" in n]
    assert lora and all(g is not None for g in lora) and any(g.abs().sum() > 0 for g in lora)
    gated.zero_grad()
    assert_one_step_lowers(gated, loss_of)


def test_save_and_load_keep_the_scope(gated, tmp_path):
    gated.save(tmp_path / "ckpt")
    back = KTMModel.load(tmp_path / "ckpt")
    assert back.config.lora.scope == "merged"
    with torch.no_grad():
        close(prompt_logits(back, PROMPT), prompt_logits(gated, PROMPT))


def test_a_bad_scope_is_refused():
    with pytest.raises(KTMError, match="scope must be one of all, merged, got 'plain'"):
        LoraSettings(scope="plain")
