"""Task distillation: a fine-tuned model reading the *plain* prompt teaches the merged student.

``ktm train --teacher CHECKPOINT --teacher-weight W`` (API: ``train(..., loss_fn=
distill_loss(teacher, W))``). Per target token the loss is

    (1 - W) * CE(gold token) + W * KL(teacher || student)

where the teacher is a separate, frozen checkpoint (typically the uncompressed model fine-tuned
on the same task) that reads each prompt with merging off. The KL term gives the student the
teacher's whole next-token distribution at every answer position, not one gold token: what the
perplexity ratio K=4 / uncompressed measures is exactly this gap. Reader pretraining's
``distill`` objective differs: its teacher is the student's own base LM with the adapter off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ktm.core.batch import LossOutput
from ktm.core.checkpoint import model_record
from ktm.core.loss import target_logits
from ktm.errors import KTMError
from ktm.tasks.base import Example


@dataclass
class TeacherConfig:
    teacher: str | None = field(default=None, metadata={
        "help": "checkpoint or reader name read with merging off; its distribution is mixed "
                "into the loss (task distillation, ktm.training.teacher)"})
    teacher_weight: float | None = field(default=None, metadata={
        "help": "W in (1 - W) * CE + W * KL(teacher || student), 0 < W <= 1 (with --teacher: "
                "0.5 unless given)"})

    def __post_init__(self) -> None:
        if self.teacher is None:
            if self.teacher_weight is not None:
                raise KTMError("--teacher-weight without --teacher: give the teacher checkpoint")
            return
        if self.teacher_weight is None:
            self.teacher_weight = 0.5
        check_weight(self.teacher_weight)


def check_weight(weight: float) -> None:
    if not 0.0 < weight <= 1.0:
        raise KTMError(f"teacher_weight={weight}: expected 0 < W <= 1")


def kl_per_token(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Per-token KL(teacher || student) from (N, V) logits."""
    t = nn.functional.log_softmax(teacher.float(), dim=-1)
    s = nn.functional.log_softmax(student.float(), dim=-1)
    return (t.exp() * (t - s)).sum(-1)


def check_teacher(student, teacher) -> None:
    """The KL compares distributions over one vocabulary, token for token."""
    sv, tv = (model_record(m)["vocab_size"] for m in (student, teacher))
    if sv != tv:
        raise KTMError(f"teacher vocabulary has {tv} tokens, the student's {sv}: expected a "
                       "teacher on the same base model (or one with the same tokenizer)")


def distill_loss(teacher, weight: float = 0.5) -> Callable:
    """A ``train`` loss_fn: cross-entropy mixed with KL to ``teacher`` reading plain prompts."""
    check_weight(weight)
    teacher.eval()

    def loss_fn(model, batch: Sequence[Example]) -> LossOutput:
        prompts, targets = [e.segments for e in batch], [e.target for e in batch]
        s = target_logits(model, prompts, targets)
        with torch.no_grad():
            t = target_logits(teacher, prompts, targets, merge=False)
        if not torch.equal(t.labels.cpu(), s.labels.cpu()):
            raise KTMError("teacher and student tokenize the targets differently: expected "
                           "a teacher on the same base model")
        ce = nn.functional.cross_entropy(s.logits, s.labels, reduction="none")
        kl = kl_per_token(s.logits, t.logits.to(s.logits.device))
        tok = (1.0 - weight) * ce + weight * kl
        nll = tok.new_zeros(len(batch)).index_add(0, s.rows, tok)
        parts = {name: (float(v.detach().sum()), sum(s.lengths)) for name, v in
                 (("ce", ce), ("kl", kl))}
        return LossOutput(tok.mean(), nll, torch.tensor(s.lengths, device=model.device),
                          s.tokens_in, s.tokens_out, parts)

    return loss_fn
