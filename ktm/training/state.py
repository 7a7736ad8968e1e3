"""A training run on disk, and the checks that let a resume continue the *same* run.

    OUT/run.json           what started the run, one entry per start (``history``)
    OUT/metrics.jsonl      one JSON row per logged step / evaluation (an append-only log)
    OUT/run.lock           locked while a run writes the folder (``ktm.training.run_lock``)
    OUT/checkpoint/        a loadable KTMModel checkpoint + optimizer.safetensors (Adam moments,
                           CPU and CUDA RNG states) + trainer_state.json; extra files (LTSC
                           state) are written inside the same atomic folder swap. With a weight
                           average (``ema_decay``) the checkpoint's weights are the average and
                           checkpoint/live/ is the last iterate, itself a loadable checkpoint

A resume refuses anything that would change the data a step sees (the global batch: processes
x batch size x accumulation; the seed; the examples) or the model (K, encoder, LoRA
r/alpha/dropout/targets). Another number of processes is fine if the global batch stays.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ktm.core.checkpoint import load_weights_into, save_atomic, write_model_files
from ktm.errors import KTMError
from ktm.training import distributed
from ktm.util.fileio import (
    TEMP_DIR_PREFIX,
    existing_dir,
    read_metrics,
    remove_path,
    write_json_atomic,
    write_text_atomic,
)

CHECKPOINT = "checkpoint"
METRICS = "metrics.jsonl"
RUN = "run.json"
OPTIMIZER = "optimizer.safetensors"
TRAINER = "trainer_state.json"
LIVE = "live"  # the last iterate beside a weight average (ktm.training.ema)
BATCH = ("processes", "batch_size", "grad_accum")  # only their product must stay
FINGERPRINT_EXAMPLES = 16


def data_signature(examples: Sequence) -> dict:
    """How many examples, and a hash of the first few: another task, seed or option shows."""
    # a stream's length follows max_steps and does not change what a step sees: hash only its
    # first example, which exists at every length
    stream = bool(getattr(examples, "is_stream", False))
    head = [examples[i] for i in range(1 if stream else min(FINGERPRINT_EXAMPLES, len(examples)))]
    digest = hashlib.sha256(repr([(e.segments, e.target) for e in head]).encode()).hexdigest()
    out = {"n_examples": None if stream else len(examples), "fingerprint": digest[:16]}
    if getattr(examples, "signature", None) is not None:  # the settings a stream draws from
        out["stream"] = examples.signature
    return out


# ---------------------------------------------------------------- checkpoint
def _cuda_rng() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _rng_tensors(world: distributed.World = distributed.ONE) -> dict[str, torch.Tensor]:
    """RNG states to save (complete on rank 0): rank 0's under the plain keys, every other
    process's under ``.rank{r}``. Every process must call it (it gathers)."""
    out = {"rng.torch": torch.get_rng_state()}
    if _cuda_rng():
        out.update({f"rng.cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    if world.size > 1:
        states = {"torch": distributed.gather(torch.get_rng_state(), world)}
        if _cuda_rng():
            states["cuda"] = distributed.gather(torch.cuda.get_rng_state(), world)
        out.update({f"rng.{kind}.rank{r}": t for kind, ts in states.items()
                    for r, t in enumerate(ts) if r})
    return out


def _restore_rng(tensors: dict[str, torch.Tensor],
                 world: distributed.World = distributed.ONE) -> None:
    if world.rank:  # another process's own streams
        torch.set_rng_state(tensors[f"rng.torch.rank{world.rank}"])
        if f"rng.cuda.rank{world.rank}" in tensors and torch.cuda.is_available():
            torch.cuda.set_rng_state(tensors[f"rng.cuda.rank{world.rank}"])
        return
    torch.set_rng_state(tensors["rng.torch"])
    # rank 0's own device states only (rng.cuda.0, rng.cuda.1, ...), not other processes'
    # (rng.cuda.rank1, ...)
    own = {int(k.rsplit(".", 1)[1]): v for k, v in tensors.items()
           if k.startswith("rng.cuda.") and k.rsplit(".", 1)[1].isdigit()}
    cuda = [own[i] for i in sorted(own)]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[:torch.cuda.device_count()])


def save_checkpoint(model, opt, step: int, cfg, out: Path, data: dict,
                    extra: Callable[[Path], None] | None = None,
                    world: distributed.World = distributed.ONE, ema=None) -> None:
    """Model, optimizer, RNG and trainer state, plus ``extra(folder)``'s files, in one swap.
    With ``ema`` (a ``ktm.training.ema.WeightAverage``) the model files hold the average and
    ``live/`` the weights training continues from. Every process calls it; rank 0 alone writes."""
    rngs = _rng_tensors(world)
    if not world.is_main:
        return

    def write(tmp: Path) -> None:
        if ema is not None:
            (tmp / LIVE).mkdir()
            write_model_files(model, tmp / LIVE)
            with ema.applied():
                write_model_files(model, tmp)
        else:
            write_model_files(model, tmp)
        sd = opt.state_dict()
        tensors = {f"state.{i}.{name}": (v if torch.is_tensor(v) else torch.tensor(v)).cpu()
                   for i, st in sd["state"].items() for name, v in st.items()}
        tensors.update(rngs)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / OPTIMIZER))
        write_json_atomic(tmp / TRAINER, {"step": step, "config": asdict(cfg), "data": data,
                                          "param_groups": sd["param_groups"],
                                          "world_size": world.size})
        if extra is not None:
            extra(tmp)

    save_atomic(out / CHECKPOINT, write)


def check_resume(saved: dict, cfg, data: dict, where: Path, processes: int = 1) -> None:
    """Refuse a resume that would change which examples a step sees."""
    old = saved.get("config", {})
    diffs = [("seed", old.get("seed"), cfg.seed)] if old.get("seed") != cfg.seed else []
    was = {"processes": int(saved.get("world_size", 1)), "batch_size": old.get("batch_size"),
           "grad_accum": old.get("grad_accum")}
    now = {"processes": processes, "batch_size": cfg.batch_size, "grad_accum": cfg.grad_accum}
    hint = ""
    if math.prod(v or 0 for v in was.values()) != math.prod(now.values()):
        diffs += [(n, was[n], now[n]) for n in BATCH if was[n] != now[n]]
        total, rest = math.prod(v or 0 for v in was.values()), processes * cfg.grad_accum
        if total and total % rest == 0:
            hint = (f" (the global batch, processes x batch_size x grad_accum, must stay {total}:"
                    f" here --batch-size {total // rest})")
        elif total:  # no --batch-size fits: say which sizes do not divide
            hint = (f" (the global batch, processes x batch_size x grad_accum, must stay {total},"
                    f" which {processes} processes x grad_accum {cfg.grad_accum} = {rest} does "
                    f"not divide: use processes x grad_accum dividing {total})")
    old_data = saved.get("data")
    if old_data is not None:  # older checkpoints did not record it
        if old_data.get("n_examples") != data["n_examples"]:
            diffs.append(("n_train", old_data.get("n_examples"), data["n_examples"]))
        elif old_data.get("fingerprint") != data["fingerprint"]:
            diffs.append(("examples", "the checkpoint's", "other ones (task, seed or options)"))
        # a stream's first example can survive a change of its mix: compare the settings
        # (checkpoints written before streams recorded them have none)
        old_stream, stream = old_data.get("stream") or {}, data.get("stream") or {}
        diffs += [(n, old_stream[n], stream.get(n)) for n in old_stream
                  if old_stream[n] != stream.get(n)]
    if diffs:
        theirs = ", ".join(f"{n}={a}" for n, a, _ in diffs)
        ours = ", ".join(f"{n}={b}" for n, _, b in diffs)
        raise KTMError(f"cannot resume from {str(where)!r}: it was trained with {theirs}, this "
                       f"run has {ours}; the data order would change. Resume with the same "
                       f"settings{hint}, or start a new out_dir")


def load_checkpoint(model, opt, out: Path, cfg, data: dict,
                    world: distributed.World = distributed.ONE, ema=None) -> int:
    """Restore a run's checkpoint into ``model`` and ``opt``; returns the step it reached.

    Training continues from the last iterate (``live/`` when the run kept a weight average).
    ``ema`` gets the saved average, or starts at the weights if the run kept none."""
    ckpt = existing_dir(out / CHECKPOINT)
    if not (ckpt / TRAINER).is_file():
        shared = (" (with several machines, out_dir must be on a filesystem they all see)"
                  if world.size > 1 else "")
        raise KTMError(f"cannot resume: no checkpoint in {str(out)!r}{shared}; run without "
                       "--resume")
    try:
        state = json.loads((ckpt / TRAINER).read_text())
        step = int(state["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise KTMError(f"trainer state in {str(ckpt)!r} is corrupt: {e}") from e
    check_resume(state, cfg, data, ckpt, world.size)
    load_weights_into(model, ckpt)
    if ema is not None:
        ema.reset_to(ema.params)  # the saved average, or (no live/ folder) the weights
        ema.updates = step
    if (ckpt / LIVE).is_dir():
        load_weights_into(model, ckpt / LIVE)
    try:
        tensors = load_file(str(ckpt / OPTIMIZER))
        opt_state: dict[int, dict] = {}
        for key, v in tensors.items():
            if key.startswith("state."):
                _, i, name = key.split(".", 2)
                opt_state.setdefault(int(i), {})[name] = v
        opt.load_state_dict({"state": opt_state, "param_groups": state["param_groups"]})
        if int(state.get("world_size", 1)) == world.size:
            _restore_rng(tensors, world)
        else:  # another number of processes: each dropout stream restarts from (seed, step, rank)
            torch.manual_seed(cfg.seed + 1_000_003 * step + world.rank)
    except Exception as e:  # noqa: BLE001 - any failure here means a corrupt optimizer state
        raise KTMError(f"optimizer state in {str(ckpt)!r} is corrupt or does not fit this "
                       f"model: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    return step


# ---------------------------------------------------------------- metrics and run.json
def trim_metrics(path: Path, step: int) -> None:
    """Drop rows logged after the checkpoint we resume from; they will be logged again."""
    if path.exists():
        rows = [r for r in read_metrics(path) if r.get("step", 0) <= step]
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


def last_cpu(path: Path) -> float:
    """CPU seconds of the last logged step (after trimming), to continue the count on resume."""
    cpu = 0.0
    for row in read_metrics(path):
        cpu = row.get("cpu_s", cpu)
    return cpu


def check_fresh(out: Path) -> None:
    """A new run never writes into an old one's folder."""
    if existing_dir(out / CHECKPOINT).exists():  # or the copy a crash mid-swap left
        raise KTMError(f"{str(out)!r} already holds a run: pass --resume or use another out_dir")
    if (out / METRICS).exists():
        raise KTMError(f"{str(out)!r} has a {METRICS} from an earlier run but no checkpoint to "
                       "resume from: remove it or use another out_dir")


def record_start(out: Path, info: dict, step: int) -> None:
    """``run.json``: the latest start's fields at the top, every start in ``history``."""
    history: list = []
    try:
        old = json.loads((out / RUN).read_text())
        history = old.get("history") or [{k: v for k, v in old.items() if k != "history"}]
    except (OSError, ValueError, AttributeError):
        pass
    entry = {**info, "started_at_step": step, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_json_atomic(out / RUN, {**entry, "history": [*history, entry] if step else [entry]})


def remove_temps(out: Path) -> None:
    """The temp folder and files a killed run left beside its checkpoint, metrics and run.json
    (a kill between writing one and renaming it in): only the rank-0 process of a started run,
    which owns the folder, calls it."""
    for pattern in (f"{TEMP_DIR_PREFIX.format(CHECKPOINT)}*", f".{METRICS}.*.tmp", f".{RUN}.*.tmp"):
        for path in out.glob(pattern):
            remove_path(path)


def interrupted_note(out: Path, step: int) -> str:
    """What an interrupted run left: the last checkpoint, which a resume continues from."""
    try:
        saved = json.loads((existing_dir(out / CHECKPOINT) / TRAINER).read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return (f"interrupted at step {step}: no checkpoint saved yet in {str(out)!r}, nothing to "
                "resume")
    return (f"interrupted at step {step}: the checkpoint of step {saved} in "
            f"{str(out / CHECKPOINT)!r} is intact; --resume (resume=True) continues from it")
