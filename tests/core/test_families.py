"""Every supported causal-LM family, built tiny in-process: LoRA lands on all its attention and
MLP projections, logits equal the HF forward's (post-head transforms included), and cached
generation equals a full re-run."""

import json

import pytest
import torch
import transformers as T
from helpers import FAMILIES, build_tokenizer, save_tiny, tiny_config, trains_compiled_as_eager

from ktm import KTMError
from ktm.core.checkpoint import model_record
from ktm.core.config import LoraSettings
from ktm.core.loss import target_logits
from ktm.decode.generate import generate_ids
from ktm.model import KTMModel, prompt_logits, trainable_parameters

TEXT = "The quick brown fox jumps over the lazy dog. Hello world"
INT8_BOUND = 0.06  # tests/decode/test_compiled.py's
# family -> its decoder layer classes inductor cannot compile, which train eager
EAGER_LAYERS = {"jamba": ("JambaMambaDecoderLayer",)}


def built(name: str, tmp_path_factory):
    path = tmp_path_factory.mktemp(name)
    base, tok = save_tiny(name, path)
    return name, str(path), base, tok


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    return built(request.param, tmp_path_factory)


# families whose caches hold layers other than full attention (sliding windows, Mamba's state):
# a static cache cannot hold them, and compile="on" refuses them by name
NOT_STATIC = {"cohere2", "exaone4", "gemma2", "gemma3_text", "jamba", "llama4_text", "mistral"}
# the compiled paths (a graph per family, the suite's costliest tests) on one family per kind of
# decoder layer a graph meets: the Llama layer (which qwen2/3, olmo/2, smollm3, granite, cohere,
# starcoder2, stablelm, phi3, gemma and exaone4 share), Conv1D and learned positions (gpt2),
# OPT's offset positions, ALiBi (bloom), fused multi-query attention (falcon, gpt_bigcode), the
# parallel block with partial or interleaved rotary (gpt_neox, gptj, phi), GLM's rotary, routed
# experts (mixtral, qwen3_moe), latent attention (deepseek_v3), soft-capped sliding windows
# (gemma2, training) and Mamba layers (jamba, falcon_h1); every family keeps every eager test
COMPILED = {"llama", "gpt2", "opt", "bloom", "falcon", "gpt_bigcode", "gpt_neox", "gptj", "phi",
            "glm", "mixtral", "qwen3_moe", "deepseek_v3", "gemma2", "jamba", "falcon_h1"}
# the "sweep": CI runs it, and ``pytest --sweep``. From an empty compile cache each family takes a
# minute or more a test (falcon_h1's Mamba layers about four); every run compiles the Llama layer
# in tests/decode/test_compiled.py and tests/training/test_compiled_training.py, and a refusal
# here compiles nothing


def compiled_params(names) -> list:
    return [pytest.param(n, marks=() if n in NOT_STATIC - COMPILED else pytest.mark.sweep)
            for n in sorted(names)]


@pytest.fixture(scope="module", params=compiled_params(COMPILED | NOT_STATIC))
def decoding_family(request, tmp_path_factory):
    """``family`` for the compiled decoding step: ``COMPILED``, and the families a static cache
    refuses (their refusal is the test)."""
    return built(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=compiled_params(COMPILED))
def compiled_family(request, tmp_path_factory):
    """``family`` for the compiled training step: ``COMPILED``."""
    return built(request.param, tmp_path_factory)


def perturb_lora(model: KTMModel) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in trainable_parameters(model):
            if "lora_B" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


def test_lora_covers_every_attention_and_mlp_projection(family):
    name, path, _, _ = family
    model = KTMModel.from_base(path, k=1)
    assert model_record(model)["lora_modules"] == FAMILIES[name][2]
    assert sorted(model.config.lora.target_modules) == sorted(FAMILIES[name][2])


def test_logits_equal_the_hf_forward(family):
    """K=1 with its zero-initialised MLP is the base model exactly, through every post-head
    transform (Gemma-2 soft-capping, Cohere logit_scale, Granite logits_scaling)."""
    _, path, base, tok = family
    model = KTMModel.from_base(path, k=1)
    ids = torch.tensor([tok(TEXT)["input_ids"]])
    with torch.no_grad():
        want = base(ids).logits[0]
        torch.testing.assert_close(prompt_logits(model, TEXT), want, atol=1e-5, rtol=1e-5)
        # the training path computes the head only at target positions: same numbers there
        n = ids.shape[1]
        t = target_logits(model, [tok.decode(ids[0, :n - 4])], [ids[0, n - 4:].tolist()],
                          merge=False)
    torch.testing.assert_close(t.logits, want[n - 5:n - 1], atol=1e-5, rtol=1e-5)


def test_cached_generation_equals_full_rerun(family):
    _, path, _, _ = family
    torch.manual_seed(0)
    model = KTMModel.from_base(path, k=4)
    perturb_lora(model)
    prompts = [TEXT, "Hello world"]
    assert generate_ids(model, prompts, max_new_tokens=6) == generate_ids(
        model, prompts, max_new_tokens=6, use_cache=False)


def test_folded_lora_decodes_as_peft_lora(family):
    """Every family's LoRA folds (GPT-2's transposed Conv1D, Phi-3's fused projections, MoE
    and Mamba hybrids' attention): the same greedy tokens, logits a rounding apart (measured
    up to 8.4 units in the last place of the largest logit; see tests/core/test_lora_fold.py)."""
    _, path, _, _ = family
    torch.manual_seed(0)
    model = KTMModel.from_base(path, k=4)
    perturb_lora(model)
    prompts = [TEXT, "Hello world"]
    model.fold_lora = True
    assert model.decode_lm() is not None
    folded = generate_ids(model, prompts, max_new_tokens=6)
    model.fold_lora = False
    assert folded == generate_ids(model, prompts, max_new_tokens=6)


def test_int8_weights_hold_every_linear_layer_and_stay_near_the_native_logits(family):
    """Every family's linear layers (GPT-2's Conv1D too) are held in int8 once its LoRA is
    folded, and its first-token logits stay within a few int8 steps (INT8_BOUND of their
    largest magnitude, the bound tests/decode/test_compiled.py gives the reason for)."""
    from ktm.core.int8 import Int8Linear, linears
    from ktm.decode.generate import prefill

    _, path, _, _ = family
    torch.manual_seed(0)
    model = KTMModel.from_base(path, k=4)
    perturb_lora(model)
    model.requires_grad_(False)
    cps = model.encode_prompts([TEXT, "Hello world"])
    with torch.no_grad():
        native = prefill(model, cps).logits
        model.runtime.weights = "int8"
        state = prefill(model, cps)
    assert not linears(state.via)  # none left in its dtype
    assert any(type(m) is Int8Linear for m in state.via.modules())
    scale = float(native.abs().max())
    assert float((state.logits - native).abs().max()) <= INT8_BOUND * scale


@torch.no_grad()
def test_compiled_decoding_equals_eager_or_is_refused_by_name(decoding_family):
    """The compiled step (static cache, the packed attention on the CPU) on each kind of layer:
    the same greedy tokens as eager, or, for a cache a static one cannot hold, a refusal naming
    the layers."""
    name, path, _, _ = decoding_family
    torch.manual_seed(0)
    model = KTMModel.from_base(path, k=4)
    perturb_lora(model)
    model.requires_grad_(False)
    prompts = [TEXT, "Hello world"]
    eager = generate_ids(model, prompts, max_new_tokens=6, stop_at_eos=False)
    model.runtime.compile = "on"
    if name in NOT_STATIC:
        with pytest.raises(KTMError, match="layers other than full attention"):
            generate_ids(model, prompts, max_new_tokens=6, stop_at_eos=False)
        return
    assert generate_ids(model, prompts, max_new_tokens=6, stop_at_eos=False) == eager
    assert model.runtime.compiles > 0


def test_compiled_training_equals_eager(compiled_family):
    """A training step through the compiled decoder layers (``ktm train --compile``) gives
    eager's loss and gradients on each kind of layer, dropout off (eager and compiled draw their
    masks differently); Jamba's Mamba layers, which do not compile, train eager."""
    name, path, _, _ = compiled_family
    torch.manual_seed(0)
    model = KTMModel.from_base(path, k=4, lora=LoraSettings(dropout=0.0))
    perturb_lora(model)
    model.train()
    for module in model.modules():  # the base LM's own dropout: modules and float settings
        for key, value in list(vars(module).items()):
            if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
                setattr(module, key, 0.0)
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    trains_compiled_as_eager(model, [TEXT, "Hello world"], [" yes", " no"],
                             eager=EAGER_LAYERS.get(name, ()))


def test_a_left_padded_batch_equals_its_rows_one_by_one(family):
    """Rows of different lengths are left-padded and position ids count real positions only, so
    each row reads as it would alone (the family's own positions, ALiBi's from the mask)."""
    _, path, _, _ = family
    torch.manual_seed(0)
    model = KTMModel.from_base(path, k=4)
    perturb_lora(model)
    prompts, targets = [TEXT, "Hello world"], ["fox jumps", "world"]
    with torch.no_grad():
        batch = target_logits(model, prompts, targets).logits
        rows = [target_logits(model, [p], [t]).logits for p, t in zip(prompts, targets)]
    torch.testing.assert_close(batch, torch.cat(rows), atol=1e-5, rtol=1e-5)


def test_a_saved_model_reloads_exactly_and_a_step_lowers_its_loss(family, tmp_path):
    _, path, _, _ = family
    torch.manual_seed(0)
    model = KTMModel.from_base(path, k=4)
    perturb_lora(model)
    model.save(tmp_path / "ck")
    loaded = KTMModel.load(tmp_path / "ck", trainable=True).eval()  # eval: no dropout noise
    with torch.no_grad():
        assert torch.equal(prompt_logits(loaded, TEXT), prompt_logits(model, TEXT))
    opt = torch.optim.SGD([p for _, p in trainable_parameters(loaded)], lr=1e-3)
    before = loaded([TEXT], ["fox jumps"]).loss
    before.backward()
    # a module whose weight the model reads directly (Jamba's dt_proj) bypasses its LoRA
    dead = {n for n, p in trainable_parameters(loaded) if "lora_A" in n
            and (p.grad is None or not p.grad.any())}
    assert not dead
    opt.step()
    with torch.no_grad():
        assert loaded([TEXT], ["fox jumps"]).loss < before


def test_checkpoint_records_the_adapted_modules(tmp_path):
    base, tok = save_tiny("phi3", tmp_path / "phi3")
    model = KTMModel.from_base(base, k=2, tokenizer=tok)
    model.save(tmp_path / "ck")
    loaded = KTMModel.load(tmp_path / "ck")
    assert model_record(loaded)["lora_modules"] == FAMILIES["phi3"][2]
    assert sorted(loaded.config.lora.target_modules) == sorted(FAMILIES["phi3"][2])


def test_input_embeddings_narrower_than_the_hidden_states(tmp_path):
    """OPT-350m's input embeddings are 512 wide and projected to its 1024-wide hidden states
    inside the model: the encoder merges embeddings, so it is as wide as they are."""
    tok = build_tokenizer()
    cfg = tiny_config("opt", len(tok))
    cfg.word_embed_proj_dim = 32
    torch.manual_seed(0)
    base = T.AutoModelForCausalLM.from_config(cfg).eval()
    base.save_pretrained(tmp_path / "opt")
    tok.save_pretrained(tmp_path / "opt")
    model = KTMModel.from_base(str(tmp_path / "opt"), k=1)
    assert model.encoder.config.hidden_size == 32
    ids = torch.tensor([tok(TEXT)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(prompt_logits(model, TEXT), base(ids).logits[0], atol=1e-5,
                                   rtol=1e-5)
    model = KTMModel.from_base(str(tmp_path / "opt"), k=4)
    perturb_lora(model)
    model.save(tmp_path / "ck")
    loaded = KTMModel.load(tmp_path / "ck")
    assert loaded.generate(TEXT, max_new_tokens=4) == model.generate(TEXT, max_new_tokens=4)
    assert torch.isfinite(loaded([TEXT], ["fox"]).loss)


def test_targets_a_model_lacks_are_an_error_not_dropped(tmp_path):
    base, tok = save_tiny("phi3", tmp_path / "phi3")
    with pytest.raises(KTMError, match=r"\['q_proj', 'k_proj'\].* not modules of this 'phi3'"):
        KTMModel.from_base(base, tokenizer=tok,
                           lora=LoraSettings(target_modules=("q_proj", "k_proj", "o_proj")))


def test_targets_peft_would_move_onto_fused_experts_are_an_error(tmp_path):
    """On DeepSeek-V3 PEFT turns a ``down_proj`` target into one on the fused 3-D expert
    parameters (and off the dense layers' ``down_proj``), which failed inside PEFT."""
    base, tok = save_tiny("deepseek_v3", tmp_path / "ds")
    with pytest.raises(KTMError, match=r"LoRA targets \['down_proj'\] cannot be adapted on this "
                                       r"'deepseek_v3' model: PEFT moves them onto the fused"):
        KTMModel.from_base(base, tokenizer=tok,
                           lora=LoraSettings(target_modules=("q_a_proj", "down_proj")))
    with pytest.raises(KTMError, match=r"'deepseek_v3' model: .*gate_proj without also "
                                       r"targeting up_proj"):
        KTMModel.from_base(base, tokenizer=tok,
                           lora=LoraSettings(target_modules=("q_a_proj", "gate_proj")))


def test_a_target_whose_weight_the_model_reads_directly_is_an_error(tmp_path):
    base, tok = save_tiny("jamba", tmp_path / "jamba")
    with pytest.raises(KTMError, match=r"LoRA targets \['dt_proj'\] cannot be adapted on this "
                                       r"'jamba' model: .*reads their weight directly"):
        KTMModel.from_base(base, tokenizer=tok,
                           lora=LoraSettings(target_modules=("q_proj", "dt_proj")))


# ---------------------------------------------------------------- position limits
@pytest.fixture(scope="module")
def gpt2_128(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2-128")
    base, tok = save_tiny("gpt2", path, positions=128)
    return str(path), tok


def long_text(tok, n: int) -> str:
    words = " fox" * n
    assert len(tok(words)["input_ids"]) == n
    return words


def test_prompt_over_the_position_limit_names_the_k_that_fits(gpt2_128):
    path, tok = gpt2_128
    model = KTMModel.from_base(path, k=4)
    text = long_text(tok, 200)
    with pytest.raises(KTMError, match=r"150 positions after merging \(K=4, 600 tokens before\) "
                                       r"\+ 3 target tokens, over the model's limit of 128 "
                                       r"positions; K=5 would fit"):
        model([long_text(tok, 600)], [[5, 6, 7]])
    # with merging off nothing was merged: it said "after merging (K=4 ...)"
    with pytest.raises(KTMError, match=r"200 positions with merging off \+ 3 target tokens, over "
                                       r"the model's limit of 128 positions; merging at K=2 "
                                       r"would fit"):
        model([text], [[5, 6, 7]], merge=False)
    with pytest.raises(KTMError, match=r"limit of 128 positions; merging at K=2 would fit"):
        model.generate(text, max_new_tokens=4, merge=False)


def test_prompt_that_fits_only_after_merging_works(gpt2_128):
    path, tok = gpt2_128
    model = KTMModel.from_base(path, k=4)
    text = long_text(tok, 200)
    out = model([text], [[5, 6, 7]])
    assert out.tokens_in == 200 and out.tokens_out == 50 and torch.isfinite(out.loss)
    assert len(model.generate(text, max_new_tokens=8, stop_at_eos=False)) > 0


def test_a_prompt_exactly_at_the_position_limit_still_yields_one_token(gpt2_128):
    """The last new token is returned, never read back: a prompt of exactly 128 positions can be
    answered with one token (it was refused); one more position or one more token cannot be
    read plain, and a merged one is read deeper to fit (``ktm.core.fit``)."""
    from ktm.core.allocate import RatioWarning

    path, tok = gpt2_128
    model = KTMModel.from_base(path, k=4)
    for merge, n in ((False, 128), (True, 512)):
        text = long_text(tok, n)
        assert len(generate_ids(model, text, max_new_tokens=1, stop_at_eos=False,
                                merge=merge)[0]) == 1
    with pytest.raises(KTMError, match=r"over the model's limit of 128 positions"):
        generate_ids(model, long_text(tok, 128), max_new_tokens=2, merge=False)
    with pytest.warns(RatioWarning, match=r"read at ratio 16\.00 .* to leave 1 of the model's "
                                          r"128 after it"):
        assert len(generate_ids(model, long_text(tok, 512), max_new_tokens=2,
                                stop_at_eos=False)[0]) == 2
    with pytest.raises(KTMError, match=r"129 positions with merging off \+ 1 new tokens, over"):
        generate_ids(model, long_text(tok, 129), max_new_tokens=1, merge=False)
    assert len(generate_ids(model, "fox", max_new_tokens=128, stop_at_eos=False)[0]) == 128
    with pytest.raises(KTMError, match=r"129 new tokens alone reach.*fewer than 129"):
        generate_ids(model, "fox", max_new_tokens=129)


def test_no_k_fits_when_the_plain_part_alone_is_too_long(gpt2_128):
    from ktm.core.prompt import Segment

    path, tok = gpt2_128
    model = KTMModel.from_base(path, k=4)
    prompt = [Segment("fox"), Segment(long_text(tok, 130), compress=False)]
    with pytest.raises(KTMError, match="no K fits: shorten the plain segments"):
        model([prompt], [[5]])


def test_a_model_that_cannot_read_inputs_embeds_is_refused_up_front():
    """ktm feeds the LM embeddings, never ids: PEFT's causal-LM wrapper refuses inputs_embeds
    for MPT, and a forward without the parameter cannot take them; say so before adapting it."""
    tok = build_tokenizer()
    mpt = T.AutoModelForCausalLM.from_config(T.MptConfig(
        vocab_size=len(tok), d_model=64, n_heads=4, n_layers=1, max_seq_len=64))
    with pytest.raises(KTMError, match=r"MptForCausalLM \('mpt'\).*inputs_embeds"):
        KTMModel.from_base(mpt, tokenizer=tok)
    assert not any("lora" in n for n, _ in mpt.named_parameters())  # left as it was

    class IdsOnly(T.LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask)

    ids_only = IdsOnly(tiny_config("llama", len(tok)))
    with pytest.raises(KTMError, match=r"IdsOnly \('llama'\).*inputs_embeds"):
        KTMModel.from_base(ids_only, tokenizer=tok)


def test_a_target_too_long_on_its_own_is_named_not_the_plain_segments(gpt2_128):
    """An autoencoding target as long as the model's positions fits under no K and no prompt;
    the error names the target, not the plain segments the prompt may not even have."""
    from ktm.core.prompt import Segment

    path, tok = gpt2_128
    model = KTMModel.from_base(path, k=4)
    with pytest.raises(KTMError, match=r"130 target tokens alone reach the model's limit of 128 "
                                       r"positions.*expected fewer than 128"):
        model([long_text(tok, 40)], [[5] * 130])
    with pytest.raises(KTMError, match=r"200 new tokens alone reach the model's limit of 128"):
        model.generate("fox", max_new_tokens=200)
    # neither alone is too long, together they are: both are named
    prompt = [Segment("fox"), Segment(long_text(tok, 100), compress=False)]
    with pytest.raises(KTMError, match=r"no K fits: the prompt takes at least 101 positions, "
                                       r"leaving 27 for the 40 target tokens; shorten the plain "
                                       r"segments or the target tokens"):
        model([prompt], [[5] * 40])


def test_an_adapter_from_another_family_is_named_as_such(tmp_path):
    """``--init-adapter`` across families of the same sizes: the error says so, not that the
    LoRA settings differ."""
    from ktm.core.checkpoint import load_adapter_into

    base, tok = save_tiny("gpt2", tmp_path / "gpt2")
    KTMModel.from_base(base, k=4, tokenizer=tok).save(tmp_path / "ck")
    base, tok = save_tiny("opt", tmp_path / "opt")
    other = KTMModel.from_base(base, k=2, tokenizer=tok)
    with pytest.raises(KTMError, match=r"another model of the same sizes \(model_type='gpt2' "
                                       r"vs 'opt'"):
        load_adapter_into(other, tmp_path / "ck")
    # a checkpoint from before the base model's identity was recorded: its adapter tells
    cfg_path = tmp_path / "ck" / "ktm_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["base_identity"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(KTMError, match=r"has unexpected weights .*: it was trained on a 'gpt2' "
                                       r"model, this one is 'opt'"), \
            pytest.warns(UserWarning, match="predates the record of its base model's identity"):
        load_adapter_into(other, tmp_path / "ck")


# ---------------------------------------------------------------- families ktm cannot decode
@pytest.mark.parametrize("make, match", [
    # the state lives outside past_key_values: cached decoding read an empty cache
    (lambda v: T.MambaConfig(vocab_size=v, hidden_size=32, num_hidden_layers=2, state_size=4),
     r"MambaForCausalLM \('mamba'\) keeps no key/value cache"),
    (lambda v: T.RwkvConfig(vocab_size=v, hidden_size=32, num_hidden_layers=2,
                            attention_hidden_size=32, intermediate_size=64),
     r"RwkvForCausalLM \('rwkv'\) keeps no key/value cache"),
    # every layer recurrent: the HF forward itself failed inside the cache
    (lambda v: T.RecurrentGemmaConfig(vocab_size=v, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=16, lru_width=32),
     r"RecurrentGemmaForCausalLM \('recurrent_gemma'\) has no attention layer"),
    # BART's decoder: learned positions ignore the left padding (a batch read shifted positions)
    (lambda v: T.BartConfig(vocab_size=v, d_model=32, encoder_layers=1, decoder_layers=2,
                            encoder_attention_heads=2, decoder_attention_heads=2,
                            encoder_ffn_dim=64, decoder_ffn_dim=64),
     r"BartForCausalLM \('bart'\) is an encoder-decoder model"),
], ids=["mamba", "rwkv", "recurrent_gemma", "bart"])
def test_a_family_ktm_cannot_decode_is_refused_up_front(make, match):
    tok = build_tokenizer()
    lm = T.AutoModelForCausalLM.from_config(make(len(tok)))
    with pytest.raises(KTMError, match=match):
        KTMModel.from_base(lm, tokenizer=tok)
    assert not any("lora" in n for n, _ in lm.named_parameters())  # left as it was


def test_a_model_that_scales_only_its_own_lookups_is_refused_unless_known(monkeypatch):
    """Falcon-H1 multiplies embed_tokens(ids) by embedding_multiplier and passes inputs_embeds
    through: ktm's lookup applies the multiplier (K=1 parity above). Without that entry the
    tried check sees ids and rows read differently and refuses, rather than run another model."""
    tok = build_tokenizer()
    lm = T.AutoModelForCausalLM.from_config(tiny_config("falcon_h1", len(tok)))
    monkeypatch.setattr("ktm.core.input_lookup.ID_ONLY_SCALES", {})
    with pytest.raises(KTMError, match=r"FalconH1ForCausalLM \('falcon_h1'\) reads token ids "
                                       r"otherwise than their embedding rows"):
        KTMModel.from_base(lm, tokenizer=tok)


def test_a_multimodal_model_is_refused(tmp_path):
    """AutoModelForCausalLM loads a Gemma-3 checkpoint as Gemma3ForConditionalGeneration, whose
    config keeps the text model's sizes in text_config: saving a checkpoint then failed."""
    tok = build_tokenizer()
    text = tiny_config("gemma3_text", len(tok)).to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    cfg = T.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                         image_token_index=399, boi_token_index=398, eoi_token_index=397)
    T.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "g3")
    tok.save_pretrained(tmp_path / "g3")
    with pytest.raises(KTMError, match=r"Gemma3ForConditionalGeneration \('gemma3'\) is a "
                                       r"multimodal model"):
        KTMModel.from_base(str(tmp_path / "g3"), k=2)


def test_an_encoder_decoder_model_object_is_refused():
    tok = build_tokenizer()
    t5 = T.T5ForConditionalGeneration(T.T5Config(vocab_size=len(tok), d_model=32, d_ff=64,
                                                 num_layers=1, num_heads=2, d_kv=16))
    with pytest.raises(KTMError, match=r"T5ForConditionalGeneration \('t5'\) is an "
                                       r"encoder-decoder model"):
        KTMModel.from_base(t5, tokenizer=tok)


@pytest.mark.parametrize("cfg", [
    T.BloomConfig(hidden_size=32, n_layer=2, n_head=2),
    T.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, alibi=True),
    tiny_config("jamba", 1),
], ids=["bloom", "falcon-alibi", "jamba"])
def test_spread_positions_are_refused_for_a_model_that_ignores_position_ids(cfg):
    """ALiBi reads no position_ids: spread positions changed nothing, silently; without them
    the same models work (their K=1 logits equal the HF forward, see FAMILIES)."""
    tok = build_tokenizer()
    cfg.vocab_size = len(tok)
    lm = T.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(KTMError, match=r"\('(bloom|falcon|jamba)'\) ignores position_ids.*"
                                       r"expected spread_positions=False"):
        KTMModel.from_base(lm, tokenizer=tok, spread_positions=True)
    assert not any("lora" in n for n, _ in lm.named_parameters())
    KTMModel.from_base(lm, tokenizer=tok)


def test_spread_positions_are_kept_for_a_model_that_reads_them(tmp_path):
    base, tok = save_tiny("gpt2", tmp_path / "gpt2")
    model = KTMModel.from_base(base, k=4, tokenizer=tok, spread_positions=True)
    assert model.config.spread_positions and model.compress(TEXT).positions is not None


def test_loading_a_checkpoint_applies_the_same_family_checks(tmp_path):
    """``KTMModel.load`` once skipped the checks ``from_base`` runs: a checkpoint that asks for
    spread positions on an ALiBi model, or read on a Mamba base of the same sizes, loaded
    silently (and decoded wrongly)."""
    base, tok = save_tiny("bloom", tmp_path / "bloom")
    KTMModel.from_base(base, k=2, tokenizer=tok).save(tmp_path / "ck")
    cfg_path = tmp_path / "ck" / "ktm_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["config"]["spread_positions"] = True
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(KTMError, match=r"BloomForCausalLM \('bloom'\) ignores position_ids"):
        KTMModel.load(tmp_path / "ck")
    mamba = T.MambaConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, state_size=4)
    T.AutoModelForCausalLM.from_config(mamba).save_pretrained(tmp_path / "mamba")
    tok.save_pretrained(tmp_path / "mamba")
    cfg["config"]["spread_positions"] = False
    cfg_path.write_text(json.dumps(cfg))
    KTMModel.load(tmp_path / "ck")  # as saved, it loads
    with pytest.raises(KTMError, match=r"MambaForCausalLM \('mamba'\) keeps no key/value cache"):
        KTMModel.load(tmp_path / "ck", base=str(tmp_path / "mamba"))
