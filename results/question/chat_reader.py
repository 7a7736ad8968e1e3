"""A question about one line of a document asked in a chat, as ``ktm serve``'s chat reads it,
beside the library's marked question, per reader: a needle in 1,024 tokens of held-out code,
greedy, 20 documents (the documents of ``entries.py``).

    python results/question/chat_reader.py --reader smollm2-135m-k4-qa \\
        --reader runs/readers/k4qac/checkpoint --out results/question/chat_reader.json

    chat      one user message, the document then the question on its last line, read through
              the chat template by ``ktm.serving.prompts.chat_prompt`` (what ``ktm serve`` reads
              for it: the question split off and read plain, the document merged)
    library   ``[Segment(document), Segment(question, question=True)]``, the task's question
              with its answer cue ("Question: what is the secret code for NAME? Answer: The
              secret code for NAME is")
    bare      the same with the question alone ("What is the secret code for NAME?")
    cue       the same with "Question: What is the secret code for NAME?\nAnswer:"

``--quote all``: each reader read with its question's lines quoted after the document, the
document read as without a question (``KTMConfig.quote``; default: the reader's own).

One JSON row per reader: hits of N each way, the answers, the configuration, versions and
revision.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ktm.core.checkpoint import model_record
from ktm.core.config import QUOTE_MODES, Layout
from ktm.core.prompt import Segment
from ktm.evaluation.evaluate import hit
from ktm.model import KTMModel
from ktm.serving.prompts import chat_prompt
from ktm.tasks import get_task
from ktm.tasks.base import bind
from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import git_revision, versions

MAX_TOKENS = 24


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reader", action="append", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--quote", choices=QUOTE_MODES, default=None,
                    help="read every reader with this quote mode (default: its own)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for reader in args.reader:
        model = KTMModel.load(reader, layout=Layout(quote=args.quote))
        task = get_task("needle", length=1024)
        bind(task, model)
        examples = task.eval_examples(args.n, seed=1)
        answers = {"chat": [], "library": [], "bare": [], "cue": []}
        for e in examples:
            doc, question = (s.text for s in e.segments)
            asked = question.split("? Answer:")[0].strip() + "?"
            chat = chat_prompt(model, [{"role": "user", "content": f"{doc}\n{asked}"}])
            answers["chat"].append(model.generate(list(chat), max_new_tokens=MAX_TOKENS))
            bare = asked.replace("Question:", "").strip()
            bare = bare[0].upper() + bare[1:]
            for reading, q in (("library", question), ("bare", f"\n{bare}"),
                               ("cue", f"\nQuestion: {bare}\nAnswer:")):
                answers[reading].append(model.generate(
                    [Segment(doc), Segment(q, question=True)], max_new_tokens=MAX_TOKENS))
        hits = {k: sum(hit(a, e.meta["answers"]) for a, e in zip(v, examples))
                for k, v in answers.items()}
        state = Path(reader) / "trainer_state.json"  # a training checkpoint: its step
        step = json.loads(state.read_text())["step"] if state.is_file() else None
        rows.append({"reader": reader, "step": step, "hits": hits, "n": args.n,
                     "answers": answers,
                     "config": {"task": "needle", "length": 1024, "seed": 1,
                                "max_tokens": MAX_TOKENS, "threads": 1, "greedy": True,
                                "model": model_record(model)["config"]},
                     "versions": versions(), "git": git_revision()})
        write_json_atomic(args.out, rows)
        print(reader, hits, flush=True)


if __name__ == "__main__":
    main()
