import pytest
import torch
from helpers import PROMPTS, perturb

from ktm import KTMError, Segment
from ktm.decode.generate import GenerationConfig, generate_ids, sampling_probs, select_next


@pytest.mark.parametrize("merge", [True, False])
def test_cached_greedy_equals_full_rerun(ktm_model, merge):
    perturb(ktm_model)
    cached = generate_ids(ktm_model, PROMPTS, max_new_tokens=12, merge=merge)
    rerun = generate_ids(ktm_model, PROMPTS, max_new_tokens=12, use_cache=False, merge=merge)
    assert cached == rerun
    assert all(len(r) > 0 for r in cached)


def test_batch_generation_equals_each_prompt_alone(ktm_model):
    perturb(ktm_model)
    batch = ktm_model.generate(PROMPTS, max_new_tokens=10)
    alone = [ktm_model.generate(p, max_new_tokens=10) for p in PROMPTS]
    assert isinstance(alone[0], str)
    assert batch == alone


def test_stream_pieces_join_to_generate(ktm_model):
    perturb(ktm_model)
    pieces = list(ktm_model.stream(PROMPTS[1], max_new_tokens=10))
    assert len(pieces) > 1
    assert "".join(pieces) == ktm_model.generate(PROMPTS[1], max_new_tokens=10)


def test_sampling_is_seeded_and_top_p_tiny_is_greedy(ktm_model):
    perturb(ktm_model)
    a = ktm_model.generate(PROMPTS, max_new_tokens=8, do_sample=True, seed=3)
    b = ktm_model.generate(PROMPTS, max_new_tokens=8, do_sample=True, seed=3)
    assert a == b
    greedy = ktm_model.generate(PROMPTS, max_new_tokens=8)
    nucleus = ktm_model.generate(PROMPTS, max_new_tokens=8, do_sample=True, top_p=1e-6, seed=1)
    assert nucleus == greedy


def test_seeded_sampling_of_a_batch_equals_each_prompt_alone(ktm_model):
    # one generator was shared by the batch: a prompt's samples depended on its batch-mates
    perturb(ktm_model)
    kw = dict(max_new_tokens=10, do_sample=True, temperature=1.5, seed=0)
    batch = ktm_model.generate(PROMPTS, **kw)
    assert batch == [ktm_model.generate(p, **kw) for p in PROMPTS]
    assert ktm_model.generate(PROMPTS[::-1], **kw) == batch[::-1]
    # a batch == its samples one by one: one prompt twice is one sample twice, other seeds differ
    twice = ktm_model.generate([PROMPTS[0]] * 2, **kw)
    assert twice == [batch[0]] * 2
    others = {ktm_model.generate(PROMPTS[0], **{**kw, "seed": s}) for s in range(1, 6)}
    assert len(others | {batch[0]}) > 1


def test_stops_at_eos(ktm_model):
    eos = ktm_model.tokenizer.eos_token_id
    head = ktm_model.peft.get_base_model().get_output_embeddings().weight
    with __import__("torch").no_grad():  # make EOS overwhelmingly likely at every step
        head[eos] += 50 * head.abs().max()
    ids = generate_ids(ktm_model, [PROMPTS[0]], max_new_tokens=5)
    assert ids == [[]]


@pytest.mark.parametrize("kwargs,match", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"temperature": 0.0}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    # NaN passed "<= 0" and crashed sampling in torch.multinomial; inf sampled uniform noise;
    # a float or bool count crashed in range() or generated one token
    ({"temperature": float("nan"), "do_sample": True}, r"temperature .* got nan"),
    ({"temperature": float("inf"), "do_sample": True}, r"temperature .* got inf"),
    ({"max_new_tokens": 2.5}, r"max_new_tokens must be an integer >= 1, got 2.5"),
    ({"max_new_tokens": True}, r"max_new_tokens must be an integer >= 1, got True"),
])
def test_bad_generation_options(ktm_model, kwargs, match):
    with pytest.raises(KTMError, match=match):
        ktm_model.generate("Hello", **kwargs)


def test_stream_refuses_a_list(ktm_model):
    with pytest.raises(KTMError, match="one prompt"):
        list(ktm_model.stream(["a b", "c d"]))


def test_mixed_segments_keep_plain_tokens(ktm_model):
    cp = ktm_model.compress([Segment("Hello world", compress=False)])
    assert cp.tokens_in == cp.tokens_out


def test_precomputed_prefixes_give_the_same_output(ktm_model):
    perturb(ktm_model)
    prefixes = ktm_model.compress(PROMPTS)
    assert generate_ids(ktm_model, PROMPTS, prefixes=prefixes, max_new_tokens=6) == generate_ids(
        ktm_model, PROMPTS, max_new_tokens=6)
    with pytest.raises(KTMError, match="2 prefixes for 3 prompts"):
        generate_ids(ktm_model, PROMPTS, prefixes=prefixes[:2], max_new_tokens=2)


def test_stops_at_every_eos_of_the_generation_config(tiny_model_dir):
    """Llama-3 / Qwen end turns with an id that is not the tokenizer's EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ktm.model import KTMModel

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    first = generate_ids(KTMModel.from_base(tiny_model_dir, k=4), [PROMPTS[0]],
                         max_new_tokens=5)[0]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    end_of_turn = first[0]  # the greedy first token becomes an end-of-turn id
    assert end_of_turn != tok.eos_token_id
    base.generation_config.eos_token_id = [tok.eos_token_id, end_of_turn]
    model = KTMModel.from_base(base, k=4, tokenizer=tok)
    assert generate_ids(model, [PROMPTS[0]], max_new_tokens=5) == [[]]
    assert list(model.stream(PROMPTS[0], max_new_tokens=5)) == []


def test_a_tokenizer_without_pad_token_works(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ktm.model import KTMModel

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.pad_token = None
    assert tok.pad_token_id is None
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = KTMModel.from_base(base, k=4, tokenizer=tok)
    perturb(model)
    batch = model.generate(PROMPTS, max_new_tokens=6)
    assert batch == [model.generate(p, max_new_tokens=6) for p in PROMPTS]
    out = model(PROMPTS, ["a", "b c", "d"])
    assert out.loss.isfinite()


def test_an_unfinished_stream_leaves_the_model_in_its_mode(ktm_model):
    perturb(ktm_model)
    ktm_model.train()
    pieces = ktm_model.stream(PROMPTS[0], max_new_tokens=8, stop_at_eos=False)
    first = next(pieces)
    assert ktm_model.training, "stream switched the model to eval mode and left it there"
    ktm_model.eval()
    assert first == next(ktm_model.stream(PROMPTS[0], max_new_tokens=8, stop_at_eos=False))
    del pieces


@pytest.mark.parametrize("prompts", [None, 5])
def test_a_non_prompt_is_refused_naming_its_type(ktm_model, prompts):
    for call in (ktm_model.compress, ktm_model.generate):
        with pytest.raises(KTMError, match=f"prompts must be .* got {type(prompts).__name__}"):
            call(prompts)


def test_an_iterator_of_prompts_generates_as_its_list(ktm_model):
    prompts = ["Tree: AB", "Review: shoes"]
    want = ktm_model.generate(prompts, max_new_tokens=3)
    assert ktm_model.generate(iter(prompts), max_new_tokens=3) == want


def test_decoding_sets_no_module_mode_once_in_eval(ktm_model, monkeypatch):
    """Switching modes walks every module: in eval mode the decode loop switches nothing, and a
    model in train mode is switched once per generate call, not at every step."""
    calls = []
    real = torch.nn.Module.train
    monkeypatch.setattr(torch.nn.Module, "train",
                        lambda self, mode=True: calls.append(mode) or real(self, mode))
    n_modules = len(list(ktm_model.modules()))  # train() calls itself on every submodule
    ktm_model.eval()
    calls.clear()
    generate_ids(ktm_model, PROMPTS[:1], max_new_tokens=8, stop_at_eos=False)
    assert calls == []
    ktm_model.train()
    calls.clear()
    generate_ids(ktm_model, PROMPTS[:1], max_new_tokens=8, stop_at_eos=False)
    assert ktm_model.training and calls == [False] * n_modules + [True] * n_modules


@pytest.mark.parametrize("max_room", [256, 2])  # 2: the room runs out and grows on the way
def test_a_cache_with_room_decodes_as_the_growing_cache(ktm_model, monkeypatch, max_room):
    import ktm.decode.generate as gen

    perturb(ktm_model)
    monkeypatch.setattr(gen, "MAX_ROOM", max_room)
    cps = ktm_model.encode_prompts(PROMPTS)
    roomy, plain = gen.prefill(ktm_model, cps, room=9), gen.prefill(ktm_model, cps)
    layer = roomy.cache.layers[0]
    assert type(layer) is gen.RoomyLayer and type(plain.cache.layers[0]) is not gen.RoomyLayer
    start = layer.keys.data_ptr()
    for step in range(9):
        torch.testing.assert_close(roomy.logits, plain.logits, rtol=0, atol=0)
        nxt = roomy.logits.argmax(-1)
        gen.advance(ktm_model, roomy, nxt)
        gen.advance(ktm_model, plain, nxt)
        if step < max_room:  # written in place, never copied while the room lasts
            assert layer.keys.data_ptr() == start
    assert layer.keys.shape == plain.cache.layers[0].keys.shape
    torch.testing.assert_close(layer.keys, plain.cache.layers[0].keys, rtol=0, atol=0)
    # rows selected the DynamicLayer way (a new tensor): the next step still writes after them
    for state in (roomy, plain):
        for x in state.cache.layers:
            x.batch_select_indices(torch.tensor([2, 0]))
        state.mask, state.pos = state.mask[[2, 0]], state.pos[[2, 0]]
    nxt = plain.logits[[2, 0]].argmax(-1)
    gen.advance(ktm_model, roomy, nxt)
    gen.advance(ktm_model, plain, nxt)
    torch.testing.assert_close(roomy.logits, plain.logits, rtol=0, atol=0)


def test_sampling_keeps_the_tokens_and_probabilities_a_hand_calculation_gives():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    # top_p 0.7: 0.5 alone falls short, 0.5 + 0.3 reaches it; the rest goes
    probs = sampling_probs(logits, GenerationConfig(do_sample=True, top_p=0.7))
    torch.testing.assert_close(probs / probs.sum(), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # temperature 2 flattens p to p ** 0.5 (renormalised) before top-p
    p = torch.tensor([0.5, 0.3, 0.15, 0.05]) ** 0.5
    p = p / p.sum()  # 0.373, 0.289, 0.204, 0.134: three are needed to reach 0.8
    probs = sampling_probs(logits, GenerationConfig(do_sample=True, temperature=2.0, top_p=0.8))
    torch.testing.assert_close(probs / probs.sum(), torch.cat([p[:3] / p[:3].sum(),
                                                               torch.zeros(1)])[None])
    # the draws follow those weights
    gen = torch.Generator().manual_seed(0)
    cfg = GenerationConfig(do_sample=True, top_p=0.7)
    draws = torch.cat([select_next(logits, cfg, gen) for _ in range(4000)])
    assert set(draws.tolist()) == {0, 1} and abs(float((draws == 0).float().mean()) - 0.625) < 0.03


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9), (1.5, 0.5), (0.3, 0.95)])
def test_sampling_weights_equal_transformers_logits_processors(temperature, top_p):
    """The same distribution transformers' TemperatureLogitsWarper + TopPLogitsWarper give."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(6, 200, generator=torch.Generator().manual_seed(3)) * 3
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    want = torch.softmax(scores, dim=-1)
    got = sampling_probs(logits, GenerationConfig(do_sample=True, temperature=temperature,
                                                  top_p=top_p))
    got = got / got.sum(-1, keepdim=True)
    assert torch.equal(got > 0, want > 0)  # the same tokens kept
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_one_rule_ends_a_generation_for_the_loop_the_trim_and_the_server():
    eos = frozenset({2, 7})
    on, off = GenerationConfig(), GenerationConfig(stop_at_eos=False)
    assert [on.ends_at(t, eos) for t in (1, 2, 7)] == [False, True, True]
    assert not any(off.ends_at(t, eos) for t in (1, 2, 7))
    assert on.stop_ids(eos, "cpu").tolist() == [2, 7] and off.stop_ids(eos, "cpu").numel() == 0
