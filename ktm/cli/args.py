"""The CLI's flags, built from the typed config dataclasses (the config is the CLI), and what a
result row records about them.

A field's flag is ``--name`` (``metadata["flag"]`` renames it, ``metadata["aliases"]`` adds
other names); a nested dataclass field adds its own fields with a prefix (``KTMConfig.lora`` ->
``--lora-r``, ``--lora-alpha``, ...). With ``suppress=True`` a flag left out is absent from the
parsed namespace, so ``from_args`` can fill it from a base config (a checkpoint's) and ``given``
can tell what the user actually set.

Model flags come from ``KTMConfig`` (``--model --k --mlp-ratio --mlp/--no-mlp ... --lora-r``)
and are only set when given: a fresh model takes ``KTMConfig``'s defaults for the rest; a
checkpoint (``--checkpoint``, ``--init``) takes its own saved config, and a given flag that
contradicts it is an error rather than silently ignored. Result rows record the model's real
config, the task's real settings and the compressor's options, never unused flag defaults.

Flag groups several ``ktm`` commands share: --data-dir, --threads, and a baseline compressor's
--compressor / --compressor-option (with --task-option for the commands that build a task).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import typing
from collections.abc import Sequence
from typing import Any

from ktm.core.config import KTMConfig, ModelSpec
from ktm.errors import KTMError
from ktm.util.flags import default, flag_fields, from_flags


def add_dataclass_args(parser, cls: type, *, suppress: bool = False,
                       skip: tuple[str, ...] = (), nested: bool = True,
                       groups: dict[str, Any] | None = None) -> None:
    """One ``--flag`` per field; bools become ``--flag/--no-flag``, tuples/lists take values.
    ``skip``: fields a command sets itself (no flag; ``from_args`` gives them their default).
    ``nested`` False: a nested dataclass's fields get no flags here. ``groups``: argument
    groups of ``--help`` by title; a field (or a nested dataclass field, for all of its own)
    with ``metadata["group"]`` adds its flags to that group, made on first use."""
    for dest, f, kind, group in flag_fields(cls, nested=nested):
        if dest in skip:
            continue
        where = parser
        if groups is not None and group:
            if group not in groups:
                groups[group] = parser.add_argument_group(group)
            where = groups[group]
        _add_flag(where, dest, f, kind, suppress)


def _add_flag(parser, dest: str, f: dataclasses.Field, kind: Any, suppress: bool) -> None:
    flag = "--" + dest.replace("_", "-")
    value = default(f)
    text = f.metadata.get("help", "") + f" (default: {value!r})"
    kw: dict[str, Any] = {"dest": dest, "help": text.replace("%", "%%"),
                          "default": argparse.SUPPRESS if suppress else value}
    for key in ("choices", "metavar"):
        if key in f.metadata:
            kw[key] = f.metadata[key]
    # another command's name for the same setting (``metadata["aliases"]``)
    flags = [flag, *f.metadata.get("aliases", ())]
    if kind is bool:
        parser.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
    elif f.metadata.get("repeat"):  # --flag A --flag B (a copy of the default is extended)
        if not suppress:
            kw["default"] = list(value)
        parser.add_argument(*flags, type=typing.get_args(kind)[0], action="append", **kw)
    elif typing.get_origin(kind) in (list, tuple):
        parser.add_argument(*flags, type=typing.get_args(kind)[0], nargs="+", **kw)
    else:
        parser.add_argument(*flags, type=kind, **kw)


def given(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The flags of ``cls`` present in ``args`` (with ``suppress``: those the user set)."""
    return {dest: getattr(args, dest) for dest, *_ in flag_fields(cls) if hasattr(args, dest)}


def from_args(cls: type, args: argparse.Namespace, base: Any = None, **fields: Any) -> Any:
    """Build ``cls`` from the parsed flags (``ktm.util.flags.from_flags``): a flag absent from
    ``args`` takes ``base``'s value, else the field's default; ``fields`` given outright."""
    return from_flags(cls, vars(args), base, **fields)


def parse_options(items: Sequence[str]) -> dict[str, Any]:
    """``["ratio=0.5", "unit=token"]`` -> ``{"ratio": 0.5, "unit": "token"}`` (literals or str;
    ``true`` / ``false`` in any case are booleans, as a shell user writes them)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise KTMError(f"option {item!r}: expected NAME=VALUE")
        name = key.replace("-", "_")
        if raw.lower() in ("true", "false"):
            out[name] = raw.lower() == "true"
            continue
        try:
            out[name] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[name] = raw
    return out


def compressor_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task-option", action="append", default=[], metavar="NAME=VALUE",
                        help="task constructor option, e.g. max_chars=400 or (amazon) "
                        "balance_train=true (repeatable)")
    method_args(parser)


def method_args(parser: argparse.ArgumentParser) -> None:
    from ktm.compressors.apply import METHODS

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


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """A model's flags: ``KTMConfig``'s (each set only when given) and ``ModelSpec``'s
    ``--device`` (the command names its checkpoint flag itself)."""
    add_dataclass_args(parser, KTMConfig, suppress=True)
    add_dataclass_args(parser, ModelSpec, skip=("checkpoint",))


def model_spec(args: argparse.Namespace, checkpoint: Any = None) -> ModelSpec:
    """The ``ModelSpec`` of the model flags given (``add_model_args``) and ``checkpoint``."""
    return ModelSpec(checkpoint, given(KTMConfig, args), args.device)


def init_or_build(args: argparse.Namespace):
    """A trainable model: from ``--init`` (a checkpoint folder or a shipped reader's name),
    else a fresh one from the model flags (``--init-adapter``: LoRA from a checkpoint); the
    command's ``--seed`` draws any new weights (``ktm.training.start.open_trainable``)."""
    from ktm.training.start import open_trainable

    return open_trainable(model_spec(args, getattr(args, "init", None)),
                          init_adapter=getattr(args, "init_adapter", None),
                          seed=getattr(args, "seed", 0) or 0)


def load_or_build(args: argparse.Namespace, opened=None):
    """An inference model: ``--checkpoint`` (``opened``: it, already read by
    ``ktm.readers.open_checkpoint``), else a fresh one from the model flags; on the
    ``--backend`` the command was given (``backend_args``)."""
    from ktm.model import open_model

    spec = runtime_spec(args)  # checked before the model loads
    return open_model(model_spec(args, opened or getattr(args, "checkpoint", None)), runtime=spec)


def runtime_spec(args: argparse.Namespace):
    """The ``RuntimeSpec`` of a command's runtime flags (``backend_args``; a command without
    them: torch)."""
    from ktm.model import RuntimeSpec

    return from_args(RuntimeSpec, args) if hasattr(args, "backend") else RuntimeSpec()


def backend_args(parser: argparse.ArgumentParser) -> None:
    """Where the model runs: ``RuntimeSpec``'s flags (``--backend``, the llama.cpp and vLLM
    settings, ``--press``, ``--compile``, ``--weights``), in a group of their own."""
    from ktm.model import RuntimeSpec

    group = parser.add_argument_group("runtime", "where the model runs (ktm.model.RuntimeSpec)")
    add_dataclass_args(group, RuntimeSpec)
