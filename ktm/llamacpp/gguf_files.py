"""Writing a ktm model's LM as GGUF files llama.cpp reads: the LoRA adapter, and the base model
when it is an HF folder.

Both use the ``gguf`` package's writer and its tensor-name maps (HF module names -> llama.cpp's
``blk.N.attn_q`` ...), so any family the package maps has its adapter names. The facts of the
format that llama.cpp's loader checks, written here from its documentation and error messages:

- an adapter file has ``general.type = "adapter"``, ``adapter.type = "lora"``,
  ``adapter.lora.alpha`` and the base's ``general.architecture``;
- each adapted weight ``W`` (out x in) has ``NAME.lora_a`` (r x in, PEFT's ``lora_A``) and
  ``NAME.lora_b`` (out x r, PEFT's ``lora_B``); llama.cpp scales ``B A x`` by alpha / r, as
  PEFT does without rsLoRA;
- llama.cpp's ``llama`` architecture rotates interleaved pairs of a head's dimensions where HF
  rotates its two halves, so the rows of ``q_proj`` and ``k_proj`` (and of their ``lora_B``) are
  reordered per head: within each head, HF row ``h * d + i`` (i < d/2) goes to ``2i`` and
  ``h * d + d/2 + i`` to ``2i + 1``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ktm.errors import KTMError

# HF model_type -> gguf's architecture name, where they differ (the rest: the same name)
ARCH = {"mistral": "llama", "smollm3": "smollm3"}
# architectures whose q/k rows llama.cpp reads in interleaved-pair order (see the docstring)
PAIRED_ROPE = {"llama"}
# architectures this writer can write a whole base model for (their metadata keys are set below;
# for another family, convert it with llama.cpp's own converter and pass the file as the base)
BASE_ARCHS = {"llama", "qwen2", "qwen3"}


def gguf_module():
    import gguf  # a dependency of ktm (transformers reads the embedded model with it)

    return gguf


def gguf_arch(lm_config) -> str:
    """The gguf architecture name of an HF config; a clear error for a family gguf lacks."""
    gguf = gguf_module()
    name = ARCH.get(lm_config.model_type, lm_config.model_type)
    if name not in gguf.MODEL_ARCH_NAMES.values():
        raise KTMError(f"the {lm_config.model_type!r} family has no llama.cpp architecture in "
                       f"gguf {gguf.__version__ if hasattr(gguf, '__version__') else ''}: "
                       "expected one llama.cpp runs (e.g. llama, qwen2, qwen3)")
    return name


def _arch_enum(name: str):
    gguf = gguf_module()
    return next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == name)


def tensor_names(lm_config, arch: str):
    """HF parameter name -> gguf tensor name (None for a name the map lacks)."""
    tmap = gguf_module().get_tensor_name_map(_arch_enum(arch), lm_config.num_hidden_layers)

    def name(hf: str) -> str | None:
        return tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
    return name


def pair_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q/k projection (or its lora_B) from HF's half-split rotary order to the
    interleaved-pair order of llama.cpp's ``llama`` architecture (module docstring)."""
    out = w.shape[0]
    if out % (2 * heads):
        raise KTMError(f"a projection of {out} rows does not split into {heads} heads of pairs")
    d = out // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _heads_of(hf_name: str, lm_config) -> int | None:
    """Heads to reorder a q/k projection by, None for any other weight."""
    if ".q_proj" in hf_name:
        return lm_config.num_attention_heads
    if ".k_proj" in hf_name:
        return getattr(lm_config, "num_key_value_heads", None) or lm_config.num_attention_heads
    return None


def _np(t: torch.Tensor, dtype=np.float32) -> np.ndarray:
    return t.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy().astype(dtype)


def lora_tensors(peft_model, lm_config, arch: str) -> tuple[dict[str, np.ndarray], float]:
    """The adapter's tensors by gguf name (``NAME.lora_a`` / ``NAME.lora_b``) and its alpha.

    Refuses what llama.cpp's adapters cannot express: rsLoRA, DoRA, per-module ranks or alphas,
    and an adapted module the architecture's name map lacks."""
    from peft.tuners.lora import LoraLayer

    cfg = peft_model.peft_config[peft_model.active_adapter]
    for flag, what in (("use_rslora", "rsLoRA"), ("use_dora", "DoRA")):
        if getattr(cfg, flag, False):
            raise KTMError(f"this adapter uses {what}, which llama.cpp's LoRA adapters do not "
                           "express: expected a plain LoRA")
    if getattr(cfg, "rank_pattern", None) or getattr(cfg, "alpha_pattern", None):
        raise KTMError("this adapter has per-module ranks or alphas; llama.cpp's LoRA adapters "
                       "hold one alpha: expected one rank and alpha for every module")
    name = tensor_names(lm_config, arch)
    adapter = peft_model.active_adapter
    out: dict[str, np.ndarray] = {}
    for path, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
            continue
        hf = path.removeprefix("base_model.model.") + ".weight"
        target = name(hf)
        if target is None:
            raise KTMError(f"the adapted module {hf!r} has no llama.cpp tensor name for the "
                           f"{arch!r} architecture: expected LoRA on the attention and MLP "
                           "projections")
        a = module.lora_A[adapter].weight
        b = module.lora_B[adapter].weight
        heads = _heads_of(hf, lm_config) if arch in PAIRED_ROPE else None
        if heads is not None:
            b = pair_rows(b, heads)
        out[f"{target}.lora_a"] = _np(a)
        out[f"{target}.lora_b"] = _np(b)
    if not out:
        raise KTMError("the model has no LoRA weights to export")
    return out, float(cfg.lora_alpha)


def write_adapter(path: Path, peft_model, lm_config, arch: str) -> None:
    """The LoRA adapter as a GGUF file for a base of architecture ``arch``."""
    gguf = gguf_module()
    tensors, alpha = lora_tensors(peft_model, lm_config, arch)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for key, value in sorted(tensors.items()):
        w.add_tensor(key, value)
    finish_writer(w)


def read_adapter(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """An adapter GGUF's tensors (numpy, gguf's row-major shapes) and its metadata values."""
    gguf = gguf_module()
    r = gguf.GGUFReader(str(path))
    tensors = {t.name: np.array(t.data).reshape([int(n) for n in reversed(t.shape)])
               for t in r.tensors}
    meta = {}
    for key in ("general.type", "general.architecture", gguf.Keys.Adapter.TYPE,
                gguf.Keys.Adapter.LORA_ALPHA):
        field = r.get_field(key)
        if field is not None:
            meta[key] = field.contents()
    return tensors, meta


def finish_writer(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _rope_theta(c) -> float:
    params = getattr(c, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default")
    if kind != "default":
        raise KTMError(f"the base model uses {kind!r} rope scaling, which this GGUF writer does "
                       "not write: convert the base with llama.cpp's converter and pass it as "
                       "the base GGUF")
    return float(params.get("rope_theta", getattr(c, "rope_theta", 10000.0)))


def _vocab(tokenizer, n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE tokenizer's tokens, token types and merges, as llama.cpp's ``gpt2``
    vocabulary holds them (ktm tokenizes itself and hands llama.cpp ids, so the vocabulary is
    what lets the file load and name its tokens)."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    model = state["model"]
    if model.get("type") != "BPE":
        raise KTMError(f"the base model's tokenizer is {model.get('type')!r}; this GGUF writer "
                       "writes byte-level BPE vocabularies: convert the base with llama.cpp's "
                       "converter and pass it as the base GGUF")
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [5] * n_vocab  # unused
    for text, i in model["vocab"].items():
        if i < n_vocab:
            tokens[i], types[i] = text, 1  # normal
    for added in state.get("added_tokens", []):
        if added["id"] < n_vocab:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = 3 if added.get("special") else 4  # control / user-defined
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return tokens, types, merges


def write_base(path: Path, lm, tokenizer, file_type: str = "f32") -> None:
    """An HF causal LM (weights as loaded, LoRA not merged) as a GGUF base model, F32 or F16."""
    gguf = gguf_module()
    c = lm.config
    arch = gguf_arch(c)
    if arch not in BASE_ARCHS:
        raise KTMError(f"this GGUF writer writes base models of the {sorted(BASE_ARCHS)} "
                       f"architectures, not {arch!r}: convert the base with llama.cpp's "
                       "converter (convert_hf_to_gguf.py) and pass the file as the base GGUF")
    if file_type not in ("f32", "f16"):
        raise KTMError(f"GGUF base type must be f32 or f16, got {file_type!r}")
    state = lm.state_dict()
    emb = lm.get_input_embeddings().weight
    n_vocab, hidden = emb.shape
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(Path(str(getattr(c, "_name_or_path", "")) or "base").name or "base")
    w.add_context_length(int(c.max_position_embeddings))
    w.add_embedding_length(int(hidden))
    w.add_block_count(int(c.num_hidden_layers))
    w.add_feed_forward_length(int(c.intermediate_size))
    w.add_head_count(int(heads))
    w.add_head_count_kv(int(kv))
    w.add_key_length(int(head_dim))
    w.add_value_length(int(head_dim))
    w.add_rope_dimension_count(int(head_dim))
    w.add_rope_freq_base(_rope_theta(c))
    w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    w.add_vocab_size(int(n_vocab))
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if file_type == "f32"
                    else gguf.LlamaFileType.MOSTLY_F16)
    tokens, types, merges = _vocab(tokenizer, n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for key, ids in (("bos", tokenizer.bos_token_id), ("eos", tokenizer.eos_token_id),
                     ("pad", tokenizer.pad_token_id)):
        if ids is not None:
            getattr(w, f"add_{key}_token_id")(int(ids))
    w.add_add_bos_token(False)  # ktm adds what its tokenizer adds; llama.cpp is handed ids
    name = tensor_names(c, arch)
    tied = bool(getattr(c, "tie_word_embeddings", False))
    for key, value in state.items():
        if ".lora_" in key:  # the adapter's own weights (written to the adapter file)
            continue
        key = key.replace(".base_layer.", ".")  # a PEFT-wrapped module's own weight
        if tied and key == "lm_head.weight":
            continue  # llama.cpp reads the output layer from token_embd when output is absent
        target = name(key)
        if target is None:
            if key.endswith("rotary_emb.inv_freq"):
                continue
            raise KTMError(f"base weight {key!r} has no llama.cpp tensor name for the {arch!r} "
                           "architecture")
        heads_of = _heads_of(key, c) if arch in PAIRED_ROPE and key.endswith(".weight") else None
        if heads_of is not None:
            value = pair_rows(value, heads_of)
        # 1-D tensors (norms, biases) stay F32, as llama.cpp expects
        dtype = np.float16 if file_type == "f16" and value.dim() == 2 else np.float32
        w.add_tensor(target, _np(value, dtype))
    finish_writer(w)
