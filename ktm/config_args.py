"""argparse flags built from typed config dataclasses: the config is the CLI.

A field's flag is ``--name`` (``metadata["flag"]`` renames it, ``metadata["aliases"]`` adds
other names); a nested dataclass field adds its own fields with a prefix (``KTMConfig.lora`` ->
``--lora-r``, ``--lora-alpha``, ...). With
``suppress=True`` a flag left out is absent from the parsed namespace, so ``from_args`` can fill
it from a base config (a checkpoint's) and ``given`` can tell what the user actually set.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any


def _unwrap(kind: Any) -> Any:
    """``X | None`` -> ``X``."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return next(t for t in typing.get_args(kind) if t is not type(None))
    return kind


def _fields(cls: type, prefix: str = ""):
    """(dest, field, type) for every field, nested dataclasses flattened with their prefix."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = _unwrap(hints[f.name])
        if dataclasses.is_dataclass(kind):
            yield from _fields(kind, prefix + f.metadata.get("prefix", f.name) + "_")
        else:
            yield prefix + f.metadata.get("flag", f.name), f, kind


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, *,
                       suppress: bool = False, skip: tuple[str, ...] = ()) -> None:
    """One ``--flag`` per field; bools become ``--flag/--no-flag``, tuples/lists take values.
    ``skip``: fields a command sets itself (no flag; ``from_args`` gives them their default)."""
    for dest, f, kind in _fields(cls):
        if dest in skip:
            continue
        flag = "--" + dest.replace("_", "-")
        default = _default(f)
        text = f.metadata.get("help", "") + f" (default: {default!r})"
        kw: dict[str, Any] = {"dest": dest, "help": text.replace("%", "%%"),
                              "default": argparse.SUPPRESS if suppress else default}
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        # another command's name for the same setting (``metadata["aliases"]``)
        flags = [flag, *f.metadata.get("aliases", ())]
        if kind is bool:
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
        elif typing.get_origin(kind) in (list, tuple):
            parser.add_argument(*flags, type=typing.get_args(kind)[0], nargs="+", **kw)
        else:
            parser.add_argument(*flags, type=kind, **kw)


def given(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The flags of ``cls`` present in ``args`` (with ``suppress``: those the user set)."""
    return {dest: getattr(args, dest) for dest, _, _ in _fields(cls) if hasattr(args, dest)}


def from_args(cls: type, args: argparse.Namespace, base: Any = None, prefix: str = "") -> Any:
    """Build ``cls`` from the parsed flags; a flag absent from ``args`` takes ``base``'s value
    (else the field's default). Tuple fields get tuples back."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        kind = _unwrap(hints[f.name])
        if dataclasses.is_dataclass(kind):
            values[f.name] = from_args(kind, args, getattr(base, f.name, None),
                                       prefix + f.metadata.get("prefix", f.name) + "_")
            continue
        dest = prefix + f.metadata.get("flag", f.name)
        if hasattr(args, dest):
            v = getattr(args, dest)
            if typing.get_origin(kind) is tuple and isinstance(v, list):
                v = tuple(v)
            values[f.name] = v
        elif base is not None:
            values[f.name] = getattr(base, f.name)
    return cls(**values)
