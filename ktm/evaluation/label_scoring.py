"""Classification by label likelihood: score every label's answer text, pick the most likely.

Greedy generation answers with whatever the LM says first, so a fine-tune that learned the
training set's class balance (amazon: 4:1 positive) answers the majority class whenever the
prompt leaves it unsure, and balanced accuracy pays for it. Scoring instead reads
``log p(answer_L | prompt)`` for each label L (its whole answer text, EOS included, exactly the
tokens the fine-tune was trained to produce), so every example gets a label (nothing is unparsed)
and the decision can be corrected for the class prior:

    prior_L = mean over calibration prompts of p(L | x)   (p renormalised over the labels)
    predict argmax_L  log p(L | x) - log prior_L

Dividing by the prior the model learned gives the decision for equal class priors, which is what
balanced accuracy scores. The calibration prompts need no labels; ``ktm eval`` draws them from
the task's training side, never from the test set.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from ktm.errors import KTMError
from ktm.evaluation.tally import Tally
from ktm.tasks.base import Example

SCORINGS = ("generate", "likelihood")


@torch.no_grad()
def label_logprobs(model, examples: Sequence[Example], targets: Sequence[str], *,
                   merge: bool = True, batch_size: int = 16, progress: bool = False,
                   desc: str = "score") -> tuple[torch.Tensor, Tally]:
    """(N, L) ``log p(targets[l] | prompt)`` per example; the prompts' token counts and the
    seconds spent merging them (``Tally``).

    Each batch's prompts are encoded (merged) once and read once per label. Runs in the
    model's current mode: callers put it in eval mode.
    """
    if not targets:
        raise KTMError("no label targets to score: expected at least one")
    if not examples:
        raise KTMError("no examples to score: expected at least one")
    rows, tally = [], Tally()
    for i in tqdm(range(0, len(examples), batch_size), desc=desc, disable=not progress):
        prompts = [e.segments for e in examples[i:i + batch_size]]
        prefixes = tally.encode(model, prompts, merge)
        cols = [model(prompts, [t] * len(prompts), merge=merge, prefixes=prefixes).nll
                for t in targets]
        rows.append(-torch.stack(cols, dim=1).float().cpu())
    return torch.cat(rows), tally


def label_prior(logprobs: torch.Tensor) -> torch.Tensor:
    """(L,) the mean over examples of p(label | x), renormalised over the labels."""
    if logprobs.dim() != 2 or logprobs.shape[0] == 0:
        raise KTMError(f"expected (N >= 1, L) label log-probs, got {tuple(logprobs.shape)}")
    return torch.softmax(logprobs, dim=1).mean(dim=0)


def decide(logprobs: torch.Tensor, labels: Sequence[str],
           prior: torch.Tensor | None = None) -> list[str]:
    """The label with the highest (prior-corrected) score for each row."""
    if logprobs.shape[1] != len(labels):
        raise KTMError(f"{logprobs.shape[1]} scores per example for {len(labels)} labels")
    scores = logprobs if prior is None else logprobs - prior.clamp(min=1e-12).log()
    return [labels[j] for j in scores.argmax(dim=1).tolist()]


def prior_dict(prior: torch.Tensor, labels: Sequence[str]) -> dict[str, float]:
    return {lab: round(float(p), 6) for lab, p in zip(labels, prior, strict=True)}


def check_scoring(scoring: str, n_calibrate: int) -> None:
    if scoring not in SCORINGS:
        raise KTMError(f"scoring={scoring!r}: expected one of {', '.join(SCORINGS)}")
    if isinstance(n_calibrate, bool) or not isinstance(n_calibrate, int) or n_calibrate < 0:
        raise KTMError(f"n_calibrate={n_calibrate!r}: expected an integer >= 0")
    if n_calibrate and scoring != "likelihood":
        raise KTMError(f"n_calibrate={n_calibrate} needs scoring='likelihood' (generated "
                       "answers have no scores to correct)")

