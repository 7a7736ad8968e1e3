"""Scoring a model on a task's examples: accuracy for classification, perplexity for generation.

Both report the exact prompt token counts before and after merging, so length reduction is
measured on the prompts actually evaluated, and the merging overhead: ``compression_s`` and
``compression_ms_per_1k_tokens``, per 1k prompt tokens before merging (a baseline that rewrote
the prompts first re-bases it on the original prompts: ``ktm.compressors.apply.finish_eval_row``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import torch
from tqdm.auto import tqdm

from ktm.core.allocate import quiet_ratio
from ktm.core.loss import target_ids
from ktm.decode.generate import eval_mode
from ktm.errors import KTMError
from ktm.evaluation.label_scoring import (
    check_scoring,
    decide,
    label_logprobs,
    label_prior,
    prior_dict,
)
from ktm.evaluation.metrics import accuracy, balanced_accuracy, perplexity
from ktm.evaluation.tally import Tally
from ktm.tasks.base import Example
from ktm.tasks.fits import check_examples_fit
from ktm.tasks.labels import parse_label


def eval_mode_call(fn):
    """Run ``fn(model, ...)`` in eval mode (no dropout), then give the caller's mode back."""
    @functools.wraps(fn)
    def wrapper(model, *args, **kwargs):
        with eval_mode(model):
            return fn(model, *args, **kwargs)

    return wrapper


def _batches(items: Sequence, size: int):
    for i in range(0, len(items), size):
        yield items[i:i + size]


PER_EXAMPLE = ("predictions", "answers")  # lists, one entry per example


def summary(result: dict) -> dict:
    """An evaluation result without its per-example lists: the row that results files keep."""
    return {k: v for k, v in result.items() if k not in PER_EXAMPLE}


@torch.no_grad()
@eval_mode_call
def evaluate_classification(model, examples: Sequence[Example], labels: Sequence[str], *,
                            merge: bool = True, batch_size: int = 16, max_new_tokens: int = 4,
                            progress: bool = False, scoring: str = "generate",
                            targets: Sequence[str] | None = None,
                            calibration: Sequence[Example] = (),
                            parse: Callable[[str], str | None] | None = None) -> dict:
    """Accuracy and balanced accuracy of a label per example.

    ``scoring="generate"``: greedy-generate an answer and compare its first word with the gold
    label (``parse``: another reading of the answer, e.g. the task's own). ``"likelihood"``: the
    label whose answer text (``targets``, one per label; default the labels themselves) is most
    likely, corrected for the prior the model gives each label on the ``calibration`` prompts
    when there are any (``ktm.evaluation.label_scoring``).
    """
    check_scoring(scoring, len(calibration))
    if scoring == "likelihood":
        return _by_likelihood(model, examples, labels, targets or labels, calibration,
                              merge=merge, batch_size=batch_size, progress=progress)
    preds: list[str | None] = []
    answers: list[str] = []
    tally = Tally()
    t0 = time.perf_counter()
    for batch in tqdm(list(_batches(examples, batch_size)), desc="eval", disable=not progress):
        prompts = [e.segments for e in batch]
        prefixes = tally.encode(model, prompts, merge)
        texts = model.generate(prompts, prefixes=prefixes, max_new_tokens=max_new_tokens,
                               merge=merge)
        answers += texts
        preds += [parse(t) if parse else parse_label(t, labels) for t in texts]
    return _class_row(examples, labels, preds, answers, tally, t0)


def _by_likelihood(model, examples, labels, targets, calibration, *, merge, batch_size,
                   progress) -> dict:
    if len(targets) != len(labels):
        raise KTMError(f"{len(targets)} answer texts for {len(labels)} labels: expected one each")
    t0 = time.perf_counter()
    prior = None
    if calibration:
        cal, _ = label_logprobs(model, calibration, targets, merge=merge,
                                batch_size=batch_size, progress=progress, desc="calibrate")
        prior = label_prior(cal)
    t1 = time.perf_counter()
    logp, counts = label_logprobs(model, examples, targets, merge=merge, batch_size=batch_size,
                                  progress=progress)
    preds = decide(logp, labels, prior)
    # the per-example record: each label's log-probability, rounded for the predictions file
    answers = [{lab: round(v, 4) for lab, v in zip(labels, row, strict=True)}
               for row in logp.tolist()]
    row = _class_row(examples, labels, preds, answers, counts, t1)
    uncorrected = row["balanced_accuracy"] if prior is None else balanced_accuracy(
        decide(logp, labels), _golds(examples), labels)
    row["scoring"] = {"method": "likelihood", "targets": list(targets),
                      "n_calibrate": len(calibration),
                      "prior": None if prior is None else prior_dict(prior, labels),
                      "uncorrected_balanced_accuracy": uncorrected,
                      "calibrate_s": t1 - t0}
    return row


def _golds(examples: Sequence[Example]) -> list[str]:
    return [e.label or e.target.strip() for e in examples]


def _class_row(examples, labels, preds, answers, tally: Tally, t0: float) -> dict:
    golds = _golds(examples)
    return {
        "n": len(examples),
        "accuracy": accuracy(preds, golds),
        "balanced_accuracy": balanced_accuracy(preds, golds, labels),
        "unparsed": sum(p is None for p in preds),
        **tally.fields(len(examples)),
        "wall_s": time.perf_counter() - t0,
        # the parsed label (None: unparsed) and the generated text (likelihood: label log-probs)
        "predictions": preds,
        "answers": answers,
    }


@torch.no_grad()
@eval_mode_call
def evaluate_perplexity(model, examples: Sequence[Example], *, merge: bool = True,
                        batch_size: int = 4, progress: bool = False) -> dict:
    """Perplexity of the targets given the (merged) prompts, pooled over all target tokens."""
    nll, n_tok = 0.0, 0
    tally = Tally()
    t0 = time.perf_counter()
    for batch in tqdm(list(_batches(examples, batch_size)), desc="eval", disable=not progress):
        prompts = [e.segments for e in batch]
        prefixes = tally.encode(model, prompts, merge)
        out = model(prompts, [e.target for e in batch], merge=merge, prefixes=prefixes)
        nll += float(out.nll.sum())
        n_tok += int(out.n_tokens.sum())
    return {
        "n": len(examples),
        "perplexity": perplexity(nll, n_tok),
        "target_tokens": n_tok,
        **tally.fields(len(examples)),
        "wall_s": time.perf_counter() - t0,
    }


def hit(answer: str, wanted: Sequence[str]) -> bool:
    """Whether a generated answer holds every wanted value (spaces aside: ``f(a, b)`` and
    ``f(a,b)`` are one expression)."""
    flat = "".join(answer.split())
    return all("".join(w.split()) in flat for w in wanted)


@torch.no_grad()
@eval_mode_call
def evaluate_qa(model, examples: Sequence[Example], *, merge: bool = True, batch_size: int = 1,
                max_new_tokens: int = 16, progress: bool = False) -> dict:
    """Accuracy of open answers: a hit is a greedy answer holding every value of the example's
    ``meta["answers"]`` (``hit``). Also by depth (``meta["depth"]``, where the task sets one,
    to two decimals), and the seconds spent encoding (``compression_s``: merging and
    allocating, the question allocator's scoring included) and prefilling (``prefill_s``: the
    runtime's prefill alone, a KV press included), over all examples as the other kinds' rows
    count them; per example, their sum is the time to the first token but for one step."""
    tally, prefill_s = Tally(), 0.0
    answers: list[str] = []
    t0 = time.perf_counter()
    for batch in tqdm(list(_batches(examples, batch_size)), desc="eval", disable=not progress):
        prompts = [e.segments for e in batch]
        prefixes = tally.encode(model, prompts, merge, room=max(max_new_tokens - 1, 0))
        timing: dict = {}
        answers += model.generate(prompts, prefixes=prefixes, timing=timing,
                                  max_new_tokens=max_new_tokens, merge=merge)
        prefill_s += timing["prefill_s"]
    hits = [hit(a, e.meta["answers"]) for a, e in zip(answers, examples)]
    by_depth: dict[str, list[int]] = {}
    for e, h in zip(examples, hits):
        if e.meta.get("depth") is not None:
            by_depth.setdefault(f"{e.meta['depth']:.2f}", []).append(h)
    n = len(examples)
    return {
        "n": n,
        "accuracy": sum(hits) / n,
        "accuracy_by_depth": {d: sum(v) / len(v) for d, v in sorted(by_depth.items())},
        **tally.fields(n),
        "prefill_s": prefill_s,
        "wall_s": time.perf_counter() - t0,
        "predictions": hits,
        "answers": answers,
    }


@quiet_ratio()  # the row reports the ratio read
def evaluate_task(model, task, examples: Sequence[Example], **kwargs) -> dict:
    """``kwargs`` go to the task kind's scorer; for classification, likelihood scoring reads
    each label's answer text from the task (``task.label_target``), and a generated answer is
    read by the task's ``parse_label`` when it has one.

    A task that picks its metric from the data (``custom``) has ``chosen_metric``, which the
    row records as ``metric``."""
    chosen = getattr(task, "chosen_metric", None)
    check_task_fits(model, task, examples, kwargs.get("merge", True),
                    kwargs.get("max_new_tokens"))
    if task.kind == "perplexity":
        for name in ("max_new_tokens", "scoring", "calibration"):
            kwargs.pop(name, None)
        row = evaluate_perplexity(model, examples, **kwargs)
    elif task.kind == "qa":
        for name in ("scoring", "calibration"):
            kwargs.pop(name, None)
        kwargs["batch_size"] = 1  # long documents of different lengths: one at a time
        kwargs.setdefault("max_new_tokens", task.answer_tokens)
        row = evaluate_qa(model, examples, **kwargs)
    else:
        targets = [task.label_target(lab) for lab in task.labels]
        kwargs.setdefault("max_new_tokens", answer_room(model, targets))
        row = evaluate_classification(model, examples, task.labels, targets=targets,
                                      parse=getattr(task, "parse_label", None), **kwargs)
    return row if chosen is None else {"metric": chosen, **row}


def answer_room(model, targets: Sequence[str]) -> int:
    """New tokens a generated answer gets: room for the longest answer text and its EOS (a
    user's label may be several tokens long), at least 4."""
    return max(4, max(len(target_ids(model, t)) for t in targets))


def check_task_fits(model, task, examples: Sequence[Example], merge: bool = True,
                    max_new_tokens: int | None = None) -> None:
    """Refuse, before scoring (or before the training run whose end scores them), an example
    too long for the model's positions with what ``evaluate_task`` adds to it: its target
    (perplexity), or each label's answer text and the generated answer (classification)."""
    if task.kind == "perplexity":
        check_examples_fit(model, examples, "evaluation", merge=merge)
        return
    if task.kind == "qa":
        check_examples_fit(model, examples, "evaluation", merge=merge, answer_tokens=0,
                           new_tokens=max_new_tokens or task.answer_tokens, fitted=True)
        return
    targets = [task.label_target(lab) for lab in task.labels]
    longest = max(len(target_ids(model, t)) for t in targets)
    check_examples_fit(model, examples, "evaluation", merge=merge, answer_tokens=longest,
                       new_tokens=max_new_tokens or answer_room(model, targets))
