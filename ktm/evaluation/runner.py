"""``ktm eval`` as a library function: ``run(EvalConfig(...))`` evaluates a model on a task (or
readability R on held-out text) and returns one result row recording what was really used (the
model's saved config, the task's settings, the compressor's options, the runtime, versions,
git revision). The CLI only parses its flags into an ``EvalConfig``.

    from ktm.evaluation.runner import EvalConfig, run
    from ktm.core.config import ModelSpec
    from ktm.tasks.spec import TaskSpec

    row = run(EvalConfig(model=ModelSpec("smollm2-135m-k4-qa"),
                         task=TaskSpec("needle", n_eval=20), task_options={"length": 1024}))
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ktm.compressors.record import resolve
from ktm.core.checkpoint import model_record
from ktm.core.config import ModelSpec
from ktm.core.levels import merges
from ktm.errors import KTMError
from ktm.evaluation.evaluate import evaluate_task
from ktm.evaluation.label_scoring import check_scoring
from ktm.model import RuntimeSpec, open_model
from ktm.readers import open_checkpoint
from ktm.tasks.base import bind
from ktm.tasks.corpus import HELDOUT, is_heldout
from ktm.tasks.spec import TaskSpec, task_settings
from ktm.util.fileio import check_writable, write_json_atomic, write_text_atomic
from ktm.util.provenance import git_revision, plain, versions


@dataclass(frozen=True)
class EvalConfig:
    """One evaluation: the model (``ModelSpec``), the task and its options, a baseline
    compressor, where it runs (``RuntimeSpec``), and the evaluation's own settings. The
    fields with help text are ``ktm eval``'s flags."""

    json: str | None = field(default=None, metadata={
        "group": "evaluation", "help": "write the result object here"})
    predictions: str | None = field(default=None, metadata={
        "group": "evaluation",
        "help": "classification: write one JSON line per example here (prompt as the model "
                "read it, gold label, prediction, generated text), for error analysis"})
    method: str | None = field(default=None, metadata={
        "group": "evaluation", "help": "method name in tables (None: ktm-kK or uncompressed)"})
    merge: bool = field(default=True, metadata={
        "group": "evaluation",
        "help": "merge the prompts (--no-merge: the same model, uncompressed)"})
    seed: int = field(default=1, metadata={
        "group": "evaluation", "help": "seed for drawing eval examples (or readability windows)"})
    readability: tuple[str, ...] | None = field(default=None, metadata={
        "group": "evaluation",
        "help": "instead of a task: readability R and recall R on these held-out sets (reviews "
                "of other categories, code of unseen repositories, stdlib: Python "
                "standard-library modules no project file uses) or on a file or folder of "
                f"your own text ({', '.join(HELDOUT)}, or a path)"})
    context_tokens: int = field(default=256, metadata={
        "group": "evaluation",
        "help": "--readability: tokens of context before each continuation (a document needs "
                "this many plus 64)"})
    n_windows: int = field(default=64, metadata={
        "group": "evaluation",
        "aliases": ["--n-eval-windows"],  # ktm pretrain's name
        "help": "held-out windows per readability set"})
    scoring: str = field(default="generate", metadata={
        "group": "evaluation", "choices": ["generate", "likelihood"],
        "help": "classification: 'generate' greedy-decodes an answer; 'likelihood' picks the "
                "label whose answer text is most likely (every example gets a label)"})
    n_calibrate: int = field(default=0, metadata={
        "group": "evaluation",
        "help": "likelihood scoring: correct for the label prior the model gives these many "
                "training-side prompts (no labels used; 0: no correction)"})
    task: TaskSpec = field(default_factory=TaskSpec, metadata={"prefix": "", "group": "task"})
    task_options: dict[str, Any] = field(default_factory=dict, metadata={"flag": None})
    compressor: str | None = field(default=None, metadata={"flag": None})
    compressor_options: dict[str, Any] = field(default_factory=dict, metadata={"flag": None})
    model: ModelSpec = field(default_factory=ModelSpec, metadata={"prefix": "",
                                                                  "group": "model"})
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec, metadata={"prefix": "",
                                                                        "group": "runtime"})
    command: str | None = field(default=None, metadata={"flag": None})  # recorded in the row


def run(config: EvalConfig, progress: bool = True) -> dict:
    """Evaluate as ``config`` says; the result row (also written to ``config.json``)."""
    for path in (config.json, config.predictions):
        if path:  # refused now, not after the evaluation
            check_writable(path)
    # what is running, read before the run: a commit or an edit during a long eval is not it
    made_by = {"versions": versions(), "git": git_revision()}
    if config.readability:
        row = _readability(config, progress)
    else:
        row = _task(config, progress)
    row = {**row, "command": config.command, **made_by}
    if config.json:
        write_json_atomic(config.json, row)
    return row


def _opened(config: EvalConfig):
    """The checkpoint, read once (None: a fresh model), and the model spec that reads it."""
    if config.model.checkpoint is None:
        return None, config.model
    ckpt = open_checkpoint(config.model.checkpoint)
    return ckpt, ModelSpec(ckpt, config.model.settings, config.model.device)


def _task(config: EvalConfig, progress: bool) -> dict:
    check_scoring(config.scoring, config.n_calibrate)
    # a baseline's checkpoint is read with the method it records (compressor.json)
    ckpt, spec = _opened(config)
    method_name, options = resolve(ckpt, config.compressor, config.compressor_options)
    task = config.task.build(config.task_options)
    model = open_model(spec, runtime=config.runtime)
    bind(task, model)  # a question task counts its documents in the model's tokens
    t0 = time.perf_counter()
    n_eval, seed = config.task.n_eval, config.seed
    examples = task.eval_examples(n_eval, seed=seed)
    natural = (task.natural_eval_examples(n_eval, seed)
               if hasattr(task, "natural_eval_examples") else None)  # tree only
    comp = info = None
    if method_name:
        from ktm.compressors.apply import apply_compressor
        from ktm.compressors.base import compress_examples

        # only LTSC fits on training prompts; its state is restored from the checkpoint if there
        model, _, examples, info, comp = apply_compressor(
            method_name, options, model, task.train_examples(config.task.n_train, seed=0),
            examples, state_dir=ckpt and ckpt.path, replace_encoder=ckpt is None,
            compress_train=False)
        if natural and comp.rewrites_prompts:
            natural, _ = compress_examples(comp, natural)
    merge = config.merge and merges(model)
    score = _scoring(config, task)
    result = evaluate_task(model, task, examples, merge=merge, progress=progress, **score)
    preds, answers = result.pop("predictions", None), result.pop("answers", None)
    if config.predictions:
        _write_predictions(config.predictions, examples, preds, answers)
    if comp:
        from ktm.compressors.apply import finish_eval_row

        result = finish_eval_row(result, examples, info)
    if natural:  # tree: accuracy on the natural pair distribution too
        nat = evaluate_task(model, task, natural, merge=merge, progress=progress, **score)
        result["natural_accuracy"] = nat["accuracy"]
        result["natural_balanced_accuracy"] = nat["balanced_accuracy"]
    method = config.method or method_name or (f"ktm-k{model.k}" if merge else "uncompressed")
    record = {"model": model_record(model), "task": task_settings(task),
              "eval": {"n_eval": n_eval, "seed": seed, "merge": merge,
                       "device": str(model.device), "scoring": config.scoring,
                       "backend": backend_record(model), "n_calibrate": config.n_calibrate},
              "compressor": None if comp is None else {
                  "name": comp.name, "options": plain(comp.options()),
                  "fitted_on_n_train": None if info.get("state_restored")
                  else config.task.n_train}}
    return {"task": task.name, "method": method, "k": model.k if merge else None, **result,
            "eval_wall_s": time.perf_counter() - t0, "checkpoint": ckpt and ckpt.name,
            "config": record}


def _scoring(config: EvalConfig, task) -> dict:
    """``evaluate_task``'s scoring options: a classification task's scoring and calibration
    prompts; the classification settings refused for another kind of task."""
    if task.kind == "classification":
        # calibration prompts come from the training side (a seed of their own), never the test
        n_cal = config.n_calibrate
        cal = task.train_examples(n_cal, seed=config.seed + 7919) if n_cal else []
        return {"scoring": config.scoring, "calibration": cal}
    for flag, value, default in (("--predictions", config.predictions, None),
                                 ("--scoring", config.scoring, "generate"),
                                 ("--n-calibrate", config.n_calibrate, 0)):
        if value != default and not (task.kind == "qa" and flag == "--predictions"):
            raise KTMError(f"{flag} is for classification tasks; {task.name!r} is scored "
                           f"by {'perplexity' if task.kind == 'perplexity' else 'its answers'}")
    return {}


def backend_record(model) -> dict:
    """The backend a row was measured on (llama.cpp, vLLM: their files and settings)."""
    return {"name": model.runtime.name, **model.runtime.record()}


def _write_predictions(path: str, examples, preds, answers) -> None:
    import json

    # a question task's prediction is whether the answer holds the wanted values
    rows = [{"i": i, "prompt": [{"text": s.text, "compress": s.compress} for s in e.segments],
             "gold": e.label if e.label is not None else e.meta.get("answers"),
             "prediction": p, "answer": a,
             "correct": p if e.label is None and "answers" in e.meta else p == e.label}
            for i, (e, p, a) in enumerate(zip(examples, preds, answers))]
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


def _readability(config: EvalConfig, progress: bool) -> dict:
    """R and the three NLLs on held-out text, per set, as one result row."""
    from ktm.evaluation.readability import BOOTSTRAP, heldout_readability

    ckpt, spec = _opened(config)
    name, options = _readability_method(config, ckpt)
    for where in config.readability:  # refused before the model loads
        if not is_heldout(where):
            raise KTMError(f"--readability {where!r} is neither a held-out set "
                           f"({', '.join(HELDOUT)}) nor an existing file or folder of text")
    model = open_model(spec, runtime=config.runtime)
    comp = None
    if name:  # mean pooling: only the encoder setting, which R reads like any merger's
        from ktm.compressors.apply import apply_compressor

        comp = apply_compressor(name, options, model, [], [], state_dir=ckpt and ckpt.path,
                                replace_encoder=ckpt is None, compress_train=False).compressor
    t0 = time.perf_counter()
    sets = heldout_readability(model, config.readability, config.n_windows, seed=config.seed,
                               progress=progress, context_tokens=config.context_tokens,
                               merge=config.merge)
    method = config.method or name or (f"ktm-k{model.k}" if merges(model) and config.merge
                                       else "uncompressed")
    record = {"model": model_record(model),
              "readability": {"sets": list(config.readability), "n_windows": config.n_windows,
                              "context_tokens": config.context_tokens, "merge": config.merge,
                              "seed": config.seed, "device": str(model.device),
                              "ci_bootstrap": BOOTSTRAP, "backend": backend_record(model)},
              "compressor": None if comp is None else {"name": comp.name,
                                                       "options": plain(comp.options())}}
    return {"task": "readability", "method": method, "k": model.k, "readability": sets,
            "n_windows": config.n_windows, "eval_wall_s": time.perf_counter() - t0,
            "checkpoint": ckpt and ckpt.name, "config": record}


def _readability_method(config: EvalConfig, ckpt) -> tuple[str | None, dict]:
    """The baseline R is read with (the checkpoint's record, or ``compressor``); refused when
    it rewrites prompts: R reads held-out text as given, merged and plain, so for a model
    trained on rewritten prompts it would measure another model under the baseline's name."""
    from ktm.compressors import COMPRESSORS
    from ktm.compressors.record import RECORD

    name, options = resolve(ckpt, config.compressor, config.compressor_options)
    if name and COMPRESSORS[name].rewrites_prompts:
        source = (f"checkpoint {ckpt.name!r} was trained with it ({RECORD})"
                  if config.compressor is None else f"--compressor {name}")
        raise KTMError(f"ktm eval --readability reads held-out text as given (merged and plain), "
                       f"not rewritten by {name}, and {source}: R is not defined for it; "
                       "expected a checkpoint trained without a baseline or with mean_pool "
                       "(score this one on a task: ktm eval --task)")
    return name, options
