"""What int8 weights (``ktm.core.int8``) cost in accuracy on a real model, teacher-forced: the
model reads a text once with its own weights and once per way of rounding them, and each row
gives the largest and median per-position logit difference, the relative norm of the
difference, how often the next-token argmax agrees and the text's loss (mean next-token NLL).

Rows: ``int8 per row`` is what ``--weights int8`` reads (the ``Int8Linear`` view; a whole text
read at once goes through its dequantized GEMM);
the others round the weights the same way in fp32 and compute in fp32, to show where the error
comes from: every linear layer but the output head, and scales per group of 64 or 32 inputs
(llama.cpp's Q8_0 keeps one per 32) instead of per row.

The text: the start of a Python standard-library module's source (never trained on).

    python results/bench/int8_accuracy.py --out results/bench/int8_accuracy.json
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
from torch import nn

from ktm.model import KTMModel
from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import stamped


def rounded(w: torch.Tensor, group: int | None) -> torch.Tensor:
    """``w`` rounded to int8 steps with one scale per row (``group`` None) or per ``group``
    inputs of a row, back in its dtype."""
    n, k = w.shape
    g = k if group is None else group
    wg = w.float().view(n, k // g, g)
    s = (wg.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-30)
    return (torch.round(wg / s).clamp(-127, 127) * s).view(n, k).to(w.dtype)


def fake_quantized(view: nn.Module, group: int | None, head: bool) -> nn.Module:
    out = copy.deepcopy(view)
    for name, mod in out.named_modules():
        if type(mod) is nn.Linear and (head or name != "lm_head"):
            mod.weight = nn.Parameter(rounded(mod.weight.data, group), requires_grad=False)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-k4-seq")
    ap.add_argument("--module", default="argparse", help="the standard-library module read")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = KTMModel.load(args.model)
    source = open(__import__(args.module).__file__, encoding="utf-8").read()
    ids = torch.tensor([model.tokenize(source, first=True)[:args.tokens]])
    native = model.decode_lm()
    model.runtime.weights = "int8"
    ways = [("int8 per row", model.decode_lm())]
    ways += [(f"fp32 rounded per {'row' if g is None else f'{g} inputs'}"
              + ("" if head else ", head as loaded"), fake_quantized(native, g, head))
             for g, head in ((None, True), (None, False), (64, True), (32, True))]
    rows = []
    with torch.no_grad():
        ref = native(input_ids=ids).logits[0].float()
        nll = nn.functional.cross_entropy(ref[:-1], ids[0, 1:]).item()
        rows.append({"weights": "native", "nll": nll})
        for name, lm in ways:
            out = lm(input_ids=ids).logits[0].float()
            d = (out - ref).abs().amax(-1)
            rows.append({
                "weights": name, "max_abs_logit_diff": float(d.max()),
                "median_abs_logit_diff": float(d.median()),
                "rel_logit_diff": float((out - ref).norm() / ref.norm()),
                "argmax_agreement": float((out.argmax(-1) == ref.argmax(-1)).float().mean()),
                "nll": nn.functional.cross_entropy(out[:-1], ids[0, 1:]).item()})
            print(rows[-1], flush=True)
    write_json_atomic(args.out, stamped(rows, {**{k: v for k, v in vars(args).items()
                                                  if k != "out"},
                                               "positions": int(ids.shape[1])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
