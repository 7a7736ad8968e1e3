"""The exported HF folder, loaded by plain transformers and fed the prompt embeddings the vLLM
client builds, computes the ktm model's logits: across families, a recursive reader read at its
inner K, and bf16 (vLLM itself needs a GPU; transformers stands in for it)."""

import pytest
import torch
from helpers import PROMPT, perturb
from transformers import AutoModelForCausalLM

from ktm.model import KTMModel, prompt_logits
from ktm.vllm.client import VLLMClient
from ktm.vllm.export import export_vllm


def _served_logits(out, prompt, dtype=torch.float32) -> torch.Tensor:
    """Logits of the exported HF LM, loaded by plain transformers, on the client's embeds."""
    hf = AutoModelForCausalLM.from_pretrained(out / "lm", dtype=dtype).eval()
    with torch.no_grad():
        embeds = VLLMClient(out).encode(prompt).embeds
        return hf(inputs_embeds=embeds[None].to(dtype)).logits[0].float()


@pytest.mark.parametrize("family", ["gpt2", "granite", "bloom", "phi3", "falcon", "cohere"])
def test_exported_family_reads_the_client_embeds_as_the_ktm_model(family, tmp_path):
    """Conv1D + tied head (gpt2), an embedding multiplier applied to inputs_embeds inside the
    LM (granite, as vLLM's Granite does), an embedding LayerNorm (bloom), fused qkv (phi3),
    logit scales (cohere, granite): the served LM on the client's embeds is the ktm model."""
    from helpers import save_tiny

    base, tok = save_tiny(family, tmp_path / family)
    torch.manual_seed(0)
    model = KTMModel.from_base(base, k=4, tokenizer=tok, plain_prefix=1)
    perturb(model, seed=1)
    export_vllm(model, tmp_path / "x")
    with torch.no_grad():
        want = prompt_logits(model, PROMPT)
    torch.testing.assert_close(_served_logits(tmp_path / "x", PROMPT), want, atol=1e-5,
                               rtol=1e-5)


def test_exported_recursive_reader_at_its_inner_k_and_in_bf16(tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    model = KTMModel.from_base(tiny_model_dir, k=4, inner_k=2, slot_weights=True)
    perturb(model, seed=1)
    model.save(tmp_path / "ck")
    inner = KTMModel.load(tmp_path / "ck", k=2)
    m = export_vllm(inner, tmp_path / "k2")
    assert m["k"] == 2 and m["served_model_name"].startswith("ktm-k2-")
    with torch.no_grad():
        want = prompt_logits(inner, PROMPT)
    torch.testing.assert_close(_served_logits(tmp_path / "k2", PROMPT), want, atol=1e-5,
                               rtol=1e-5)
    bf16 = KTMModel.load(tmp_path / "ck", dtype=torch.bfloat16)
    assert export_vllm(bf16, tmp_path / "bf16")["dtype"] == "bfloat16"
    with torch.no_grad():
        want = prompt_logits(bf16, PROMPT).float()
    got = _served_logits(tmp_path / "bf16", PROMPT, torch.bfloat16)
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)  # LoRA merged into bf16 rows
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
