"""``ktm bench --mode serve`` on the tiny model: a real ktm serve process, tiny settings.

Timings are never compared with targets: only the row schema, token counts and orderings that
hold by construction (TTFT <= latency, p50 <= p95, the cached context length)."""

import json
import math

import pytest

from ktm.bench.bench import main_bench
from ktm.bench.config import BenchConfig


def test_serve_preset_fills_only_options_left_at_default():
    c = BenchConfig(mode="serve")
    assert (c.lengths, c.ks, c.clients, c.out) == ((1024,), (2, 4), (1, 4, 16),
                                                   "results/bench/serve.json")
    q = BenchConfig(mode="serve", quick=True, ks=(4,))
    assert (q.lengths, q.ks, q.clients, q.requests) == ((256,), (4,), (1, 4), 8)


@pytest.mark.slow  # starts a ktm serve process
def test_serve_bench_writes_load_and_prefix_rows(tiny_model_dir, tmp_path, capsys):
    from ktm.bench.serve import CUE, Tokens

    out = tmp_path / "serve.json"
    cfg = BenchConfig(mode="serve", model=tiny_model_dir, lengths=(40,), ks=(2,), clients=(1, 3),
                      requests=3, output_tokens=3, repeats=2, warmup=1, threads=1,
                      progress=False, out=str(out))
    assert main_bench(cfg) == 0
    rows = json.loads(out.read_text())
    load = [r for r in rows if r["kind"] == "load"]
    assert [(r["method"], r["k"], r["clients"]) for r in load] == [
        ("ktm", 2, 1), ("ktm", 2, 3), ("uncompressed", None, 1), ("uncompressed", None, 3)]
    cue = len(Tokens(tiny_model_dir).tokenize(CUE))
    for r in load:
        assert r["requests"] == 3 and len(r["per_request"]["ttft_s"]) == 3
        assert 0 < r["ttft_p50_s"] <= r["latency_p50_s"] <= r["latency_p95_s"]
        assert r["requests_per_s"] > 0 and r["output_tokens_per_s"] > 0
        assert r["prompt_tokens"] == 40 + cue
        merged = math.ceil(40 / 2) + cue if r["method"] == "ktm" else 40 + cue
        assert r["prompt_tokens_merged"] == merged
        assert r["versions"]["ktm"] and r["config"]["mode"] == "serve"
    (prefix,) = [r for r in rows if r["kind"] == "prefix"]
    assert prefix["cached_positions"] == 20 and prefix["k"] == 2
    assert prefix["ttft_uncached_s"] > 0 and prefix["ttft_cached_s"] > 0
    table = capsys.readouterr().out
    assert "requests_per_s" in table and "ttft_cached_s" in table


@pytest.mark.llamacpp
def test_serve_bench_on_the_llama_cpp_backend(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KTM_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "serve.json"
    cfg = BenchConfig(mode="serve", model=tiny_model_dir, lengths=(40,), ks=(2,), clients=(2,),
                      requests=2, output_tokens=3, repeats=1, warmup=0, threads=1,
                      backends=("torch", "llamacpp"), progress=False, out=str(out))
    assert main_bench(cfg) == 0
    rows = json.loads(out.read_text())
    assert [(r["kind"], r["backend"], r["method"]) for r in rows] == [
        ("load", "torch", "ktm"), ("load", "torch", "uncompressed"), ("prefix", "torch", "ktm"),
        ("load", "llamacpp", "ktm"), ("load", "llamacpp", "uncompressed"),
        ("prefix", "llamacpp", "ktm")]
    for r in rows[:2]:  # the same prompts: the same prompt sizes on both runtimes
        twin = next(t for t in rows[3:5] if t["method"] == r["method"])
        assert (twin["prompt_tokens"], twin["prompt_tokens_merged"]) == (
            r["prompt_tokens"], r["prompt_tokens_merged"])
    # llama.cpp keeps the repeated context's rows in its sequence and prefills the rest
    assert rows[5]["cached_positions"] >= 20
