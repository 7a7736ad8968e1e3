"""What the merged rest adds: the question reader's reading against the same plain lines with
the merged rest dropped, on the same questions, greedy:

    python results/question/remainder.py --out results/question/remainder.json

For each question kind (``--kinds``: ``TASK[:OPTION]`` as ``run.sh`` names them) and each ratio
(``--ratios``), the question reader lays the document out as it reads it (the question
allocator: the lines the question asks about plain, the rest merged, the least relevant left
out), then answers twice:

    reader        that reading: the plain lines and the merged rest (``ktm eval``'s reading)
    lines alone   the base model reading only that reading's plain tokens, in the order the
                  reader reads them (quoted lines where they are quoted), then the question:
                  the merged rest dropped, the plain lines the same

A hit holds every wanted value (``ktm.evaluation.evaluate.hit``). One JSON row per kind and
ratio: both readings' hits per question, the plain tokens and the positions the reader read,
the configuration, versions and revision. The documents are ``ktm eval --n-eval N --seed 1``'s.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from tqdm import tqdm

from ktm.core.allocate import RatioWarning
from ktm.core.batch import CompressedPrompt
from ktm.core.checkpoint import model_record
from ktm.core.prompt import Segment
from ktm.evaluation.evaluate import hit
from ktm.model import KTMModel
from ktm.tasks import get_task
from ktm.tasks.base import bind
from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import git_revision, versions

KINDS = ("needle", "codeqa:variant=assign", "codeqa:variant=params",
         "codeqa:variant=default", "codeqa:variant=within")


def plain_ids(cp: CompressedPrompt) -> list[int]:
    """The token ids a reading (``cp``) reads plain before the question, in its order."""
    merged = (cp.merged_rows if cp.merged_rows is not None
              else torch.zeros(cp.tokens_out, dtype=torch.bool))
    return [cp.ids[int(cp.sources[i])] for i in range(cp.pressable) if not merged[i]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reader", default="smollm2-135m-k4-qa")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS))
    ap.add_argument("--ratios", nargs="+", type=float, default=[4.0, 4.01])
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore", RatioWarning)
    model = KTMModel.load(args.reader)
    made_by = {"versions": versions(), "git": git_revision()}
    rows = []
    for kind in args.kinds:
        name, _, option = kind.partition(":")
        options = dict([option.split("=", 1)]) if option else {}
        task = get_task(name, length=args.length, **options)
        bind(task, model)
        examples = task.eval_examples(args.n, seed=1)
        for ratio in args.ratios:
            reader, alone, tokens, positions, t0 = [], [], [], [], time.perf_counter()
            for e in tqdm(examples, desc=f"{kind} r{ratio:g}"):
                doc, question = e.segments
                prompt = (Segment(doc.text, ratio=ratio), question)
                cp = model.encode_prompts([prompt])[0]  # read once: laid out, then answered
                ids = plain_ids(cp)
                a = model.generate([prompt], prefixes=[cp], max_new_tokens=task.answer_tokens)[0]
                b = model.generate([(Segment(model.tokenizer.decode(ids), ids=tuple(ids),
                                             compress=False), question)],
                                   max_new_tokens=task.answer_tokens, merge=False)[0]
                reader.append(hit(a, e.meta["answers"]))
                alone.append(hit(b, e.meta["answers"]))
                tokens.append(len(ids))
                positions.append(cp.tokens_out)
            rows.append({"kind": kind, "ratio": ratio, "n": len(examples),
                         "reader_hits": sum(reader), "lines_alone_hits": sum(alone),
                         "reader": reader, "lines_alone": alone,
                         "plain_tokens_mean": sum(tokens) / len(tokens),
                         "positions_mean": sum(positions) / len(positions),
                         "wall_s": time.perf_counter() - t0,
                         "config": {**vars(args), "reader_record": model_record(model)}, **made_by})
            print(kind, ratio, sum(reader), sum(alone), flush=True)
            write_json_atomic(args.out, rows)


if __name__ == "__main__":
    main()
