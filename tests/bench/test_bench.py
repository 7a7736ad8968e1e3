"""Benchmark mechanics on the tiny model: schema, exact token counts, KV ratio, pairing, plots.

Timings are never asserted: only what the numbers are computed from.
"""

import argparse
import json
import math
import re
from pathlib import Path

import pytest
import torch
from helpers import require_module

from ktm import KTMError
from ktm.bench.bench import aggregate, main_bench, run_bench
from ktm.bench.config import BenchConfig, Method
from ktm.bench.measure import (
    PeakMemory,
    encode_prefix,
    infer_once,
    interleave,
    synthetic_text,
    word_pool,
)
from ktm.bench.plot import plot_results
from ktm.cli.args import add_dataclass_args, from_args
from ktm.cli.main import main
from ktm.core.prompt import as_segments
from ktm.decode.generate import GenerationConfig, decode_steps
from ktm.model import KTMModel

INFER_FIELDS = {
    "method", "k", "mlp_ratio", "encoder_params", "input_tokens", "compressed_tokens", "batch",
    "repeats", "output_tokens", "encoder_s", "prefill_s", "encoder_share", "ttft_s", "decode_s",
    "decode_tokens_per_s", "e2e_s", "samples_per_s", "peak_mem_bytes", "peak_mem_delta_bytes",
    "kv_cache_bytes", "kv_ratio", "speedup_prefill", "speedup_ttft", "speedup_e2e", "per_repeat",
    "mem_kind", "mode", "model", "device", "dtype", "threads", "config", "versions", "git",
}
TRAIN_FIELDS = {
    "method", "k", "mlp_ratio", "encoder_params", "input_tokens", "compressed_tokens", "batch",
    "repeats", "target_tokens", "step_s", "input_tokens_per_s", "speedup_train", "loss",
    "peak_mem_bytes", "peak_mem_delta_bytes", "per_repeat", "config", "versions", "git", "threads",
}


def small(model_dir, tmp_path, **kw) -> BenchConfig:
    base = dict(model=model_dir, lengths=(24, 25), ks=(1, 2, 3, 4), batch_sizes=(1, 2),
                repeats=2, warmup=0, output_tokens=3, target_tokens=2, progress=False,
                out=str(tmp_path / "bench.json"))
    return BenchConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def infer_rows(tiny_model_dir, tmp_path_factory):
    return run_bench(small(tiny_model_dir, tmp_path_factory.mktemp("b")))


@pytest.mark.parametrize("kw", [
    {"mode": "bogus"}, {"lengths": ()}, {"lengths": (0,)}, {"ks": (2, -1)}, {"ks": (1.5,)},
    {"mlp_ratios": (0.0,)}, {"repeats": 0}, {"output_tokens": 0}, {"warmup": -1},
    {"dtype": "int8"}, {"device": "tpu"}, {"clients": (0,)}, {"requests": 0},
    {"presses": ("knorm",)}, {"presses": ("nope=0.5",)}, {"presses": ("knorm=1.5",)},
    {"presses": ("knorm=0.5",), "mode": "train"},
    {"presses": ("knorm=0.5",), "backends": ("llamacpp",)},
    {"compile": ("fast",)}, {"compile": ()}, {"compile": ("on",), "mode": "serve"},
    {"weights": ("int4",)}, {"weights": ()}, {"weights": ("int8",), "mode": "train"},
    {"weights": ("int8",), "backends": ("llamacpp",)},
])
def test_config_rejects_bad_values(kw):
    with pytest.raises(KTMError):
        BenchConfig(**kw)


def test_compile_modes_time_each_torch_method_both_ways():
    from ktm.bench.config import methods_of

    cfg = BenchConfig(ks=(4,), compile=("off", "on"), backends=("torch", "llamacpp"))
    keys = [m.key for m in methods_of(cfg)]
    assert keys == ["uncompressed+compile=off", "uncompressed+compile=on",
                    "K=4,r=2.0+compile=off", "K=4,r=2.0+compile=on",
                    "uncompressed@llamacpp", "K=4,r=2.0@llamacpp"]
    assert [m.key for m in methods_of(BenchConfig(ks=(4,)))] == ["uncompressed", "K=4,r=2.0"]
    # weights: each torch method once per weights, its speed-ups against the same weights
    cfg = BenchConfig(ks=(4,), weights=("native", "int8"), backends=("torch", "llamacpp"))
    methods = methods_of(cfg)
    assert [m.key for m in methods] == ["uncompressed", "uncompressed+int8", "K=4,r=2.0",
                                        "K=4,r=2.0+int8", "uncompressed@llamacpp",
                                        "K=4,r=2.0@llamacpp"]
    assert methods[3].baseline == "uncompressed+int8"


def test_quick_preset_only_fills_options_left_at_default():
    q = BenchConfig(quick=True, ks=(2,))
    assert q.ks == (2,)
    assert q.lengths != BenchConfig().lengths and q.repeats < BenchConfig().repeats


def config_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, BenchConfig)
    return parser


def test_cli_flags_are_built_from_the_dataclass():
    args = config_parser().parse_args(["--lengths", "64", "128", "--ks", "2", "--mode", "train",
                                       "--mlp-ratios", "1", "2", "--no-uncompressed"])
    cfg = from_args(BenchConfig, args)
    assert cfg.lengths == (64, 128) and cfg.ks == (2,) and cfg.mlp_ratios == (1.0, 2.0)
    assert cfg.mode == "train" and cfg.uncompressed is False
    helps = [a.help for a in config_parser()._actions if a.dest != "help"]
    assert all(helps), "every option needs a help string"


@pytest.mark.parametrize("n", [2, 7, 64, 300])
def test_synthetic_text_has_exact_token_count(ktm_model, n):
    pool = word_pool(ktm_model.tokenizer)
    text = synthetic_text(ktm_model, n, seed=n, pool=pool)
    assert len(ktm_model.tokenize(text, first=True)) == n
    assert text == synthetic_text(ktm_model, n, seed=n, pool=pool)  # deterministic


@pytest.mark.parametrize("first", [True, False])
def test_word_pool_reads_sentencepiece_word_starts(first):
    """A SentencePiece '▁word' decodes alone without its space: the pool was empty and the
    benchmark refused every Llama-2 / Mistral style tokenizer."""
    from helpers import sentencepiece_like_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = sentencepiece_like_tokenizer()
    pool = word_pool(tok)
    assert len(pool) >= 4 and all(w[0] == " " and w[1:].isalpha() for w in pool)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4))
    model = KTMModel.from_base(lm, k=2, tokenizer=tok)
    for n in (3, 40):
        text = synthetic_text(model, n, seed=n, pool=pool, first=first)
        assert len(model.tokenize(text, first=first)) == n


@pytest.mark.parametrize("merge", [True, False])
def test_timed_path_matches_model_prefix_and_generate(ktm_model, merge):
    """The benchmark times the same computation as encode_prompts + decode_steps."""
    text = synthetic_text(ktm_model, 30, seed=1, pool=word_pool(ktm_model.tokenizer))
    ids = [ktm_model.tokenize(text, first=True)]
    with torch.no_grad():
        want = ktm_model.encode_prompts([as_segments(text)], merge)[0].embeds
        got = encode_prefix(ktm_model, ids, merge)[0].embeds
    torch.testing.assert_close(got, want)
    res = infer_once(ktm_model, ids, merge, output_tokens=5)
    cfg = GenerationConfig(max_new_tokens=5, stop_at_eos=False, merge=merge)
    ref = torch.stack(list(decode_steps(ktm_model, [as_segments(text)], cfg)), 1).tolist()
    assert res["tokens"] == ref
    assert res["compressed_tokens"] == (math.ceil(30 / 4) if merge else 30)


def test_timing_runs_through_generates_own_prefill_and_decode(ktm_model, monkeypatch):
    """No copy of the decode loop: the benchmark calls the model's runtime, whose torch prefill
    and advance are ktm.decode.generate's."""
    import ktm.bench.measure as bm
    import ktm.decode.generate as gen
    import ktm.decode.runtime as rt

    calls = {"prefill": 0, "advance": 0}
    for name in calls:
        real = getattr(gen, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(gen, name, counted)
        monkeypatch.setattr(rt, name, counted)
        if hasattr(bm, name):
            monkeypatch.setattr(bm, name, counted)
    ids = [ktm_model.tokenize(synthetic_text(ktm_model, 12, seed=2,
                                             pool=word_pool(ktm_model.tokenizer)), first=True)]
    infer_once(ktm_model, ids, True, output_tokens=5)
    assert calls == {"prefill": 1, "advance": 4}


def test_cuda_peak_memory_is_read_on_the_models_device(monkeypatch):
    """On cuda:1 the peak is cuda:1's, not that of the current device (cuda:0 by default)."""
    seen = []

    def fake(name, value=0):
        return lambda device=None: seen.append((name, device)) or value

    for name, value in (("synchronize", None), ("reset_peak_memory_stats", None),
                        ("memory_allocated", 10), ("max_memory_allocated", 30)):
        monkeypatch.setattr(torch.cuda, name, fake(name, value))
    gpu = torch.device("cuda:1")
    with PeakMemory(gpu) as mem:
        pass
    assert (mem.start, mem.peak) == (10, 30)
    assert len(seen) == 5 and all(device == gpu for _, device in seen)


def test_infer_rows_have_schema_and_exact_counts(infer_rows):
    assert len(infer_rows) == 2 * 2 * 5  # lengths x batches x (uncompressed + 4 Ks)
    for r in infer_rows:
        assert INFER_FIELDS <= set(r), INFER_FIELDS - set(r)
        assert r["compressed_tokens"] == math.ceil(r["input_tokens"] / r["k"])
        assert r["compressed_tokens"] == r["expected_compressed_tokens"]
        assert len(r["per_repeat"]["prefill_s"]) == 2
        assert r["encoder_s"] <= r["prefill_s"] <= r["ttft_s"] <= r["e2e_s"]
        assert r["threads"] == torch.get_num_threads()
        assert r["mem_kind"] == "rss" and r["peak_mem_bytes"] > 0
    json.dumps(infer_rows)  # plain JSON values only


def test_kv_cache_bytes_are_compressed_positions_times_per_token_bytes(infer_rows):
    for r in infer_rows:
        base = next(b for b in infer_rows if b["method"] == "uncompressed"
                    and b["input_tokens"] == r["input_tokens"] and b["batch"] == r["batch"])
        assert r["kv_ratio"] == pytest.approx(r["compressed_tokens"] / r["input_tokens"])
        if r["input_tokens"] % r["k"] == 0:
            assert r["kv_ratio"] == pytest.approx(1 / r["k"])
        assert r["kv_cache_bytes"] * base["compressed_tokens"] == (
            base["kv_cache_bytes"] * r["compressed_tokens"])


def test_speedups_are_paired_by_repeat(infer_rows):
    for r in infer_rows:
        base = next(b for b in infer_rows if b["method"] == "uncompressed"
                    and b["input_tokens"] == r["input_tokens"] and b["batch"] == r["batch"])
        pairs = [b / m for b, m in zip(base["per_repeat"]["prefill_s"],
                                       r["per_repeat"]["prefill_s"])]
        assert r["per_repeat"]["speedup_prefill"] == pytest.approx(pairs)


def test_aggregate_takes_median_of_same_repeat_ratios():
    base = [{"prefill_s": t} for t in (1.0, 10.0, 10.0)]  # a slow moment in repeats 1 and 2
    meth = [{"prefill_s": t} for t in (0.5, 5.0, 1.0)]
    stats = aggregate({"uncompressed": base, "K=2": meth})
    assert stats["K=2"]["per_repeat"]["speedup_prefill"] == [2.0, 2.0, 10.0]
    assert stats["K=2"]["speedup_prefill"] == 2.0  # ratio of medians would give 10 / 1 = 10
    assert stats["uncompressed"]["speedup_prefill"] == 1.0
    assert aggregate({"K=2": meth}, baseline=None)["K=2"]["speedup_prefill"] is None


def test_interleave_alternates_methods_and_drops_warmup():
    calls = []
    ms = [Method("uncompressed"), Method("ktm", 2, 2.0), Method("ktm", 4, 2.0)]
    runs = interleave(lambda m: calls.append(m.key) or {"i": len(calls)}, ms, warmup=1, repeats=2)
    keys = [m.key for m in ms]
    assert calls == keys + keys[::-1] + keys
    assert [r["i"] for r in runs["uncompressed"]] == [6, 7]  # warm-up pass (call 1) left out


def test_train_mode_rows(tiny_model_dir, tmp_path):
    rows = run_bench(small(tiny_model_dir, tmp_path, mode="train", lengths=(24,), ks=(2, 4),
                           batch_sizes=(2,), mlp_ratios=(1.0, 2.0)))
    assert [(r["method"], r["k"], r["mlp_ratio"]) for r in rows] == [
        ("uncompressed", 1, None), ("ktm", 2, 1.0), ("ktm", 2, 2.0), ("ktm", 4, 1.0),
        ("ktm", 4, 2.0)]
    for r in rows:
        assert TRAIN_FIELDS <= set(r), TRAIN_FIELDS - set(r)
        assert r["compressed_tokens"] == math.ceil(24 / r["k"])
        assert r["target_tokens"] == 3  # two words + EOS
        assert len(r["per_repeat"]["speedup_train"]) == 2
    for r in rows:  # one definition with ktm train: prompt tokens before merging + targets
        tokens = r["batch"] * (r["input_tokens"] + r["target_tokens"])
        rep = r["per_repeat"]
        for rate, secs in zip(rep["input_tokens_per_s"], rep["step_s"]):
            assert rate * secs == pytest.approx(tokens)
    narrow, wide = rows[1], rows[2]
    assert 0 < narrow["encoder_params"] < wide["encoder_params"]


def test_checkpoint_folder_reuses_its_trained_encoder(tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    model = KTMModel.from_base(tiny_model_dir, k=2)
    model.save(str(tmp_path / "ckpt"))
    rows = run_bench(small(str(tmp_path / "ckpt"), tmp_path, lengths=(16,), ks=(2,),
                           batch_sizes=(1,), repeats=1, warmup=0))
    assert [r["k"] for r in rows] == [1, 2] and rows[1]["compressed_tokens"] == 8


def test_a_recursive_checkpoint_reuses_its_own_encoder(tiny_model_dir, tmp_path):
    """A K=4 reader of two K=2 merges (the shipped K=4 readers) is benchmarked with itself."""
    torch.manual_seed(0)
    model = KTMModel.from_base(tiny_model_dir, k=4, inner_k=2, mlp_ratio=0.5)
    model.save(str(tmp_path / "ckpt"))
    rows = run_bench(small(str(tmp_path / "ckpt"), tmp_path, lengths=(16,), ks=(4,),
                           mlp_ratios=(0.5,), batch_sizes=(1,), repeats=1, warmup=0))
    own = sum(p.numel() for p in model.encoder.parameters())
    assert rows[1]["k"] == 4 and rows[1]["encoder_params"] == own


def test_too_long_prompt_is_refused(tiny_model_dir, tmp_path):
    with pytest.raises(KTMError, match="context"):
        run_bench(small(tiny_model_dir, tmp_path, lengths=(600,)))


def test_preset_lengths_beyond_a_short_context_are_left_out(tiny_model_dir, tmp_path):
    """`ktm bench --quick` on a local model of 512 positions (the preset reaches 2048): the
    lengths nobody chose that do not fit are left out and said so, not refused."""
    out = tmp_path / "bench.json"
    with pytest.warns(UserWarning, match=r"\[1024, 2048\] left out"):
        assert main(["bench", "--model", tiny_model_dir, "--quick", "--ks", "2", "--repeats",
                     "1", "--warmup", "0", "--no-progress", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {r["input_tokens"] for r in rows} == {256} and rows[0]["config"]["lengths"] == [256]
    assert main(["bench", "--model", tiny_model_dir, "--lengths", "256", "1024", "--ks", "2",
                 "--out", str(out)]) == 2  # lengths given are never cut


def test_main_writes_json_and_plots_read_it(tiny_model_dir, tmp_path, capsys):
    cfg = small(tiny_model_dir, tmp_path, lengths=(16, 32), ks=(2, 4), batch_sizes=(1,),
                repeats=1, warmup=0)
    assert main_bench(cfg) == 0
    assert "speedup_prefill" in capsys.readouterr().out
    rows = json.loads((tmp_path / "bench.json").read_text())
    assert rows[0]["config"]["lengths"] == [16, 32]
    written = plot_results(tmp_path / "bench.json", tmp_path / "plots")
    assert [p.name for p in written] == ["bench_prefill.png", "bench_speedup.png"]
    assert all(p.stat().st_size > 1000 for p in written)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(KTMError, match="not a ktm bench result"):
        plot_results(bad)


def test_bench_errors_use_the_ktm_error_form(tmp_path, capsys):
    from ktm.cli.main import main

    code = main(["bench", "--model", str(tmp_path / "nope"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("ktm: error: unknown model")
    with pytest.raises(KTMError, match="unknown model"):
        main_bench(BenchConfig(model=str(tmp_path / "nope"), progress=False))


@pytest.mark.parametrize("text, match", [
    ("{}", "not a ktm bench result"),
    ('[{"mode": "infer"}]', "row 0 lacks \\['method', 'k', 'mlp_ratio', 'input_tokens', 'batch'"),
    ("[", "cannot read bench results"),
    ('[{"mode": "infer", "method": "ktm", "k": 4, "mlp_ratio": 2.0, "input_tokens": 512, '
     '"batch": 1, "prefill_s": NaN}]', "row 0: prefill_s=nan: expected a positive number"),
    ('[{"mode": "infer", "method": "ktm", "k": 4, "mlp_ratio": 2.0, "input_tokens": "512", '
     '"batch": 1}]', "row 0: input_tokens='512': expected a positive integer"),
    ('[{"mode": "serve", "method": "ktm"}]', "no rows to plot \\(rows: mode serve\\)"),
    ("[]", "no rows to plot \\(rows: none\\)"),
])
def test_bench_plot_errors_are_one_line(text, match, tmp_path, capsys):
    # `python -m ktm.bench.plot` printed a traceback (a KeyError for a row without its fields;
    # a matplotlib ValueError for a NaN or text value) or, for serve rows, wrote nothing silently
    from ktm.bench.plot import main as plot_main

    bad = tmp_path / "bad.json"
    bad.write_text(text)
    assert plot_main([str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ktm bench-plot: error:")
    assert re.search(match, err[0]), err[0]
    assert not list(tmp_path.glob("*.png"))


def merging_across_words(decoder: str = "byte-level"):
    """A tiny model whose tokenizer merges across words ("t" + "Ġ" before any word's own merges:
    " cat dog" reads " ca", "t ", "d", "o", "g"); ``decoder``: "byte-level" (exact), "none" (the
    raw pieces joined by spaces: a cut re-reads longer), "drops-cat" (a cut re-reads shorter)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1}
    for c in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[c] = len(vocab)
    merges = [("t", "Ġ")] + [("Ġ" + w[:i], w[i]) for w in ("cat", "dog", "sun", "top")
                             for i in range(len(w))]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    backend = Tokenizer(models.BPE(vocab, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if decoder != "none":
        backend.decoder = decoders.ByteLevel()
    if decoder == "drops-cat":
        backend.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Replace(" cat", "")])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4))
    return KTMModel.from_base(lm, k=2, tokenizer=tok)


def test_synthetic_text_is_exact_where_merges_span_word_boundaries():
    """A tokenizer that merges across words read the synthetic prompt as more tokens than
    words, and ``ktm bench`` stopped ("349 tokens, expected exactly 256"): the text is now cut
    at the requested number of token ids."""
    model = merging_across_words()
    tok = model.tokenizer
    pool = word_pool(tok)
    assert len(tok(" cat dog", add_special_tokens=False)["input_ids"]) == 5
    for n, first in [(3, True), (40, False), (256, True)]:
        text = synthetic_text(model, n, seed=n, pool=pool, first=first)
        assert len(model.tokenize(text, first=first)) == n
        assert text == synthetic_text(model, n, seed=n, pool=pool, first=first)


@pytest.mark.parametrize("decoder", ["none", "drops-cat"])
def test_synthetic_text_names_the_length_no_cut_reads_exactly(decoder):
    """Where no cut of the longer text re-reads as exactly the requested number of tokens, the
    prompt is refused with its lengths, not returned at another length or cut forever."""
    model = merging_across_words(decoder)
    pool = [" cat", " dog", " sun", " top"]
    with pytest.raises(KTMError, match=r"synthetic prompt has \d+ tokens, expected exactly 40: "
                                       r"this tokenizer's merges span word boundaries"):
        synthetic_text(model, 40, seed=1, pool=pool)


@pytest.mark.llamacpp
def test_both_backends_run_interleaved_each_against_its_own_uncompressed_run(tiny_model_dir,
                                                                             tmp_path,
                                                                             monkeypatch):
    monkeypatch.setenv("KTM_CACHE", str(tmp_path / "cache"))
    cfg = BenchConfig(model=tiny_model_dir, lengths=(64,), ks=(2,), repeats=2, warmup=1,
                      output_tokens=4, backends=("torch", "llamacpp"), progress=False,
                      out=str(tmp_path / "b.json"))
    rows = run_bench(cfg)
    assert [(r["method"], r["backend"]) for r in rows] == [
        ("uncompressed", "torch"), ("ktm", "torch"),
        ("uncompressed", "llamacpp"), ("ktm", "llamacpp")]
    for r in rows:
        base = next(b for b in rows if b["method"] == "uncompressed"
                    and b["backend"] == r["backend"])
        pairs = [b / m for b, m in zip(base["per_repeat"]["e2e_s"], r["per_repeat"]["e2e_s"])]
        assert r["per_repeat"]["speedup_e2e"] == pytest.approx(pairs)
        assert r["compressed_tokens"] == 64 // r["k"]
        assert r["kv_ratio"] == pytest.approx(1 / r["k"])
    llama = rows[3]["llamacpp"]  # the LoRA folded into the base
    assert llama["sequences"] == 1 and llama["model_gguf"].endswith("model.gguf")
    plain = rows[2]["llamacpp"]  # plain llama.cpp: the base alone
    assert plain["model_gguf"].endswith("base.gguf") and plain["adapter_gguf"] is None


@pytest.mark.llamacpp
def test_plain_llama_cpp_can_run_another_gguf_of_the_base(tiny_model_dir, tmp_path, monkeypatch):
    """--plain-gguf: the uncompressed baseline on llama.cpp runs the file given (e.g. a Q8_0
    copy of the base), the merged runs the model's own export."""
    monkeypatch.setenv("KTM_CACHE", str(tmp_path / "cache"))
    with pytest.raises(KTMError, match="--plain-gguf is an option of --mode infer with "
                                       "--backends llamacpp"):
        BenchConfig(model=tiny_model_dir, plain_gguf="x.gguf")
    common = dict(model=tiny_model_dir, lengths=(64,), ks=(2,), repeats=1, warmup=0,
                  output_tokens=2, backends=("llamacpp",), progress=False,
                  out=str(tmp_path / "b.json"))
    with pytest.raises(KTMError, match="--plain-gguf .*nowhere.gguf.* is not a file"):
        run_bench(BenchConfig(plain_gguf=str(tmp_path / "nowhere.gguf"), **common))
    from ktm.llamacpp.export import export_gguf

    model = KTMModel.from_base(tiny_model_dir, k=2)
    export_gguf(model, tmp_path / "plain")
    plain = str(tmp_path / "plain" / "model.gguf")
    rows = run_bench(BenchConfig(plain_gguf=plain, **common))
    # a row records a file by its folder and name, never a path of this machine
    recorded = "/".join(Path(plain).parts[-2:])
    assert rows[0]["method"] == "uncompressed" and rows[0]["llamacpp"]["model_gguf"] == recorded
    assert rows[1]["llamacpp"]["model_gguf"].endswith("model.gguf")
    assert rows[1]["llamacpp"]["model_gguf"] != recorded


def test_backends_other_than_torch_are_an_infer_option():
    with pytest.raises(KTMError, match="backends must be some of"):
        BenchConfig(backends=("onnx",))
    with pytest.raises(KTMError, match="--backends is an option of --mode infer and serve"):
        BenchConfig(mode="train", backends=("torch", "llamacpp"))


def test_ratio_methods_read_at_their_ratio_with_the_models_own_levels(tiny_model_dir, tmp_path):
    """--ratios: each prompt also read at a ratio by the checkpoint's own encoder (its levels,
    its allocator), the row recording the ratio and the positions the LM read."""
    from ktm.bench.bench import run_bench

    torch.manual_seed(0)
    KTMModel.from_base(tiny_model_dir, k=8, inner_k=(4, 2), allocator="even").save(
        str(tmp_path / "k8"))
    cfg = BenchConfig(model=str(tmp_path / "k8"), lengths=(128,), ks=(8,), ratios=(3, 6),
                      repeats=1, warmup=0, output_tokens=2, progress=False)
    rows = {(r["k"], r["ratio"]): r for r in run_bench(cfg) if r["method"] == "ktm"}
    assert set(rows) == {(8, None), (8, 3.0), (8, 6.0)}
    for ratio in (3.0, 6.0):
        got = 128 / rows[8, ratio]["compressed_tokens"]
        assert abs(got / ratio - 1) <= 0.05
        assert rows[8, ratio]["expected_compressed_tokens"] == round(128 / ratio)
        assert rows[8, ratio]["allocator"] == "even"  # the checkpoint's own, recorded
    assert rows[8, None]["allocator"] is None
    with pytest.raises(KTMError, match="each of ratios must be a finite number >= 1"):
        BenchConfig(ratios=(0.5,))


def test_press_rows_keep_their_share_of_the_kv(tiny_model_dir, tmp_path):
    require_module("kvpress", "the [kvpress] extra and kvpress (the README's test command)")
    rows = run_bench(small(tiny_model_dir, tmp_path, lengths=(41,), ks=(4,), batch_sizes=(1, 2),
                           presses=("knorm=0.5",)))
    for r in rows:
        assert r["speedup_prefill"] > 0
        plain = 41 if r["method"] == "uncompressed" else 11  # ceil(41 / 4) positions
        # the press drops half of every position but the last (read after it)
        want = plain if r["press"] is None else int((plain - 1) * 0.5) + 1
        assert r["kv_ratio"] == pytest.approx(want / 41)
    assert {r["press"] for r in rows} == {None, "knorm=0.5"}


def test_inner_k_builds_recursive_encoders_frozen_outside_training(tiny_model_dir, tmp_path):
    """--inner-k 2: K=4 is timed with two K=2 merges (the shipped readers' encoder), K=2 with
    one level; an infer run's encoders are frozen (held in the LM's dtype, as served)."""
    from ktm.bench.config import Method, methods_of
    from ktm.bench.runners import _encoders, load_model

    config = small(tiny_model_dir, tmp_path, lengths=(16,), ks=(2, 4), mlp_ratios=(0.5,),
                   inner_k=2, batch_sizes=(1,), repeats=1)
    model = load_model(config)
    encs = _encoders(model, methods_of(config, model.k), 0, config.inner_k)
    four, two = encs[Method("ktm", 4, 0.5).key], encs[Method("ktm", 2, 0.5).key]
    assert four.config.inner_k == 2 and four.inner.k == 2 and two.config.inner_k == 1
    assert not any(p.requires_grad for e in (four, two) for p in e.parameters())
    trained = _encoders(model, methods_of(config, model.k), 0, config.inner_k, train=True)
    assert all(p.requires_grad for p in trained[Method("ktm", 4, 0.5).key].parameters())
    rows = run_bench(config)
    assert [r["compressed_tokens"] for r in rows] == [16, 8, 4]
    with pytest.raises(KTMError, match="inner_k 3 divides none of ks"):
        small(tiny_model_dir, tmp_path, ks=(2, 4), inner_k=3)
