"""``ktm train`` as a library function: ``finetune(FinetuneConfig(...))`` fine-tunes a model on
a task (a baseline compressor's prompts or K-token merging, optionally distilled from a teacher)
and returns the last logged metrics; the CLI only parses its flags into a ``FinetuneConfig``.

    from ktm.core.config import ModelSpec
    from ktm.tasks.spec import TaskSpec
    from ktm.training.config import TrainConfig
    from ktm.training.finetune import FinetuneConfig, finetune

    last = finetune(FinetuneConfig(model=ModelSpec("smollm2-135m-k4"),
                                   task=TaskSpec("amazon", n_train=2000, n_eval=200),
                                   train=TrainConfig(out_dir="runs/amazon-k4")))
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ktm.compressors.record import plan_training
from ktm.core.config import ModelSpec
from ktm.errors import KTMError
from ktm.evaluation.evaluate import check_task_fits, evaluate_task, summary
from ktm.tasks.base import bind
from ktm.tasks.spec import TaskSpec, task_settings
from ktm.training import distributed
from ktm.training.config import TrainConfig
from ktm.training.start import open_trainable
from ktm.training.teacher import TeacherConfig, check_teacher, distill_loss
from ktm.training.train import cross_entropy_loss, train
from ktm.util.provenance import plain


@dataclass(frozen=True)
class FinetuneConfig:
    """One fine-tune: the model it starts from (``model.checkpoint``: ``--init``; or a fresh one,
    ``init_adapter`` its LoRA from a checkpoint), the task and its options, a baseline
    compressor, the training loop's settings and a teacher."""

    model: ModelSpec = field(default_factory=ModelSpec)
    init_adapter: str | None = None
    task: TaskSpec = field(default_factory=TaskSpec)
    task_options: dict[str, Any] = field(default_factory=dict)
    compressor: str | None = None
    compressor_options: dict[str, Any] = field(default_factory=dict)
    train: TrainConfig = field(default_factory=TrainConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    command: str | None = None  # recorded in run.json

    def __post_init__(self) -> None:
        if self.teacher.teacher and self.compressor:
            raise KTMError(f"--teacher with --compressor {self.compressor}: the teacher reads "
                           "the original prompts, which a baseline rewrites; use one or the "
                           "other")


def finetune(config: FinetuneConfig) -> dict:
    """Fine-tune as ``config`` says (``ktm.training.train.train``'s folder and resume); the last
    logged metrics, with the final evaluation."""
    tcfg = config.train
    world = distributed.setup(config.model.device)  # under a launcher: join first
    task = config.task.build(config.task_options)
    # the method a resumed run or an --init checkpoint was trained with, checked before loading
    init = config.model.checkpoint
    options, state_dir = plan_training(Path(tcfg.out_dir) / "checkpoint", tcfg.resume,
                                       None if init is None else os.fspath(init),
                                       config.compressor,
                                       config.compressor_options)
    model = open_trainable(config.model, init_adapter=config.init_adapter, seed=tcfg.seed)
    bind(task, model)  # a question task counts its documents in the model's tokens
    train_set = task.train_examples(config.task.n_train, seed=tcfg.seed)
    # rank 0 alone evaluates: the others neither read nor (with a compressor) compress the set
    eval_set = distributed.on_main(
        lambda: task.eval_examples(config.task.n_eval, seed=tcfg.seed + 1),
        world, model.device) or []
    distill = _distillation(config, model)  # before a baseline's compression: its errors first
    comp = info = save_extra = None
    if config.compressor:  # a baseline: rewrite the prompts (or set the encoder) first
        from ktm.compressors.apply import apply_compressor
        from ktm.compressors.record import checkpoint_saver

        model, train_set, eval_set, info, comp = apply_compressor(
            config.compressor, options, model, train_set, eval_set, state_dir=state_dir)
        # every checkpoint holds the method's fitted state (LTSC vocabulary, meta rows) and
        # its record (compressor.json), so eval / generate / serve read it as it was trained
        save_extra = checkpoint_saver(comp, plain(options))

    def evaluate(m) -> dict:
        r = summary(evaluate_task(m, task, eval_set))
        if comp:
            from ktm.compressors.apply import finish_eval_row

            r = finish_eval_row(r, eval_set, info)
        return r

    # an evaluation example too long for the model fails now, not after training
    check_task_fits(model, task, eval_set)
    extra = {"command": config.command, "task": task_settings(task),
             "compressor": None if comp is None else {"name": comp.name,
                                                      "options": plain(comp.options())}}
    loss_fn = cross_entropy_loss
    if distill:
        loss_fn, extra["teacher"] = distill
    return train(model, train_set, tcfg, evaluate=evaluate, loss_fn=loss_fn, run_extra=extra,
                 save_extra=save_extra)


def _distillation(config: FinetuneConfig, model):
    """The teacher's loss (its plain-prompt distribution mixed in) and the settings run.json
    records; None without a teacher."""
    cfg = config.teacher
    if not cfg.teacher:
        return None
    from ktm.model import KTMModel

    # the student's base-model override and dtype; the teacher's own K does not matter, it
    # reads every prompt with merging off
    teacher = KTMModel.load(cfg.teacher, base=config.model.settings.get("model"),
                            device=config.model.device, dtype=model.dtype)
    check_teacher(model, teacher)
    return distill_loss(teacher, cfg.teacher_weight), dataclasses.asdict(cfg)
