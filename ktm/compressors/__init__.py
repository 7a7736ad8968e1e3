"""Compressor registry: a baseline is one file plus one line here."""

from __future__ import annotations

from typing import Any

from ktm.compressors.base import CompressionStats, Compressor, compress_examples
from ktm.compressors.bm25 import BM25Lines
from ktm.compressors.llmlingua import LLMLingua
from ktm.compressors.ltsc import LTSC
from ktm.compressors.mean_pool import MeanPool
from ktm.compressors.selective_context import SelectiveContext
from ktm.compressors.truncate import Truncate
from ktm.errors import KTMError

COMPRESSORS: dict[str, type[Compressor]] = {
    "mean_pool": MeanPool,
    "selective_context": SelectiveContext,
    "llmlingua": LLMLingua,
    "ltsc": LTSC,
    "truncate": Truncate,
    "bm25": BM25Lines,
}


def get_compressor(name: str, **kwargs: Any) -> Compressor:
    """Build the compressor registered as ``name`` with its keyword options."""
    if name not in COMPRESSORS:
        raise KTMError(f"unknown compressor {name!r}: expected one of {', '.join(COMPRESSORS)}")
    try:
        return COMPRESSORS[name](**kwargs)
    except TypeError as e:  # an option the method does not have
        raise KTMError(f"compressor {name!r}: bad options {sorted(kwargs)}: {e}") from e


__all__ = ["COMPRESSORS", "CompressionStats", "Compressor", "compress_examples",
           "get_compressor"]
