"""``ktm demo``: the main job. Fine-tune a K=4 merger on a tree stage in a few CPU minutes.

It starts from the shipped reader for the model and K (``smollm2-135m-k4``: an encoder + LoRA
pretrained to read merged text, see ``ktm.readers``), or from plain mean pooling with
``--reader none``. It evaluates the start, fine-tunes on the task, evaluates again, times the
compressed against the plain prefill, and shows a generation.

Tree prompts are short, so it then reads one long prompt, where merging pays: about 1,500
tokens of text no shipped data holds (Python standard-library source), read by the start model
(the reader, untouched by the fine-tune) merged and plain, each answering with 64 tokens through
the one decode path. It prints tokens in and out, the time to first token, the end-to-end time
and the readability R of that text (``ktm.evaluation.readability``).

It ends with one question about a document four times the model's window (``--question-tokens``,
32,768 by default: standard-library source with one line ``# The secret code for NAME is
NUMBER.`` at a seeded depth), the needle task's evaluation example as the library reads it: the
document merged, then the question marked and plain with its answer cue. The question reader
(``smollm2-135m-k4-qa`` for the embedded model) fits the document to the window by itself
(``ktm.core.fit``); the plain model reads the document's last tokens that fit its window, then
the same question (truncation, what a user of the plain model can do). Each says its answer,
whether it holds the number, the positions read and the time to the first token. (Asked in a
chat instead, as ``ktm ask`` asks, the shipped question reader finds about half such needles:
results/question/README.md.)
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ktm.bench.measure import infer_once
from ktm.core.base_model import parse_dtype
from ktm.core.config import DEFAULT_MODEL
from ktm.core.prompt import Segment, prompt_text
from ktm.errors import KTMError
from ktm.evaluation.evaluate import evaluate_classification, summary
from ktm.evaluation.readability import readability
from ktm.model import KTMModel
from ktm.tasks.corpus import Window
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
    long_tokens: int = field(default=1536, metadata={
        "help": "tokens of the long prompt (0: skip it); fewer where the model's positions end"})
    answer_tokens: int = field(default=64, metadata={"help": "tokens of the long prompt's answer"})
    question_tokens: int = field(default=32768, metadata={
        "help": "tokens of the long document the demo ends with a question about (0: skip it)"})
    question_reader: str = field(default="auto", metadata={
        "help": "the reader that answers it: auto (the shipped question reader of the embedded "
                "model; none for another model) or a reader name / checkpoint folder"})
    device: str = field(default="cpu", metadata={"help": "torch device"})
    dtype: str = field(default="float32", metadata={"help": "float32 | bfloat16 | float16"})

    def __post_init__(self) -> None:
        if self.long_tokens < 0 or self.answer_tokens < 1:
            raise KTMError(f"long_tokens must be >= 0 and answer_tokens >= 1, got "
                           f"{self.long_tokens} and {self.answer_tokens}")
        if self.question_tokens < 0:
            raise KTMError(f"question_tokens must be >= 0, got {self.question_tokens}")


@torch.no_grad()
def time_prefill(model: KTMModel, prompts, repeats: int = 5) -> dict:
    """Median prefill seconds (encoder included), merged vs plain, interleaved so drift hits
    both alike; through ``ktm.decode.generate``'s own prefill, on a clock that waits for the
    device."""
    def once(merge: bool) -> float:
        t0 = clock(model.device)
        model.runtime.prefill(model.encode_prompts(prompts, merge))
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
    reader = start_name(cfg)
    model, start_label = load_start(cfg, reader)
    task = TreeTask(stage=cfg.stage, prompt_mode="context")
    train_set = task.train_examples(cfg.steps * cfg.batch_size, seed=cfg.seed)
    eval_set = task.eval_examples(cfg.n_eval, seed=cfg.seed + 1)

    print(f"evaluating the start ({start_label}) ...", flush=True)
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
    base_model = model.config.base_model

    print(f"\nK-Token Merging demo: tree stage '{cfg.stage}', K={cfg.k}, "
          f"{cfg.steps} steps x {cfg.batch_size} examples in {train_s:.0f} s "
          f"({last['input_tokens_per_s']:.0f} input tokens/s in the last step)")
    print(f"eval: {cfg.n_eval} balanced parent/child pairs; tree compressed, question plain\n")
    print(HEADER)
    print(_row(start_label, start))
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
    long = None
    del model  # the start model is loaded afresh: the fine-tune changed this one
    if cfg.long_tokens:
        long = long_prompt(cfg, reader)
    question = long_question(cfg) if cfg.question_tokens else None
    # the base actually trained: a --reader checkpoint without --model brings its own
    result = {"config": asdict(cfg), "base_model": base_model,
              "start_model": start_label, "start": summary(start),
              "trained": summary(trained),
              "prefill": timing, "train_s": train_s, "last_step": last,
              "long_prompt": long, "long_question": question, **made_by}
    write_json_atomic(out / "demo.json", result)
    print(f"\nresults: {out / 'demo.json'}, model: {out / 'checkpoint'}")
    return result


def start_name(cfg: DemoConfig) -> str:
    """The reader the demo starts from (``--reader auto`` resolved), or "none"; says why where
    ``auto`` found none or a recursive one."""
    from ktm.core.checkpoint import read_config
    from ktm.readers import READERS, find_reader, reader_path

    if cfg.reader != "auto":
        return cfg.reader
    name = find_reader(cfg.model, cfg.k) or "none"
    if name == "none":
        print(f"no shipped reader fits {cfg.model} at K={cfg.k}: a reader is used for its "
              "own base model or a local copy of it (same sizes and tokenizer); shipped: "
              f"{', '.join(sorted(READERS))}. Starting from mean pooling; pass --reader NAME "
              "to start from one anyway", flush=True)
    elif (own := read_config(reader_path(name))["config"]["k"]) != cfg.k:
        print(f"no shipped reader of K={cfg.k} fits {cfg.model}: reader {name} (K={own}) "
              f"is recursive, and read at its inner K={cfg.k}", flush=True)
    return name


def load_start(cfg: DemoConfig, name: str) -> tuple[KTMModel, str]:
    """The start model ``name`` (``start_name``) and its label."""
    dtype = parse_dtype(cfg.dtype)
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


# Python standard-library modules whose source is the long prompt's text: text that no shipped
# data file holds (their class definitions appear nowhere in the CommitPack file)
LONG_SOURCES = ("textwrap", "difflib", "fractions", "shlex")
LONG_WINDOWS = 4  # windows R is pooled over; the first one is also timed


def long_windows(model: KTMModel, context: int, target: int) -> list[Window]:
    """Up to ``LONG_WINDOWS`` (context, continuation) windows cut from the start of each
    standard-library source that has ``context + target`` tokens."""
    import importlib

    windows = []
    for name in LONG_SOURCES:
        path = getattr(importlib.import_module(name), "__file__", None)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (TypeError, OSError, UnicodeDecodeError):
            continue  # a Python without the module's source (only .pyc)
        ids = model.tokenize(text)
        for start in range(0, len(ids) - context - target + 1, context + target):
            windows.append(Window(tuple(ids[start:start + context]),
                                  tuple(ids[start + context:start + context + target]),
                                  f"{name}.py"))
            if len(windows) == LONG_WINDOWS:
                return windows
    return windows


def long_prompt(cfg: DemoConfig, reader: str) -> dict | None:
    """The start model on one long prompt, merged against plain: tokens, time to first token,
    end-to-end time of a ``cfg.answer_tokens`` answer (interleaved, after a warm-up), and R."""
    torch.manual_seed(cfg.seed)
    model, name = load_start(cfg, reader)
    model.eval()
    room = (model.max_positions or cfg.long_tokens + cfg.answer_tokens + 1) - len(model.lead_ids)
    context = min(cfg.long_tokens, room - cfg.answer_tokens - 1) // cfg.k * cfg.k
    windows = long_windows(model, context, cfg.answer_tokens) if context >= cfg.k else []
    if not windows:
        print(f"\n(no long prompt: this Python has no readable source of {LONG_SOURCES} "
              f"long enough for {context} + {cfg.answer_tokens} tokens)")
        return None
    row = [list(model.lead_ids) + list(windows[0].context)]
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for merge in (True, False):  # warm-up: a short answer is enough to touch every path
        infer_once(model, row, merge, min(2, cfg.answer_tokens))
    for repeat in range(2):  # two timed runs each, interleaved (A B, B A)
        for merge in (True, False) if repeat % 2 == 0 else (False, True):
            runs[merge].append(infer_once(model, row, merge, cfg.answer_tokens))
    times = {merge: {key: statistics.median(r[key] for r in rs)
                     for key in ("ttft_s", "e2e_s", "decode_tokens_per_s")}
             for merge, rs in runs.items()}
    r = readability(model, windows)
    src = ", ".join(sorted({w.source for w in windows}))
    tokens_in = len(row[0])
    out = {"merged": {"tokens_in": tokens_in, "tokens_out": runs[True][0]["compressed_tokens"],
                      **times[True]},
           "plain": {"tokens_in": tokens_in, "tokens_out": runs[False][0]["compressed_tokens"],
                     **times[False]},
           "answer_tokens": cfg.answer_tokens, "model": name, "sources": src,
           "ttft_speedup": times[False]["ttft_s"] / times[True]["ttft_s"],
           "e2e_speedup": times[False]["e2e_s"] / times[True]["e2e_s"],
           "R": r["R"], "R_windows": r["windows"]}
    print(f"\nlong prompt: {tokens_in} tokens of {src} (Python standard library, text no "
          f"shipped data holds), a {cfg.answer_tokens}-token answer, read by {name}")
    print("| prompt          | tokens in | tokens read | first token | whole answer |")
    print("|-----------------|-----------|-------------|-------------|--------------|")
    for label, key in ((f"merged (K={cfg.k})", "merged"), ("plain", "plain")):
        o = out[key]
        print(f"| {label:<15} | {o['tokens_in']:>9} | {o['tokens_out']:>11} | "
              f"{o['ttft_s']:>9.2f} s | {o['e2e_s']:>10.2f} s |")
    r_text = "none (the plain context barely helps)" if r["R"] is None else f"{r['R']:.2f}"
    print(f"merged: first token {speed_phrase(out['ttft_speedup'])}, whole answer "
          f"{speed_phrase(out['e2e_speedup'])}; readability R on {r['windows']} such windows: "
          f"{r_text} (the share of what the text tells the LM that survives merging)")
    return out


QUESTION_ANSWER_TOKENS = 24  # the long question's answer: the code and a few words
# the embedded model's reader for the long question, asked as the library asks it (the question
# marked, with its answer cue; ``ktm ask``'s chat layout has its own default reader)
QUESTION_READER = "smollm2-135m-k4-qa"


def question_reader_name(cfg: DemoConfig) -> str | None:
    """The reader the long question is asked of (``--question-reader`` resolved); None where
    ``auto`` finds none for the model."""
    if cfg.question_reader != "auto":
        return cfg.question_reader
    return QUESTION_READER if cfg.model == DEFAULT_MODEL else None


def long_question(cfg: DemoConfig) -> dict | None:
    """One question about a ``cfg.question_tokens``-token document (the needle task's
    evaluation document), read by the question reader as it fits it and by the plain model on
    the document's last tokens that fit its window, each answer streamed; their positions, time
    to the first token and whether the answer holds the needle's number."""
    from ktm.cli.ask import stream_answer
    from ktm.evaluation.evaluate import hit
    from ktm.model import load_any
    from ktm.tasks import get_task
    from ktm.tasks.base import bind

    name = question_reader_name(cfg)
    if name is None:
        print(f"\n(no long question: no shipped question reader for {cfg.model}; pass "
              "--question-reader NAME)")
        return None
    dtype = parse_dtype(cfg.dtype)
    reader = KTMModel.load(name, base=None if cfg.model == DEFAULT_MODEL else cfg.model,
                           device=cfg.device, dtype=dtype)
    task = get_task("needle", length=cfg.question_tokens)
    bind(task, reader)
    (example,) = task.eval_examples(1, seed=cfg.seed)
    document, asked = example.segments  # the document merged, the question marked and plain
    # the question as a user types it: the task's, without its answer cue
    question = asked.text.split("? Answer:")[0].replace("Question:", "").strip() + "?"
    question = question[0].upper() + question[1:]
    needle = next(line.strip() for line in document.text.splitlines()
                  if example.meta["answers"][0] in line)
    plain = load_any(cfg.model, device=cfg.device, dtype=dtype)
    readings = {"question reader": (reader, (document, asked), True),
                "plain, last tokens": (plain, window_tail(plain, document.text, asked), False)}
    rows = {}
    print(f"\nlong question: {example.meta['tokens']} tokens of Python standard-library source "
          f"(the model reads {reader.max_positions} positions), one line of it "
          f"\"{needle}\"; asked: {question}")
    for label, (model, prompt, merge) in readings.items():
        print(f"{label}: ", end="", flush=True)
        read = stream_answer(model, prompt, QUESTION_ANSWER_TOKENS, sys.stdout, merge=merge)
        cp = read["layout"]
        rows[label] = {"tokens_in": cp.tokens_in, "positions": cp.next_position,
                       "first_token_s": read["first_token_s"], "answer": read["answer"],
                       "found": hit(read["answer"], example.meta["answers"])}
    print("| reading            | tokens read | positions | first token | found |")
    print("|--------------------|-------------|-----------|-------------|-------|")
    for label, r in rows.items():
        first = "–" if r["first_token_s"] is None else f"{r['first_token_s']:.1f} s"
        print(f"| {label:<18} | {r['tokens_in']:>11} | {r['positions']:>9} | {first:>11} | "
              f"{'yes' if r['found'] else 'no':>5} |")
    return {"reader": name, "document_tokens": example.meta["tokens"], "question": question,
            "answers": example.meta["answers"], "readings": rows}


def window_tail(model: KTMModel, document: str, question: Segment) -> tuple[Segment, ...]:
    """The plain model's prompt: the document's last tokens that fit its window with the
    question and the answer, then the question."""
    if model.max_positions is None:  # no known window: the whole document
        return Segment(document), question
    ids = model.tokenize(document)
    room = model.max_positions - QUESTION_ANSWER_TOKENS
    keep = len(ids)
    while keep > 0:
        prompt = (Segment(model.tokenizer.decode(ids[len(ids) - keep:])), question)
        over = model.encode_prompts([prompt], merge=False, embed=False)[0].next_position - room
        if over <= 0:
            return prompt
        keep -= over  # the question takes the rest
    raise KTMError(f"the question {question.text!r} leaves no room in the model's "
                   f"{model.max_positions} positions for the document")
