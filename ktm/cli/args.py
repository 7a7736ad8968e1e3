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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ktm.core.config import KTMConfig
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
LAYOUT = ("plain_suffix", "align_lines", "spread_positions", "ratio", "allocator")


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


def _saved(args: argparse.Namespace, checkpoint: str, trainable: bool):
    """A checkpoint or shipped reader; given model flags must agree with its config, except
    those a trainable start grows (``ktm.training.growth``)."""
    from ktm.core.checkpoint import check_level, model_config
    from ktm.model import KTMModel
    from ktm.readers import resolve_checkpoint
    from ktm.training.growth import GROWABLE, grow

    path = resolve_checkpoint(checkpoint)
    own = model_config(path)
    flags = given(KTMConfig, args)
    seed, dtype = getattr(args, "seed", 0) or 0, flags.get("dtype", "float32")
    if trainable and "inner_k" in flags and flags.get("k", own.k) > own.k:
        # a reader gaining an outer level (--k 8 --inner-k 4 2 on a K=4 reader of inner K 2)
        return grow(checkpoint, replace(from_args(KTMConfig, args, base=own), dtype=dtype),
                    device=args.device, seed=seed)
    # K first, as KTMModel.load checks it: a recursive checkpoint also reads at its inner K
    check_level(own, flags.get("k"), path)
    saved = own.at_level(flags["k"]) if "k" in flags else own
    want = from_args(KTMConfig, args, base=saved)
    clash = [d for d in flags if d not in (*RUNTIME, *LAYOUT, "k")
             and _value(want, d) != _value(saved, d)]
    if trainable and clash and set(clash) <= set(GROWABLE):
        return grow(checkpoint, replace(want, dtype=dtype), device=args.device, seed=seed)
    if clash:
        ours = ", ".join(f"--{d.replace('_', '-')} {flags[d]!r}" for d in clash)
        theirs = ", ".join(f"{d}={_value(saved, d)!r}" for d in clash)
        raise KTMError(f"{ours} contradicts checkpoint {checkpoint!r}, which has {theirs}: "
                       "drop the flag or pick a matching checkpoint")
    # the dtype is a choice of this run (default float32), not the one the checkpoint trained in
    return KTMModel.load(path, base=flags.get("model"), k=flags.get("k"), device=args.device,
                         dtype=dtype, trainable=trainable,
                         plain_suffix=flags.get("plain_suffix"),
                         align_lines=flags.get("align_lines"),
                         spread_positions=flags.get("spread_positions"),
                         ratio=flags.get("ratio"), allocator=flags.get("allocator"))


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


def load_or_build(args: argparse.Namespace):
    """An inference model: ``--checkpoint``, else a fresh one from the model flags; on the
    ``--backend`` the command was given (``backend_args``)."""
    checkpoint = getattr(args, "checkpoint", None)
    model = _saved(args, checkpoint, trainable=False) if checkpoint else _fresh(args)
    if getattr(args, "press", None):  # refused by name below on a backend without presses
        model.use_press(args.press, args.press_ratio)
    if getattr(args, "compile", "auto") != "auto":
        if getattr(args, "backend", "torch") != "torch":
            raise KTMError(f"--compile {args.compile} is an option of the torch backend, not "
                           f"--backend {args.backend} (llama.cpp and vLLM run their own graphs)")
        model.runtime.compile = args.compile
    if getattr(args, "weights", "native") != "native":
        if getattr(args, "backend", "torch") != "torch":
            raise KTMError(f"--weights {args.weights} is an option of the torch backend, not "
                           f"--backend {args.backend} (llama.cpp and vLLM read their own "
                           "weight types)")
        model.runtime.weights = args.weights
    if getattr(args, "backend", "torch") != "torch":
        from ktm.readers import resolve_checkpoint

        model.use_backend(args.backend, source=resolve_checkpoint(checkpoint) if checkpoint
                          else None, gguf=args.gguf, config=runtime_config(args))
    return model


def backend_args(parser: argparse.ArgumentParser) -> None:
    """``--backend torch|llamacpp|vllm``, the llama.cpp context's settings and where vLLM runs."""
    from ktm.core.int8 import WEIGHTS
    from ktm.llamacpp.runtime import KV_TYPES, RuntimeConfig
    from ktm.model import BACKENDS
    from ktm.vllm.runtime import VLLMConfig

    d, v = RuntimeConfig(), VLLMConfig()
    parser.add_argument("--backend", choices=BACKENDS, default="torch",
                        help="what prefills and decodes: torch; llama.cpp (the [llamacpp] "
                             "extra; the model is exported to GGUF once, into the cache, unless "
                             "--gguf names an export); or vLLM (installed as docs/serving.md "
                             "says; exported once into the cache) (default: 'torch')")
    parser.add_argument("--gguf", metavar="DIR", default=None,
                        help="a GGUF export of this model (ktm export --format gguf) for "
                             "--backend llamacpp")
    parser.add_argument("--llamacpp-context", type=int, default=d.context, metavar="N",
                        help="llama.cpp KV-cache cells, shared by all prompts decoding at once "
                             "(default: the model's trained context, at most 16384)")
    parser.add_argument("--llamacpp-sequences", type=int, default=d.sequences, metavar="N",
                        help=f"prompts llama.cpp decodes at once at most (default: {d.sequences})")
    parser.add_argument("--llamacpp-kv-type", choices=sorted(KV_TYPES), default=d.kv_type,
                        help="llama.cpp KV-cache type: f16 (its default) or f32 (the torch "
                             f"path's precision exactly, no flash attention) (default: "
                             f"{d.kv_type!r})")
    parser.add_argument("--llamacpp-deterministic", action="store_true",
                        help="llama.cpp: greedy output independent of other requests and of "
                             "what ran before (cells per sequence, no reused rows, a decode "
                             "batch per row; slower under load)")
    parser.add_argument("--vllm-url", default=None, metavar="URL",
                        help="--backend vllm: a running vLLM server's /v1 address serving this "
                             "model's export (default: vLLM runs in this process)")
    parser.add_argument("--vllm-server", action="store_true",
                        help="--backend vllm: start a vLLM server process instead of an engine "
                             "in this process")
    parser.add_argument("--vllm-kv-cache-gb", type=float, default=v.kv_cache_gb, metavar="GB",
                        help=f"--backend vllm: its CPU KV cache (default: {v.kv_cache_gb:g})")
    parser.add_argument("--compile", choices=("auto", "off", "on"), default="auto",
                        help="--backend torch: decode steps on a static KV cache, compiled "
                             "(torch.compile; CUDA graphs on CUDA), and the prefill compiled "
                             "for every length: on, off, or auto, where measured to pay (on "
                             "CUDA, decode batches of up to 64k cache positions and prefills "
                             "of up to 1,024: docs/guide.md) (default: 'auto')")
    parser.add_argument("--weights", choices=WEIGHTS, default="native",
                        help="--backend torch: the LM's linear layers as loaded (native) or "
                             "in int8, one scale per output row (a quarter of fp32's bytes "
                             "read a decode step; logits within the bound docs/guide.md "
                             "states) (default: 'native')")
    press_args(parser)


def press_args(parser: argparse.ArgumentParser) -> None:
    """``--press NAME --press-ratio R``: a kvpress press on the torch runtime."""
    from ktm.decode.press import SCORERS, WRAPPERS, press_names

    parser.add_argument("--press", choices=press_names(), default=None, metavar="NAME",
                        help="press the KV cache of the prompt's compressed segments after "
                             "prefill (merged or plain; the plain segments after them never) "
                             "with a kvpress press (the [kvpress] extra; torch backend only): "
                             f"{', '.join(SCORERS)}, or WRAPPER:PRESS with a wrapper of "
                             f"{', '.join(WRAPPERS)} (default: none)")
    parser.add_argument("--press-ratio", type=float, default=0.5, metavar="R",
                        help="--press: the share of the pressed segments' KV dropped, in "
                             "[0, 1) (default: 0.5)")


def runtime_config(args: argparse.Namespace):
    """The settings of the ``--backend`` the command was given (None for torch)."""
    if args.backend == "vllm":
        from ktm.vllm.runtime import VLLMConfig

        return VLLMConfig(url=args.vllm_url, server=args.vllm_server,
                          kv_cache_gb=args.vllm_kv_cache_gb)
    if args.backend == "llamacpp":
        from ktm.llamacpp.runtime import RuntimeConfig

        return RuntimeConfig(context=args.llamacpp_context, sequences=args.llamacpp_sequences,
                             kv_type=args.llamacpp_kv_type,
                             deterministic=args.llamacpp_deterministic)
    return None


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
