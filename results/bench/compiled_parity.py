"""The compiled decode step against eager on a real model: greedy tokens up to the first
near-tie and the largest logit difference, per reading (plain and merged); with
``--weights int8``, the compiled step reads int8 linear layers (``ktm.core.int8``) against the
eager run's own weights.

A random-text prompt of ``--length`` tokens (``ktm bench``'s synthetic text), decoded greedily
for ``--new-tokens`` with ``compile="off"`` and ``"on"``; the compiled run is fed the eager
run's tokens, so every step compares the same prefix. A near-tie: a step whose eager top two
logits are closer than ``--tie`` (there either token is a right answer of a kernel's rounding).

    python results/bench/compiled_parity.py --out results/bench/compiled_parity.json
    python results/bench/compiled_parity.py --weights int8 \
        --out results/bench/compiled_parity_int8.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from ktm.bench.measure import encode_prefix, synthetic_text, word_pool
from ktm.decode.generate import Decoding, GenerationConfig
from ktm.model import KTMModel
from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import stamped


def logits_run(model, ids: list[int], merge: bool, tokens: list[int] | None, n: int):
    """Per step the (V,) logits, feeding ``tokens`` (None: the greedy choice)."""
    cfg = GenerationConfig(max_new_tokens=n, stop_at_eos=False)
    runtime = model.runtime
    out, fed = [], []
    with torch.no_grad():
        state = runtime.prefill(encode_prefix(model, [ids], merge), [cfg])
        dec = Decoding(runtime, state, [cfg], [None])
        for i in range(n):
            out.append(dec.logits[0].float().clone())
            tok = int(out[-1].argmax()) if tokens is None else tokens[i]
            fed.append(tok)
            if i + 1 < n:
                dec.advance(torch.tensor([tok]))
        dec.release()
    return out, fed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-k4-seq")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--tie", type=float, default=0.05)
    ap.add_argument("--weights", choices=("native", "int8"), default="native",
                    help="the compiled run's linear layers (ktm.core.int8); the eager run's "
                         "are always the model's own")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = KTMModel.load(args.model)
    text = synthetic_text(model, args.length, 0, word_pool(model.tokenizer, 0))
    ids = model.tokenize(text, first=True)
    rows = []
    for reading, merge in (("plain", False), (f"K={model.k}", True)):
        model.runtime.compile, model.runtime.weights = "off", "native"
        eager, tokens = logits_run(model, ids, merge, None, args.new_tokens)
        model.runtime.compile, model.runtime.weights = "on", args.weights
        compiled, _ = logits_run(model, ids, merge, tokens, args.new_tokens)
        diffs = [float((a - b).abs().max()) for a, b in zip(eager, compiled)]
        same = [int(a.argmax()) == int(b.argmax()) for a, b in zip(eager, compiled)]
        gaps = [float(a.topk(2).values[0] - a.topk(2).values[1]) for a in eager]
        first = next((i for i, s in enumerate(same) if not s), None)
        row = {"reading": reading, "steps": args.new_tokens,
               "max_abs_logit_diff": max(diffs),
               "max_rel_logit_diff": max(float((a - b).norm() / b.norm())
                                         for a, b in zip(compiled, eager)),
               "same_greedy_steps": sum(same), "first_differing_step": first,
               "first_differing_is_near_tie": None if first is None else gaps[first] < args.tie,
               # the eager top-2 margin there, and that step's largest logit difference
               "first_differing_margin": None if first is None else gaps[first],
               "first_differing_diff": None if first is None else diffs[first],
               "weights": args.weights,
               "compiles": model.runtime.compiles}
        rows.append(row)
        print(row, flush=True)
    write_json_atomic(args.out, stamped(rows, {k: v for k, v in vars(args).items()
                                               if k != "out"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
