"""``ktm demo``: the main job. Fine-tune a K=4 merger on a tree stage in a few CPU minutes.

It starts from the shipped reader for the model and K (``smollm2-135m-k4``: an encoder + LoRA
pretrained to read merged text, see ``ktm.readers``), or from plain mean pooling with
``--reader none``. It evaluates the start, fine-tunes on the task, evaluates again, times the
compressed against the plain prefill, and shows a generation.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ktm.core.base_model import parse_dtype
from ktm.core.config import DEFAULT_MODEL
from ktm.core.prompt import prompt_text
from ktm.decode.generate import prefill
from ktm.errors import KTMError
from ktm.evaluation.evaluate import evaluate_classification, summary
from ktm.model import KTMModel
from ktm.tasks.tree import TreeTask
from ktm.tasks.tree_gen import STAGES
from ktm.training.config import TrainConfig
from ktm.training.train import train
from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import git_revision, versions
from ktm.util.timing import clock


@dataclass
class DemoConfig:
    model: str = field(default=DEFAULT_MODEL, metadata={"help": "embedded model name or HF folder"})
    k: int = field(default=4, metadata={"help": "tokens merged per block"})
    reader: str = field(default="auto", metadata={
        "help": "start from: auto (the shipped reader for model and K, if any, else a "
                "recursive one whose inner K it is), none (mean pooling), or a reader name / "
                "checkpoint folder"})
    # stage small: at this budget even the uncompressed model stays at chance on xmedium, so a
    # demo there would show nothing (why this default: docs/guide.md#defaults)
    stage: str = field(default="small", metadata={"choices": list(STAGES),
                                                  "help": "tree curriculum stage"})
    steps: int = field(default=120, metadata={"aliases": ["--max-steps"],  # ktm train's name
                                              "help": "optimizer steps"})
    batch_size: int = field(default=16, metadata={"help": "examples per step"})
    # the experiment's rate; why this default: docs/guide.md#defaults
    lr: float = field(default=5e-4, metadata={"help": "AdamW learning rate (LoRA)"})
    encoder_lr: float = field(default=5e-5, metadata={"help": "learning rate of the encoder MLP"})
    n_eval: int = field(default=96, metadata={"help": "balanced eval pairs"})
    seed: int = field(default=0, metadata={"help": "random seed"})
    out_dir: str = field(default="runs/demo", metadata={
        "help": "the demo's folder: demo.json, metrics.jsonl, checkpoint/ (replaced each run)"})
    device: str = field(default="cpu", metadata={"help": "torch device"})
    dtype: str = field(default="float32", metadata={"help": "float32 | bfloat16 | float16"})


@torch.no_grad()
def time_prefill(model: KTMModel, prompts, repeats: int = 5) -> dict:
    """Median prefill seconds (encoder included), merged vs plain, interleaved so drift hits
    both alike; through ``ktm.decode.generate``'s own prefill, on a clock that waits for the
    device."""
    def once(merge: bool) -> float:
        t0 = clock(model.device)
        prefill(model, model.encode_prompts(prompts, merge))
        return clock(model.device) - t0

    once(True), once(False)  # warm-up
    merged, plain = [], []
    for _ in range(repeats):
        merged.append(once(True))
        plain.append(once(False))
    m, p = statistics.median(merged), statistics.median(plain)
    return {"merged_s": m, "plain_s": p, "speedup": p / m, "batch": len(prompts)}


def speed_phrase(speedup: float) -> str:
    """Merged against plain: '2.10x faster', or '1.32x slower' when merging lost."""
    return f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"


HEADER = """\
| model                      | accuracy | bal. acc | tokens in | tokens out | reduction |
|----------------------------|----------|----------|-----------|------------|-----------|"""


def _row(name: str, r: dict) -> str:
    return (f"| {name:<26} | {r['accuracy']:>8.3f} | {r['balanced_accuracy']:>8.3f} | "
            f"{r['tokens_before']:>9.1f} | {r['tokens_after']:>9.1f} | "
            f"{r['length_reduction']:>9.1%} |")


def check_demo_folder(out: Path) -> None:
    """The demo starts fresh, deleting its folder's checkpoint and metrics: refuse a folder that
    holds another command's run (whose run.json records the command; the demo's records none)."""
    try:
        command = json.loads((out / "run.json").read_text()).get("command")
    except (OSError, ValueError, AttributeError):
        command = None
    if command:
        raise KTMError(f"--out-dir {str(out)!r} holds a run of {command!r}: the demo would delete "
                       "its checkpoint and metrics; expected a demo's folder or a new one")


def run_demo(cfg: DemoConfig) -> dict:
    made_by = {"versions": versions(), "git": git_revision()}  # the code that starts to run
    check_demo_folder(Path(cfg.out_dir))
    torch.manual_seed(cfg.seed)
    model, start_name = _start_model(cfg)
    task = TreeTask(stage=cfg.stage, prompt_mode="context")
    train_set = task.train_examples(cfg.steps * cfg.batch_size, seed=cfg.seed)
    eval_set = task.eval_examples(cfg.n_eval, seed=cfg.seed + 1)

    print(f"evaluating the start ({start_name}) ...", flush=True)
    start = evaluate_classification(model, eval_set, task.labels, progress=True)
    out = Path(cfg.out_dir)
    tcfg = TrainConfig(out_dir=str(out), max_steps=cfg.steps, batch_size=cfg.batch_size,
                       lr=cfg.lr, encoder_lr=cfg.encoder_lr, warmup_steps=5, seed=cfg.seed,
                       save_every=0, log_every=1)
    shutil.rmtree(out / "checkpoint", ignore_errors=True)  # the demo always starts fresh
    (out / "metrics.jsonl").unlink(missing_ok=True)
    t0 = time.perf_counter()
    last = train(model, train_set, tcfg)
    train_s = time.perf_counter() - t0
    trained = evaluate_classification(model, eval_set, task.labels, progress=True)
    timing = time_prefill(model, [e.segments for e in eval_set[:16]])

    print(f"\nK-Token Merging demo: tree stage '{cfg.stage}', K={cfg.k}, "
          f"{cfg.steps} steps x {cfg.batch_size} examples in {train_s:.0f} s "
          f"({last['input_tokens_per_s']:.0f} input tokens/s in the last step)")
    print(f"eval: {cfg.n_eval} balanced parent/child pairs; tree compressed, question plain\n")
    print(HEADER)
    print(_row(start_name, start))
    print(_row(f"trained K={cfg.k} merger", trained))
    print(f"(answers that were not 'true'/'false': {start['unparsed']} of {start['n']} before "
          f"training, {trained['unparsed']} after; balanced pairs, so 0.5 is chance)")
    print(f"\nprefill of {timing['batch']} prompts: merged {timing['merged_s'] * 1e3:.1f} ms, "
          f"plain {timing['plain_s'] * 1e3:.1f} ms -> {speed_phrase(timing['speedup'])}")
    ex = eval_set[0]
    print(f"\nexample prompt:\n{prompt_text(ex.segments)}")
    print(f"gold: {ex.target}  generated: ", end="", flush=True)
    for piece in model.stream(ex.segments, max_new_tokens=4):
        print(piece, end="", flush=True)
    print()
    # the base actually trained: a --reader checkpoint without --model brings its own
    result = {"config": asdict(cfg), "base_model": model.config.base_model,
              "start_model": start_name, "start": summary(start),
              "trained": summary(trained),
              "prefill": timing, "train_s": train_s, "last_step": last,
              **made_by}
    write_json_atomic(out / "demo.json", result)
    print(f"\nresults: {out / 'demo.json'}, model: {out / 'checkpoint'}")
    return result


def _start_model(cfg: DemoConfig) -> tuple[KTMModel, str]:
    from ktm.core.checkpoint import read_config
    from ktm.readers import READERS, find_reader, reader_path

    dtype = parse_dtype(cfg.dtype)
    name = cfg.reader
    if name == "auto":
        name = find_reader(cfg.model, cfg.k) or "none"
        if name == "none":
            print(f"no shipped reader fits {cfg.model} at K={cfg.k}: a reader is used for its "
                  "own base model or a local copy of it (same sizes and tokenizer); shipped: "
                  f"{', '.join(sorted(READERS))}. Starting from mean pooling; pass --reader NAME "
                  "to start from one anyway", flush=True)
        elif (own := read_config(reader_path(name))["config"]["k"]) != cfg.k:
            print(f"no shipped reader of K={cfg.k} fits {cfg.model}: reader {name} (K={own}) "
                  f"is recursive, and read at its inner K={cfg.k}", flush=True)
    if name == "none":
        print(f"loading {cfg.model} with K={cfg.k}, mean pooling ...", flush=True)
        model = KTMModel.from_base(cfg.model, k=cfg.k, device=cfg.device, dtype=dtype)
        return model, "untrained (mean pooling)"
    print(f"loading reader {name} (K={cfg.k}) ...", flush=True)
    # a --model other than the default is the base the reader is read on (a local copy of its
    # base model; another model is refused by the load's checks), never silently dropped
    base = None if cfg.model == DEFAULT_MODEL else cfg.model
    model = KTMModel.load(name, base=base, k=cfg.k, device=cfg.device, dtype=dtype,
                          trainable=True)
    return model, f"reader {name}"[:26]
