"""Other causal-LM families load from a local folder and keep the parity guarantees."""

import pytest
import torch
from conftest import build_tokenizer
from transformers import AutoModelForCausalLM, GemmaConfig, GPT2Config, Qwen2Config

from ktm.generate import generate_ids
from ktm.model import KTMModel

TEXT = "The quick brown fox jumps over the lazy dog. Hello world"


def tiny_config(family: str, vocab: int):
    common = dict(vocab_size=vocab, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    if family == "gpt2":
        return GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, **common)
    cls = {"qwen2": Qwen2Config, "gemma": GemmaConfig}[family]
    return cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=256, **common)


@pytest.mark.parametrize("family", ["qwen2", "gpt2", "gemma"])
def test_family_parity_and_cached_generation(family, tmp_path):
    tok = build_tokenizer()
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config(family, len(tok)))
    base.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    base = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    model = KTMModel.from_base(str(tmp_path), k=1)
    assert model.trainable_parameters(), "LoRA found no target modules"
    ids = torch.tensor([tok(TEXT)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model.prompt_logits(TEXT), base(ids).logits[0],
                                   atol=1e-5, rtol=1e-5)
    k4 = KTMModel.from_base(str(tmp_path), k=4)
    prompts = [TEXT, "Hello world"]
    assert generate_ids(k4, prompts, max_new_tokens=6) == generate_ids(
        k4, prompts, max_new_tokens=6, use_cache=False)
