"""What a checkpoint records about the baseline it was trained with: ``compressor.json``.

    {"name": "selective_context", "options": {"ratio": 0.5}}

A baseline's LoRA learned to read prompts as the method rewrote them (text dropped, LTSC's
meta-tokens): read as plain prompts it is silently another model. ``ktm train --compressor``
writes the record beside ``ktm_config.json``, inside every checkpoint's atomic swap; ``ktm eval``
and ``ktm generate`` apply the recorded method unless told otherwise (a contradicting
``--compressor`` is an error), ``ktm serve`` and ``ktm export`` refuse a method that rewrites
prompts. ``options`` are the constructor options given (``--compressor-option``), so
``get_compressor(name, **options)`` builds the method again. A checkpoint without the record
reads as before.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ktm.compressors import COMPRESSORS, get_compressor
from ktm.compressors.base import Compressor
from ktm.compressors.ltsc import STATE_JSON
from ktm.core.checkpoint import COMPRESSOR_RECORD, Checkpoint, read_compressor_record
from ktm.errors import KTMError
from ktm.util.fileio import write_json_atomic

RECORD = COMPRESSOR_RECORD


def write_record(directory: str | Path, name: str, options: dict[str, Any]) -> None:
    write_json_atomic(Path(directory) / RECORD, {"name": name, "options": options})


def checkpoint_saver(compressor: Compressor, options: dict[str, Any]) -> Callable[[Path], None]:
    """``save_extra`` for ``ktm.training.train.train``: the method's fitted state and its record."""
    def save(directory: Path) -> None:
        compressor.save_state(directory)
        write_record(directory, compressor.name, options)

    return save


def read_record(checkpoint: str | Path | Checkpoint | None) -> dict[str, Any] | None:
    """``{"name", "options"}`` the checkpoint was trained with; None when it has no record."""
    if isinstance(checkpoint, Checkpoint):
        rec, checkpoint = checkpoint.compressor, checkpoint.path
    else:
        rec = read_compressor_record(checkpoint) if checkpoint else None
    if rec is not None and rec["name"] not in COMPRESSORS:
        raise KTMError(f"compressor record {str(Path(checkpoint) / RECORD)!r} is corrupt: "
                       f"expected {{'name': one of {', '.join(COMPRESSORS)}, 'options': "
                       f"{{...}}}}, got {rec!r}")
    return rec


def resolve(checkpoint: str | Checkpoint | None, name: str | None,
            options: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """The method and options to read ``checkpoint`` (a folder, or one opened:
    ``ktm.readers.open_checkpoint``) with: its recorded ones by default; a given
    ``--compressor`` or ``--compressor-option`` must agree with them."""
    rec = read_record(checkpoint)
    if isinstance(checkpoint, Checkpoint):
        checkpoint = checkpoint.name
    if rec is None:
        _check_unrecorded_ltsc(checkpoint, name)
        return name, options
    if name is not None and name != rec["name"]:
        raise KTMError(f"--compressor {name} contradicts checkpoint {checkpoint!r}, which was "
                       f"trained with --compressor {rec['name']} ({RECORD}): drop the flag or "
                       f"pick a checkpoint trained with {name}")
    merged = {**rec["options"], **options}
    theirs = get_compressor(rec["name"], **rec["options"]).options()
    ours = get_compressor(rec["name"], **merged).options()
    diff = [key for key in ours if ours[key] != theirs.get(key)]
    if diff:
        given = ", ".join(f"{key}={ours[key]!r}" for key in diff)
        saved = ", ".join(f"{key}={theirs.get(key)!r}" for key in diff)
        raise KTMError(f"--compressor-option {given} contradicts checkpoint {checkpoint!r}, "
                       f"which was trained with {rec['name']} {saved} ({RECORD}): drop the "
                       "option or pick a checkpoint trained with it")
    return rec["name"], merged


def plan_training(checkpoint: Path, resume: bool, init: str | None, name: str | None,
                  options: dict[str, Any]) -> tuple[dict[str, Any], Path | None]:
    """``ktm train``'s method options and the folder its fitted state is restored from (the run's
    own checkpoint on --resume, a same-method --init checkpoint), after the checks below."""
    if resume:
        check_resume(checkpoint, name, options)
        return options, checkpoint
    _, options, state = check_init(init, name, options)
    return options, state


def check_init(init: str | None, name: str | None, options: dict[str, Any],
               command: str = "train") -> tuple[str | None, dict[str, Any], Path | None]:
    """``--init CHECKPOINT``: a baseline's checkpoint is continued with its own method.

    Returns the method and options to train with (the record's, under any given option that
    agrees with it) and the folder to restore the method's fitted state from (LTSC's vocabulary
    and meta rows); a method that contradicts the record, or none for a checkpoint whose prompts
    a method rewrote, is refused. A plain checkpoint may start any method. A baseline that only
    set the encoder (mean pooling) continued without its method is the same model, but its
    checkpoint no longer says so: warned, as ``--init-adapter`` warns of a baseline's LoRA.
    """
    path = Path(init) if init and Path(init).is_dir() else None
    rec = read_record(path) if path else None
    found = (rec["name"], RECORD) if rec else (rewriting_method(path) if path else None)
    if found is None:
        return name, options, None
    if name is None and rec and not COMPRESSORS[rec["name"]].rewrites_prompts:
        how = ("this run has no --compressor" if command == "train"
               else f"ktm {command} takes no --compressor")
        hint = (f"give --compressor {rec['name']} to continue the baseline" if command == "train"
                else "unless that is what you meant")
        warnings.warn(f"--init {init!r} is the checkpoint of a --compressor {rec['name']} baseline "
                      f"({RECORD}); {how}, so this run's checkpoint will not record "
                      f"{rec['name']} and its rows will not name it (the model is the same, "
                      f"with the baseline's encoder settings); {hint}", UserWarning, stacklevel=2)
        return name, options, None
    method, source = found
    if name != method:
        how = (f"--compressor {name}" if name else "no --compressor" if command == "train"
               else f"ktm {command}, which reads prompts as given")
        hint = (f"give --compressor {method} to continue it" if command == "train"
                else "start from a checkpoint trained without a baseline")
        raise KTMError(f"--init {init!r} was trained with --compressor {method} (its {source}), "
                       f"this run has {how}: its LoRA reads prompts as {method} rewrote them; "
                       f"{hint}")
    name, options = resolve(path, name, options) if rec else (name, options)
    return name, options, path


def check_resume(checkpoint: str | Path, name: str | None, options: dict[str, Any]) -> None:
    """A resumed run reads its prompts as it was trained: the method and options it records."""
    rec = read_record(checkpoint) if Path(checkpoint).is_dir() else None
    if rec is None:
        _check_unrecorded_ltsc(str(checkpoint), name)
        return
    theirs = get_compressor(rec["name"], **rec["options"]).options()
    ours = get_compressor(name, **options).options() if name == rec["name"] else None
    if ours == theirs:
        return
    had = " ".join([f"--compressor {rec['name']}"]
                   + [f"--compressor-option {k}={v}" for k, v in rec["options"].items()])
    now = ("no --compressor" if name is None else
           f"--compressor {name}" + "".join(f" --compressor-option {k}={v}"
                                             for k, v in options.items()))
    raise KTMError(f"cannot resume from {str(checkpoint)!r}: it was trained with {had} ({RECORD}"
                   f"), this run has {now}; resume with {had}, or start a new out_dir")


def _check_unrecorded_ltsc(checkpoint: str | None, name: str | None) -> None:
    """A checkpoint from before the record that holds LTSC's fitted state was trained on prompts
    with its meta-tokens: read without them it would be scored on plain prompts."""
    if checkpoint and name is None and (Path(checkpoint) / STATE_JSON).is_file():
        raise KTMError(f"checkpoint {checkpoint!r} was trained with --compressor ltsc (it holds "
                       f"{STATE_JSON}): expected --compressor ltsc, which reads its prompts "
                       "as it was trained")


def rewriting_method(checkpoint: str | Path) -> tuple[str, str] | None:
    """(method, the file that says so) when a method rewrites this checkpoint's prompts; None
    when it reads them as given."""
    rec = read_record(checkpoint)
    if rec is not None:
        return (rec["name"], RECORD) if COMPRESSORS[rec["name"]].rewrites_prompts else None
    return ("ltsc", STATE_JSON) if (Path(checkpoint) / STATE_JSON).is_file() else None


def refuse_rewritten(checkpoint: str, reader: str, hint: str) -> None:
    """Raise when a method rewrites ``checkpoint``'s prompts but ``reader`` (the server, an
    export) would read them as given: for that checkpoint it is silently another model."""
    found = rewriting_method(checkpoint) if Path(checkpoint).is_dir() else None
    if found:
        method, source = found
        raise KTMError(f"checkpoint {checkpoint!r} was trained with --compressor {method} (its "
                       f"{source}): {reader} reads prompts as given, not rewritten by {method}; "
                       f"expected a checkpoint trained without a baseline ({hint})")
