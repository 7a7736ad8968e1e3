"""Time to the first token of a question about a document past the model's window, where the time
goes, each reading interleaved with the others on the same documents in one process.

    python results/question/long_speed.py --length 32768 --docs 3 \\
        --out results/question/long_speed.json
    python results/question/long_speed.py --length 32768 --docs 3 --backend llamacpp \\
        --out results/question/long_speed_llamacpp.json

``--backend llamacpp``: both models prefill through llama.cpp (the base GGUF; the reader's LoRA
set for the merged rows and cleared for the plain ones), the merging in torch as ever.

Readings (the needle task's documents, its question read plain after each):
    plain window   the base model reading the document's last 8,000 tokens (the most of it the
                   plain model reads with room for its question), then the question
    fit 4.03       the question reader at ratio 4.03, the question allocator: its merged
                   document in the window, units it needs least left out (how a prompt past
                   the window was fitted before the deeper level)
    fitted         the question reader as it loads, no ratio given: fitted to the window by
                   ``ktm.core.fit`` (past its largest level, its deeper level: K=8, its K=4
                   merges merged again, the question's lines plain)

Each row splits the first token's seconds into laying out (tokenizing, scoring, allocating:
``encode_prompts(embed=False)``, and for ``fitted`` the fit's own layouts), merging (the rest of
``encode_prompts``: embedding and the encoder) and the prefill with the first token's logits
(``generate(prefixes=..., timing=...)``'s ``prefill_s``; the answer comes from the same call),
and says whether the greedy answer holds the needle. Per reading,
the medians over documents, one thread; each reading warmed once on another document.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from ktm.core.allocate import RatioWarning
from ktm.core.fit import encode_fitted
from ktm.core.prompt import Segment
from ktm.evaluation.evaluate import hit
from ktm.model import KTMModel, load_any
from ktm.tasks import get_task
from ktm.tasks.base import bind
from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import git_revision, versions

WINDOW_TOKENS = 8000
ANSWER_TOKENS = 16


def plain_window(model, segments) -> tuple[Segment, ...]:
    doc, *rest = segments
    ids = model.tokenize(doc.text)[-WINDOW_TOKENS:]
    return (Segment("", ids=tuple(ids), compress=False), *rest)


def reading(model, prompt, merge: bool, fitted: bool) -> dict:
    """Seconds to lay out, merge and prefill ``prompt`` (``fitted``: fitted to the window
    first), its positions and its answer."""
    prompt = tuple(prompt)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RatioWarning)
        t0 = time.perf_counter()
        if fitted:  # every layout ``encode_fitted`` makes, the last one the fitted prompt's
            (prompt,), _ = encode_fitted(model, [prompt], merge, [ANSWER_TOKENS - 1],
                                         embed=False)
        t1 = time.perf_counter()
        model.encode_prompts([prompt], merge, embed=False)
        t2 = time.perf_counter()
        (cp,) = model.encode_prompts([prompt], merge)  # laid out again, then merged
        t3 = time.perf_counter()
        model.runtime.clear()  # a runtime that keeps prompts' KV reads this one from its start
        timing: dict = {}
        (answer,) = model.generate([prompt], prefixes=[cp], max_new_tokens=ANSWER_TOKENS,
                                   merge=merge, timing=timing)
    layout_s = t1 - t0 if fitted else t2 - t1
    merge_s = max(0.0, (t3 - t2) - (t2 - t1))
    return {"layout_s": layout_s, "merge_s": merge_s, "prefill_s": timing["prefill_s"],
            "first_token_s": layout_s + merge_s + timing["prefill_s"],
            "positions": cp.next_position, "tokens_in": cp.tokens_in, "answer": answer}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--backend", choices=("torch", "llamacpp"), default="torch")
    args = ap.parse_args()
    torch.set_num_threads(1)
    plain = load_any("smollm2-135m", backend=args.backend)
    reader = KTMModel.load("smollm2-135m-k4-qa", backend=args.backend)
    task = get_task("needle", length=args.length)
    bind(task, reader)
    examples = task.eval_examples(args.docs, seed=1)
    readings = {
        "plain window": lambda e: (plain, plain_window(plain, e.segments), False, False),
        "fit 4.03": lambda e: (reader, (Segment(e.segments[0].text, ratio=4.03),
                                        *e.segments[1:]), True, False),
        "fitted": lambda e: (reader, e.segments, True, True),
    }
    # warm on a document not timed: the first call pays setup, and a runtime that keeps a
    # prompt's KV (llama.cpp) would find a timed document already read
    (warm,) = task.eval_examples(1, seed=2)
    for make in readings.values():
        model, prompt, merge, fitted = make(warm)
        reading(model, prompt, merge, fitted)
    rows = {name: [] for name in readings}
    for e in examples:
        for name, make in readings.items():
            row = reading(*make(e))
            row["hit"] = hit(row["answer"], e.meta["answers"])
            rows[name].append(row)
            print(name, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()},
                  flush=True)
    base = statistics.median(r["first_token_s"] for r in rows["plain window"])
    summary = []
    for name, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs)
               for k in ("layout_s", "merge_s", "prefill_s", "first_token_s", "positions")}
        summary.append({"reading": name, **med, "of_plain_window": med["first_token_s"] / base,
                        "hits": sum(r["hit"] for r in rs), "n": len(rs), "docs": rs})
    write_json_atomic(args.out, {"rows": summary, "config": {
        "length": args.length, "docs": args.docs, "threads": 1, "task": "needle", "seed": 1,
        "reader": "smollm2-135m-k4-qa", "plain": "smollm2-135m", "backend": args.backend,
        "window_tokens": WINDOW_TOKENS, "answer_tokens": ANSWER_TOKENS,
        "runtimes": {"plain": plain.runtime.record(), "reader": reader.runtime.record()}},
        "versions": versions(), "git": git_revision()})


if __name__ == "__main__":
    main()
