"""``ktm serve`` and ``ktm export``: the commands that hand a model to other programs (flags from
``ServeConfig`` and ``ExportConfig``; nothing heavy is imported until a command runs)."""

from __future__ import annotations

import argparse

from ktm.cli.args import add_dataclass_args, from_args

SERVE_GROUPS = ("model", "server", "batching", "chat history", "runtime")


def cmd_serve(args: argparse.Namespace) -> int:
    from ktm.serving.app import serve
    from ktm.serving.config import ServeConfig

    serve(from_args(ServeConfig, args))
    return 0


def serve_parser(sp: argparse.ArgumentParser) -> None:
    from ktm.serving.config import ServeConfig

    # the groups of --help, in order; one llama.cpp sequence per request decoding at once:
    # --max-batch says how many
    groups = {title: sp.add_argument_group(title) for title in SERVE_GROUPS}
    add_dataclass_args(sp, ServeConfig, skip=("llamacpp_sequences",), groups=groups)
    sp.set_defaults(run=cmd_serve)


def cmd_export(args: argparse.Namespace) -> int:
    from ktm.serving.export import ExportConfig, run_export

    run_export(from_args(ExportConfig, args), args.out)
    return 0


def export_parser(sp: argparse.ArgumentParser) -> None:
    from ktm.serving.export import ExportConfig

    sp.add_argument("out", metavar="DIR", help="output folder (new, or a previous export)")
    add_dataclass_args(sp, ExportConfig)
    sp.set_defaults(run=cmd_export)
