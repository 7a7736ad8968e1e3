"""``ktm eval``: one JSON result row per run, recording what was really used (the model's saved
config, the task's settings, the compressor's options, the command, versions, git revision)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

from ktm.cli.args import TaskArgs, build_task, from_args, load_or_build, plain, task_settings
from ktm.core.checkpoint import model_record
from ktm.core.levels import merges
from ktm.errors import KTMError
from ktm.evaluation.label_scoring import check_scoring
from ktm.readers import open_checkpoint
from ktm.tasks.base import bind
from ktm.tasks.corpus import HELDOUT, is_heldout


@dataclass
class EvalArgs:
    checkpoint: str | None = field(default=None, metadata={
        "help": "a ktm checkpoint folder or reader (its config is used; model flags given must "
                "agree with it)"})
    json: str | None = field(default=None, metadata={"help": "write the result object here"})
    predictions: str | None = field(default=None, metadata={
        "help": "classification: write one JSON line per example here (prompt as the model "
                "read it, gold label, prediction, generated text), for error analysis"})
    method: str | None = field(default=None, metadata={
        "help": "method name in tables (None: ktm-kK or uncompressed)"})
    merge: bool = field(default=True, metadata={
        "help": "merge the prompts (--no-merge: the same model, uncompressed)"})
    seed: int = field(default=1, metadata={
        "help": "seed for drawing eval examples (or readability windows)"})
    readability: tuple[str, ...] | None = field(default=None, metadata={
        "help": "instead of a task: readability R and recall R on these held-out sets (reviews "
                "of other categories, code of unseen repositories, stdlib: Python "
                "standard-library modules no project file uses) or on a file or folder of "
                f"your own text ({', '.join(HELDOUT)}, or a path)"})
    context_tokens: int = field(default=256, metadata={
        "help": "--readability: tokens of context before each continuation (a document needs "
                "this many plus 64)"})
    n_windows: int = field(default=64, metadata={
        "aliases": ["--n-eval-windows"],  # ktm pretrain's name
        "help": "held-out windows per readability set"})
    scoring: str = field(default="generate", metadata={
        "choices": ["generate", "likelihood"],
        "help": "classification: 'generate' greedy-decodes an answer; 'likelihood' picks the "
                "label whose answer text is most likely (every example gets a label)"})
    n_calibrate: int = field(default=0, metadata={
        "help": "likelihood scoring: correct for the label prior the model gives these many "
                "training-side prompts (no labels used; 0: no correction)"})


def run_eval(args: argparse.Namespace) -> int:
    import time

    from ktm.evaluation.evaluate import evaluate_task
    from ktm.util.fileio import check_writable, write_json_atomic
    from ktm.util.provenance import git_revision, versions

    for path in (args.json, getattr(args, "predictions", None)):
        if path:  # refused now, not after the evaluation
            check_writable(path)

    # what is running, read before the run: a commit or an edit during a long eval is not it
    made_by = {"versions": versions(), "git": git_revision()}
    if args.readability:
        return _eval_readability(args, made_by)
    check_scoring(args.scoring, args.n_calibrate)
    from ktm.compressors.apply import parse_options
    from ktm.compressors.record import resolve

    # read once; a baseline's checkpoint is read with the method it records (compressor.json)
    ckpt = open_checkpoint(args.checkpoint) if args.checkpoint else None
    method_name, options = resolve(ckpt, args.compressor, parse_options(args.compressor_option))
    targs = from_args(TaskArgs, args)
    task = build_task(targs, args.task_option)
    model = load_or_build(args, ckpt)
    bind(task, model)  # a question task counts its documents in the model's tokens
    t0 = time.perf_counter()
    examples = task.eval_examples(targs.n_eval, seed=args.seed)
    natural = (task.natural_eval_examples(targs.n_eval, args.seed)
               if hasattr(task, "natural_eval_examples") else None)  # tree only
    comp = info = None
    if method_name:
        from ktm.compressors.apply import apply_compressor
        from ktm.compressors.base import compress_examples

        # only LTSC fits on training prompts; its state is restored from the checkpoint if there
        model, _, examples, info, comp = apply_compressor(
            method_name, options, model,
            task.train_examples(targs.n_train, seed=0), examples, state_dir=args.checkpoint,
            replace_encoder=not args.checkpoint, compress_train=False)
        if natural and comp.rewrites_prompts:
            natural, _ = compress_examples(comp, natural)
    merge = args.merge and merges(model)
    score = _scoring(args, task)
    result = evaluate_task(model, task, examples, merge=merge, progress=True, **score)
    preds, answers = result.pop("predictions", None), result.pop("answers", None)
    if args.predictions:
        _write_predictions(args.predictions, examples, preds, answers)
    if comp:
        from ktm.compressors.apply import finish_eval_row

        result = finish_eval_row(result, examples, info)
    if natural:  # tree: accuracy on the natural pair distribution too
        nat = evaluate_task(model, task, natural, merge=merge, progress=True, **score)
        result["natural_accuracy"] = nat["accuracy"]
        result["natural_balanced_accuracy"] = nat["balanced_accuracy"]
    method = args.method or method_name or (f"ktm-k{model.k}" if merge else "uncompressed")
    config = {"model": model_record(model), "task": task_settings(task),
              "eval": {"n_eval": targs.n_eval, "seed": args.seed, "merge": merge,
                       "device": str(model.device), "scoring": args.scoring,
                       "backend": backend_record(model),
                       "n_calibrate": args.n_calibrate},
              "compressor": None if comp is None else {
                  "name": comp.name, "options": plain(comp.options()),
                  "fitted_on_n_train": None if info.get("state_restored") else targs.n_train}}
    row = {"task": task.name, "method": method, "k": model.k if merge else None, **result,
           "eval_wall_s": time.perf_counter() - t0, "checkpoint": args.checkpoint,
           "config": config, "command": args.command_line, **made_by}
    if args.json:
        write_json_atomic(args.json, row)
    print(json.dumps({k: v for k, v in row.items() if k not in ("config", "versions")}, indent=2))
    return 0


def _scoring(args: argparse.Namespace, task) -> dict:
    """``evaluate_task``'s scoring options: a classification task's scoring and calibration
    prompts; the classification flags refused for another kind of task."""
    if task.kind == "classification":
        # calibration prompts come from the training side (a seed of their own), never the test
        n_cal = args.n_calibrate
        cal = task.train_examples(n_cal, seed=args.seed + 7919) if n_cal else []
        return {"scoring": args.scoring, "calibration": cal}
    for flag, value, default in (("--predictions", args.predictions, None),
                                 ("--scoring", args.scoring, "generate"),
                                 ("--n-calibrate", args.n_calibrate, 0)):
        if value != default and not (task.kind == "qa" and flag == "--predictions"):
            raise KTMError(f"{flag} is for classification tasks; {task.name!r} is scored "
                           f"by {'perplexity' if task.kind == 'perplexity' else 'its answers'}")
    return {}


def backend_record(model) -> dict:
    """The backend a row was measured on (llama.cpp, vLLM: their files and settings)."""
    return {"name": model.runtime.name, **model.runtime.record()}


def _write_predictions(path: str, examples, preds, answers) -> None:
    from ktm.util.fileio import write_text_atomic

    # a question task's prediction is whether the answer holds the wanted values
    rows = [{"i": i, "prompt": [{"text": s.text, "compress": s.compress} for s in e.segments],
             "gold": e.label if e.label is not None else e.meta.get("answers"),
             "prediction": p, "answer": a,
             "correct": p if e.label is None and "answers" in e.meta else p == e.label}
            for i, (e, p, a) in enumerate(zip(examples, preds, answers))]
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


def _eval_readability(args: argparse.Namespace, made_by: dict) -> int:
    """R and the three NLLs on held-out text, per set, as one result row."""
    import time

    from ktm.evaluation.readability import BOOTSTRAP, heldout_readability
    from ktm.util.fileio import write_json_atomic

    ckpt = open_checkpoint(args.checkpoint) if args.checkpoint else None  # read once
    name, options = _readability_method(args, ckpt)
    for spec in args.readability:  # refused before the model loads
        if not is_heldout(spec):
            raise KTMError(f"--readability {spec!r} is neither a held-out set "
                           f"({', '.join(HELDOUT)}) nor an existing file or folder of text")
    model = load_or_build(args, ckpt)
    comp = None
    if name:  # mean pooling: only the encoder setting, which R reads like any merger's
        from ktm.compressors.apply import apply_compressor

        comp = apply_compressor(name, options, model, [], [], state_dir=args.checkpoint,
                                replace_encoder=not args.checkpoint,
                                compress_train=False).compressor
    t0 = time.perf_counter()
    sets = heldout_readability(model, args.readability, args.n_windows, seed=args.seed,
                               progress=True, context_tokens=args.context_tokens,
                               merge=args.merge)
    method = args.method or name or (f"ktm-k{model.k}" if merges(model) and args.merge
                                     else "uncompressed")
    config = {"model": model_record(model),
              "readability": {"sets": list(args.readability), "n_windows": args.n_windows,
                              "context_tokens": args.context_tokens, "merge": args.merge,
                              "seed": args.seed, "device": str(model.device),
                              "ci_bootstrap": BOOTSTRAP, "backend": backend_record(model)},
              "compressor": None if comp is None else {"name": comp.name,
                                                       "options": plain(comp.options())}}
    row = {"task": "readability", "method": method, "k": model.k, "readability": sets,
           "n_windows": args.n_windows, "eval_wall_s": time.perf_counter() - t0,
           "checkpoint": args.checkpoint, "config": config, "command": args.command_line,
           **made_by}
    if args.json:
        write_json_atomic(args.json, row)
    print(json.dumps({k: v for k, v in row.items() if k not in ("config", "versions")}, indent=2))
    return 0


def _readability_method(args: argparse.Namespace, ckpt) -> tuple[str | None, dict]:
    """The baseline R is read with (the checkpoint's record, or --compressor); refused when it
    rewrites prompts: R reads held-out text as given, merged and plain, so for a model trained on
    rewritten prompts it would measure another model under the baseline's name."""
    from ktm.compressors import COMPRESSORS
    from ktm.compressors.apply import parse_options
    from ktm.compressors.record import RECORD, resolve

    name, options = resolve(ckpt, args.compressor, parse_options(args.compressor_option))
    if name and COMPRESSORS[name].rewrites_prompts:
        source = (f"checkpoint {args.checkpoint!r} was trained with it ({RECORD})"
                  if args.compressor is None else f"--compressor {name}")
        raise KTMError(f"ktm eval --readability reads held-out text as given (merged and plain), "
                       f"not rewritten by {name}, and {source}: R is not defined for it; "
                       "expected a checkpoint trained without a baseline or with mean_pool "
                       "(score this one on a task: ktm eval --task)")
    return name, options
