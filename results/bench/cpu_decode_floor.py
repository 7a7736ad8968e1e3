"""How far a CPU decode step is from its memory-bandwidth floor: the bound on what any compiled
decode can gain over eager on this machine (issue 47's "compiled decode >= 2x eager").

A decode step of batch one must read every weight of the LM once, and the keys and values of
every cached position. On one core this script measures, in one process:

- the eager step (torch runtime, ``--compile off``), plain and K=4 over a 2,048-token prompt,
  its time split by op (torch.profiler: the difference between a 41-token and a 1-token
  generation, per step);
- the floor: the time to read every weight once (a sum over each, which streams it at the
  machine's read bandwidth) plus the cache's bytes at that bandwidth;
- the bound: eager step / floor, which no compiled step can beat;
- the step's matvecs alone (one row through every linear layer), eager against inductor's
  compiled code with frozen, prepacked weights: what a compiled step gains where most of its
  time goes.

    python results/bench/cpu_decode_floor.py --out results/bench/cpu_decode_floor.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ktm import Segment
from ktm.decode.generate import generate_ids
from ktm.model import KTMModel
from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import git_revision, versions

STEPS = 40


def weights_read_s(model, repeats: int = 5) -> tuple[float, int]:
    """Seconds to read every weight of the LM once (median of ``repeats``), and their bytes."""
    weights = list((model.decode_lm() or model.peft).parameters())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for w in weights:
            w.sum()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), sum(w.numel() * w.element_size() for w in weights)


def matvecs_s(model, freezing: bool, repeats: int = 20) -> float:
    """Seconds for one row through every linear layer of the decoding LM (a step's matvecs),
    eager or compiled by inductor with ``freezing`` (its prepacked CPU weights)."""
    lm = model.decode_lm() or model.peft
    linears = [m for m in lm.modules() if isinstance(m, torch.nn.Linear)]
    xs = {m.in_features: torch.randn(1, m.in_features, dtype=model.dtype) for m in linears}

    def run():
        return [m(xs[m.in_features]) for m in linears]

    fn = torch.compile(run, options={"freezing": True}) if freezing else run
    with torch.no_grad():
        fn()
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_split(model, prompt) -> dict:
    """The eager decode step's wall time and its time by op, per step."""
    generate_ids(model, [prompt], max_new_tokens=2)  # warm
    tables = {}
    for n in (1, STEPS + 1):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            generate_ids(model, [prompt], max_new_tokens=n)
            wall = time.perf_counter() - t0
        tables[n] = ({e.key: e.self_cpu_time_total for e in prof.key_averages()}, wall)
    (few, few_wall), (many, many_wall) = tables[1], tables[STEPS + 1]
    per_op = {k: (many[k] - few.get(k, 0.0)) / STEPS / 1e6 for k in many}
    top = dict(sorted(per_op.items(), key=lambda kv: -kv[1])[:8])
    return {"step_s": (many_wall - few_wall) / STEPS, "by_op_s": top}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    text = Path(__file__).resolve().parents[2].joinpath("ktm", "model.py").read_text() * 4
    for name, k in (("smollm2-135m", 1), ("smollm2-135m-k4-seq", 4)):
        model = (KTMModel.from_base(name, k=1) if k == 1 else KTMModel.load(name))
        model.requires_grad_(False)
        ids = model.tokenize(text, first=True)[:args.context]
        prompt = (Segment(model.tokenizer.decode(ids), compress=k > 1),)
        split = step_split(model, prompt)
        read_s, weight_bytes = weights_read_s(model)
        cfg = model.lm_config
        positions = args.context // k + 1
        kv_bytes = (2 * cfg.num_hidden_layers * cfg.num_key_value_heads
                    * (cfg.hidden_size // cfg.num_attention_heads) * positions
                    * model.dtype.itemsize)
        floor_s = read_s * (1 + kv_bytes / weight_bytes)
        eager_mv, frozen_mv = matvecs_s(model, False), matvecs_s(model, True)
        rows.append({"model": name, "k": k, "context_tokens": args.context,
                     "cache_positions": positions, **split,
                     "weight_bytes": weight_bytes, "weights_read_s": read_s,
                     "read_gb_per_s": weight_bytes / read_s / 1e9, "kv_bytes": kv_bytes,
                     "floor_s": floor_s, "bound": split["step_s"] / floor_s,
                     "matvecs_eager_s": eager_mv, "matvecs_compiled_frozen_s": frozen_mv,
                     "dtype": str(model.dtype).removeprefix("torch."),
                     "threads": args.threads})
        print({k2: (round(v, 4) if isinstance(v, float) else v) for k2, v in rows[-1].items()},
              flush=True)
    write_json_atomic(args.out, {"rows": rows, "command": " ".join(sys.argv),
                                 "versions": versions(), "git": git_revision()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
