"""A question about one line of a long document, asked through each entry a user has: the library
(``KTMModel.generate`` with the question marked), ``ktm serve``'s chat and its completions, read
by ktm and plain, on the same documents: a needle in 1,024 tokens of held-out code, greedy.

    python results/question/entries.py --out results/question/entries.json

Each served reading goes over HTTP to a ``ktm serve`` process of its own (``--threads 1``, its
default prefix cache), as a client would send it:

    library              ``[Segment(document), Segment(question, question=True)]``
    chat                 one user message: the document, then the question on its last line
    completions          one prompt: the document, then "Question: ...? Answer: ..." (the task's
                         question and its answer cue), nothing marked
    completions marked   the prompt is the document, ``ktm.question`` the question
    ... plain            the same request with ``{"ktm": {"merge": false}}``

One JSON row per (entry, reading): hits of N, the positions read (the server's
``usage.prompt_tokens_merged``), the configuration, versions and revision.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from attack import body_of, request, send, start_server  # noqa: E402

from ktm.core.checkpoint import model_record  # noqa: E402
from ktm.core.prompt import Segment  # noqa: E402
from ktm.evaluation.evaluate import hit  # noqa: E402
from ktm.model import KTMModel  # noqa: E402
from ktm.tasks import get_task  # noqa: E402
from ktm.tasks.base import bind  # noqa: E402
from ktm.util.fileio import write_json_atomic  # noqa: E402
from ktm.util.provenance import git_revision, versions  # noqa: E402

MAX_TOKENS = 24


def post(port: int, path: str, obj: dict) -> dict:
    got = send(port, request(port, path, body_of(obj), key=None) + body_of(obj), iter(()),
               answer=True)
    if got["status"] != 200:
        raise SystemExit(f"{path} answered {got['status']}: {got['message']}")
    return got["answer"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reader", default="smollm2-135m-k4-qa")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--length", type=int, default=1024)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = KTMModel.load(args.reader)
    task = get_task("needle", length=args.length)
    bind(task, model)
    examples = task.eval_examples(args.n, seed=1)
    made_by = {"versions": versions(), "git": git_revision()}
    config = {"reader": args.reader, "n": args.n, "length": args.length, "task": "needle",
              "seed": 1, "max_tokens": MAX_TOKENS, "threads": 1, "greedy": True,
              "model": model_record(model)["config"]}
    rows: list[dict] = []

    def record(entry: str, reading: str, answers: list[tuple[str, int]]) -> None:
        hits = sum(hit(a, e.meta["answers"]) for (a, _), e in zip(answers, examples))
        rows.append({"entry": entry, "reading": reading, "hits": hits,
                     "positions": sum(p for _, p in answers) / len(answers), "config": config,
                     **made_by})
        write_json_atomic(args.out, rows)
        print(entry, reading, hits, rows[-1]["positions"], flush=True)

    asked = []
    for e in examples:
        doc, question = (s.text for s in e.segments)
        asked.append((doc, question, question.split("? Answer:")[0].strip() + "?"))
    answers = []
    for doc, question, _ in asked:
        prompt = [Segment(doc), Segment(question, question=True)]
        answers.append((model.generate(prompt, max_new_tokens=MAX_TOKENS),
                        model.encode_prompts([prompt], embed=False)[0].tokens_out))
    record("library", "ktm", answers)
    del model
    proc, port = start_server(args.reader, 1, key=None)
    try:
        for reading, ext in (("ktm", {}), ("plain", {"ktm": {"merge": False}})):
            bodies = {
                "chat": [("/v1/chat/completions",
                          {"messages": [{"role": "user", "content": f"{doc}\n{q}"}]})
                         for doc, _, q in asked],
                "completions": [("/v1/completions", {"prompt": f"{doc}\n{question}"})
                                for doc, question, _ in asked],
                "completions marked": [
                    ("/v1/completions", {"prompt": doc + "\n",
                                         "ktm": {"question": question}})
                    for doc, question, _ in asked],
            }
            for entry, calls in bodies.items():
                answers = []
                for path, body in calls:
                    body = {"model": "m", "max_tokens": MAX_TOKENS, "temperature": 0, **body}
                    if ext:
                        body["ktm"] = {**body.get("ktm", {}), **ext["ktm"]}
                    out = post(port, path, body)
                    choice = out["choices"][0]
                    text = choice["message"]["content"] if "message" in choice else choice["text"]
                    answers.append((text, out["usage"]["prompt_tokens_merged"]))
                record(entry, reading, answers)
    finally:
        proc.terminate()
        proc.wait()
    print(json.dumps([{k: r[k] for k in ("entry", "reading", "hits", "positions")}
                      for r in rows], indent=1))


if __name__ == "__main__":
    main()
