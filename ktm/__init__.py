"""ktm: K-Token Merging — compress long prompts in the latent embedding space.

The public names load on first use, so ``import ktm`` (and ``ktm report --help``) does not
import torch.
"""

from __future__ import annotations

import sys
import types
from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "CompressedPrompt": "ktm.batch", "EncoderConfig": "ktm.encoder",
    "GenerationConfig": "ktm.generate", "KTMConfig": "ktm.config", "KTMError": "ktm.errors",
    "KTMModel": "ktm.model", "KTokenEncoder": "ktm.encoder", "LoraSettings": "ktm.config",
    "Segment": "ktm.prompt", "TrainConfig": "ktm.train_config", "train": "ktm.train",
    "PretrainConfig": "ktm.pretrain", "pretrain": "ktm.pretrain",
}
# functions named like the submodule that defines them
_SHADOWED = ("train", "pretrain")
__all__ = [*sorted(_EXPORTS), "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ktm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


class _Package(types.ModuleType):
    """``ktm.train`` and ``ktm.pretrain`` are the functions, even once the submodules of the same
    names are imported (the import system would bind the module there)."""

    def __getattribute__(self, name: str):
        value = super().__getattribute__(name)
        if name in _SHADOWED and isinstance(value, types.ModuleType):
            return getattr(value, name)
        return value


sys.modules[__name__].__class__ = _Package
