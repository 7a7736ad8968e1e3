"""``ktm export --format vllm DIR``: a ktm model as files vLLM and a small client can use.

    DIR/lm/                   HF folder: the base LM with LoRA merged in (PEFT
                              ``merge_and_unload``) and its tokenizer -> vLLM serves ``DIR/lm``;
                              for a LoRA of scope "merged" the base LM as it is (``LORA_ROWS``)
    DIR/encoder.safetensors   the K-token encoder
    DIR/context_lm/           only for an encoder reading the LM's first L layers
                              (``context_layers``): those layers of the base LM, adapter-free,
                              as an HF folder of an L-layer model of the same family
    DIR/ktm_export.json       K, encoder settings, sizes, where the input embeddings are, the
                              sha256 of the LM, tokenizer and encoder files, and the model name
                              to serve under

The LM reads merged prefixes as ``prompt_embeds``; ``ktm.vllm.client`` computes them from
the tokenizer, the LM's input-embedding table and the encoder (with ``context_layers``, also the
first L layers, run in the client: the served LM has the LoRA merged into them), and refuses a
server that does not serve this export (its served name carries the fingerprint of these exact
files).
"""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ktm.core.checkpoint import check_exportable, model_record, save_atomic
from ktm.core.levels import merges
from ktm.errors import KTMError
from ktm.util.fileio import check_apart, read_json_object, sha256_files, write_json_atomic
from ktm.util.provenance import git_revision, versions

MANIFEST = "ktm_export.json"
LM_DIR = "lm"
ENCODER = "encoder.safetensors"
CONTEXT_LM_DIR = "context_lm"
EMBEDDINGS = "input_embeddings.safetensors"  # only when the LM files do not hold the table
FORMAT_VERSION = 1
# what the client reads from the manifest (the rest is provenance, or optional with a default)
REQUIRED = ("k", "encoder", "merges", "plain_prefix", "base_model", "hidden_size", "vocab_size",
            "dtype", "embeddings", "sha256", "served_model_name")


def lm_files(lm_dir: Path) -> list[Path]:
    """The files that define the LM's computation: weights and config."""
    return sorted(lm_dir.glob("*.safetensors")) + [lm_dir / "config.json"]


def tokenizer_files(lm_dir: Path) -> list[Path]:
    """The files prompts are tokenized with (tokenizer.json, its config, vocabularies, chat
    template): everything in the LM folder but the LM's weights and configs."""
    lm = set(lm_files(lm_dir)) | {lm_dir / "generation_config.json"}
    return sorted(p for p in lm_dir.iterdir() if p.is_file() and p not in lm
                  and not p.name.endswith(".safetensors.index.json"))


def _find_tensor(lm_dir: Path, key: str) -> str | None:
    """The weights file of ``lm_dir`` that holds tensor ``key``, if any."""
    for path in sorted(lm_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            if key in f.keys():
                return path.name
    return None


def truncated_config(config, layers: int):
    """``config`` of an LM with only its first ``layers`` decoder layers: ``num_hidden_layers``
    and every per-layer list (``layer_types`` ...) cut to them."""
    n = config.num_hidden_layers
    d = config.to_dict()
    d = {k: v[:layers] if isinstance(v, list) and len(v) == n else v for k, v in d.items()}
    d["num_hidden_layers"] = layers
    return type(config).from_dict(d)


def _write_context_lm(model, tmp: Path) -> dict:
    """The base LM's first L layers, adapter-free, as an L-layer model of the same family: what
    a ``context_layers`` encoder reads (the served LM has the LoRA merged into those layers)."""
    from transformers import AutoModelForCausalLM

    source = model.encoder.states.source  # ktm.core.context_states.LayerStates
    layers = model.config.context_layers
    small = AutoModelForCausalLM.from_config(truncated_config(model.lm_config, layers))
    # the base's own weights: PEFT keeps them as ``<module>.base_layer`` beside its lora_ ones
    base = {k.replace(".base_layer.", "."): v
            for k, v in source.lm.state_dict().items() if "lora_" not in k}
    wanted = small.state_dict()
    missing = sorted(k for k in wanted if k not in base)
    if missing:
        raise KTMError(f"cannot copy the base LM's first {layers} layers for the client: "
                       f"{missing[:3]} not found in the base model's weights")
    small.to(model.dtype).load_state_dict({k: base[k] for k in wanted})
    small.save_pretrained(str(tmp / CONTEXT_LM_DIR), safe_serialization=True)
    return {"dir": CONTEXT_LM_DIR, "layers": layers, "sink_id": source.sink_id,
            "sha256": sha256_files(lm_files(tmp / CONTEXT_LM_DIR))}


# what the served LM reads each kind of row with, by the LoRA's scope. vLLM applies a weight, or
# an adapter, to every row of a request, so a LoRA of scope "merged" (``ktm.core.lora_scope``),
# which adapts the merged rows only, cannot be served as trained. Served without it, every plain
# row reads as trained (by the base LM) and the merged rows lose the adapter; served with it on
# every row, the plain rows would read through an adapter they were never read with. Measured on
# the question reader (20 needles in 1,024 tokens): 20 found without the adapter, 14 with it on
# every row, 20 as trained (results/question/vllm_reader.json).
LORA_ROWS = {"all": "every row reads the LoRA, merged into the weights",
             "merged": "no row reads the LoRA, the merged ones neither (it adapts merged rows "
                       "only, and vLLM applies a weight to every row of a request)"}


def served_lm(model) -> torch.nn.Module:
    """The LM vLLM serves for ``model``: a copy, with the LoRA merged in or, for a LoRA of
    scope "merged", without it (``LORA_ROWS``); the caller's model keeps its adapter."""
    peft = copy.deepcopy(model.peft)
    return peft.unload() if model.config.lora.scope == "merged" else peft.merge_and_unload()


def _write(model, tmp: Path) -> None:
    lm_dir = tmp / LM_DIR
    merged = served_lm(model)
    emb = merged.get_input_embeddings().weight
    key = next(n for n, p in merged.named_parameters() if p is emb)
    merged.save_pretrained(str(lm_dir), safe_serialization=True)
    model.tokenizer.save_pretrained(str(lm_dir))
    found = _find_tensor(lm_dir, key)
    if found is None:  # e.g. tied weights saved under the head's name only
        save_file({key: emb.detach().contiguous().cpu()}, str(tmp / EMBEDDINGS))
    embeddings = {"file": f"{LM_DIR}/{found}" if found else EMBEDDINGS, "key": key}
    enc = {k: v.detach().contiguous().cpu() for k, v in model.encoder.state_dict().items()}
    save_file(enc, str(tmp / ENCODER), metadata={"k": str(model.k)})
    lm_sha, enc_sha = sha256_files(lm_files(lm_dir)), sha256_files([tmp / ENCODER])
    context_lm = _write_context_lm(model, tmp) if model.config.context_layers else None
    fingerprint = hashlib.sha256((lm_sha + enc_sha).encode()).hexdigest()
    cfg = model_record(model)
    write_json_atomic(tmp / MANIFEST, {
        "format": "ktm-vllm", "format_version": FORMAT_VERSION, "k": model.k,
        "encoder": model.encoder.config.to_dict(), "merges": merges(model),
        "plain_prefix": model.config.plain_prefix, "plain_suffix": model.config.plain_suffix,
        "align_lines": model.config.align_lines,
        "model": cfg["config"],
        "base_model": model.config.base_model,
        "hidden_size": cfg["hidden_size"], "vocab_size": cfg["vocab_size"],
        # what the encoder and prompt_embeds are as wide as: OPT-350m's 512-wide embeddings are
        # projected to its 1024-wide hidden states inside the LM
        "embedding_size": emb.shape[1],
        "dtype": str(model.dtype).removeprefix("torch."), "embeddings": embeddings,
        "sha256": {"lm": lm_sha, "encoder": enc_sha,
                   "tokenizer": sha256_files(tokenizer_files(lm_dir))},
        "served_model_name": f"ktm-k{model.k}-{fingerprint[:12]}",
        "lora_rows": LORA_ROWS[model.config.lora.scope],
        **({"context_lm": context_lm} if context_lm else {}),
        "versions": versions(), "git": git_revision(),
    })


def _check_plain_lookup(model) -> None:
    """Refuse an LM whose embedding layer is more than a table lookup (Gemma's multiplies the
    rows by sqrt(hidden)): ktm merges what the layer returns, the client builds prompt_embeds
    from the table, and vLLM's handling differs by family (its Gemma and Gemma 2 multiply
    prompt_embeds by the scale, its Gemma 3 only embedded ids), so the served prefix would be
    at another scale than the one the model was trained on."""
    emb = model.input_embedding
    ids = torch.arange(min(8, emb.weight.shape[0]), device=emb.weight.device)
    looked_up, rows = emb(ids), emb.weight[ids]
    if not torch.equal(looked_up, rows):
        scale = float(looked_up.float().norm() / rows.float().norm())
        raise KTMError(f"the {model.lm_config.model_type!r} LM's embedding layer scales the table "
                       f"rows (x{scale:.2f}), and vLLM's handling of prompt_embeds for it differs "
                       "(Gemma and Gemma 2 scale them again, Gemma 3 scales only embedded ids "
                       "while the client sends unscaled rows): the served prefix would not be "
                       "the one the model was trained on; the vLLM export covers LMs whose "
                       "embedding layer is a plain lookup (serve this one with ktm serve)")


def export_vllm(model, out: str | Path, source: str | Path | None = None) -> dict:
    """Write ``model`` for vLLM into ``out`` (atomically); returns the manifest.

    ``source``: the checkpoint folder the model was loaded from, if any (``out`` must lie
    apart from it, as from the base model's folder). Needs memory for a second copy of the LM
    while LoRA is merged.
    """
    check_exportable(model, "vLLM")
    _check_plain_lookup(model)
    out = Path(out)
    check_apart(out, [model.config.base_model] + ([source] if source is not None else []))
    if out.exists() and not (out / MANIFEST).is_file():
        raise KTMError(f"{str(out)!r} exists and is not a ktm export: expected a new folder")
    with torch.no_grad():
        save_atomic(out, lambda tmp: _write(model, tmp))
    return read_manifest(out)


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    m = read_json_object(path, f"{str(directory)!r} is not a ktm vLLM export: {MANIFEST} is "
                               "missing (make one with: ktm export --format vllm DIR --model "
                               "CHECKPOINT)")
    if m.get("format") != "ktm-vllm" or m.get("format_version") != FORMAT_VERSION:
        raise KTMError(f"{str(path)!r} is not a ktm-vllm export of format version "
                       f"{FORMAT_VERSION} (found {m.get('format')!r} {m.get('format_version')!r})")
    missing = [key for key in REQUIRED if key not in m]
    if missing:
        raise KTMError(f"{str(path)!r} is corrupt: it lacks {missing}; re-export")
    for key in ("encoder", "embeddings", "sha256"):
        if not isinstance(m[key], dict):
            raise KTMError(f"{str(path)!r} is corrupt: {key!r} is {m[key]!r}, expected a JSON "
                           "object; re-export")
    return m
