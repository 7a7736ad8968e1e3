"""Flag groups several ``ktm`` commands share: --data-dir, --threads, and a baseline compressor's
--compressor / --compressor-option (with --task-option for the commands that build a task)."""

from __future__ import annotations

import argparse


def compressor_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task-option", action="append", default=[], metavar="NAME=VALUE",
                        help="task constructor option, e.g. max_chars=400 or (amazon) "
                        "balance_train=true (repeatable)")
    method_args(parser)


def method_args(parser: argparse.ArgumentParser) -> None:
    from ktm.compressors.cli import METHODS

    parser.add_argument("--compressor", choices=METHODS,
                        help="a baseline instead of K-token merging (a checkpoint trained with "
                             "one is read with it by default: its compressor.json)")
    parser.add_argument("--compressor-option", action="append", default=[], metavar="NAME=VALUE",
                        help="e.g. ratio=0.5, unit=token, max_meta_tokens=64 (repeatable)")


def data_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", metavar="DIR",
                        help="folder holding the datasets (sets $KTM_DATA; README, Data)")


def threads_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice)")
