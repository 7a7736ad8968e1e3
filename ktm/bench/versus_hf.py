"""ktm's decode against transformers' ``generate`` on the same base model (``ktm bench --mode hf``).

Every method reads the same prompt of exactly ``length`` token ids, uncompressed (no merging,
so the LM does the same work), greedy, ``output_tokens`` new tokens with no stop at EOS, KV cache
on, in the model's dtype on its device:

    hf        ``generate`` on a plain copy of the base model (``load_base``)
    ktm       ``ktm.decode.generate``'s prefill and decode loop, frozen as a loaded reader is:
              its LoRA folded into the weights (``ktm.core.lora_fold``)
    ktm-peft  the same through PEFT's LoRA layers (``fold_lora=False``), as a model in training

They run interleaved after warm-up (A B C, C B A, ...). ``decode_tokens_per_s`` counts the tokens
after the first one over the time after it, for ``generate`` too (a streamer stamps each token
as ``generate`` hands it out), so prefill is in ``ttft_s`` only. ``vs_hf_decode`` and
``vs_hf_e2e`` are medians of same-repeat ratios (>1: faster than ``generate``).
``same_tokens_as_hf``: greedy tokens equal ``generate``'s (a fresh LoRA is zero, so they should).
"""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm
from transformers.generation.streamers import BaseStreamer

from ktm.bench.measure import infer_once, interleave, synthetic_text, word_pool
from ktm.core.base_model import load_base, parse_dtype
from ktm.errors import KTMError
from ktm.util.provenance import git_revision, versions
from ktm.util.timing import clock


@dataclass(frozen=True)
class Contender:
    key: str  # "hf", "ktm" or "ktm-peft"


CONTENDERS = (Contender("hf"), Contender("ktm"), Contender("ktm-peft"))


class _Stamps(BaseStreamer):
    """The clock at each ``put``: ``generate`` puts the prompt first, then each new token."""

    def __init__(self, device: torch.device):
        self.device, self.times, self.tokens = device, [], []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(clock(self.device))
        self.tokens.append(value)

    def end(self) -> None:
        pass


@torch.inference_mode()
def hf_once(lm, rows: list[list[int]], output_tokens: int, pad_id: int) -> dict:
    """One batch through ``lm.generate`` (greedy, exactly ``output_tokens`` new tokens)."""
    dev = lm.device
    ids = torch.tensor(rows, dtype=torch.long, device=dev)
    stamps = _Stamps(dev)
    t0 = clock(dev)
    out = lm.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                      max_new_tokens=output_tokens, pad_token_id=pad_id, streamer=stamps)
    t_end = clock(dev)
    if out.shape[1] - ids.shape[1] != output_tokens:
        raise KTMError(f"generate returned {out.shape[1] - ids.shape[1]} new tokens, expected "
                       f"{output_tokens}: it stopped early (an end-of-sequence id left in "
                       "lm.generation_config?)")
    t_first, decoded, b = stamps.times[1], output_tokens - 1, len(rows)
    return {"ttft_s": t_first - t0, "decode_s": t_end - t_first, "e2e_s": t_end - t0,
            "decode_tokens_per_s": b * decoded / (t_end - t_first) if decoded else None,
            "tokens": out[:, ids.shape[1]:].tolist()}


def _ratios(xs: list[dict], base: list[dict], name: str, invert: bool) -> list[float]:
    return [(b[name] / x[name]) if invert else (x[name] / b[name]) for x, b in zip(xs, base)]


def run_hf_bench(config, load_model: Callable) -> list[dict]:
    """One row per (length, batch, contender). A checkpoint's ``generate`` runs on its base
    model, so only a fresh LoRA (a base model given) gives the same tokens. ``load_model``:
    ``ktm bench``'s loader (``config`` -> a frozen ``KTMModel``)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    model = load_model(config)  # frozen (infer): decoding folds its LoRA
    # a model of its own: switching one model's fold_lora back and forth would fold it again
    # in every "ktm" run
    peft = load_model(config)
    peft.fold_lora = False
    hf, _ = load_base(model.config.base_model, model.device, parse_dtype(config.dtype))
    # no EOS, so no stop and no ban on it (min_new_tokens bans it, changing the tokens): as
    # ktm's decode with stop_at_eos=False. Set on the model itself: generate fills options
    # left None from it
    hf.generation_config.eos_token_id = None
    pool = word_pool(model.tokenizer, config.seed)
    common = {"mode": "hf", "model": config.model, "device": str(model.device),
              "dtype": config.dtype, "threads": torch.get_num_threads(),
              "config": asdict(config), "versions": versions(), "git": git_revision()}
    bar = tqdm(total=len(config.lengths) * len(config.batch_sizes) * len(CONTENDERS)
               * (config.warmup + config.repeats), desc="bench hf", disable=not config.progress)
    rows = []
    try:
        for length in config.lengths:
            for batch in config.batch_sizes:
                seeds = [config.seed * 1_000_003 + length * 1009 + i for i in range(batch)]
                ids = [model.tokenize(synthetic_text(model, length, s, pool), first=True)
                       for s in seeds]

                def run(c: Contender, ids=ids) -> dict:
                    if c.key == "hf":
                        return hf_once(hf, ids, config.output_tokens, model.pad_id)
                    # no memory sampling thread: generate runs without one
                    return infer_once(model if c.key == "ktm" else peft, ids, False,
                                      config.output_tokens, sample_memory=False)

                runs = interleave(run, list(CONTENDERS), config.warmup, config.repeats,
                                  bar.update)
                base = runs["hf"]
                for c in CONTENDERS:
                    reps = runs[c.key]
                    row = {"method": c.key, "input_tokens": length, "batch": batch,
                           "output_tokens": config.output_tokens, "repeats": config.repeats,
                           "same_tokens_as_hf": all(r["tokens"] == b["tokens"]
                                                    for r, b in zip(reps, base)),
                           "per_repeat": {}}
                    for name in ("ttft_s", "decode_s", "e2e_s", "decode_tokens_per_s"):
                        row["per_repeat"][name] = [r[name] for r in reps]
                        row[name] = statistics.median(row["per_repeat"][name])
                    for name, key, invert in (("vs_hf_decode", "decode_tokens_per_s", False),
                                              ("vs_hf_e2e", "e2e_s", True)):
                        row["per_repeat"][name] = _ratios(reps, base, key, invert)
                        row[name] = statistics.median(row["per_repeat"][name])
                    rows.append({**row, **common})
    finally:
        bar.close()
    if not all(r["same_tokens_as_hf"] for r in rows):
        warnings.warn("bench hf: greedy tokens differ from generate's (a trained LoRA, or "
                      "rounding)", UserWarning, stacklevel=2)
    return rows
