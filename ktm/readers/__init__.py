"""Shipped readers: pretrained encoder + LoRA checkpoints for the embedded model, loadable by name.

    KTMModel.load("smollm2-135m-k4")

A reader is an ordinary ktm checkpoint folder stored in 16-bit (fp16) inside the package. Each
was produced by the command in its ``reader.json`` (``results/readers/train_readers.sh`` runs
them all); ``pack_reader`` writes a trained checkpoint into this folder.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ktm.core.config import inner_chain, normal_inner_k
from ktm.errors import KTMError

HERE = Path(__file__).resolve().parent
READERS: dict[str, str] = {
    "smollm2-135m-k2": "smollm2-135m-k2",
    "smollm2-135m-k4": "smollm2-135m-k4",
    # consecutive positions: the readers llama.cpp and vLLM run (results/readers/train_readers.sh
    # k2s, k4s)
    "smollm2-135m-k2-seq": "smollm2-135m-k2-seq",
    "smollm2-135m-k4-seq": "smollm2-135m-k4-seq",
    # the K=4 consecutive-position reader pretrained further on chat-shaped windows (--chat-share
    # 0.5): what ktm serve --history-budget reads a long chat with (results/README.md, long
    # chats; results/readers/train_readers.sh k4chat)
    "smollm2-135m-k4-chat": "smollm2-135m-k4-chat",
    # the K=4 consecutive-position reader pretrained further with its LoRA on the merged rows
    # only (ktm.core.lora_scope), on recall questions read by the question allocator; read by
    # default at ratio 4 with it: a question's lines plain, the least relevant text left out to
    # pay (results/question/README.md; results/readers/train_readers.sh k4qa)
    "smollm2-135m-k4-qa": "smollm2-135m-k4-qa",
    # the question reader continued on chats about pasted documents, distilled on the base
    # model's own answers (the answer objective, documents up to 512 tokens): it answers a
    # question asked in a chat as the base model reading it plain does; read as k4-qa is
    # (results/question/README.md; results/readers/train_readers.sh k4qae)
    "smollm2-135m-k4-qa-chat": "smollm2-135m-k4-qa-chat",
    # the question reader for chats fine-tuned on questions about the training code (what a
    # name is set to, a function's parameters, a default, which function a line is in), read at
    # ratio 4 with the scope allocator: a question's lines plain with the def and class lines
    # they sit in (results/question/README.md; results/question/train_code_reader.sh natural)
    "smollm2-135m-k4-qa-code": "smollm2-135m-k4-qa-code",
}
# a reader found for a model and K (``find_reader``: the demo's start) is replaced by its
# consecutive-position twin, which llama.cpp and vLLM also run, where that twin reads as well:
# R within 0.02 on both held-out sets (K=2: 0.761 / 0.755 against 0.762 / 0.764, 64 windows
# each, results/readers/k2s_readability.json and k2_readability.json). The K=4 twin stays
# 0.03 below (0.562 / 0.628 against 0.591 / 0.656, k4s2_readability.json), so K=4 keeps the
# spread-position reader.
PREFERRED: dict[str, str] = {"smollm2-135m-k2": "smollm2-135m-k2-seq"}
# the settings a packed reader may be given as its default prompt layout (``pack_reader``)
LAYOUT = ("ratio", "allocator")
STORAGE_DTYPE = torch.float16  # weights are small (|w| << 65504); fp16 keeps 3 more bits than bf16


def reader_path(name: str) -> Path:
    """The folder of a shipped reader; a clear error for an unknown or absent one."""
    if name not in READERS:
        raise KTMError(f"unknown reader {name!r}: expected a checkpoint folder or one of "
                       f"{', '.join(sorted(READERS))}")
    path = HERE / READERS[name]
    if not (path / "ktm_config.json").is_file():
        raise KTMError(f"reader {name!r} is not in this installation ({path} is missing); "
                       "train it with results/readers/train_readers.sh")
    return path


def installed(name: str) -> bool:
    """Whether shipped reader ``name`` is registered and in this installation."""
    try:
        reader_path(name)
    except KTMError:
        return False
    return True


def find_reader(model: str, k: int) -> str | None:
    """The installed shipped reader for base model ``model`` at K=``k``, or None (see
    ``_find_reader``), replaced by its ``PREFERRED`` twin where that is installed."""
    name = _find_reader(model, k)
    twin = PREFERRED.get(name) if name else None
    return twin if twin and installed(twin) else name


def _find_reader(model: str, k: int) -> str | None:
    """The installed shipped reader for base model ``model`` at K=``k``, or None.

    An embedded model's is found by name (``smollm2-135m`` -> ``smollm2-135m-k4``); a folder's
    by content: the reader of K=``k`` whose recorded base-model identity (sizes and tokenizer
    vocabulary, ``ktm.core.base_identity``) is the folder's, so a local copy of the embedded model
    gets its reader under any path and another model never does.

    A reader of exactly K=``k`` is always preferred; without one, a recursive reader whose
    inner K is ``k`` (a K=4 reader of two K=2 merges loads at K=2, keeping about what the K=2
    reader keeps: README, "A K mix") is a better start than mean pooling.
    """
    from ktm.core.base_identity import differences, folder_identity
    from ktm.core.base_model import EMBEDDED, resolve_model_path
    from ktm.core.checkpoint import read_config

    named = f"{model}-k{k}"
    if named in READERS or model in EMBEDDED:
        if installed(named):
            return named

        def fits(saved: dict) -> bool:
            return saved["config"].get("base_model") == model
    else:
        mine = folder_identity(resolve_model_path(model))

        def fits(saved: dict) -> bool:
            recorded = saved.get("base_identity")
            return isinstance(recorded, dict) and not differences(recorded, mine)

    inner = None
    for name in sorted(READERS):
        if not installed(name):
            continue
        saved = read_config(reader_path(name))
        cfg = saved["config"]
        if not fits(saved):
            continue
        if cfg.get("k") == k:
            return name
        if inner is None and k > 1 and k in inner_chain(normal_inner_k(cfg.get("inner_k", 1))):
            inner = name
    return inner


def resolve_checkpoint(name_or_path: str | Path) -> Path:
    """A checkpoint folder from a path, or a shipped reader's name."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    if str(name_or_path) in READERS:
        return reader_path(str(name_or_path))
    raise KTMError(f"no checkpoint folder {str(name_or_path)!r} and no shipped reader of that "
                   f"name: expected a checkpoint folder or one of {', '.join(sorted(READERS))}")


def open_checkpoint(name_or_path):
    """A checkpoint's records read once (``ktm.core.checkpoint.Checkpoint``), from its folder or
    a shipped reader's name; an opened one is returned as it is."""
    from ktm.core.checkpoint import Checkpoint

    if isinstance(name_or_path, Checkpoint):
        return name_or_path
    return Checkpoint.open(resolve_checkpoint(name_or_path), name=str(name_or_path))


def pack_reader(checkpoint: str | Path, name: str, info: dict,
                layout: dict | None = None) -> Path:
    """Copy a trained checkpoint into the package as reader ``name``, weights cast to fp16.

    ``info`` (the training command, data, CPU minutes, readability) goes to ``reader.json``;
    ``layout``: prompt-layout settings the reader is read with by default (``ratio``,
    ``allocator``: ``KTMConfig`` fields a checkpoint can be read with another of), recorded
    there too.
    """
    from ktm.core.checkpoint import (
        ADAPTER,
        CONFIG,
        ENCODER,
        FILE_ERRORS,
        SURPRISAL,
        read_config,
        read_surprisal,
        save_atomic,
    )
    from ktm.core.config import KTMConfig
    from ktm.util.fileio import write_json_atomic, write_text_atomic

    src = Path(checkpoint)
    cfg = read_config(src)
    layout = dict(layout or {})
    unknown = sorted(set(layout) - set(LAYOUT))
    if unknown:
        raise KTMError(f"a reader's default layout takes {', '.join(LAYOUT)}, got {unknown}")
    cfg["config"] = KTMConfig.from_dict({**cfg["config"], **layout}).to_dict()  # checked
    if layout:
        info = {**info, "layout": layout}
    if name not in READERS:
        raise KTMError(f"reader name {name!r} is not registered: expected one of "
                       f"{', '.join(sorted(READERS))} (add it to ktm.readers.READERS)")
    check_name_fits(name, cfg["config"])
    # read whole before writing: a bad source is named as such, not as a failed write
    states, lora_config = {}, src / ADAPTER / "adapter_config.json"
    try:
        for rel in (ENCODER, f"{ADAPTER}/adapter_model.safetensors"):
            states[rel] = {k: v.to(STORAGE_DTYPE).contiguous() for k, v in
                           load_file(str(src / rel)).items()}
        lora_text = lora_config.read_text()
        table = read_surprisal(src)
    except FILE_ERRORS as e:
        raise KTMError(f"checkpoint {str(src)!r} is incomplete or corrupt: {e}") from e

    def write(tmp: Path) -> None:
        (tmp / ADAPTER).mkdir()
        for rel, state in states.items():
            save_file(state, str(tmp / rel), metadata={"format": "pt"})
        write_text_atomic(tmp / ADAPTER / "adapter_config.json", lora_text)
        if table is not None:  # the surprisal table as trained (float32 counts)
            table.save(tmp / SURPRISAL)
        write_json_atomic(tmp / CONFIG, cfg)
        write_json_atomic(tmp / "reader.json", {"name": name, **info})

    save_atomic(HERE / READERS[name], write)
    return HERE / READERS[name]


def check_name_fits(name: str, config: dict) -> None:
    """A reader named ``MODEL-kN`` (how ``ktm demo`` finds one) must be a K=N checkpoint, and of
    ``MODEL`` itself when that is an embedded model's name: packing a run of another model or K
    under it would replace the shipped reader with one its users cannot load."""
    from ktm.core.base_model import EMBEDDED

    match = re.fullmatch(r"(.+)-k(\d+)(-[a-z0-9]+)?", name)
    stem, level = (match.group(1), match.group(2)) if match else (name, "")
    if level.isdigit() and int(level) != config.get("k"):
        raise KTMError(f"reader name {name!r} says K={level}, but the run has "
                       f"K={config.get('k')}: expected a reader name ending in -k{config.get('k')}")
    if stem in EMBEDDED and config.get("base_model") != stem:
        raise KTMError(f"reader name {name!r} is for the embedded model {stem!r}, but the run "
                       f"trained {config.get('base_model')!r}: expected a run of {stem!r}")


def run_info(run_dir: str | Path) -> dict:
    """What trained a run: its command, configs, data, CPU minutes and last readability."""
    from ktm.util.fileio import read_metrics

    run = Path(run_dir)
    try:
        meta = json.loads((run / "run.json").read_text())
        rows = read_metrics(run / "metrics.jsonl")  # drops a last line a crash cut
    except (OSError, json.JSONDecodeError) as e:
        raise KTMError(f"{str(run)!r} is not a finished ktm run (run.json / metrics.jsonl): {e}"
                       ) from e
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval" in r]
    if not steps:
        raise KTMError(f"{str(run)!r} has no training steps in metrics.jsonl")
    # a resumed run has several starts: each with its command (e.g. a changed --max-steps)
    starts = [{"step": h.get("started_at_step", 0), "command": h.get("command"),
               "git": h.get("git")} for h in meta.get("history") or [meta]]
    return {"command": meta.get("command"), "starts": starts, "train": meta.get("config"),
            "pretrain": meta.get("pretrain"), "docs": meta.get("docs"), "git": meta.get("git"),
            "versions": meta.get("versions"), "steps": steps[-1]["step"],
            "cpu_minutes": steps[-1].get("cpu_s", 0.0) / 60,
            "readability": evals[-1]["eval"] if evals else None}


def check_finished(run_dir: str | Path) -> None:
    """Refuse a run whose checkpoint has not reached its ``max_steps`` (killed, or still
    training): its last checkpoint is not the reader its run.json and metrics describe."""
    run = Path(run_dir)
    try:
        step = json.loads((run / "checkpoint" / "trainer_state.json").read_text())["step"]
        want = json.loads((run / "run.json").read_text())["config"]["max_steps"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise KTMError(f"{str(run)!r} is not a finished ktm run (checkpoint/trainer_state.json, "
                       f"run.json): {e}") from e
    if step < want:
        raise KTMError(f"{str(run)!r} is unfinished: its checkpoint is at step {step} of "
                       f"{want}; expected a finished run (continue it with --resume)")


def lineage_info(stage_dirs: list[str | Path], info: dict) -> dict:
    """``info`` with the earlier stages a run continues (their run folders, oldest first).

    A reader trained in stages (K=2, then K=4 from it, then continuations) records only its
    last stage in ``run.json``; the chain goes to ``reader.json`` as ``lineage``, one entry per
    earlier stage (its command, revision, steps, CPU minutes and last readability), and
    ``cpu_minutes_total`` sums them with the last stage's.
    """
    keep = ("command", "git", "steps", "cpu_minutes", "readability")
    lineage = []
    for d in stage_dirs:
        stage = run_info(d)  # reads run.json and metrics.jsonl once per stage
        lineage.append({"run": str(d), **{k: stage[k] for k in keep}})
    total = info["cpu_minutes"] + sum(s["cpu_minutes"] for s in lineage)
    return {**info, "lineage": lineage, "cpu_minutes_total": total}


def reader_info(name: str) -> dict:
    return json.loads((reader_path(name) / "reader.json").read_text())
