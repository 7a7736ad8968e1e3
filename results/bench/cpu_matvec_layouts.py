"""What a CPU decode step's matvecs cost in other weight layouts and precisions: the slope past
the bound of ``cpu_decode_floor.py`` (issue 47's "compiled decode >= 2x eager" on the CPU).

A decode step of batch one runs one row through every linear layer of the LM: for SmolLM2-135M,
seven per layer over 30 layers and the tied head (538 MB of fp32 weights). This times that
row's matvecs alone, with random weights of the model's shapes, interleaved, in one process:

- ``fp32 linear``: ``F.linear`` on the [out, in] weight, as the eager and compiled steps run it;
- ``fp32 [in, out]``: the same product on the weight stored transposed (``x @ w_t``): the same
  precision, another summation order;
- ``bf16``: weights and the row in bf16 (the result back to fp32);
- ``int8``: weights in int8 with a bf16 scale per output row, the row in bf16
  (``torch.ops.aten._weight_int8pack_mm``, the kernel gpt-fast's int8 weight-only path calls).

    python results/bench/cpu_matvec_layouts.py --out results/bench/cpu_matvec_layouts.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import git_revision, versions

# SmolLM2-135M (hidden 576, 9 heads of 64, 3 KV heads, MLP 1,536, 30 layers, vocabulary 49,152)
HIDDEN, KV, MLP, LAYERS, VOCAB = 576, 192, 1536, 30, 49152
LAYER = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (MLP, HIDDEN),
         (MLP, HIDDEN), (HIDDEN, MLP)]  # (out, in): q, k, v, o, gate, up, down


def layouts(shapes: list[tuple[int, int]]) -> dict:
    """Each layout's call for weight ``j`` on a row of its input width."""
    torch.manual_seed(0)
    fp32 = [torch.randn(o, i) / i ** 0.5 for o, i in shapes]
    fp32_t = [w.t().contiguous() for w in fp32]
    bf16 = [w.to(torch.bfloat16) for w in fp32]
    scales = [w.abs().amax(1) / 127 for w in fp32]
    int8 = [torch.round(w / s[:, None]).to(torch.int8) for w, s in zip(fp32, scales)]
    scales = [s.to(torch.bfloat16) for s in scales]
    return {
        "fp32 linear": lambda j, x: F.linear(x, fp32[j]),
        "fp32 [in, out]": lambda j, x: x @ fp32_t[j],
        "bf16": lambda j, x: F.linear(x.to(torch.bfloat16), bf16[j]).float(),
        "int8": lambda j, x: torch.ops.aten._weight_int8pack_mm(
            x.to(torch.bfloat16), int8[j], scales[j]).float(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    shapes = LAYER * LAYERS + [(VOCAB, HIDDEN)]
    calls = layouts(shapes)
    xs = {n: torch.randn(1, n) for n in (HIDDEN, MLP)}
    ref = torch.cat([calls["fp32 linear"](j, xs[i]) for j, (_, i) in enumerate(shapes)], 1)
    out = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        times: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(args.repeats):  # interleaved: every layout once per repeat
            for name, call in calls.items():
                t0 = time.perf_counter()
                for j, (_, i) in enumerate(shapes):
                    call(j, xs[i])
                times[name].append(time.perf_counter() - t0)
        base = statistics.median(times["fp32 linear"][2:])
        for name, call in calls.items():
            got = torch.cat([call(j, xs[i]) for j, (_, i) in enumerate(shapes)], 1)
            step = statistics.median(times[name][2:])
            out.append({"layout": name, "threads": threads, "matvecs_s": step,
                        "speedup": base / step, "each_s": times[name],
                        "max_rel_err": float((got - ref).abs().max() / ref.abs().max())})
            print(out[-1]["layout"], threads, f"{step * 1e3:.1f} ms", f"{base / step:.2f}x",
                  flush=True)
    write_json_atomic(args.out, {
        "rows": out, "weights": len(shapes),
        "weight_bytes_fp32": sum(o * i * 4 for o, i in shapes),
        "config": vars(args), "command": " ".join(sys.argv), "versions": versions(),
        "git": git_revision(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return 0


if __name__ == "__main__":
    sys.exit(main())
