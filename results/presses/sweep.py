"""KV presses beside ktm at equal KV: continuation R and recall R on held-out text.

Every reading is scored on one scale: the plain and context-free references (R's denominator)
are the base model's (``--base``, LoRA off), never pressed. Readings:

    press NAME at RATIO        the base model, the context read plain, its KV pressed
    reader READER              a ktm reader, the context merged (KV: 1/K of the positions)
    reader READER + press      stacked: the merged positions' KV pressed
    reader READER at RATIO     allocated: each block of the context at its own level, the
                               positions spent by an allocator (``--allocators``; ``lm`` and
                               ``attention`` are oracles that read the context plain first)
    reader READER at RATIO + press   the allocated reading's merged positions pressed
                               (``--stack-allocated``)

One JSON row per (reading, context length), with R, recall R, their intervals, the share of the
plain prompt's positions whose KV the reading keeps (``kv_kept``), the CPU seconds it took, and
the configuration, versions and revision. Rows are written as they come (a killed run keeps
what it finished; ``--resume`` skips what the file already holds).

    python results/presses/sweep.py --contexts 256 1024 --sets code stdlib --n 24 \\
        --presses expected_attention keydiff snapkv streaming_llm tova knorm \\
        --ratios 0.5 0.75 0.875 --readers smollm2-135m-k2-seq smollm2-135m-k4-seq \\
        --stack expected_attention=0.5 --out results/presses/heldout.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ktm.core.checkpoint import model_record
from ktm.decode.press import PressConfig
from ktm.evaluation.readability import BOOTSTRAP, heldout_readability
from ktm.model import KTMModel
from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import git_revision, versions


def readings(args) -> list[dict]:
    out = [{"kind": "press", "model": args.base, "press": p, "ratio": r}
           for r in args.ratios for p in args.presses]
    for reader in args.readers:
        out.append({"kind": "reader", "model": reader, "press": None, "ratio": None})
        for spec in args.stack:
            press = PressConfig.parse(spec)
            out.append({"kind": "stacked", "model": reader, "press": press.name,
                        "ratio": press.ratio})
        for r in args.reader_ratios:
            for a in args.allocators:
                out.append({"kind": "allocated", "model": reader, "press": None, "ratio": r,
                            "allocator": a})
                for spec in args.stack_allocated:  # stacked on the allocated reading
                    press = PressConfig.parse(spec)
                    out.append({"kind": "allocated", "model": reader, "press": press.name,
                                "ratio": r, "allocator": a, "press_ratio": press.ratio})
    return out


def key(row: dict) -> tuple:
    return (row["kind"], row["model"], row["press"], row["ratio"], row["context_tokens"],
            row.get("allocator"), row.get("press_ratio"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="smollm2-135m")
    ap.add_argument("--contexts", nargs="+", type=int, default=[256, 1024])
    ap.add_argument("--sets", nargs="+", default=["code", "stdlib"])
    ap.add_argument("--n", type=int, default=24, help="held-out windows per set")
    ap.add_argument("--presses", nargs="*", default=[])
    ap.add_argument("--ratios", nargs="*", type=float, default=[0.5, 0.75, 0.875])
    ap.add_argument("--readers", nargs="*", default=[])
    ap.add_argument("--stack", nargs="*", default=[], metavar="PRESS=RATIO")
    ap.add_argument("--reader-ratios", nargs="*", type=float, default=[],
                    help="also read each reader at these ratios (tokens per position)")
    ap.add_argument("--allocators", nargs="*", default=["even"],
                    help="the allocators of the --reader-ratios readings")
    ap.add_argument("--stack-allocated", nargs="*", default=[], metavar="PRESS=RATIO",
                    help="also press each --reader-ratios reading's merged positions")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = json.loads(Path(args.out).read_text()) if args.resume and Path(args.out).exists() \
        else []
    done = {key(r) for r in rows}
    base = KTMModel.from_base(args.base, k=1).requires_grad_(False)
    base.peft.disable_adapter_layers()
    windows: dict = {}
    plain: dict = {}  # the base model's plain and context-free NLLs, read once
    models = {args.base: base}
    for ctx in args.contexts:
        for what in readings(args):
            if key({**what, "context_tokens": ctx}) in done:
                continue
            name, allocated = what["model"], what["kind"] == "allocated"
            held = (name, what["ratio"], what["allocator"]) if allocated else name
            if held not in models:
                models[held] = (KTMModel.load(name, ratio=what["ratio"],
                                              allocator=what["allocator"]) if allocated
                                else KTMModel.load(name))
            model = models[held]
            model.use_press(what["press"], what.get("press_ratio", 0.0) if allocated
                            else what["ratio"] or 0.0)
            t0 = time.process_time()
            sets = heldout_readability(model, args.sets, args.n, _cache=windows,
                                       plain_cache=plain, context_tokens=ctx,
                                       merge=what["kind"] in ("reader", "stacked",
                                                              "allocated"),
                                       reference=base)
            model.use_press(None)
            rows.append({**what, "context_tokens": ctx, "sets": sets,
                         "cpu_s": time.process_time() - t0, "n_windows": args.n,
                         "ci_bootstrap": BOOTSTRAP, "reference": args.base,
                         "model_config": model_record(model), "command": " ".join(sys.argv),
                         "versions": versions(), "git": git_revision()})
            write_json_atomic(args.out, rows)
            print(ctx, what["kind"], name, what["press"], what["ratio"], what.get("allocator"),
                  {n: (round(r["R"] or 0, 3), round(r["R_recall"] or 0, 3),
                       round(r["kv_kept"], 3)) for n, r in sets.items()}, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
