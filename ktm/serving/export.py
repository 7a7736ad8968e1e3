"""``ktm export --format vllm|gguf DIR``: a ktm model handed to another engine, one config for
both formats (``ExportConfig``); the files each writes are in ``ktm.vllm.export`` and
``ktm.llamacpp.export``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ktm.core.base_model import parse_dtype
from ktm.core.config import DEFAULT_MODEL
from ktm.errors import KTMError

FORMATS = ("vllm", "gguf")
BASE_TYPES = ("f32", "f16")


@dataclass
class ExportConfig:
    format: str = field(default="vllm", metadata={"help": "export format", "choices": FORMATS})
    model: str = field(default=DEFAULT_MODEL, metadata={
        "help": "ktm checkpoint folder or shipped reader name (or a base model: an untrained "
                "mean-pooling merger)"})
    k: int | None = field(default=None, metadata={
        "help": "a base model's K (default 4); a checkpoint's K if given must match"})
    dtype: str = field(default="float32", metadata={
        "help": "vllm: weights and prompt_embeds dtype: float32 | bfloat16 | float16"})
    base_gguf: str | None = field(default=None, metadata={
        "help": "gguf: a GGUF file of the base model (default: the embedded model's own, else "
                "one written from the HF folder)"})
    write_base: bool = field(default=False, metadata={
        "help": "gguf: write the base as GGUF even for the embedded model (its dequantised "
                "weights, F32 or F16: the torch path's exact function)"})
    base_type: str = field(default="f32", metadata={
        "help": "gguf: the type of a written base GGUF", "choices": BASE_TYPES})
    fold_lora: bool = field(default=True, metadata={
        "help": "gguf: also write model.gguf, the base with the LoRA folded into its weights "
                "(see --fold-type), which the llama.cpp backend runs as fast as the plain base "
                "(off: base + adapter only)"})
    fold_type: str = field(default="auto", metadata={
        "help": "gguf: the type of a folded weight: auto (its own where 8 bits or more, else "
                "Q8_0), same, or a type (F32, F16, Q8_0, ...)"})

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise KTMError(f"format must be one of {FORMATS}, got {self.format!r}")
        if self.k is not None and self.k < 1:
            raise KTMError(f"k must be an integer >= 1, got {self.k}")
        if self.base_type not in BASE_TYPES:
            raise KTMError(f"base_type must be one of {BASE_TYPES}, got {self.base_type!r}")
        if self.format != "gguf" and (self.base_gguf or self.write_base):
            raise KTMError("--base-gguf and --write-base are options of --format gguf")
        if self.format != "gguf" and (not self.fold_lora or self.fold_type != "auto"):
            raise KTMError("--no-fold-lora and --fold-type are options of --format gguf")
        from ktm.llamacpp.fold import fold_type

        fold_type("F32", self.fold_type)  # a clear error for an unknown type, before any work
        parse_dtype(self.dtype)


def run_export(cfg: ExportConfig, out: str) -> dict:
    """``ktm export --format FORMAT DIR``."""
    from ktm.compressors.record import refuse_rewritten
    from ktm.model import load_any

    # the exported LM is served on the prompts clients send, never rewritten by a baseline
    refuse_rewritten(cfg.model, "an exported model", "ktm eval and ktm generate apply its method")
    if cfg.format == "gguf":
        from ktm.llamacpp.export import GGUFOptions, export_gguf
        from ktm.llamacpp.runtime import import_llama_cpp

        import_llama_cpp()  # before the model loads: the install hint comes first
        model = load_any(cfg.model, cfg.k, "cpu", "float32")
        manifest = export_gguf(model, out, source=cfg.model, opts=GGUFOptions(
            cfg.base_gguf, cfg.write_base, cfg.base_type, cfg.fold_lora, cfg.fold_type))
        print(f"wrote {out}: run it with\n  ktm generate --checkpoint {out} --backend llamacpp "
              "--prompt ...\n  ktm serve --model {out} --backend llamacpp".replace("{out}", out))
        return manifest
    from ktm.vllm.export import LM_DIR, export_vllm
    from ktm.vllm.install import server_command

    model = load_any(cfg.model, cfg.k, "cpu", cfg.dtype)
    manifest = export_vllm(model, out, source=cfg.model)
    cmd = server_command(str(Path(out) / LM_DIR), manifest["served_model_name"],
                         manifest["dtype"])
    print(f"wrote {out}: serve it with\n  python {' '.join(cmd[1:])}\nor run it with\n  "
          f"ktm generate --checkpoint {cfg.model} --backend vllm --prompt ...")
    return manifest
