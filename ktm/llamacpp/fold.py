"""A base GGUF with a LoRA adapter folded into its weights: ``W + (alpha / r) B A``, stored in
``W``'s own number type (a Q4_1 base stays Q4_1), so llama.cpp runs it with no adapter.

Why: llama.cpp applies an attached adapter as two extra matrix products per adapted weight at
every step. On a small model decoding one token at a time those extra graph nodes cost about a
quarter of the step (``results/bench/llamacpp_fold.json``); a folded model runs as fast as the
plain base. A quantized weight is dequantized, added to and quantized again with the ``gguf``
package's own quantizers, which round to the nearest level per block as llama.cpp's do, so the
folded weight differs from the exact sum by at most the type's rounding step (readability with
the folded Q4_1 base: ``results/readers/k4s2_readability_llamacpp_folded.json``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ktm.errors import KTMError
from ktm.llamacpp.gguf_files import finish_writer, gguf_module

# number types a weight is folded into and written back in (the gguf package quantizes these)
FOLDABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def fold_adapter(base: Path, out: Path, adapter: dict[str, np.ndarray], alpha: float) -> dict:
    """Write ``base`` with ``adapter`` (``NAME.lora_a`` / ``NAME.lora_b`` by gguf name, as
    ``gguf_files.lora_tensors`` gives them) folded in, to ``out``. Returns what was folded:
    the weights and the number types they kept. Raises ``KTMError`` for an adapter weight the
    base lacks or holds in a type the ``gguf`` package cannot quantize."""
    gguf = gguf_module()
    reader = gguf.GGUFReader(str(base))
    arch = reader.get_field("general.architecture")
    if arch is None:
        raise KTMError(f"{str(base)!r} has no general.architecture: expected a GGUF base model")
    pairs = {name.removesuffix(".lora_a") for name in adapter if name.endswith(".lora_a")}
    have = {t.name for t in reader.tensors}
    missing = sorted(p for p in pairs if p not in have)
    if missing:
        raise KTMError(f"the base GGUF {str(base)!r} lacks the adapted weights {missing[:3]}: "
                       "expected the base this adapter was exported for")
    writer = gguf.GGUFWriter(str(out), arch.contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer writes these itself
        kinds = [gguf.GGUFValueType(t) for t in field.types]
        writer.add_key_value(key, field.contents(), kinds[0],
                             sub_type=kinds[-1] if kinds[0] == gguf.GGUFValueType.ARRAY else None)
    folded = {}
    for t in reader.tensors:
        if t.name not in pairs:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
            continue
        kind = t.tensor_type.name
        if kind not in FOLDABLE:
            raise KTMError(f"base weight {t.name!r} is of type {kind}, which this export cannot "
                           f"quantize again after folding (it can: {', '.join(FOLDABLE)}); "
                           "export without folding (--no-fold-lora)")
        w = gguf.quants.dequantize(np.array(t.data), t.tensor_type).astype(np.float32)
        a, b = adapter[f"{t.name}.lora_a"], adapter[f"{t.name}.lora_b"]
        if a.ndim != 2 or b.shape != (w.shape[0], a.shape[0]) or a.shape[1] != w.shape[1]:
            raise KTMError(f"the adapter of {t.name!r} has lora_a {a.shape} and lora_b "
                           f"{b.shape}, which do not fit the base weight {w.shape}: expected "
                           "the base this adapter was exported for")
        delta = (alpha / a.shape[0]) * (b.astype(np.float32) @ a.astype(np.float32))
        data = gguf.quants.quantize(w + delta, t.tensor_type)
        writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
        folded[t.name] = kind
    finish_writer(writer)
    return folded

