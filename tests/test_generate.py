import pytest
from test_model import PROMPTS, perturb

from ktm import KTMError, Segment
from ktm.generate import generate_ids


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


def test_stops_at_eos(ktm_model):
    eos = ktm_model.tokenizer.eos_token_id
    with __import__("torch").no_grad():  # make EOS overwhelmingly likely at every step
        ktm_model._head.weight[eos] += 50 * ktm_model._head.weight.abs().max()
    ids = generate_ids(ktm_model, [PROMPTS[0]], max_new_tokens=5)
    assert ids == [[]]


@pytest.mark.parametrize("kwargs,match", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"temperature": 0.0}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
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
