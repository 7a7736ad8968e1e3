"""Efficiency benchmark: uncompressed vs K-token merging, interleaved in one run.

For every (input length, batch size) the methods run A B C A B C ... (order reversed on odd
repeats) after warm-up, so slow drifts of a shared machine hit every method alike. Speed-ups are
medians of per-repeat ratios against the uncompressed run of the *same* repeat. Peak memory
comes from one extra untimed run per method (see ``memory_pass``).

    infer: ids -> [encoder] -> prefill (KV cache filled) -> first token -> greedy decode
    train: LoRA training step (forward + backward + clip + AdamW) at a fixed input length

Prompts are synthetic text built from single-token words, so a prompt has exactly the requested
number of tokens (checked). Inference starts from token ids: tokenization is outside the timings.

    ktm bench --quick                       # about two minutes on 2 CPU cores
    ktm bench --lengths 2048 --ks 2 4       # the prefill speed-up targets
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections import Counter
from dataclasses import asdict

import torch
from tqdm.auto import tqdm

from ktm.bench.config import BenchConfig, Method, methods_of
from ktm.bench.measure import (
    interleave,
    synthetic_text,
    word_pool,
)
from ktm.bench.runners import (
    _encoders,
    _optimizers,
    _runner,
    bench_runtimes,
    load_model,
    memory_pass,
)
from ktm.bench.tables import format_table
from ktm.errors import KTMError
from ktm.util.fileio import check_writable, write_json_atomic
from ktm.util.provenance import git_revision, versions

PAIRED = {"prefill_s": "speedup_prefill", "ttft_s": "speedup_ttft", "e2e_s": "speedup_e2e",
          "step_s": "speedup_train"}


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    if xs and all(x == xs[0] for x in xs):
        return xs[0]  # counts such as compressed tokens stay ints
    return statistics.median(xs) if xs else None


def aggregate(runs: dict[str, list[dict]], baseline: str | None = "uncompressed") -> dict:
    """Per method key: medians over repeats, plus speed-ups paired by repeat index.

    ``runs[key][r]`` is repeat r of method ``key``; speed-up = median_r(base[r] / method[r]) on
    the times in PAIRED, so a slow moment of the machine cancels within its own pair.
    """
    base = runs.get(baseline) if baseline else None
    out = {}
    for key, reps in runs.items():
        row: dict = {"per_repeat": {}}
        for name in reps[0]:
            if name == "tokens":
                continue
            values = [r[name] for r in reps]
            row["per_repeat"][name] = values
            row[name] = _median(values)
        if "encoder_s" in row:
            row["encoder_share"] = _median([r["encoder_s"] / r["prefill_s"] for r in reps])
        for t, s in PAIRED.items():
            if t in reps[0] and base is not None:
                if len(base) != len(reps):
                    raise KTMError(f"{key} has {len(reps)} repeats, baseline {len(base)}")
                ratios = [b[t] / r[t] for b, r in zip(base, reps)]
                row["per_repeat"][s] = ratios
                row[s] = statistics.median(ratios)
            elif t in reps[0]:
                row[s] = None
        if base is not None and "kv_cache_bytes" in row:
            row["kv_ratio"] = row["kv_cache_bytes"] / _median([b["kv_cache_bytes"] for b in base])
        out[key] = row
    return out


# ---------------------------------------------------------------- the run


def _fit_lengths(config: BenchConfig, model) -> None:
    """Lengths beyond the model's context: left out (said so) where nobody chose them (a local
    model of a shorter context than the embedded one's), refused where given (--lengths)."""
    extra = config.output_tokens if config.mode == "infer" else config.target_tokens + 1
    limit = getattr(model.peft.get_base_model().config, "max_position_embeddings", None)
    fit = tuple(n for n in config.lengths if not limit or n + extra <= limit)
    if getattr(config, "lengths_unchosen", False) and fit and fit != config.lengths:
        warnings.warn(f"bench: lengths {[n for n in config.lengths if n not in fit]} left out: "
                      f"beyond the model's context of {limit} positions", UserWarning,
                      stacklevel=3)
        config.lengths = fit
    if limit and max(config.lengths) + extra > limit:
        raise KTMError(f"length {max(config.lengths)} + {extra} generated/target tokens exceeds "
                       f"the model's context of {limit} positions")


def _row(model, config: BenchConfig, m: Method, enc, runtimes: dict, length: int, batch: int,
         compiles: int, stats: dict, common: dict) -> dict:
    """One method's result row at (``length``, ``batch``)."""
    return {
        "method": m.name, "k": m.k, "mlp_ratio": m.mlp_ratio, "backend": m.backend,
        **({m.backend: runtimes[m.backend, m.name].record()} if m.backend != "torch" else {}),
        "encoder_params": sum(p.numel() for p in enc.parameters()) if enc else 0,
        "input_tokens": length, "batch": batch, "repeats": config.repeats,
        **({"output_tokens": config.output_tokens} if config.mode == "infer"
           else {"target_tokens": config.target_tokens + 1}),
        "ratio": m.ratio, "press": m.press,
        # graphs compiled for this point, its untimed passes included
        **({"compile": m.compile, "compiles": compiles, "weights": m.weights}
           if m.backend == "torch" else {}),
        # the model's own allocator lays out a ratio row (its config's)
        "allocator": model.config.allocator if m.ratio is not None else None,
        "expected_compressed_tokens": (math.ceil(length / m.k) if m.ratio is None
                                       else round(length / m.ratio)),
        **stats,
        **(utilisation(model, enc, batch, stats, config) if config.mode == "train" else {}),
        **common}


def run_bench(config: BenchConfig, model=None) -> list[dict]:
    """Run every (length, batch) with all methods interleaved; one result row per method.
    ``model``: one ``load_model(config)`` made before (several runs of one large model)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    model = load_model(config) if model is None else model
    _fit_lengths(config, model)
    methods = methods_of(config, model.k)
    runtimes = bench_runtimes(model, config)
    encs = _encoders(model, methods, config.seed, config.inner_k, config.mode == "train")
    opts = _optimizers(model, methods, encs) if config.mode == "train" else {}
    pool = word_pool(model.tokenizer, config.seed)
    common = {"mode": config.mode, "model": config.model, "device": str(model.device),
              **({"shape": config.shape, "random_weights": True} if config.shape else {}),
              **({"device_name": torch.cuda.get_device_name(model.device)}
                 if model.device.type == "cuda" else {}),
              "dtype": config.dtype, "threads": torch.get_num_threads(),
              "mem_kind": "cuda_max_allocated" if model.device.type == "cuda" else "rss",
              "config": asdict(config), "versions": versions(), "git": git_revision()}
    per_point = (config.warmup + config.repeats + 1) * len(methods)
    bar = tqdm(total=len(config.lengths) * len(config.batch_sizes) * per_point,
               desc=f"bench {config.mode}", disable=not config.progress)
    rows = []
    try:
        for length in config.lengths:
            for batch in config.batch_sizes:
                seeds = [config.seed * 1_000_003 + length * 1009 + i for i in range(batch)]
                prompts = [synthetic_text(model, length, s, pool) for s in seeds]
                targets = [synthetic_text(model, config.target_tokens, s + 1, pool, first=False)
                           for s in seeds]
                compiles = Counter()
                run = _runner(model, config, encs, opts, prompts, targets, runtimes, compiles)
                runs = interleave(run, methods, config.warmup, config.repeats, bar.update)
                stats = {}
                # speed-ups against the same runtime, uncompressed, compiled the same way
                for base in dict.fromkeys(m.baseline for m in methods):
                    stats.update(aggregate({m.key: runs[m.key] for m in methods
                                            if m.baseline == base},
                                           base if config.uncompressed else None))
                memory_pass(run, methods, stats)
                bar.update(len(methods))
                rows += [_row(model, config, m, encs.get(m.key), runtimes, length, batch,
                              compiles[m.key], stats[m.key], common) for m in methods]
    finally:
        bar.close()
        own = runtimes["torch", "ktm"]
        for rt in set(runtimes.values()) - {own}:  # vLLM's one engine serves two methods
            rt.close()
    return rows


def utilisation(model, encoder, batch: int, row: dict, config: BenchConfig) -> dict:
    """A train row's model FLOPs per step, their rate and MFU (``ktm.bench.flops``)."""
    from ktm.bench.flops import peak_tflops, train_step_flops

    merged = row["compressed_tokens"]
    targets = config.target_tokens + 1  # EOS
    flops = train_step_flops(model, encoder, batch, merged + targets, targets,
                             merged if encoder is not None else 0)
    peak, _ = peak_tflops(model.device, model.dtype)
    rate = flops / row["step_s"] / 1e12
    return {"model_flops_per_step": flops, "model_tflops_per_s": rate,
            "peak_tflops": peak, "mfu": rate / peak if peak else None}


def main_bench(config: BenchConfig) -> int:
    """Run, write the JSON rows atomically, print a table. A ``KTMError`` propagates: the CLI
    prints it as ``ktm: error: ...`` like every other command."""
    check_writable(config.out)  # refused now, not after the benchmark
    if config.mode == "serve":
        from ktm.bench.serve import run_serve_bench

        rows = run_serve_bench(config)
    elif config.mode == "hf":
        from ktm.bench.versus_hf import run_hf_bench

        rows = run_hf_bench(config, load_model)
    else:
        rows = run_bench(config)
    write_json_atomic(config.out, rows)
    print(format_table(rows))
    print(f"wrote {len(rows)} rows to {config.out}")
    return 0
