"""Adaptive merging against uniform K at equal ratio: continuation R and recall R on held-out text.

For one reader: every (allocator, ratio) reads the held-out contexts at that ratio (the
allocator spending the positions), and every merge level K of the reader reads them uniformly
(the reference at ratio ~K). One JSON row per reading, with both kinds of R, their intervals, the
ratio each set was read at, and the configuration, versions and revision.

    python results/adaptive/sweep.py --checkpoint runs/adaptive/k8mix/checkpoint \\
        --ratios 1.5 2 3 4 6 8 --allocators even rules surprisal recency lm \\
        --out results/adaptive/k8mix.json

``--surprisal-from SOURCES``: a reader without a surprisal table gets one counted from these
pretraining sources (as ``ktm pretrain`` builds it) for the ``surprisal`` allocator.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch
from tqdm.auto import tqdm

from ktm.core.checkpoint import model_record
from ktm.core.levels import merging_at
from ktm.evaluation.readability import BOOTSTRAP, heldout_readability
from ktm.model import KTMModel
from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import git_revision, versions


def with_table(model: KTMModel, sources: list[str]) -> None:
    from ktm.core.surprisal import SurprisalTable
    from ktm.training.pretrain import PretrainConfig, load_docs

    docs = load_docs(model.tokenizer, PretrainConfig(sources=tuple(sources), eval_sets=()))
    model.scorer.table = SurprisalTable.count((d for ds in docs.values() for d in ds),
                                              len(model.tokenizer))


def readings(model: KTMModel, args) -> list[tuple[dict, object]]:
    """(what, how to set the model up) per reading: each K uniformly, then each allocator at
    each ratio."""
    out = [({"layout": "uniform", "k": k, "ratio": None, "plain_suffix": 0}, ("k", k, 0))
           for k in sorted(model.config.levels) if args.ks is None or k in args.ks]
    out += [({"layout": "adaptive", "allocator": a, "ratio": r, "plain_suffix": n},
             ("ratio", a, r, n))
            for n in args.suffixes for r in args.ratios for a in args.allocators]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--sets", nargs="+", default=["code", "reviews"])
    ap.add_argument("--n", type=int, default=32, help="held-out windows per set")
    ap.add_argument("--ratios", nargs="+", type=float, default=[1.5, 2, 3, 4, 6, 8])
    ap.add_argument("--allocators", nargs="+", default=["even", "rules", "surprisal", "recency",
                                                         "lm"])
    ap.add_argument("--ks", nargs="*", type=int, default=None,
                    help="uniform levels (default: all; none given: none)")
    ap.add_argument("--suffixes", nargs="+", type=int, default=[0],
                    help="plain suffixes (the last N tokens plain, counted in the ratio)")
    ap.add_argument("--surprisal-from", nargs="*", default=[])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = KTMModel.load(args.checkpoint)
    if args.surprisal_from and model.scorer.table is None:
        with_table(model, args.surprisal_from)
    top = model.k
    cache: dict = {}
    plain: dict = {}  # plain and context-free NLLs: the same under every layout, read once
    rows = []
    own = model._config
    todo = [(what, how) for what, how in readings(model, args)
            if how[0] == "k" or how[2] <= top * 1.0001]
    for what, how in tqdm(todo, desc="readings"):
        t0 = time.process_time()
        if how[0] == "k":
            with merging_at(model, how[1]):
                sets = heldout_readability(model, args.sets, args.n, _cache=cache,
                                           plain_cache=plain)
        else:
            model._config = dataclasses.replace(own, allocator=how[1], plain_suffix=how[3])
            try:
                sets = heldout_readability(model, args.sets, args.n, _cache=cache,
                                           ratio=how[2], plain_cache=plain)
            finally:
                model._config = own
        rows.append({**what, "checkpoint": args.checkpoint, "levels": list(model.config.levels),
                     "sets": {name: {k: v for k, v in r.items()} for name, r in sets.items()},
                     "cpu_s": time.process_time() - t0, "n_windows": args.n,
                     "ci_bootstrap": BOOTSTRAP, "surprisal_from": args.surprisal_from or None,
                     "command": " ".join(sys.argv), "model": model_record(model),
                     "versions": versions(), "git": git_revision()})
        write_json_atomic(args.out, rows)  # what is done so far, at every reading
        print(what, {n: (round(r["R"] or 0, 3), round(r["R_recall"] or 0, 3),
                         round(r["ratio_read"], 2)) for n, r in sets.items()}, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
