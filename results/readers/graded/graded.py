"""Recency-graded K, measured without a product change: R of the shipped K=4 reader (recursive:
a K=2 merge of two K=2 merges) when the last G context tokens are merged at its inner K=2
instead of 4, optionally with the last P tokens plain (as ``--plain-suffix P``).

A probe, not a layout of the library: it swaps ``PromptEncoder.encode`` for one that cuts the
context into [plain prefix][K=4 blocks][G tokens at K=2][P plain], on the same 64 held-out
windows per set (seed 1) as results/readers/k4e_readability.json and suffix/k4-sP.json. With
G=0 it must reproduce suffix/k4-sP.json (checked: P=4 gives 0.660 / 0.752).

Usage: python results/readers/graded/graded.py G P   -> results/readers/graded/gG-sP.json
"""

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from ktm import KTMModel
from ktm.core.batch import CompressedPrompt
from ktm.core.prefix import PromptEncoder
from ktm.evaluation.readability import heldout_readability
from ktm.util.provenance import git_revision, versions

GRADED, PLAIN = int(sys.argv[1]), int(sys.argv[2])
N_WINDOWS, SEED, READER = 64, 1, "smollm2-135m-k4"


def graded_encode(self, prompts, merge=True, cache=None):
    """The held-out windows' one-segment prompts, merged with the last tokens graded."""
    out, enc = [], self.encoder
    dev = self.embed.weight.device
    for segs in prompts:
        (seg,) = segs
        ids = list(seg.ids)
        n = len(ids)
        if not merge:
            e = self.embed(torch.tensor(ids, device=dev))
            out.append(CompressedPrompt(e, n, n, (n,), None, torch.arange(n), merged=False))
            continue
        p0 = self.plain_prefix
        c2 = max(n - PLAIN, p0)
        c1 = max(c2 - GRADED, p0)
        pieces = [(ids[:p0], None), (ids[p0:c1], enc), (ids[c1:c2], enc.inner), (ids[c2:], None)]
        parts, pos, start = [], [], 0
        for piece, mod in pieces:
            m = len(piece)
            if not m:
                continue
            e = self.embed(torch.tensor([piece], device=dev))
            if mod is None:
                parts.append(e[0])
                pos += range(start, start + m)
            else:
                merged, _ = mod(e, torch.ones(1, m, dtype=torch.bool, device=dev))
                parts.append(merged[0])
                pos += [start + min(j + mod.k, m) - 1 for j in range(0, m, mod.k)]
            start += m
        emb = torch.cat(parts)
        pos_t = torch.tensor(pos, device=dev)
        out.append(CompressedPrompt(emb, n, emb.shape[0], (n,),
                                    pos_t if self.spread_positions else None, pos_t))
    return out


def main() -> None:
    torch.set_num_threads(1)
    rev = git_revision()
    PromptEncoder.encode = graded_encode
    model = KTMModel.load(READER)
    assert model.encoder.config.inner_k == 2 and model.config.plain_suffix == 0
    t0 = time.perf_counter()
    with torch.no_grad():
        res = heldout_readability(model, ("reviews", "code"), n=N_WINDOWS, seed=SEED)
    row = {"task": "readability", "method": f"{READER}-graded{GRADED}-suffix{PLAIN}",
           "graded_tokens": GRADED, "graded_k": model.encoder.inner.k, "plain_suffix": PLAIN,
           "readability": res, "n_windows": N_WINDOWS, "windows_seed": SEED, "checkpoint": READER,
           "eval_wall_s": time.perf_counter() - t0,
           "command": f"python results/readers/graded/graded.py {GRADED} {PLAIN}",
           "versions": versions(), "git": rev}
    path = Path(__file__).parent / f"g{GRADED}-s{PLAIN}.json"
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump(row, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f.name, path)
    print(json.dumps({s: round(r["R"], 4) for s, r in res.items()}))


if __name__ == "__main__":
    main()
