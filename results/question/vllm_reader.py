"""The question reader on vLLM: a needle in 1,024 tokens of held-out code (the needle task's
evaluation documents, its question and answer cue read plain after each), greedy, each reading on
the same documents.

    python results/question/vllm_reader.py --out results/question/vllm_reader.json

Readings:
    plain               the base model (torch) reading the whole document
    as trained          the question reader on torch: its LoRA on the merged rows only
    LoRA on no row      the same reader on torch with its LoRA's B zeroed: what vLLM serves
                        (``ktm.vllm.export.LORA_ROWS``)
    LoRA on every row   the same reader on torch with its LoRA on every row, plain ones too:
                        what vLLM would serve with the LoRA merged into its weights
    vLLM                the question reader on a vLLM engine in this process (fp32)

A row: hits of N, positions (mean), and for vLLM how many of its answers equal "LoRA on no
row"'s, token for token. One thread for torch; vLLM's CPU engine runs as it is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from ktm.core import lora_scope
from ktm.evaluation.evaluate import hit
from ktm.model import KTMModel, load_any
from ktm.tasks import get_task
from ktm.tasks.base import bind
from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import git_revision, versions

READER = "smollm2-135m-k4-qa"
NEW_TOKENS = 16


def lora_off(model: KTMModel) -> KTMModel:
    """``model`` with its LoRA's B zeroed: every row read by the base LM (before any forward,
    so no folded weight holds the old LoRA)."""
    with torch.no_grad():
        for name, p in model.peft.named_parameters():
            if "lora_B" in name:
                p.zero_()
    return model


def lora_on_every_row(model: KTMModel) -> KTMModel:
    """``model`` read as a LoRA of scope "all": the gate's hooks removed (a measurement only:
    the library reads a reader as it was trained)."""
    for module in model.peft.modules():
        for b in getattr(module, "lora_B", {}).values():
            hook = getattr(b, lora_scope._HOOKED, None)
            if hook is not None:
                hook.remove()
                setattr(b, lora_scope._HOOKED, None)
    lora = dataclasses.replace(model.config.lora, scope="all")
    model._config = dataclasses.replace(model.config, lora=lora)
    return model


def answers(model, examples, merge: bool) -> list[dict]:
    rows = []
    for e in examples:
        (cp,) = model.encode_prompts([e.segments], merge)
        text = model.generate(e.segments, max_new_tokens=NEW_TOKENS, merge=merge)
        rows.append({"answer": text, "hit": hit(text, e.meta["answers"]),
                     "positions": cp.next_position})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--docs", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    task = get_task("needle", length=1024)
    bind(task, KTMModel.load(READER))
    examples = task.eval_examples(args.docs, seed=1)
    readings = {
        "plain": lambda: load_any("smollm2-135m"),
        "as trained": lambda: KTMModel.load(READER),
        "LoRA on no row": lambda: lora_off(KTMModel.load(READER)),
        "LoRA on every row": lambda: lora_on_every_row(KTMModel.load(READER)),
        "vLLM": lambda: KTMModel.load(READER, backend="vllm"),
    }
    results, record = {}, None
    for name, make in readings.items():
        model = make()
        results[name] = answers(model, examples, merge=name != "plain")
        if name == "vLLM":
            record = model.runtime.record()
            model.use_backend("torch")  # the engine ends here
        print(name, sum(r["hit"] for r in results[name]), flush=True)
    off = [r["answer"] for r in results["LoRA on no row"]]
    rows = [{"reading": name, "hits": sum(r["hit"] for r in rs), "n": len(rs),
             "positions": statistics.mean(r["positions"] for r in rs),
             **({"equal_to_lora_off": sum(r["answer"] == o for r, o in zip(rs, off))}
                if name == "vLLM" else {}),
             "docs": rs} for name, rs in results.items()]
    write_json_atomic(args.out, {"rows": rows, "config": {
        "task": "needle", "length": 1024, "docs": args.docs, "seed": 1, "reader": READER,
        "plain": "smollm2-135m", "new_tokens": NEW_TOKENS, "threads": 1, "vllm": record},
        "versions": versions(), "git": git_revision()})


if __name__ == "__main__":
    main()
