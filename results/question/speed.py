"""Time to the first token of a question about a long document, each reading timed interleaved
with the others on the same documents in one process (the rows of run.sh time each reading in
its own run, beside whatever else the machine ran then).

    python results/question/speed.py --docs 3 --repeats 1 --out results/question/speed.json

Readings: plain (the base model), the question reader as it loads (ratio 4, the question
allocator: its scoring included), and KVzip at 30 % of the KV (it re-reads the document to score
it), each a greedy first token: encoding, allocating, prefilling and pressing. Per length, the
median over documents and repeats, one thread (each reading is warmed once per length on its
first document: the first call pays setup).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ktm.decode.press import PressConfig
from ktm.model import KTMModel, load_any
from ktm.tasks import get_task
from ktm.tasks.base import bind
from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import git_revision, versions

LENGTHS = (1024, 4096)
DOCS, REPEATS = 4, 3


def first_token(model, prompt, merge: bool) -> float:
    """Seconds to the first greedy token of ``prompt``."""
    t0 = time.perf_counter()
    model.generate(prompt, max_new_tokens=1, merge=merge)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--docs", type=int, default=DOCS, help="documents per length")
    ap.add_argument("--repeats", type=int, default=REPEATS, help="timings per document")
    args = ap.parse_args()
    if args.docs < 1 or args.repeats < 1:
        ap.error(f"--docs and --repeats must be >= 1, got {args.docs} and {args.repeats}")
    torch.set_num_threads(1)
    plain = load_any("smollm2-135m")
    pressed = load_any("smollm2-135m")
    pressed.use_press(PressConfig("kvzip", 0.7))
    reader = KTMModel.load("smollm2-135m-k4-qa")
    readings = {"plain": (plain, False), "kvzip": (pressed, False),
                "question reader": (reader, True)}
    rows = []
    for length in LENGTHS:
        task = get_task("needle", length=length)
        bind(task, reader)
        examples = task.eval_examples(args.docs, seed=1)
        seconds: dict[str, list[float]] = {name: [] for name in readings}
        for model, merge in readings.values():  # warm: the first call pays setup
            first_token(model, examples[0].segments, merge)
        for e in examples:
            for _ in range(args.repeats):
                for name, (model, merge) in readings.items():
                    seconds[name].append(first_token(model, e.segments, merge))
        base = statistics.median(seconds["plain"])
        for name, times in seconds.items():
            rows.append({"length": length, "reading": name, "median_s": statistics.median(times),
                         "of_plain": statistics.median(times) / base, "times_s": times})
            print(length, name, round(statistics.median(times), 3), flush=True)
    write_json_atomic(args.out, {"rows": rows, "config": {
        "docs": args.docs, "repeats": args.repeats, "lengths": list(LENGTHS), "threads": 1,
        "press": {"name": "kvzip", "ratio": 0.7}, "reader": "smollm2-135m-k4-qa",
        "task": "needle", "seed": 1}, "versions": versions(), "git": git_revision()})


if __name__ == "__main__":
    main()
