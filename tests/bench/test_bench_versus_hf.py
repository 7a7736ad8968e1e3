"""``ktm bench --mode hf`` on the tiny model: ktm's decode against transformers' ``generate``.

Timings are never asserted: only the rows, the tokens and how the ratios are formed.
"""

import json

import pytest
import torch

from ktm.bench.bench import main_bench
from ktm.bench.config import BenchConfig
from ktm.bench.runners import load_model
from ktm.bench.versus_hf import run_hf_bench
from ktm.core.base_model import load_base


@pytest.fixture(scope="module")
def hf_rows(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "hf.json"
    config = BenchConfig(model=tiny_model_dir, mode="hf", lengths=(20,), batch_sizes=(1, 2),
                         repeats=2, warmup=1, output_tokens=5, progress=False, out=str(out))
    assert main_bench(config) == 0
    return json.loads(out.read_text())


def test_the_hf_preset_fills_only_what_was_left_at_default():
    c = BenchConfig(mode="hf", output_tokens=128)
    assert (c.lengths, c.output_tokens, c.out) == ((512,), 128, "results/bench/decode_vs_hf.json")


def test_every_contender_reads_the_same_prompt_and_gives_generates_tokens(hf_rows):
    assert [(r["method"], r["batch"]) for r in hf_rows] == [
        (m, b) for b in (1, 2) for m in ("hf", "ktm", "ktm-peft")]
    for r in hf_rows:
        assert r["mode"] == "hf" and r["input_tokens"] == 20 and r["output_tokens"] == 5
        assert r["same_tokens_as_hf"]  # a fresh LoRA is zero, folded or not
        assert {"config", "versions", "git", "threads"} <= set(r)


def test_ratios_against_generate_are_paired_by_repeat(hf_rows):
    for batch in (1, 2):
        rows = {r["method"]: r for r in hf_rows if r["batch"] == batch}
        hf = rows["hf"]["per_repeat"]
        assert rows["hf"]["vs_hf_decode"] == rows["hf"]["vs_hf_e2e"] == 1.0
        for r in rows.values():
            rep = r["per_repeat"]
            assert rep["vs_hf_decode"] == pytest.approx(
                [x / h for x, h in zip(rep["decode_tokens_per_s"], hf["decode_tokens_per_s"])])
            assert rep["vs_hf_e2e"] == pytest.approx(
                [h / x for x, h in zip(rep["e2e_s"], hf["e2e_s"])])
            # tokens after the first over the time after it, for generate too
            for rate, secs in zip(rep["decode_tokens_per_s"], rep["decode_s"]):
                assert rate * secs == pytest.approx(batch * 4)


def test_both_decode_past_the_end_of_sequence(tiny_model_dir, tmp_path):
    """An EOS at every step: generate neither stops nor bans it (min_new_tokens would, and its
    tokens would then differ from ktm's), as ktm's decode with stop_at_eos=False."""
    lm, tok = load_base(tiny_model_dir)
    head = lm.get_output_embeddings().weight
    with torch.no_grad():
        head[tok.eos_token_id] += 50 * head.abs().max()
    lm.save_pretrained(tmp_path / "eos")
    tok.save_pretrained(tmp_path / "eos")
    rows = run_hf_bench(BenchConfig(model=str(tmp_path / "eos"), mode="hf", lengths=(12,),
                                    repeats=1, warmup=0, output_tokens=4, progress=False),
                        load_model)
    assert all(r["same_tokens_as_hf"] for r in rows)
