"""argparse flags built from typed config dataclasses: the config is the CLI."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """One ``--flag`` per field; bools become ``--flag/--no-flag``, tuples/lists take values."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        text = f.metadata.get("help", "") + f" (default: {default!r})"
        kw: dict[str, Any] = {"default": default, "help": text.replace("%", "%%")}
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif typing.get_origin(kind) in (list, tuple):
            parser.add_argument(flag, type=typing.get_args(kind)[0], nargs="+", **kw)
        else:  # X | None takes X
            base = next((t for t in typing.get_args(kind) or (kind,) if t is not type(None)), str)
            parser.add_argument(flag, type=base, **kw)


def from_args(cls: type, args: argparse.Namespace) -> Any:
    """Build ``cls`` from the parsed flags (tuple fields get tuples back)."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        v = getattr(args, f.name)
        if typing.get_origin(hints[f.name]) is tuple and isinstance(v, list):
            v = tuple(v)
        values[f.name] = v
    return cls(**values)
