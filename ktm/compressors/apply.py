"""Running a baseline under ``ktm train`` / ``ktm eval``: one call between loading and training.

    applied = apply_compressor("selective_context", {"ratio": 0.5}, model, train_set, eval_set)
    model, train_set, eval_set, info, compressor = applied

``apply_compressor`` puts the model in the setting the method needs (hard methods: K=1 without
MLP, i.e. the plain LM + LoRA; mean pooling: no MLP), fits the method on the training prompts
(or restores its state from a checkpoint) and rewrites both example sets, timing the rewrite.
``finish_eval_row`` then corrects an evaluation result: ``length_reduction`` against the original
prompts, and the compression overhead ``compression_ms_per_1k_tokens`` (rewrite + merging time
per 1k *original* prompt tokens, the one denominator every method's overhead uses).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ktm.compressors import COMPRESSORS, get_compressor
from ktm.compressors.base import Compressor, compress_examples
from ktm.core.encoder import KTokenEncoder
from ktm.errors import KTMError
from ktm.tasks.base import Example

METHODS = tuple(COMPRESSORS)  # for argparse ``choices``


class Applied(NamedTuple):
    model: Any
    train_examples: list[Example]
    eval_examples: list[Example]
    info: dict[str, Any]  # JSON-plain: method, options, fit time, per-set CompressionStats
    compressor: Compressor


def configure_model(model, compressor: Compressor, replace_encoder: bool = True) -> bool:
    """Give ``model`` the encoder the method needs; True when the encoder was replaced.

    With ``replace_encoder=False`` (a trained checkpoint) a mismatch is an error rather than a
    silent loss of trained encoder weights.
    """
    cfg = model.encoder.config
    want = {"k": cfg.k, "use_mlp": cfg.use_mlp, **compressor.model_kwargs}
    if (want["k"], want["use_mlp"]) == (cfg.k, cfg.use_mlp):
        return False
    if not replace_encoder:
        raise KTMError(f"method {compressor.name!r} needs an encoder with K={want['k']}, "
                       f"use_mlp={want['use_mlp']}, but the checkpoint has K={cfg.k}, "
                       f"use_mlp={cfg.use_mlp}: evaluate a checkpoint trained with this method")
    model.encoder = KTokenEncoder(cfg.hidden_size, want["k"], cfg.mlp_ratio,
                                  want["use_mlp"]).to(model.device)  # fp32, as trained weights are
    return True


def apply_compressor(name: str, options: dict[str, Any], model,
                     train_examples: Sequence[Example], eval_examples: Sequence[Example], *,
                     state_dir: str | Path | None = None, replace_encoder: bool = True,
                     compress_train: bool = True, batch_size: int = 16) -> Applied:
    """Set up ``model`` for method ``name``, fit it, and compress both example sets.

    ``state_dir``: a checkpoint folder holding the method's fitted state (LTSC vocabulary and
    meta-token rows, written by ``Compressor.save_state``); when found it is restored instead of
    fitting.
    ``compress_train=False`` (evaluation): the training examples are only fitted on, and come
    back unchanged.
    """
    compressor = get_compressor(name, **options)
    replaced = configure_model(model, compressor, replace_encoder)
    model.applied_compressor = name  # its prompts are rewritten: generate need not warn
    t0 = time.perf_counter()
    restored = state_dir is not None and compressor.load_state(state_dir, model)
    if not restored:
        compressor.fit(train_examples, model)
    fit_s = time.perf_counter() - t0
    info: dict[str, Any] = {"method": name, "options": compressor.options(),
                            "encoder_replaced": replaced, "state_restored": restored,
                            "fit_s": fit_s}
    sets = {"train": list(train_examples), "eval": list(eval_examples)}
    for key, examples in sets.items():
        if compressor.rewrites_prompts and examples and (key == "eval" or compress_train):
            sets[key], stats = compress_examples(compressor, examples, batch_size)
            info[key] = stats.to_dict()
    return Applied(model, sets["train"], sets["eval"], info, compressor)


def finish_eval_row(result: dict[str, Any], examples: Sequence[Example],
                    info: dict[str, Any]) -> dict[str, Any]:
    """Measure ``result``'s length reduction against the original prompts; add the overhead.

    ``result`` is an ``evaluate_task`` dict on ``examples`` (the compressed ones): its
    ``tokens_after`` are the positions the LM read; ``tokens_before`` becomes the original
    prompt length from each example's meta (unchanged for mean pooling, which rewrites nothing).
    """
    out = dict(result)
    original = out["tokens_before"] * len(examples)  # unchanged for mean pooling
    if examples and all("tokens_before" in e.meta for e in examples):
        original = sum(e.meta["tokens_before"] for e in examples)
        out["tokens_before"] = original / len(examples)
        out["length_reduction"] = 1.0 - out["tokens_after"] / out["tokens_before"]
    # the overhead has one denominator, the original prompt tokens: the text rewrite's time
    # plus the (small) time of embedding / merging what is left
    seconds = info.get("eval", {}).get("seconds", 0.0) + out.get("compression_s", 0.0)
    out["compression_s"] = seconds
    out["compression_ms_per_1k_tokens"] = 1e6 * seconds / original if original else 0.0
    out["compressor"] = {k: v for k, v in info.items() if k not in ("train",)}
    return out

