"""ktm: K-Token Merging — compress long prompts in the latent embedding space.

The public names load on first use, so ``import ktm`` (and ``ktm report --help``) does not
import torch. The layers, bottom up (``docs/design.md`` lists every module):

    errors, util/   the error type; atomic files, provenance, timing, field checks
    core/           prompt segments, tokens, the merging encoder, prefixes, LoRA, checkpoints,
                    base-model loading
    readers/        the shipped readers (pretrained K=2 / K=4 weights) and name resolution
    decode/         the one prefill + decode loop, continuous batching, text streaming
    model.py        KTMModel: building, loading, saving, forward, generate; RuntimeSpec: where
                    it runs (torch, llama.cpp, vLLM), declared once
    tasks/          the tasks, their data files and unlabeled text corpora
    compressors/    the baselines (mean pooling, SelectiveContext, LLMLingua, LTSC)
    evaluation/     evaluation, metrics, readability R, label scoring, reports and curves
    training/       the training loop, its state and config, processes, EMA, pretraining,
                    curriculum, teacher
    serving/        ``ktm serve``, the vLLM export and its client
    bench/          the efficiency benchmark
    cli/            the command line, built from the configs; the demo
"""

from __future__ import annotations

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "CompressedPrompt": "ktm.core.batch", "EncoderConfig": "ktm.core.encoder",
    "GenerationConfig": "ktm.decode.generate", "KTMConfig": "ktm.core.config",
    "KTMError": "ktm.errors", "KTMModel": "ktm.model", "KTokenEncoder": "ktm.core.encoder",
    "LoraSettings": "ktm.core.config", "Segment": "ktm.core.prompt",
    "TrainConfig": "ktm.training.config", "train": "ktm.training.train",
    "PretrainConfig": "ktm.training.pretrain", "pretrain": "ktm.training.pretrain",
    "chat_prompt": "ktm.serving.prompts",
}
__all__ = [*sorted(_EXPORTS), "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ktm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
