"""Two levers of question-aware reading, each switched off on the same needles:

- scope: the shipped K=4 reader (its LoRA trained on every row) read with its LoRA on every row,
  and on the merged rows only (``ktm.core.lora_scope``), at ratio 3.33 with the question
  allocator: what gating alone does to a plain line, before any training;
- quote: the question reader with its far plain lines quoted after the document
  (``ktm.core.allocate.QUOTE_BEYOND``), and left in place;
- quote distance: how far before the question a plain line is quoted (``QUOTE_BEYOND``
  positions: 1,024, the default, 512 and 256), on needles at depth 0.75 of 16,384 tokens, where
  the needle's line lies near the default's distance.

    python results/question/ablations.py --out results/question/ablations.json

One JSON row per (lever, setting, length): the needle task's result row (``ktm.evaluation``),
with the setting and the configuration used. One thread; a row already in --out is kept.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

import ktm.core.prefix as prefix
from ktm.core.checkpoint import model_record
from ktm.core.lora_scope import gate_lora
from ktm.evaluation.evaluate import evaluate_task, summary
from ktm.model import KTMModel
from ktm.tasks import get_task
from ktm.tasks.base import bind
from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import git_revision, versions

# (lever, setting, reader, ratio, length, questions, the needle's depth: None spread)
RUNS = [("scope", "all", "smollm2-135m-k4-seq", 3.33, 1024, 20, None),
        ("scope", "merged", "smollm2-135m-k4-seq", 3.33, 1024, 20, None),
        ("quote", "in place", "smollm2-135m-k4-qa", 4.0, 8000, 8, None),
        ("quote", "quoted", "smollm2-135m-k4-qa", 4.0, 8000, 8, None),
        ("quote", "in place", "smollm2-135m-k4-qa", 4.0, 16384, 8, None),
        ("quote", "quoted", "smollm2-135m-k4-qa", 4.0, 16384, 8, None),
        *(("quote distance", str(d), "smollm2-135m-k4-qa", 4.03, 16384, 5, 0.75)
          for d in (1024, 512, 256))]


def _quote_beyond(lever: str, setting: str, default: int) -> int:
    if lever == "quote distance":
        return int(setting)
    return 10 ** 9 if setting == "in place" else default


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else []
    done = {(r["lever"], r["setting"], r["length"], r.get("depth")) for r in rows}
    made_by = {"versions": versions(), "git": git_revision()}
    quote_beyond = prefix.QUOTE_BEYOND
    for lever, setting, reader, ratio, length, n, depth in RUNS:
        if (lever, setting, length, depth) in done:
            continue
        model = KTMModel.load(reader, ratio=ratio, allocator="question")
        if lever == "scope" and setting == "merged":
            model._config = replace(model._config, lora=replace(model._config.lora,
                                                                scope="merged"))
            gate_lora(model.peft)
        prefix.QUOTE_BEYOND = _quote_beyond(lever, setting, quote_beyond)
        task = get_task("needle", length=length,
                        **({} if depth is None else {"depth": depth}))
        bind(task, model)
        row = summary(evaluate_task(model, task, task.eval_examples(n, seed=1), progress=True))
        rows.append({"lever": lever, "setting": setting, "reader": reader, "length": length,
                     **({} if depth is None else {"depth": depth}), **row,
                     "config": {"model": model_record(model)["config"],
                                "quote_beyond": prefix.QUOTE_BEYOND, "seed": 1},
                     **made_by})
        write_json_atomic(args.out, rows)
        print(lever, setting, length, row["accuracy"], flush=True)
    prefix.QUOTE_BEYOND = quote_beyond


if __name__ == "__main__":
    main()
