"""The prefill of a reader whose LoRA adapts its merged rows only, three ways, interleaved in one
process on one thread: the base LM alone (no adapter, the floor), PEFT's LoRA layers with the
gate's hook (the adapter on every row, multiplied away on the plain ones) and the LM switched by
row (``ktm.core.lora_fold.rows_view``: the LoRA folded in at the merged rows, the base weight at
the plain ones).

    python results/bench/row_switch.py --positions 256 2048 --out results/bench/row_switch.json

The rows: each of ``--positions`` random embeddings, the last ``--plain`` of them plain (a
question after a merged document). One JSON row per (positions, way): the median seconds of
``--reps`` forwards, its ratio to the base LM's, and the largest logit difference of the two
adapted ways.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ktm.model import KTMModel
from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import git_revision, versions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reader", default="smollm2-135m-k4-qa")
    ap.add_argument("--positions", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--plain", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = KTMModel.load(args.reader)
    rows = []
    for n in args.positions:
        rows += timed(model, n, args.plain, args.reps)
    write_json_atomic(args.out, {
        "rows": rows,
        "config": {"reader": args.reader, "positions": args.positions, "plain": args.plain,
                   "reps": args.reps, "threads": 1, "dtype": "float32"},
        "versions": versions(), "git": git_revision()})


def timed(model, n: int, plain: int, reps: int) -> list[dict]:
    """The three ways at ``n`` positions, the last ``plain`` plain, interleaved."""
    width = model.peft.get_base_model().config.hidden_size
    embeds = torch.randn(1, n, width) * 0.02
    mask = torch.ones(1, n, dtype=torch.long)
    pos = torch.arange(n)[None]
    gate = torch.zeros(1, n, dtype=torch.bool)
    gate[:, : n - plain] = True
    base = model.decode_lm()  # the base LM's view: what a plain row reads through
    ways = {"base LM": dict(via=base), "gated PEFT": dict(gate=gate),
            "switched by row": dict(gate=gate, via=base)}
    seconds: dict[str, list[float]] = {w: [] for w in ways}
    logits = {}
    with torch.no_grad():
        for rep in range(reps + 1):  # the first round warms every way
            for way, kw in ways.items():
                t0 = time.perf_counter()
                out = model.lm(embeds, mask, pos, keep=plain + 1, **kw)
                if rep:
                    seconds[way].append(time.perf_counter() - t0)
                logits[way] = out
    floor = statistics.median(seconds["base LM"])
    diff = float((logits["gated PEFT"] - logits["switched by row"]).abs().max())
    rows = [{"positions": n, "plain": plain, "way": w, "seconds": statistics.median(s),
             "of_base": statistics.median(s) / floor, "all_s": s, "max_logit_diff": diff}
            for w, s in seconds.items()]
    for r in rows:
        print(f"{n} positions, {r['way']}: {r['seconds']:.2f} s, {r['of_base']:.2f} x",
              flush=True)
    return rows


if __name__ == "__main__":
    main()
