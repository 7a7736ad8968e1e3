"""The paper's efficiency table at its own scale, on one GPU: Qwen2.5-Coder-7B's shape with random
weights in bf16 (``ktm bench --shape``), plain against K=2 and K=4, interleaved in one run, plus
training throughput and MFU at Qwen2.5-0.5B's shape.

Each part is ``ktm.bench.bench.run_bench`` on one model built once, and writes its own rows
(``results/bench/gpu-*.json`` once copied back):

    prefill   time to first token at 1k, 4k and 16k input tokens, batch 1
    e2e       4k in, 128 out, batch 1: end to end, and the share of decode
    batch16   16 prompts of 4k tokens, 16 out each: requests per second
    compiled  4k in, 128 out, batch 1, each method decoded eager and compiled (ktm bench
              --compile off on: a static cache and CUDA graphs), interleaved
    batch16-compiled  batch16, each method decoded eager and compiled
    compiled-int8  compiled, decoded compiled with the model's own weights and with int8 ones
              (``--weights native int8``, ``ktm.core.int8``)
    compiled-packed  compiled, decoded compiled, one query reading its grouped KV heads in place
              on CUDA too (``ktm.decode.compiled.packed_gqa_attention``): against ``compiled``'s
              compiled rows, whether it pays there
    prefill-compiled  prefill at 1k, 4k and 16k, eager and compiled (``--compile off on``: the
              prefill compiled with dynamic shapes), K=4 as the shipped readers merge (two K=2
              levels at mlp_ratio 0.5)
    prefill-paper  the same at 4k and 16k with K=4 at the paper's width (one level, mlp_ratio
              2.0), its encoder frozen as served
    train     ktm bench --mode train at Qwen2.5-0.5B's shape: tokens/s and MFU, plain vs K=4
    train-compiled  train at 4k, eager and through the compiled LM body, K=4 as the shipped
              readers merge
    train-k4-batch32  K=4 alone, compiled, at a batch of 32 (as many LM positions as plain's 8)

and ``gpu-7b-kernel-time.json``: the wall time of a prefill against the GPU's time in kernels
(the rest is the host launching them), with the top kernels in ``gpu-profile.txt``.

    python results/device/gpu_bench.py OUT_DIR [--parts prefill e2e batch16 compiled profile train]

``--shape``, ``--train-shape``, ``--device`` and ``--dtype`` run the same script at another scale
(a dry run on the CPU with a small config.json checks it end to end before GPU time is spent).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from ktm.bench.bench import run_bench
from ktm.bench.config import BenchConfig
from ktm.bench.runners import load_model
from ktm.bench.tables import format_table
from ktm.decode import compiled
from ktm.util.fileio import write_json_atomic

SEVEN_B = BenchConfig(shape="qwen2.5-coder-7b", ks=(2, 4), device="cuda", dtype="bfloat16",
                      progress=False)
PARTS = {
    "prefill": replace(SEVEN_B, lengths=(1024, 4096, 16384), output_tokens=1, repeats=5),
    "e2e": replace(SEVEN_B, lengths=(4096,), output_tokens=128, repeats=3),
    "batch16": replace(SEVEN_B, lengths=(4096,), batch_sizes=(16,), output_tokens=16,
                       repeats=3),
    "compiled": replace(SEVEN_B, ks=(4,), lengths=(4096,), output_tokens=128, repeats=3,
                        compile=("off", "on")),
}
PARTS["batch16-compiled"] = replace(PARTS["batch16"], compile=("off", "on"))
PARTS["compiled-int8"] = replace(PARTS["compiled"], compile=("on",), weights=("native", "int8"))
PARTS["compiled-packed"] = replace(PARTS["compiled"], compile=("on",))
# parts whose compiled step reads grouped KV heads in place on CUDA too
# (``ktm.decode.compiled.PACKED_DEVICES``; by default the CPU only, where it was measured)
PACKED_ON_CUDA = {"compiled-packed"}
PARTS["prefill-compiled"] = replace(PARTS["prefill"], ks=(4,), mlp_ratios=(0.5,), inner_k=2,
                                    compile=("off", "on"))
PARTS["prefill-paper"] = replace(PARTS["prefill"], ks=(4,), lengths=(4096, 16384),
                                 compile=("off", "on"))
TRAIN = BenchConfig(mode="train", shape="qwen2.5-0.5b", ks=(4,), lengths=(1024, 4096),
                    batch_sizes=(8,), device="cuda", dtype="bfloat16", repeats=5,
                    progress=False)
TRAINS = {"train": TRAIN,
          "train-compiled": replace(TRAIN, lengths=(4096,), mlp_ratios=(0.5,), inner_k=2,
                                    compile=("off", "on"))}
# K=4 at the batch whose merged windows hold as many LM positions as plain's batch of 8 (the
# memory merging frees, spent on a bigger batch); plain does not fit there
TRAINS["train-k4-batch32"] = replace(TRAINS["train-compiled"], batch_sizes=(32,),
                                     compile=("on",), uncompressed=False)


def kernel_time(model, out: Path) -> list[dict]:
    """Where prefill time goes: for plain, K=2 and K=4 at 1k, 4k and 16k tokens, the wall time
    of a prefill to the first token (median of 3, no profiler) against the time the GPU spent in
    kernels during one profiled prefill; the rest is the host launching them. Also the top
    kernels of the K=4 and plain 4k prefills, as text in ``out``."""
    import statistics

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from ktm.bench.measure import infer_once, synthetic_text, word_pool
    from ktm.core.encoder import KTokenEncoder

    own, pool, rows, text = model.encoder, word_pool(model.tokenizer, 0), [], []
    with torch.device(model.device):
        encoders = {1: own, 2: KTokenEncoder(own.config.hidden_size, 2),
                    4: KTokenEncoder(own.config.hidden_size, 4)}
    prompts = {n: [model.tokenize(synthetic_text(model, n, n, pool), first=True)]
               for n in (1024, 4096, 16384)}
    walls = {}  # every wall time before any profiling: CUPTI, once attached, slows launches
    for n, ids in prompts.items():
        for k, enc in encoders.items():
            model.encoder = enc
            infer_once(model, ids, k > 1, 1)  # warm
            walls[n, k] = statistics.median(infer_once(model, ids, k > 1, 1)["ttft_s"]
                                            for _ in range(3))
    for n, ids in prompts.items():
        for k, enc in encoders.items():
            model.encoder, wall = enc, walls[n, k]
            # (a dry run on the CPU profiles the CPU: its kernel time then reads 0)
            with torch_profile(activities=[ProfilerActivity.CUDA if model.device.type == "cuda"
                                           else ProfilerActivity.CPU]) as prof:
                infer_once(model, ids, k > 1, 1)
            events = prof.key_averages()
            kernels = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e6
            rows.append({"method": "ktm" if k > 1 else "uncompressed", "k": k,
                         "input_tokens": n, "ttft_s": wall, "kernel_s": kernels,
                         "gpu_busy": kernels / wall})
            if n == 4096 and k in (1, 4):
                text += [f"## {'plain' if k == 1 else 'K=4'}: prefill of 4,096 tokens", "",
                         events.table(sort_by="self_device_time_total", row_limit=15), ""]
    model.encoder = own
    out.write_text("\n".join(text))
    return rows


def revision(recorded: str | None) -> dict:
    """A record's revision fields: ``KTM_SOURCE_REVISION``, where set, names the commit the tree
    was copied from (the device machine's copy may carry no .git, or a stale one), and the
    revision the copy itself gave is kept beside it."""
    source = os.environ.get("KTM_SOURCE_REVISION")
    return {"git": source, "git_as_recorded": recorded} if source else {"git": recorded}


def record(rows: list[dict], path: Path) -> None:
    """Write ``rows``, each with its ``revision`` fields."""
    for r in rows:
        r.update(revision(r.get("git")))
    write_json_atomic(path, rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--parts", nargs="+", default=[*PARTS, "profile", "train"])
    ap.add_argument("--shape", default=SEVEN_B.shape)
    ap.add_argument("--train-shape", default=TRAIN.shape)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    where = dict(device=args.device, dtype=args.dtype)
    seven_b = replace(SEVEN_B, shape=args.shape, **where)
    parts = {n: replace(c, shape=args.shape, **where) for n, c in PARTS.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    seven = [p for p in args.parts if p in PARTS or p == "profile"]
    if seven:
        model = load_model(seven_b)
        print(f"{args.shape} built in {time.perf_counter() - t0:.0f} s on {model.device}",
              flush=True)
        for name in seven:
            if name == "profile":
                rows = kernel_time(model, args.out / "gpu-profile.txt")
                record(rows, args.out / "gpu-7b-kernel-time.json")
                print("## kernel time\n" + "\n".join(
                    f"{r['method']} K={r['k']} {r['input_tokens']}: ttft {r['ttft_s']:.4f} s, "
                    f"kernels {r['kernel_s']:.4f} s ({r['gpu_busy']:.0%})" for r in rows),
                    flush=True)
                continue
            devices = compiled.PACKED_DEVICES
            if name in PACKED_ON_CUDA:
                compiled.PACKED_DEVICES = (*devices, "cuda")
            try:
                rows = run_bench(parts[name], model)
            finally:
                packed, compiled.PACKED_DEVICES = compiled.PACKED_DEVICES, devices
            for r in rows:
                r["packed_gqa_devices"] = list(packed)
            record(rows, args.out / f"gpu-7b-{name}.json")
            print(f"## {name} ({time.perf_counter() - t0:.0f} s)\n{format_table(rows)}",
                  flush=True)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for name in (p for p in args.parts if p in TRAINS):
        rows = run_bench(replace(TRAINS[name], shape=args.train_shape, **where))
        record(rows, args.out / f"gpu-0.5b-{name}.json")
        print(f"## {name} ({time.perf_counter() - t0:.0f} s)\n{format_table(rows)}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
