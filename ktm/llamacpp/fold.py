"""A base GGUF with a LoRA adapter folded into its weights, ``W + (alpha / r) B A``, so llama.cpp
runs it with no adapter. A folded weight keeps its number type where that is 8 bits or more and
is stored as Q8_0 otherwise (``fold_type``).

Why: llama.cpp applies an attached adapter as two extra matrix products per adapted weight at
every step. A small model decoding one token at a time spends much of a step on graph nodes
rather than arithmetic, so those extra nodes slow it noticeably; a folded model has the plain
base's graph. A quantized weight is dequantized, added to and quantized again with the ``gguf``
package's own quantizers (block by block, as llama.cpp's reference quantizers do), so the
folded weight differs from the exact sum by at most the stored type's rounding step. Why not
back to Q4_1: results/README.md (the readers table, R on llama.cpp).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ktm.errors import KTMError
from ktm.llamacpp.gguf_files import finish_writer, gguf_module

# number types a weight is read from and folded into (the gguf package quantizes these)
FOLDABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# types a folded weight keeps; one of fewer bits is folded into Q8_0: a LoRA's change to a weight
# is mostly well under one Q4_1 step, so quantizing the sum to 4 bits again rounds it away and
# adds a new rounding error as large as the first
KEEPS = ("F32", "F16", "BF16", "Q8_0")


def fold_type(kind: str, want: str = "auto") -> str:
    """The type a weight of type ``kind`` is folded into: ``want``, or for "auto" its own type
    where that is in ``KEEPS`` and Q8_0 otherwise."""
    if want == "auto":
        return kind if kind in KEEPS else "Q8_0"
    if want == "same":
        return kind
    if want not in FOLDABLE:
        raise KTMError(f"fold type must be auto, same or one of {', '.join(FOLDABLE)}, got "
                       f"{want!r}")
    return want


def fold_adapter(base: Path, out: Path, adapter: dict[str, np.ndarray], alpha: float,
                 into: str = "auto") -> dict:
    """Write ``base`` with ``adapter`` (``NAME.lora_a`` / ``NAME.lora_b`` by gguf name, as
    ``gguf_files.lora_tensors`` gives them) folded in, to ``out``, each folded weight stored in
    ``fold_type(its type, into)``. Returns the folded weights and the types they were stored
    in. Raises ``KTMError`` for an adapter weight the base lacks or holds in a type the ``gguf``
    package cannot quantize."""
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
    fold_type("F32", into)  # a bad choice is an error before anything is read or written
    folded = {}
    # the one-time export of a reader (``KTMModel.load(..., backend="llamacpp")``): seconds
    for t in tqdm(reader.tensors, desc="fold the LoRA into the GGUF", unit="tensor"):
        if t.name not in pairs:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
            continue
        if t.tensor_type.name not in FOLDABLE:
            raise KTMError(f"base weight {t.name!r} is of type {t.tensor_type.name}, which this "
                           f"export cannot quantize again after folding (it can: "
                           f"{', '.join(FOLDABLE)}); export without folding (--no-fold-lora)")
        w = gguf.quants.dequantize(np.array(t.data), t.tensor_type).astype(np.float32)
        a, b = adapter[f"{t.name}.lora_a"], adapter[f"{t.name}.lora_b"]
        if a.ndim != 2 or b.shape != (w.shape[0], a.shape[0]) or a.shape[1] != w.shape[1]:
            raise KTMError(f"the adapter of {t.name!r} has lora_a {a.shape} and lora_b "
                           f"{b.shape}, which do not fit the base weight {w.shape}: expected "
                           "the base this adapter was exported for")
        delta = (alpha / a.shape[0]) * (b.astype(np.float32) @ a.astype(np.float32))
        kind = gguf.GGMLQuantizationType[fold_type(t.tensor_type.name, into)]
        data = gguf.quants.quantize(w + delta, kind)
        writer.add_tensor(t.name, data, raw_dtype=kind)
        folded[t.name] = kind.name
    finish_writer(writer)
    return folded

