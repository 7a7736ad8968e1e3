"""``ktm train``, ``ktm pretrain`` and ``ktm curriculum``: the commands that train a model (a
task fine-tune, reader pretraining, the tree curriculum); flags from ``TrainConfig`` and each
command's own config, and ``--init`` / ``--init-adapter`` to start from a reader."""

from __future__ import annotations

import argparse
import json
from functools import partial

from ktm.cli.args import (
    add_dataclass_args,
    add_model_args,
    compressor_args,
    data_args,
    from_args,
    init_or_build,
    model_spec,
    parse_options,
    threads_arg,
)


def cmd_train(args: argparse.Namespace) -> int:
    from ktm.tasks.spec import TaskSpec
    from ktm.training import distributed
    from ktm.training.config import TrainConfig
    from ktm.training.finetune import FinetuneConfig, finetune
    from ktm.training.teacher import TeacherConfig

    config = FinetuneConfig(
        model=model_spec(args, args.init), init_adapter=args.init_adapter,
        task=from_args(TaskSpec, args), task_options=parse_options(args.task_option),
        compressor=args.compressor, compressor_options=parse_options(args.compressor_option),
        train=from_args(TrainConfig, args), teacher=from_args(TeacherConfig, args),
        command=args.command_line)
    last = finetune(config)
    if distributed.setup(args.device).is_main:  # the run's world, joined by finetune
        print(json.dumps(last, indent=2))
    return 0


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
    if pcfg.chat_share > 0 or pcfg.objective_weights.get("answer", 0) > 0:
        # windows read as ktm serve reads a chat
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


def _groups(parser: argparse.ArgumentParser, *titles: str) -> list:
    """Argument groups of ``--help``, in order: the command's own settings first."""
    return [parser.add_argument_group(t) for t in titles]


def _model_and_machine(parser: argparse.ArgumentParser) -> None:
    model, machine = _groups(parser, "model", "machine")
    _init_args(model)
    add_model_args(model)
    threads_arg(machine)
    data_args(machine)


def train_parser(tr: argparse.ArgumentParser) -> None:
    from ktm.tasks.spec import TaskSpec
    from ktm.training.config import TrainConfig
    from ktm.training.teacher import TeacherConfig

    task, training, teacher = _groups(tr, "task", "training", "teacher")
    add_dataclass_args(task, TaskSpec)
    compressor_args(task)
    add_dataclass_args(training, TrainConfig)
    add_dataclass_args(teacher, TeacherConfig)
    _model_and_machine(tr)
    tr.set_defaults(run=cmd_train)


def pretrain_parser(pre: argparse.ArgumentParser) -> None:
    from ktm.training.config import TrainConfig
    from ktm.training.pretrain import PretrainConfig

    pretraining, training = _groups(pre, "pretraining", "training")
    add_dataclass_args(pretraining, PretrainConfig)
    add_dataclass_args(training, TrainConfig)
    _model_and_machine(pre)
    pre.set_defaults(run=cmd_pretrain)


def curriculum_parser(cur: argparse.ArgumentParser) -> None:
    from ktm.training.config import TrainConfig
    from ktm.training.curriculum import CurriculumConfig

    curriculum, training = _groups(cur, "curriculum", "training")
    add_dataclass_args(curriculum, CurriculumConfig)
    curriculum.add_argument("--prompt-mode", default="context", choices=["context", "paper"],
                            help="context: the question plain | paper: all compressed "
                                 "(default: 'context')")
    # each round trains --steps-per-round steps and is evaluated at its end: --max-steps and
    # --eval-every would be ignored
    add_dataclass_args(training, TrainConfig, skip=("max_steps", "eval_every"))
    _model_and_machine(cur)  # the curriculum starts from a reader like any fine-tune
    cur.set_defaults(run=cmd_curriculum)
