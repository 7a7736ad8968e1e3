"""The embedded SmolLM2-135M on llama.cpp: an F32 GGUF of its weights against the torch path
(logits, greedy generations), and its shipped Q4_1 GGUF as the default base. Slow: ~1 min."""

from pathlib import Path

import pytest
import torch

from ktm.core.prompt import Segment
from ktm.llamacpp.export import GGUFOptions, embedded_gguf, export_gguf, read_manifest
from ktm.llamacpp.runtime import RuntimeConfig
from ktm.model import KTMModel

pytestmark = [pytest.mark.slow, pytest.mark.llamacpp]
READER = "smollm2-135m-k4"
SOURCE = Path(__file__).resolve().parents[2] / "ktm" / "llamacpp" / "runtime.py"


@pytest.fixture(scope="module")
def torch_model():
    # the shipped K=4 reader read with consecutive positions: llama.cpp accepts no others
    return KTMModel.load(READER, spread_positions=False)


def _prompt() -> list[Segment]:
    return [Segment(SOURCE.read_text()[:1500]), Segment(" This module", compress=False)]


def test_an_f32_gguf_of_the_embedded_model_reads_a_merged_prompt_as_torch_does(
        torch_model, tmp_path):
    export_gguf(torch_model, tmp_path / "f32", opts=GGUFOptions(write_base=True))
    assert read_manifest(tmp_path / "f32")["base_gguf"]["written"]
    llama = KTMModel.load(tmp_path / "f32", backend="llamacpp",
                          llamacpp=RuntimeConfig(kv_type="f32", sequences=2))
    cp = torch_model.encode_prompts([tuple(_prompt())])[0]
    assert cp.tokens_out < cp.tokens_in / 3
    with torch.no_grad():
        n = cp.tokens_out
        want = torch_model.lm(cp.embeds[None], torch.ones(1, n, dtype=torch.long),
                              torch.arange(n)[None])[0]
    got = llama.runtime.row_logits(cp.embeds)
    rel = float((got - want).norm() / want.norm())
    assert rel < 1e-3, rel
    want_text = torch_model.generate(_prompt(), max_new_tokens=32, stop_at_eos=False)
    assert llama.generate(_prompt(), max_new_tokens=32, stop_at_eos=False) == want_text


def test_the_shipped_q4_1_gguf_is_the_default_base(torch_model, tmp_path):
    m = export_gguf(torch_model, tmp_path / "q4")
    assert m["base_gguf"]["file"] == str(embedded_gguf("smollm2-135m"))
    assert not m["base_gguf"]["written"] and not (tmp_path / "q4" / "base.gguf").exists()
    assert m["embedding_check"]["relative_difference"] == 0.0  # the same rows, dequantised
    llama = KTMModel.load(tmp_path / "q4", backend="llamacpp")
    text = llama.generate(_prompt(), max_new_tokens=8)
    assert isinstance(text, str) and text
