"""The GGUF files: the adapter read back equals the PEFT weights, the q/k row order llama.cpp's
``llama`` architecture reads, and what llama.cpp's adapters cannot hold is refused."""

import numpy as np
import pytest
import torch
from helpers import fresh_model, perturb

from ktm.errors import KTMError
from ktm.llamacpp.gguf_files import gguf_arch, pair_rows, read_adapter, write_adapter


def test_the_adapter_read_back_from_gguf_equals_the_peft_weights(tiny_model_dir, tmp_path):
    model = fresh_model(tiny_model_dir, k=2)
    perturb(model)
    path = tmp_path / "adapter.gguf"
    write_adapter(path, model.peft, model.lm_config, gguf_arch(model.lm_config))
    tensors, meta = read_adapter(path)
    assert meta["general.type"] == "adapter" and meta["adapter.type"] == "lora"
    assert meta["general.architecture"] == "llama"
    assert meta["adapter.lora.alpha"] == pytest.approx(model.config.lora.alpha)
    c = model.lm_config
    seen = 0
    for layer in range(c.num_hidden_layers):
        for hf, gg, heads in (("self_attn.q_proj", "attn_q", c.num_attention_heads),
                              ("self_attn.k_proj", "attn_k", c.num_key_value_heads),
                              ("self_attn.v_proj", "attn_v", None),
                              ("mlp.down_proj", "ffn_down", None)):
            mod = model.peft.get_submodule(f"base_model.model.model.layers.{layer}.{hf}")
            a, b = mod.lora_A["default"].weight, mod.lora_B["default"].weight
            if heads is not None:
                b = pair_rows(b, heads)
            name = f"blk.{layer}.{gg}.weight"
            np.testing.assert_array_equal(tensors[f"{name}.lora_a"], a.detach().numpy())
            np.testing.assert_array_equal(tensors[f"{name}.lora_b"], b.detach().numpy())
            seen += 1
    assert seen == 4 * c.num_hidden_layers
    # every adapted module of the model is in the file, and nothing else
    assert len(tensors) == 2 * sum(1 for n, _ in model.peft.named_parameters() if "lora_A" in n)


def test_pair_rows_turns_half_split_rotation_into_adjacent_pairs():
    """A head's rotary pairs are (i, i + d/2) in HF's layout and (2i, 2i + 1) in llama.cpp's
    ``llama`` layout: the reordered rows put each pair side by side, head by head."""
    heads, d = 3, 4
    w = torch.arange(heads * d, dtype=torch.float32)[:, None].repeat(1, 2)
    out = pair_rows(w, heads)
    for h in range(heads):
        for i in range(d // 2):
            assert out[h * d + 2 * i, 0] == h * d + i
            assert out[h * d + 2 * i + 1, 0] == h * d + d // 2 + i
    with pytest.raises(KTMError, match="does not split into 5 heads"):
        pair_rows(w, 5)


def test_an_adapter_llama_cpp_cannot_express_is_refused(tiny_model_dir, tmp_path):
    model = fresh_model(tiny_model_dir, k=2)
    model.peft.peft_config["default"].use_rslora = True
    with pytest.raises(KTMError, match="rsLoRA"):
        write_adapter(tmp_path / "a.gguf", model.peft, model.lm_config, "llama")
    assert not (tmp_path / "a.gguf").exists()


@pytest.mark.parametrize("kw,match", [
    ({"context": 0}, "context must be an integer >= 1"),
    ({"sequences": 0}, "sequences must be an integer >= 1"),
    ({"sequences": 64, "batch": 32}, r"sequences \(64\) must not exceed its batch \(32\)"),
    ({"kv_type": "q8"}, "kv_type must be one of"),
    ({"threads": 0}, "threads must be an integer >= 1 or None"),
])
def test_runtime_settings_are_checked_on_construction(kw, match):
    from ktm.llamacpp.runtime import RuntimeConfig

    with pytest.raises(KTMError, match=match):
        RuntimeConfig(**kw)
