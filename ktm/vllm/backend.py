"""``backend="vllm"``: a loaded ktm model that prefills and decodes through vLLM.

The model keeps the tokenizer, the input-embedding table, the encoder and the prompt layout, so
prompts merge in torch as always; the LM runs in vLLM from an export (``ktm export --format
vllm``) written once into ``$KTM_CACHE/vllm/`` and reused, on an engine in this process, a server
started here, or a server the user names (``VLLMConfig.url``).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

from ktm.core.checkpoint import digest_weights, model_record
from ktm.errors import KTMError
from ktm.util.fileio import written_once
from ktm.vllm.export import FORMAT_VERSION, LORA_ROWS, MANIFEST, export_vllm, read_manifest
from ktm.vllm.install import check_vllm
from ktm.vllm.runtime import VLLMConfig, VLLMEngine, VLLMRuntime, VLLMServer


def export_key(model) -> str:
    """A fingerprint of what a vLLM export of ``model`` holds: its LoRA, encoder, layout, dtype
    and base (the cache folder it is exported into once)."""
    h = hashlib.sha256(json.dumps([FORMAT_VERSION, model_record(model), str(model.dtype)],
                                  sort_keys=True, default=str).encode())
    digest_weights(model, h)
    return h.hexdigest()[:20]


def export_dir(model) -> Path:
    """The cache folder of this model's vLLM export, written now if absent."""
    from ktm.core.base_model import cache_dir

    return written_once(cache_dir() / "vllm" / export_key(model), MANIFEST,
                        lambda dest: export_vllm(model, dest))


def make_runtime(model, config: VLLMConfig | None = None) -> VLLMRuntime:
    """A vLLM runtime for ``model`` (its export made or found first)."""
    config = config or VLLMConfig()
    if model.config.lora.scope == "merged":
        warnings.warn(f"vLLM serves this model's LM without its LoRA: {LORA_ROWS['merged']}; "
                      "torch and llama.cpp read it as trained (what it costs: "
                      "ktm.vllm.export.LORA_ROWS)", stacklevel=2)
    if config.url is None:
        check_vllm()  # the one-line install hint before any export work
    where = export_dir(model)
    if read_manifest(where)["dtype"] != str(model.dtype).removeprefix("torch."):
        raise KTMError(f"the vLLM export in {str(where)!r} is not in this model's dtype "
                       f"{model.dtype}: re-export")
    kind = VLLMServer if config.url is not None or config.server else VLLMEngine
    return kind(where, config, model.eos_ids, model.pad_id)
