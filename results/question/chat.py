"""A chat that pastes a document and asks about it, read as ``ktm serve`` reads a chat: a needle
in 1,024 tokens of held-out code, then the question, in one user message.

    python results/question/chat.py --out results/question/chat.json

Readings (the same messages for each):

    merged whole      the message merged whole ({"ktm": {"merge": true}}: how ktm serve read
                      every message before it read a question)
    question plain    ktm serve's default: the message's end read plain as its question, the
                      rest merged (``ktm.core.question.split_question``)
    plain             merging off: the base model reading the whole chat (the question
                      reader's LoRA adapts merged rows only, so this is the base model)
    with each reader: smollm2-135m-k4-chat (the reader for long chats, uniform K=4) and
    smollm2-135m-k4-qa (the question reader: ratio 4, the question allocator)

One JSON row per (reader, reading): hits of 20, positions read, the configuration; one thread.
"""

from __future__ import annotations

import argparse

import torch

from ktm.core.checkpoint import model_record
from ktm.evaluation.evaluate import hit
from ktm.model import KTMModel
from ktm.serving.prompts import chat_prompt
from ktm.tasks import get_task
from ktm.tasks.base import bind
from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import git_revision, versions

READERS = ("smollm2-135m-k4-chat", "smollm2-135m-k4-qa")
N, LENGTH = 20, 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    made_by = {"versions": versions(), "git": git_revision()}
    rows = []
    for name in READERS:
        model = KTMModel.load(name)
        task = get_task("needle", length=LENGTH)
        bind(task, model)
        examples = task.eval_examples(N, seed=1)
        readings = [("merged whole", {"ktm": {"merge": True}}), ("question plain", {})]
        if model.config.lora.scope == "merged":
            readings.append(("plain", {}))
        for reading, marked in readings:
            hits, positions = 0, 0
            for e in examples:
                doc, question = (s.text for s in e.segments)
                # the question as a user writes it: after a blank line, no answer cue
                asked = question.split("? Answer:")[0].strip() + "?"
                merge = reading != "plain"
                prompt = chat_prompt(model, [{"role": "user", "content": f"{doc}\n{asked}",
                                              **marked}], merge=merge)
                answer = model.generate(prompt, max_new_tokens=24, merge=merge)
                hits += hit(answer, e.meta["answers"])
                positions += model.encode_prompts([prompt], merge, embed=False)[0].tokens_out
            rows.append({"reader": name, "reading": reading, "n": N, "length": LENGTH,
                         "hits": hits, "positions": positions / N,
                         "config": {"model": model_record(model)["config"], "seed": 1},
                         **made_by})
            write_json_atomic(args.out, rows)
            print(name, reading, hits, positions / N, flush=True)


if __name__ == "__main__":
    main()
