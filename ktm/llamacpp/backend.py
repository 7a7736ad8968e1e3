"""``backend="llamacpp"``: a loaded ktm model that prefills and decodes through llama.cpp.

The model keeps everything else (tokenizer, input-embedding table, encoder, the prompt layout),
so ``generate``, ``stream``, ``ktm serve`` and sampling work as on the torch path; only the LM's
two calls in the decode loop go to llama.cpp (``ktm.llamacpp.runtime``). The GGUF files come from
an export (``ktm export --format gguf``): the checkpoint folder itself when it is one, a folder
given as ``gguf``, or else one written once into ``$KTM_CACHE/gguf/`` and reused.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ktm.llamacpp.export import MANIFEST, export_files, export_gguf, export_key, read_manifest
from ktm.llamacpp.runtime import LlamaCppRuntime, RuntimeConfig, import_llama_cpp
from ktm.util.fileio import written_once


def export_dir(model, source: str | Path | None, gguf: str | Path | None) -> Path:
    """Where ``model``'s GGUF export is: ``gguf``, else ``source`` if it is an export, else the
    cache folder of this model's fingerprint (written now if absent)."""
    if gguf is not None:
        return Path(gguf)
    if source is not None and (Path(source) / MANIFEST).is_file():
        return Path(source)
    from ktm.core.base_model import cache_dir

    def export(dest: Path) -> dict:
        # once per model and machine; the progress bars that follow are its steps
        print(f"ktm: exporting the model for llama.cpp once, into {dest.parent}",
              file=sys.stderr, flush=True)
        return export_gguf(model, dest)

    return written_once(cache_dir() / "gguf" / export_key(model), MANIFEST, export)


def attach(model, source: str | Path | None = None, gguf: str | Path | None = None,
           config: RuntimeConfig | None = None) -> LlamaCppRuntime:
    """A llama.cpp runtime for ``model`` (``KTMModel.use_backend`` makes it its runtime);
    ``source``: the checkpoint folder it was loaded from, if any."""
    import_llama_cpp()  # the one-line install hint before any export work
    if model.config.spread_positions:
        from ktm.llamacpp.export import check_exportable

        check_exportable(model)  # the error that names the reader to use instead
    where = export_dir(model, source, gguf)
    base, adapter = export_files(where, model)
    folded = read_manifest(where).get("model_gguf")
    runtime = LlamaCppRuntime(base, adapter, config or RuntimeConfig(),
                              gated=model.config.lora.scope == "merged")
    # what a result row records of the runtime: whether the LoRA is folded in, and into what
    runtime.files["folded_types"] = None if folded is None else folded["types"]
    return runtime
