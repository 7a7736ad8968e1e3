"""One document, many questions: each of 20 documents (1,024 tokens of held-out code holding five
needles of distinct keys) asked about every key in turn through ``ktm serve``'s completions, the
document the same in each request and the question in ``ktm.question``, greedy:

    python results/question/many.py --out results/question/many.json

Readings, interleaved document by document in one run (each server its own process, one
thread, its default prefix cache):

    plain                 ``{"ktm": {"merge": false}}``: the base model reads the document plain;
                          its KV, the context before the question, is cached by the first
                          question and reused by the others
    ktm, in place         the question reader as it loads (``--quote far``): the lines the
                          question asks about read plain where they stand, so the document's
                          reading, and its KV, depend on the question
    ktm, document once    the question reader with ``--quote all``: the document read as
                          without a question, the lines each question picks quoted after it;
                          the document's KV is cached once and serves every question
    ... ratio R           the same, the document read at ``--ratio`` R tokens a position
                          (``ktm.ratio``; default 5), so that with its quoted lines it holds
                          under 0.3 x plain's positions (at 4.5 the deeper level's units leave
                          room for more plain lines, all of them quoted)
    BM25 lines            the base model reading the document's lines BM25 ranks best for the
                          question, up to 30 % of its tokens (``--compressor bm25``'s rule,
                          its ranking timed into the first token), nothing cached

One JSON row per reading: hits over every question, the first token's seconds for the first
question of a document and for the later ones (medians), the positions held after the prompt
(the server's ``usage.prompt_tokens_merged``) and those reused from its cache, the
configuration, versions and revision.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from attack import start_server  # noqa: E402

from ktm.compressors import get_compressor  # noqa: E402
from ktm.core.checkpoint import model_record  # noqa: E402
from ktm.core.question import asking  # noqa: E402
from ktm.evaluation.evaluate import hit  # noqa: E402
from ktm.model import KTMModel  # noqa: E402
from ktm.tasks import get_task  # noqa: E402
from ktm.tasks.base import Example, bind  # noqa: E402
from ktm.util.fileio import write_json_atomic  # noqa: E402
from ktm.util.provenance import git_revision, versions  # noqa: E402

NEEDLE = re.compile(r"# The secret code for (\w+) is (\d+)\.")
MAX_TOKENS = 12
BM25_RATIO = 0.7


def ask(port: int, prompt: str, ktm: dict) -> dict:
    """One streamed greedy completion: its text, the seconds to its first chunk, its usage."""
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS,
                       "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}, "ktm": ktm})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"the server answered {resp.status}: {resp.read()[:500]!r}")
    first, text, usage = None, "", None
    for line in resp:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        if chunk.get("choices"):
            first = time.perf_counter() - t0 if first is None else first
            text += chunk["choices"][0]["text"]
    conn.close()
    return {"text": text, "first_s": first, "usage": usage}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reader", default="smollm2-135m-k4-qa")
    ap.add_argument("--docs", type=int, default=20)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--ratio", type=float, default=5.0,
                    help="the document-once reading's second ratio")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = KTMModel.load(args.reader)
    task = get_task("needle", length=args.length, variant="multikey", keys=5)
    bind(task, model)
    docs = [e.segments[0].text for e in task.eval_examples(args.docs, seed=1)]
    bm25 = get_compressor("bm25", ratio=BM25_RATIO)
    bm25.fit([], model)
    config = {"reader": args.reader, "docs": args.docs, "length": args.length,
              "task": "needle multikey, 5 keys, every key asked", "seed": 1,
              "max_tokens": MAX_TOKENS, "threads": 1, "greedy": True,
              "bm25_ratio": BM25_RATIO, "ratio": args.ratio, "model": model_record(model)["config"]}
    made_by = {"versions": versions(), "git": git_revision()}
    in_place, _ = servers = [start_server(args.reader, 1, key=None),
                             start_server(args.reader, 1, "--quote", "all", key=None)]
    readings = {"plain": (in_place[1], {"merge": False}),
                "ktm, in place": (in_place[1], {}),
                "ktm, document once": (servers[1][1], {}),
                f"ktm, document once, ratio {args.ratio:g}": (servers[1][1],
                                                              {"ratio": args.ratio}),
                "BM25 lines": (in_place[1], None)}
    got: dict[str, list[dict]] = {name: [] for name in readings}
    try:
        for d, doc in enumerate(docs):
            facts = NEEDLE.findall(doc)
            for name, (port, ext) in readings.items():
                for q, (key, value) in enumerate(facts):
                    question = (f"\nQuestion: what is the secret code for {key}? Answer: The "
                                f"secret code for {key} is")
                    if ext is None:  # BM25: the kept lines, then the question, read plain
                        t0 = time.perf_counter()
                        [e] = bm25.compress_batch([Example(asking(doc, question), "", "")])
                        ranked = time.perf_counter() - t0
                        out = ask(port, e.segments[0].text + question,
                                  {"merge": False, "question": ""})
                        out["first_s"] += ranked
                    else:
                        out = ask(port, doc, {**ext, "question": question})
                    got[name].append({"doc": d, "question": q, "hit": hit(out["text"], [value]),
                                      "first_s": out["first_s"],
                                      "positions": out["usage"]["prompt_tokens_merged"],
                                      "tokens": out["usage"]["prompt_tokens"],
                                      "cached": out["usage"]["prompt_tokens_details"][
                                          "cached_tokens"]})
            rows = [summary(name, got[name], config, made_by) for name in readings]
            write_json_atomic(args.out, rows)
            print(f"document {d + 1}/{len(docs)}: " + "; ".join(
                f"{r['reading']} {r['hits']}/{r['questions']} first {r['first_s_first']:.2f} s "
                f"later {r['first_s_later']:.2f} s" for r in rows), flush=True)
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait()


def summary(name: str, asked: list[dict], config: dict, made_by: dict) -> dict:
    first = [a["first_s"] for a in asked if a["question"] == 0]
    later = [a["first_s"] for a in asked if a["question"] > 0]
    return {"reading": name, "questions": len(asked), "hits": sum(a["hit"] for a in asked),
            "first_s_first": statistics.median(first),
            "first_s_later": statistics.median(later) if later else None,
            "positions": statistics.mean(a["positions"] for a in asked),
            "tokens": statistics.mean(a["tokens"] for a in asked),
            "cached_later": statistics.mean(a["cached"] for a in asked if a["question"] > 0)
            if later else None,
            "asked": asked, "config": config, **made_by}


if __name__ == "__main__":
    main()
