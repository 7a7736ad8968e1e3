"""What a question-aware reading of the tree task could spend: the tokens of its contexts, the
positions K=4 reads them in, and the tokens of the lines that name the question's two nodes.

    python results/question/tree_budget.py --out results/question/tree_budget.json

The tree task's question names a parent and a child; a question-aware allocator would read the
lines naming them plain. Counted on the evaluation examples of ``results/experiment.sh``'s tree
rows (stage small, 128 examples, seed 1), in the embedded model's tokens.
"""

from __future__ import annotations

import argparse
import re
import statistics

from ktm.model import KTMModel
from ktm.tasks import get_task
from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import git_revision, versions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", default="small")
    p.add_argument("--n", type=int, default=128)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    model = KTMModel.load("smollm2-135m-k4-seq")
    task = get_task("tree", stage=args.stage, prompt_mode="context")
    context, named = [], []
    for e in task.eval_examples(args.n, seed=1):
        doc, question = e.segments[0].text, e.segments[1].text
        nodes = re.search(r"Parent: (\w+), Child: (\w+)", question).groups()
        context.append(len(model.tokenize(doc)))
        named.append(sum(len(model.tokenize(line)) for line in doc.split("\n")
                         if any(n in line for n in nodes)))
    row = {"stage": args.stage, "n": args.n, "k": args.k,
           "context_tokens": statistics.mean(context),
           "context_tokens_range": [min(context), max(context)],
           "positions_at_k": statistics.mean(-(-c // args.k) for c in context),
           "named_line_tokens": statistics.mean(named),
           "named_lines_fit": sum(n <= -(-c // args.k) for n, c in zip(named, context)),
           "git": git_revision(), "versions": versions()}
    write_json_atomic(args.out, row)
    print({k: v for k, v in row.items() if k != "versions"})


if __name__ == "__main__":
    main()
