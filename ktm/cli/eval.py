"""``ktm eval``: its flags, generated from ``ktm.evaluation.runner.EvalConfig`` (and the model's
``KTMConfig``), parsed into one and handed to ``ktm.evaluation.runner.run``; the result row printed
without its config and versions (the ``--json`` file holds all of it)."""

from __future__ import annotations

import argparse
import json

from ktm.cli.args import (
    add_dataclass_args,
    compressor_args,
    data_args,
    from_args,
    model_spec,
    parse_options,
    threads_arg,
)
from ktm.core.config import KTMConfig

# the groups of --help, in order: the evaluation's own flags first
GROUPS = (("evaluation", None), ("task", None),
          ("model", "a checkpoint, or a fresh model's settings (with --checkpoint: given ones "
                    "must agree with its own)"),
          ("runtime", "where the model runs (ktm.model.RuntimeSpec)"), ("machine", None))


def eval_parser(ev: argparse.ArgumentParser) -> None:
    from ktm.evaluation.runner import EvalConfig

    groups = {title: ev.add_argument_group(title, text) for title, text in GROUPS}
    add_dataclass_args(ev, EvalConfig, groups=groups)
    add_dataclass_args(groups["model"], KTMConfig, suppress=True)
    compressor_args(groups["task"])
    data_args(groups["machine"])
    threads_arg(groups["machine"])
    ev.set_defaults(run=cmd_eval)


def eval_config(args: argparse.Namespace):
    """The ``EvalConfig`` of ``ktm eval``'s parsed flags."""
    from ktm.evaluation.runner import EvalConfig

    return from_args(EvalConfig, args, model=model_spec(args, args.checkpoint),
                     task_options=parse_options(args.task_option), compressor=args.compressor,
                     compressor_options=parse_options(args.compressor_option),
                     command=args.command_line)


def cmd_eval(args: argparse.Namespace) -> int:
    from ktm.evaluation.runner import run

    row = run(eval_config(args))
    print(json.dumps({k: v for k, v in row.items() if k not in ("config", "versions")}, indent=2))
    return 0
