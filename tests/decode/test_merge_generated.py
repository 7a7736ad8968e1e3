"""Merging during generation (``merge_window``): the oldest answer tokens merged K to a position
and read again, what follows untouched; a window the answer never passes changes nothing."""

import pytest
import torch
from helpers import PROMPTS, fresh_model, perturb

from ktm import KTMError, Segment
from ktm.decode.generate import Decoding, GenerationConfig, generate_ids
from ktm.decode.merge_generated import due


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    m = fresh_model(tiny_model_dir, k=4)
    perturb(m)
    return m.requires_grad_(False)


def test_a_window_the_answer_never_passes_changes_nothing(model):
    plain = generate_ids(model, PROMPTS, max_new_tokens=12, stop_at_eos=False)
    assert generate_ids(model, PROMPTS, max_new_tokens=12, stop_at_eos=False,
                        merge_window=12) == plain
    merged = generate_ids(model, PROMPTS, max_new_tokens=30, stop_at_eos=False, merge_window=8)
    assert merged != generate_ids(model, PROMPTS, max_new_tokens=30, stop_at_eos=False)


def test_a_batch_merging_its_answers_equals_each_prompt_alone(model):
    both = generate_ids(model, PROMPTS, max_new_tokens=30, stop_at_eos=False, merge_window=8)
    assert both == [generate_ids(model, [p], max_new_tokens=30, stop_at_eos=False,
                                 merge_window=8)[0] for p in PROMPTS]


def _fed(model, prompt, tokens, window):
    cfg = GenerationConfig(max_new_tokens=len(tokens) + 1, stop_at_eos=False,
                           merge_window=window)
    with torch.no_grad():
        state = model.runtime.prefill(model.encode_prompts([prompt]), [cfg])
        dec = Decoding(model.runtime, state, [cfg], [None])
        for t in tokens:
            dec.advance(torch.tensor([t]))
    return dec.state


@torch.no_grad()
def test_a_merge_reads_the_merged_rows_over_what_precedes_them_and_keeps_the_rest(model):
    prompt = PROMPTS[0]
    p = model.encode_prompts([prompt])[0]
    tokens = generate_ids(model, [prompt], max_new_tokens=9, stop_at_eos=False)[0]
    assert due(8, 9, 4) == 4  # the 9th plain token: the oldest 4 merge, 5 stay plain
    plain, merged = _fed(model, prompt, tokens, 0), _fed(model, prompt, tokens, 8)
    n = p.tokens_out
    assert merged.mask.shape[1] == n + 1 + 5 == merged.cache.layers[0].keys.shape[2]
    # the merged row: the encoder's merge of the 4 tokens, read after the prompt at the first
    # one's position
    row = model.encode_prompts([(Segment("", ids=tuple(tokens[:4])),)])[0].embeds
    embeds = torch.cat([p.embeds, row])[None]
    pos = torch.arange(n + 1)[None]
    from transformers import DynamicCache

    fresh = DynamicCache(config=model.lm_config)
    model.lm(embeds, torch.ones(1, n + 1, dtype=torch.long), pos, fresh, keep=1,
             via=merged.via)
    for mine, ref, full in zip(merged.cache.layers, fresh.layers, plain.cache.layers):
        torch.testing.assert_close(mine.keys[:, :, :n + 1], ref.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine.values[:, :, :n + 1], ref.values, rtol=1e-5, atol=1e-5)
        # the 5 plain tokens after it keep the KV they were read with
        assert torch.equal(mine.keys[:, :, n + 1:], full.keys[:, :, n + 4:])
    assert torch.equal(merged.pos, plain.pos)  # what follows keeps its positions


def test_merge_windows_a_model_or_runtime_cannot_use_are_refused(model, tiny_model_dir):
    with pytest.raises(KTMError, match="at least 2K = 8"):
        generate_ids(model, PROMPTS[:1], max_new_tokens=4, merge_window=5)
    with pytest.raises(KTMError, match="expected use_cache on"):
        generate_ids(model, PROMPTS[:1], max_new_tokens=4, merge_window=8, use_cache=False)
    with pytest.raises(KTMError, match="merge_window must be 0"):
        GenerationConfig(merge_window=-1)
    k1 = fresh_model(tiny_model_dir, k=1)
    with pytest.raises(KTMError, match="K=1, expected a model with K >= 2"):
        generate_ids(k1, PROMPTS[:1], max_new_tokens=4, merge_window=8)
    cfg = GenerationConfig(max_new_tokens=4, merge_window=8)
    a, b = (Decoding(model.runtime, model.runtime.prefill(model.encode_prompts([q]), [cfg]),
                     [cfg], [None]) for q in PROMPTS[:2])
    with pytest.raises(KTMError, match="decode alone"):
        a.join(b)

    class Elsewhere:
        name = "llamacpp"
        merges = False

    with pytest.raises(KTMError, match="llamacpp backend keeps its own"):
        Decoding(Elsewhere(), a.state, [cfg], [None])
