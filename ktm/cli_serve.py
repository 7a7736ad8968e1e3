"""``ktm serve``: the command that hands a model to other programs over HTTP (flags from
``ServeConfig``; nothing heavy is imported until the command runs)."""

from __future__ import annotations

import argparse

from ktm.config_args import add_dataclass_args, from_args


def cmd_serve(args: argparse.Namespace) -> int:
    from ktm.serve.app import serve
    from ktm.serve.config import ServeConfig

    serve(from_args(ServeConfig, args))
    return 0


def serve_parser(sp: argparse.ArgumentParser) -> None:
    from ktm.serve.config import ServeConfig

    add_dataclass_args(sp, ServeConfig)
    sp.set_defaults(run=cmd_serve)
