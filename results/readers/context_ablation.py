"""How much a contextual reader uses its context: R with the context branch switched off.

For each checkpoint of a contextual encoder (``--context-blocks``, ``--context-layers``,
``--context-transformer``), on the held-out readability windows (code, reviews; 32 each, seed 0,
as the probes' evaluations):
- R as trained, and R with the context branch removed (the conv's weights, the LM-state MLP and
  the token mixer dropped: the block encoder and the LoRA as trained);
- the context branch's share of each merged vector: ||v - v_off|| / ||v_off||, median over the
  merged vectors of the windows' contexts.

A reader that learned to use its context loses R without it; one whose R barely moves has a
context branch that the 150 steps left near its zero start.

Usage: python results/readers/context_ablation.py --out results/readers/context_ablation.json \
           NAME=CHECKPOINT [NAME=CHECKPOINT ...]
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

from ktm.core.encoder import KTokenEncoder, RecursiveEncoder
from ktm.core.prompt import Segment
from ktm.evaluation.readability import heldout_sets, readability
from ktm.model import KTMModel
from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import git_revision, versions

SETS = ("code", "reviews")


@contextlib.contextmanager
def context_off(model: KTMModel):
    """The model with every level's context branch removed; restored on exit."""
    saved = []
    for m in model.encoder.modules():
        if isinstance(m, KTokenEncoder | RecursiveEncoder):
            for name in ("context", "states", "mixer"):
                if getattr(m, name, None) is not None:
                    saved.append((m, name, getattr(m, name)))
                    setattr(m, name, None)
    if not saved:
        raise SystemExit("this checkpoint's encoder has no context branch: nothing to switch off")
    try:
        yield [f"{type(m).__name__}.{n}" for m, n, _ in saved]
    finally:
        for m, name, value in saved:
            setattr(m, name, value)


@torch.no_grad()
def branch_share(model: KTMModel, windows) -> float:
    lead = model.lead_ids
    prompts = [(Segment("", ids=lead + w.context),) for w in windows]
    on = torch.cat([cp.embeds for cp in model.encode_prompts(prompts)])
    with context_off(model):
        off = torch.cat([cp.embeds for cp in model.encode_prompts(prompts)])
    return ((on - off).norm(dim=-1) / off.norm(dim=-1).clamp_min(1e-12)).median().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="NAME=CHECKPOINT")
    ap.add_argument("--n-windows", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    made_by = {"versions": versions(), "git": git_revision()}  # the code that starts to run
    rows = []
    for run in args.runs:
        name, _, checkpoint = run.partition("=")
        model = KTMModel.load(checkpoint)
        windows = heldout_sets(model.tokenizer, SETS, args.n_windows, args.seed)
        row = {"name": name, "checkpoint": checkpoint, "k": model.k,
               "encoder": {f: getattr(model.config, f) for f in
                           ("context_blocks", "context_layers", "context_pool",
                            "context_transformer")}}
        for s in SETS:
            on = readability(model, windows[s], progress=True)
            with context_off(model) as removed:
                off = readability(model, windows[s], progress=True)
            row[s] = {"R": on["R"], "R_context_off": off["R"],
                      "branch_share_median": branch_share(model, windows[s]),
                      "nll_merged": on["nll_merged"], "nll_merged_context_off": off["nll_merged"]}
        row["removed"] = removed
        print({k: row[k] for k in ("name", *SETS)}, flush=True)
        rows.append(row)
    write_json_atomic(args.out, {"rows": rows, "n_windows": args.n_windows, "seed": args.seed,
                                 "sets": list(SETS), "command": " ".join(sys.argv), **made_by})


if __name__ == "__main__":
    main()
