"""Where a training step's time goes at Qwen2.5-0.5B's shape (bf16, 8 x 4,096 tokens, the LM
body compiled as ``ktm bench --mode train --compile on`` runs it), plain and K=4 (two K=2
levels, MLP ratio 0.5):

- the wall time of a step (median of 5, interleaved, no profiler) against the time the GPU spent
  in kernels during one profiled step; the rest is the host (Python, launches, tokenizing);
- the forward in mixed precision where the LM is bf16 (``ktm.training.precision``), as every
  training step runs;
- the same with the LoRA's dropout off (``--lora-dropout 0``): dropout copies the input of every
  adapted projection;
- the top kernels of each profiled step, and where the host spends a step (cProfile), as text.

    python results/device/train_profile.py OUT_DIR   -> OUT_DIR/train-profile.{json,txt}
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from gpu_bench import revision  # beside this script (results/device)
from torch import nn

from ktm.bench.config import BenchConfig, Method
from ktm.bench.measure import synthetic_text, train_once, word_pool
from ktm.bench.runners import _encoders, _optimizers, load_model
from ktm.util.provenance import git_revision, versions

CONFIG = BenchConfig(mode="train", shape="qwen2.5-0.5b", ks=(4,), mlp_ratios=(0.5,), inner_k=2,
                     lengths=(4096,), batch_sizes=(8,), device="cuda", dtype="bfloat16")


def set_dropout(model, on: bool, kept: dict) -> None:
    """The LoRA dropout modules swapped for identities (off) or put back (on)."""
    for name, mod in model.peft.named_modules():
        drops = getattr(mod, "lora_dropout", None)
        if isinstance(drops, nn.ModuleDict):
            for key in list(drops):
                if on and (name, key) in kept:
                    drops[key] = kept[name, key]
                elif not on:
                    kept.setdefault((name, key), drops[key])
                    drops[key] = nn.Identity()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default=CONFIG.device)
    ap.add_argument("--dtype", default=CONFIG.dtype)
    ap.add_argument("--shape", default=CONFIG.shape, help="a shape name or an HF config.json")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    config = replace(CONFIG, device=args.device, dtype=args.dtype, shape=args.shape,
                     lengths=(args.length,),
                     batch_sizes=(args.batch,))
    args.out.mkdir(parents=True, exist_ok=True)
    model = load_model(config)
    methods = [Method("uncompressed"), Method("ktm", 4, 0.5)]
    encs = _encoders(model, methods, config.seed, config.inner_k, train=True)
    opts = _optimizers(model, methods, encs)
    pool = word_pool(model.tokenizer, 0)
    prompts = [synthetic_text(model, args.length, i, pool) for i in range(args.batch)]
    targets = [synthetic_text(model, 16, i + 1, pool, first=False) for i in range(args.batch)]
    kept: dict = {}

    def step(m: Method) -> dict:
        if m.key in encs:
            model.encoder = encs[m.key]
        return train_once(model, opts[m.key], prompts, targets, m.name != "uncompressed",
                          compile="on")

    variants = [(m, drop) for drop in (True, False) for m in methods]
    walls = {}
    for m, drop in variants:  # warm: compile each shape once
        set_dropout(model, drop, kept)
        step(m)
    for _ in range(args.repeats):
        for m, drop in variants:
            set_dropout(model, drop, kept)
            walls.setdefault((m.key, drop), []).append(step(m)["step_s"])
    rows, text = [], []
    for m, drop in variants:
        set_dropout(model, drop, kept)
        with torch_profile(activities=[ProfilerActivity.CUDA if model.device.type == "cuda"
                                       else ProfilerActivity.CPU]) as prof:
            step(m)
        events = prof.key_averages()
        kernels = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e6
        wall = statistics.median(walls[m.key, drop])
        rows.append({"method": m.name, "k": m.k, "lora_dropout": drop, "step_s": wall,
                     "step_s_each": walls[m.key, drop], "kernel_s": kernels,
                     "gpu_busy": kernels / wall,
                     "input_tokens_per_s": args.length * args.batch / wall})
        text += [f"## {m.key}, LoRA dropout {'on' if drop else 'off'}: one step, "
                 f"{args.batch} x {args.length}", "",
                 events.table(sort_by="self_device_time_total", row_limit=20), ""]
        print(rows[-1], flush=True)
    for m in methods:  # where the host's time goes: one step under cProfile, dropout on
        set_dropout(model, True, kept)
        prof = cProfile.Profile()
        prof.enable()
        step(m)
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(40)
        text += [f"## {m.key}: the host's step under cProfile", "", out.getvalue(), ""]
    record = {"rows": rows, "config": {**vars(args), "out": str(args.out), "bench": str(config)},
              "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "versions": versions(), **revision(git_revision()),
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (args.out / "train-profile.json").write_text(json.dumps(record, indent=1))
    (args.out / "train-profile.txt").write_text("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
