"""Does a reader keep a merged tree exactly? Autoencoding exact match on held-out tree texts.

The tree task's last misreads at K=4 are 3-level chains (`A`, `+B`, `++C`): results/README.md,
"Fine-tuning curves". This asks the reader itself, before any task fine-tuning, to regenerate
each test tree of a stage from its merged form (the `ae` objective's cue, greedy) and counts
exact reconstructions, for the 3-level chains and for the other trees.

    python results/readers/reconstruct.py CHECKPOINT_OR_NAME --json OUT.json [--stage small]

The texts are the tree task's test split (trees no fine-tuning sees); they are used here to
measure, never to train.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from ktm.core.prompt import Segment
from ktm.model import KTMModel
from ktm.tasks import get_task
from ktm.training.pretrain import PretrainConfig
from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import git_revision, versions


def is_chain(text: str) -> bool:
    """Three nodes, each one level below the one before: 'A\\n+B\\n++C'."""
    lines = text.split("\n")
    return len(lines) == 3 and [len(x) - len(x.lstrip("+")) for x in lines] == [0, 1, 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint folder or a shipped reader's name")
    parser.add_argument("--json", required=True, help="write the result row here")
    parser.add_argument("--stage", default="small")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = KTMModel.load(args.checkpoint)
    task = get_task("tree", stage=args.stage)
    texts = [f"Tree: {task.trees[i].text}" for i in task.test_trees]
    texts = list(dict.fromkeys(texts))  # a tree text asked twice counts once
    cue = PretrainConfig().ae_cue
    start = time.perf_counter()
    outs: list[str] = []
    for i in range(0, len(texts), args.batch_size):
        batch = texts[i:i + args.batch_size]
        budget = max(len(model.tokenize(t)) for t in batch) + 2
        outs += model.generate([[Segment(t), Segment(cue, compress=False)] for t in batch],
                               max_new_tokens=budget)
    # exact: the tree and nothing more; prefix: the tree, then perhaps more lines (no EOS)
    exact = [o.strip() == t for t, o in zip(texts, outs)]
    prefix = [o.startswith(t) for t, o in zip(texts, outs)]
    groups = {"chains": [is_chain(t[len("Tree: "):]) for t in texts]}
    groups["others"] = [not c for c in groups["chains"]]
    row = {"checkpoint": args.checkpoint, "stage": args.stage, "k": model.k,
           "trees": len(texts), "exact": sum(exact) / len(texts),
           "prefix": sum(prefix) / len(texts),
           **{f"{what}_{g}": sum(e for e, m in zip(hits, mask) if m) / max(1, sum(mask))
              for g, mask in groups.items() for what, hits in (("exact", exact),
                                                               ("prefix", prefix))},
           **{f"n_{g}": sum(mask) for g, mask in groups.items()},
           "wall_s": time.perf_counter() - start,
           "samples": [{"tree": t, "out": o, "exact": e} for t, o, e in zip(texts, outs, exact)],
           "command": " ".join(["python", *sys.argv]), "versions": versions(),
           "git": git_revision()}
    write_json_atomic(args.json, row)
    print(json.dumps({k: v for k, v in row.items() if k not in ("samples", "versions")},
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
