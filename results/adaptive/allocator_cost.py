"""What planning a ratio costs: the allocator's time beside the merged prefill it plans.

For a reader and a prompt of N tokens (held-out code, as ids), each allocator lays the prompt out
at each ratio (``PromptEncoder.layout``: scores, then the water-filling); the uniform layout's time
is taken off, so what is left is the allocator's. The merged prefill of the same prompt at the
same ratio (encoder + LM forward) is timed alongside. Median of repeats, one thread.

    python results/adaptive/allocator_cost.py --checkpoint runs/adaptive/k8mix/checkpoint \\
        --tokens 2048 --out results/adaptive/allocator_cost.json
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--ratios", nargs="+", type=float, default=[2, 4])
    ap.add_argument("--allocators", nargs="+", default=["even", "rules", "surprisal", "lm"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from ktm.core.prompt import Segment
    from ktm.decode.generate import prefill
    from ktm.evaluation.readability import heldout_sets
    from ktm.model import KTMModel
    from ktm.util.fileio import write_json_atomic
    from ktm.util.provenance import git_revision, versions

    model = KTMModel.load(args.checkpoint)
    windows = heldout_sets(model.tokenizer, ("code",), 64, seed=3)["code"]
    ids = tuple(t for w in windows for t in w.context + w.target)[:args.tokens]
    own = model._config

    def timed(fn) -> float:
        fn()  # warm
        out = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    uniform = timed(lambda: model._prompt_encoder().layout([(Segment("", ids=ids),)]))
    rows = []
    for ratio in args.ratios:
        for alloc in args.allocators:
            model._config = dataclasses.replace(own, allocator=alloc)
            seg = (Segment("", ids=ids, ratio=ratio),)
            layout = timed(lambda seg=seg: model._prompt_encoder().layout([seg]))

            def merged_prefill(seg=seg):
                with torch.no_grad():
                    prefill(model, model.encode_prompts([seg]))

            whole = timed(merged_prefill)
            rows.append({"allocator": alloc, "ratio": ratio, "tokens": len(ids),
                         "allocator_s": layout - uniform, "uniform_layout_s": uniform,
                         "merged_prefill_s": whole,
                         "allocator_share": (layout - uniform) / whole,
                         "checkpoint": args.checkpoint, "repeats": args.repeats,
                         "threads": torch.get_num_threads(), "command": " ".join(sys.argv),
                         "versions": versions(), "git": git_revision()})
            print(f"{alloc} r={ratio:g}: allocator {1e3 * (layout - uniform):.1f} ms, merged "
                  f"prefill {1e3 * whole:.0f} ms ({(layout - uniform) / whole:.1%})", flush=True)
    model._config = own
    write_json_atomic(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
