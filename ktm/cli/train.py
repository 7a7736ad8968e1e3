"""``ktm train``, ``ktm pretrain`` and ``ktm curriculum``: the commands that train a model (a
task fine-tune, reader pretraining, the tree curriculum); flags from ``TrainConfig`` and each
command's own config, and ``--init`` / ``--init-adapter`` to start from a reader."""

from __future__ import annotations

import argparse
import dataclasses
import json
from functools import partial
from pathlib import Path

from ktm.cli.args import (
    add_dataclass_args,
    add_model_args,
    compressor_args,
    data_args,
    from_args,
    init_or_build,
    parse_options,
    threads_arg,
)
from ktm.errors import KTMError
from ktm.util.provenance import plain


def cmd_train(args: argparse.Namespace) -> int:
    from ktm.evaluation.evaluate import check_task_fits, evaluate_task, summary
    from ktm.tasks.spec import TaskSpec, task_settings
    from ktm.training import distributed
    from ktm.training.config import TrainConfig
    from ktm.training.train import cross_entropy_loss, train

    world = distributed.setup(args.device)  # under torchrun / accelerate launch: join first
    targs = from_args(TaskSpec, args)
    tcfg = from_args(TrainConfig, args)
    task = targs.build(parse_options(args.task_option))
    ckpt = Path(tcfg.out_dir) / "checkpoint"
    from ktm.compressors.record import plan_training

    # the method a resumed run or an --init checkpoint was trained with, checked before loading
    options, state_dir = plan_training(ckpt, tcfg.resume, args.init, args.compressor,
                                       parse_options(args.compressor_option))
    model = init_or_build(args)
    train_set = task.train_examples(targs.n_train, seed=tcfg.seed)
    # rank 0 alone evaluates: the others neither read nor (with --compressor) compress the set
    eval_set = distributed.on_main(lambda: task.eval_examples(targs.n_eval, seed=tcfg.seed + 1),
                                   world, model.device) or []
    distill = _distillation(args, model)  # before a baseline's compression: its errors first
    comp = info = save_extra = None
    if args.compressor:  # a baseline: rewrite the prompts (or set the encoder) before training
        from ktm.compressors.apply import apply_compressor
        from ktm.compressors.record import checkpoint_saver

        model, train_set, eval_set, info, comp = apply_compressor(
            args.compressor, options, model, train_set, eval_set, state_dir=state_dir)
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
    extra = {"command": args.command_line, "task": task_settings(task),
             "compressor": None if comp is None else {"name": comp.name,
                                                      "options": plain(comp.options())}}
    loss_fn = cross_entropy_loss
    if distill:
        loss_fn, extra["teacher"] = distill
    last = train(model, train_set, tcfg, evaluate=evaluate, loss_fn=loss_fn, run_extra=extra,
                 save_extra=save_extra)
    if world.is_main:
        print(json.dumps({k: v for k, v in last.items()}, indent=2))
    return 0


def _distillation(args: argparse.Namespace, model):
    """``--teacher``: the loss with the frozen teacher's plain-prompt distribution mixed in, and
    the settings run.json records; None without a teacher."""
    from ktm.cli.args import given
    from ktm.training.teacher import TeacherConfig, check_teacher, distill_loss

    cfg = from_args(TeacherConfig, args)
    if not cfg.teacher:
        if "teacher_weight" in given(TeacherConfig, args):
            raise KTMError("--teacher-weight without --teacher: give the teacher checkpoint")
        return None
    if args.compressor:
        raise KTMError(f"--teacher with --compressor {args.compressor}: the teacher reads the "
                       "original prompts, which a baseline rewrites; use one or the other")
    from ktm.model import KTMModel

    # the student's base-model override and dtype; the teacher's own K does not matter, it
    # reads every prompt with merging off
    teacher = KTMModel.load(cfg.teacher, base=getattr(args, "model", None), device=args.device,
                            dtype=model.dtype)
    check_teacher(model, teacher)
    return distill_loss(teacher, cfg.teacher_weight), dataclasses.asdict(cfg)


def _check_plain_init(args: argparse.Namespace, command: str) -> None:
    """Refuse ``--init`` of a checkpoint whose prompts a baseline rewrote, for a run without it."""
    from ktm.compressors.record import check_init

    check_init(getattr(args, "init", None), None, {}, command)


def cmd_pretrain(args: argparse.Namespace) -> int:
    from ktm.training import distributed
    from ktm.training.config import TrainConfig
    from ktm.training.pretrain import PretrainConfig, pretrain

    world = distributed.setup(args.device)  # under torchrun / accelerate launch: join first
    pcfg, tcfg = from_args(PretrainConfig, args), from_args(TrainConfig, args)
    _check_plain_init(args, "pretrain")
    model = init_or_build(args)
    chat = None
    if pcfg.chat_share > 0:  # windows read as ktm serve reads a chat
        from ktm.serving.prompts import chat_prompt

        chat = partial(chat_prompt, model)
    last = pretrain(model, pcfg, tcfg, command=args.command_line, chat=chat)
    if world.is_main:
        print(json.dumps(last, indent=2))
    return 0


def cmd_curriculum(args: argparse.Namespace) -> int:
    from ktm.training import distributed
    from ktm.training.config import TrainConfig
    from ktm.training.curriculum import CurriculumConfig, run_curriculum

    # under torchrun / accelerate launch: join first, so that --device cuda builds the model on
    # this process's GPU (cuda:LOCAL_RANK), not every process's on cuda:0
    world = distributed.setup(args.device)
    ccfg, tcfg = from_args(CurriculumConfig, args), from_args(TrainConfig, args)
    _check_plain_init(args, "curriculum")
    rows = run_curriculum(init_or_build(args), ccfg, tcfg, args.prompt_mode)
    last = rows[-1]
    if world.is_main:  # every process has the rows; one prints them
        for r in rows:
            print(json.dumps(r))
        if not last["passed"]:  # why exit code 1 (under torchrun: amid its ChildFailedError)
            import sys

            print(f"ktm: curriculum stopped: stage {last['stage']!r} reached balanced accuracy "
                  f"{last['balanced_accuracy']:.3f} < {last['threshold']} in {last['round']} "
                  f"round(s) (--max-rounds {ccfg.max_rounds}); exit code 1", file=sys.stderr)
    return 0 if last["passed"] else 1


def _init_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--init", metavar="CHECKPOINT_OR_NAME",
                        help="start from a reader: a checkpoint folder or a shipped reader's name "
                             "(--k, if given, must be its K or a recursive reader's inner K; its "
                             "encoder and LoRA settings are used, grown by a larger --lora-r, "
                             "--lora-alpha or --mlp-ratio)")
    parser.add_argument("--init-adapter", metavar="CHECKPOINT_OR_NAME",
                        help="start only LoRA from a checkpoint or reader, with a fresh encoder "
                             "(any K: the K curriculum, e.g. K=4 from the K=2 reader)")


def train_parser(tr: argparse.ArgumentParser) -> None:
    from ktm.tasks.spec import TaskSpec
    from ktm.training.config import TrainConfig
    from ktm.training.teacher import TeacherConfig

    add_model_args(tr)
    add_dataclass_args(tr, TaskSpec)
    add_dataclass_args(tr, TrainConfig)
    add_dataclass_args(tr, TeacherConfig, suppress=True)
    tr.set_defaults(run=cmd_train)
    compressor_args(tr)
    _init_args(tr)
    threads_arg(tr)
    data_args(tr)


def pretrain_parser(pre: argparse.ArgumentParser) -> None:
    from ktm.training.config import TrainConfig
    from ktm.training.pretrain import PretrainConfig

    add_model_args(pre)
    add_dataclass_args(pre, PretrainConfig)
    add_dataclass_args(pre, TrainConfig)
    _init_args(pre)
    threads_arg(pre)
    data_args(pre)
    pre.set_defaults(run=cmd_pretrain)


def curriculum_parser(cur: argparse.ArgumentParser) -> None:
    from ktm.training.config import TrainConfig
    from ktm.training.curriculum import CurriculumConfig

    add_model_args(cur)
    add_dataclass_args(cur, CurriculumConfig)
    # each round trains --steps-per-round steps and is evaluated at its end: --max-steps and
    # --eval-every would be ignored
    add_dataclass_args(cur, TrainConfig, skip=("max_steps", "eval_every"))
    cur.add_argument("--prompt-mode", default="context", choices=["context", "paper"],
                     help="context: the question plain | paper: all compressed "
                          "(default: 'context')")
    _init_args(cur)  # the curriculum starts from a reader like any fine-tune
    threads_arg(cur)
    data_args(cur)
    cur.set_defaults(run=cmd_curriculum)
