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
import dataclasses
import types
import typing
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ktm.core.config import KTMConfig, Layout
from ktm.errors import KTMError
from ktm.tasks import TASKS
from ktm.tasks.tree_gen import STAGES
from ktm.util.field_types import check_at_least


def _unwrap(kind: Any) -> Any:
    """``X | None`` -> ``X``; ``int | tuple[int, ...]`` -> the tuple (a flag taking values)."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kinds = [t for t in typing.get_args(kind) if t is not type(None)]
        return next((t for t in kinds if typing.get_origin(t) is tuple), kinds[0])
    return kind


def _nested_prefix(prefix: str, f: dataclasses.Field) -> str:
    """A nested dataclass's flags: the field's name (or ``metadata["prefix"]``; "": none) and
    an underscore before each of its own."""
    own = f.metadata.get("prefix", f.name)
    return prefix + own + "_" if own else prefix


def _fields(cls: type, prefix: str = ""):
    """(dest, field, type) for every field that has a flag (``metadata["flag"]`` None: none),
    nested dataclasses flattened with their prefix."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = _unwrap(hints[f.name])
        if dataclasses.is_dataclass(kind):
            yield from _fields(kind, _nested_prefix(prefix, f))
        elif f.metadata.get("flag", f.name) is not None:
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
        for key in ("choices", "metavar"):
            if key in f.metadata:
                kw[key] = f.metadata[key]
        # another command's name for the same setting (``metadata["aliases"]``)
        flags = [flag, *f.metadata.get("aliases", ())]
        if kind is bool:
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
        elif f.metadata.get("repeat"):  # --flag A --flag B (a copy of the default is extended)
            if not suppress:
                kw["default"] = list(default)
            parser.add_argument(*flags, type=typing.get_args(kind)[0], action="append", **kw)
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
                                       _nested_prefix(prefix, f))
            continue
        flag = f.metadata.get("flag", f.name)
        dest = None if flag is None else prefix + flag
        if dest is not None and hasattr(args, dest):
            v = getattr(args, dest)
            if typing.get_origin(kind) is tuple and isinstance(v, list):
                v = tuple(v)
            values[f.name] = v
        elif base is not None:
            values[f.name] = getattr(base, f.name)
    return cls(**values)


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


RUNTIME = ("model", "dtype")  # base folder and dtype may differ from a checkpoint's
# how prompts are laid out, not weights: may differ from a checkpoint's
LAYOUT = tuple(f.name for f in fields(Layout))


@dataclass
class TaskArgs:
    task: str = field(default="tree", metadata={"choices": sorted(TASKS), "help": "the task"})
    stage: str = field(default="xmedium", metadata={"choices": list(STAGES),
                                                    "help": "tree stage (tree task only)"})
    prompt_mode: str = field(default="context", metadata={
        "choices": ["context", "paper"],
        "help": "context: the question plain | paper: all compressed"})
    data_path: str | None = field(default=None, metadata={
        "help": "a JSONL (.gz too) of the task's schema instead of its shipped file; required "
                "by custom (context, optional prompt, target)"})
    n_train: int = field(default=2000, metadata={"help": "training examples to draw"})
    n_eval: int = field(default=200, metadata={"help": "evaluation examples"})

    def __post_init__(self) -> None:
        # n_eval 0 failed at the evaluation after training
        check_at_least(self, 1, "n_train", "n_eval", flags=True)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser, KTMConfig, suppress=True)
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:N "
                                                        "(default: 'cpu')")


def _fresh(args: argparse.Namespace):
    from ktm.model import KTMModel

    return KTMModel.from_base(config=from_args(KTMConfig, args), device=args.device)


def _saved(args: argparse.Namespace, checkpoint: str, trainable: bool, runtime=None):
    """A checkpoint or shipped reader; given model flags must agree with its config, except
    those a trainable start grows (``ktm.training.growth``); running where ``runtime`` (a
    ``RuntimeSpec``; None: torch) says."""
    from ktm.model import KTMModel
    from ktm.readers import open_checkpoint
    from ktm.training.growth import GROWABLE, grow

    ckpt = open_checkpoint(checkpoint)  # read once: the name or folder, or already opened
    checkpoint, own = ckpt.name, ckpt.config
    flags = given(KTMConfig, args)
    seed, dtype = getattr(args, "seed", 0) or 0, flags.get("dtype", "float32")
    if trainable and "inner_k" in flags and flags.get("k", own.k) > own.k:
        # a reader gaining an outer level (--k 8 --inner-k 4 2 on a K=4 reader of inner K 2)
        return grow(ckpt, replace(from_args(KTMConfig, args, base=own), dtype=dtype),
                    device=args.device, seed=seed)
    # K first, as KTMModel.load checks it: a recursive checkpoint also reads at its inner K
    ckpt.check_level(flags.get("k"))
    saved = own.at_level(flags["k"]) if "k" in flags else own
    want = from_args(KTMConfig, args, base=saved)
    clash = [d for d in flags if d not in (*RUNTIME, *LAYOUT, "k")
             and _value(want, d) != _value(saved, d)]
    if trainable and clash and set(clash) <= set(GROWABLE):
        return grow(ckpt, replace(want, dtype=dtype), device=args.device, seed=seed)
    if clash:
        ours = ", ".join(f"--{d.replace('_', '-')} {flags[d]!r}" for d in clash)
        theirs = ", ".join(f"{d}={_value(saved, d)!r}" for d in clash)
        raise KTMError(f"{ours} contradicts checkpoint {checkpoint!r}, which has {theirs}: "
                       "drop the flag or pick a matching checkpoint")
    # the dtype is a choice of this run (default float32), not the one the checkpoint trained in
    return KTMModel.load(ckpt, base=flags.get("model"), k=flags.get("k"), device=args.device,
                         dtype=dtype, trainable=trainable,
                         layout=Layout(**{n: flags.get(n) for n in LAYOUT}), runtime=runtime)


def _value(cfg: KTMConfig, dest: str) -> Any:
    if dest.startswith("lora_"):
        return getattr(cfg.lora, dest.removeprefix("lora_"))
    return getattr(cfg, {"model": "base_model", "mlp": "use_mlp"}.get(dest, dest))


def init_or_build(args: argparse.Namespace):
    """A trainable model: from ``--init`` (a checkpoint folder or a shipped reader's name),
    else a fresh one from the model flags (``--init-adapter``: LoRA from a checkpoint)."""
    if getattr(args, "init", None) and getattr(args, "init_adapter", None):
        raise KTMError("give --init or --init-adapter, not both")
    if getattr(args, "init", None):
        return _saved(args, args.init, trainable=True)
    # the fresh weights (LoRA's A matrices, the encoder MLP) come from the run's seed, so the
    # same command gives the same model; a local generator state, restored afterwards
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(getattr(args, "seed", 0) or 0)
        model = _fresh(args)
    if getattr(args, "init_adapter", None):
        from ktm.core.checkpoint import load_adapter_into
        from ktm.readers import resolve_checkpoint

        path = resolve_checkpoint(args.init_adapter)
        warn_adapter_source(path, args.init_adapter)
        load_adapter_into(model, path)
    return model


def warn_adapter_source(path: Path, name: str) -> None:
    """Say what ``--init-adapter`` takes when it is not a K-token merging checkpoint: a
    baseline's (``compressor.json``) or uncompressed fine-tuning's (K=1). Its LoRA
    learned to read prompts rewritten, or plain: a legitimate start for an adapter, which is why
    it is allowed, but also what a mixed-up folder looks like. What cannot work (another base
    model, a smaller rank) is refused by ``load_adapter_into``."""
    from ktm.core.checkpoint import (
        COMPRESSOR_RECORD,
        SETTING_ONLY,
        model_config,
        read_compressor_record,
    )

    rec = read_compressor_record(path)
    if rec is not None:
        how = "merged" if rec["name"] in SETTING_ONLY else "rewritten"
        what = (f"the checkpoint of a --compressor {rec['name']} baseline ({COMPRESSOR_RECORD}): "
                f"its LoRA learned to read prompts {how} by {rec['name']}")
    elif model_config(path).k == 1:
        what = ("an uncompressed (K=1) checkpoint: its LoRA learned to read plain prompts, "
                "never merged ones")
    else:
        return
    warnings.warn(f"--init-adapter {name!r} is {what}. This run's LoRA starts from it anyway, "
                  "with a fresh encoder; expected a reader or a K-token merging checkpoint, "
                  "unless that is what you meant", UserWarning, stacklevel=2)


def load_or_build(args: argparse.Namespace, opened=None):
    """An inference model: ``--checkpoint`` (``opened``: it, already read by
    ``ktm.readers.open_checkpoint``), else a fresh one from the model flags; on the
    ``--backend`` the command was given (``backend_args``)."""
    checkpoint = opened or getattr(args, "checkpoint", None)
    spec = runtime_spec(args)  # checked before the model loads
    if checkpoint:
        return _saved(args, checkpoint, trainable=False, runtime=spec)
    return spec.apply(_fresh(args))


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


def build_task(t: TaskArgs, options: Sequence[str] = ()):
    from ktm.compressors.apply import parse_options
    from ktm.tasks import get_task

    kwargs: dict[str, Any] = {"prompt_mode": t.prompt_mode, **parse_options(options)}
    if t.task == "tree":
        kwargs["stage"] = t.stage
    if t.data_path:
        kwargs["data_path"] = t.data_path
    return get_task(t.task, **kwargs)


def plain(value: Any) -> Any:
    """A JSON-plain copy (paths as strings, tuples as lists)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def task_settings(task) -> dict[str, Any]:
    """Every constructor setting of the task as it was really built (options included), and
    the data file it read (None: generated, e.g. trees without the data folder)."""
    return {"name": task.name, **{f.name: plain(getattr(task, f.name))
                                  for f in dataclasses.fields(task) if f.init},
            "file": plain(getattr(task, "path", None))}
