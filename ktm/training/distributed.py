"""One training run on several processes: plain ``torch.distributed``, started by a launcher.

    torchrun --nproc_per_node 2 -m ktm.cli train ...                      # gloo on CPU
    accelerate launch --multi_gpu --num_processes 2 -m ktm.cli train ...  # NCCL on CUDA

The launcher sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; ``setup`` joins the
process group once (NCCL for CUDA, gloo otherwise; each process on ``cuda:LOCAL_RANK``). The
training loop then

- starts from rank 0's trainable weights (``broadcast_params``);
- reads only its shard of each step's global window (global batch = processes x batch_size x
  grad_accum); which examples form step s's window stays a pure function of (seed, s);
- sums the gradients over processes after backward (``sum_grads``), so every process takes the
  same clipped AdamW step and the weights stay identical: those of one process reading the whole
  window;
- writes metrics, run records and checkpoints on rank 0 only, and reads what only rank 0
  needs (its evaluation data) there alone (``on_main``).

A process waits in a collective up to ``KTM_DIST_TIMEOUT`` minutes (default 120: rank 0 may be
evaluating); a collective that fails because another process ended is ``PeerLost``, one line.

Why no DDP wrapper: the losses call model methods other than ``forward`` (``target_logits``, the
distillation teacher's adapter-disabled pass), which DDP's forward hooks do not follow. One
all-reduce per step over the LoRA and encoder gradients (a few MB) is all DDP would add here.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from ktm.errors import KTMError

T = TypeVar("T")


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, n: int) -> range:
        """This process's part of ``n`` items: a contiguous block of ``n / size``."""
        if n % self.size:
            raise KTMError(f"{n} items cannot be split evenly over {self.size} processes")
        per = n // self.size
        return range(self.rank * per, (self.rank + 1) * per)


ONE = World()  # a run without a launcher

TIMEOUT_ENV = "KTM_DIST_TIMEOUT"
DEFAULT_TIMEOUT_MIN = 120.0  # rank 0 evaluates while the others wait in the next collective


class PeerLost(KTMError):
    """A collective failed: another process ended (its own error names why) or stayed away
    longer than the timeout. One line, exit code 1: the cause is elsewhere."""

    exit_code = 1


def timeout_minutes() -> float:
    """How long a process waits in a collective: ``KTM_DIST_TIMEOUT`` minutes (default 120).

    The backends' own defaults (NCCL 10 min, gloo 30) are shorter than an evaluation during
    training on a large held-out set, which rank 0 runs while the others wait."""
    value = os.environ.get(TIMEOUT_ENV)
    if value is None:
        return DEFAULT_TIMEOUT_MIN
    try:
        minutes = float(value)
    except ValueError:
        minutes = float("nan")
    if not minutes > 0 or minutes == float("inf"):
        raise KTMError(f"environment variable {TIMEOUT_ENV}={value!r}: expected a number of "
                       "minutes > 0 (how long a process waits for the others)")
    return minutes


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    try:
        return int(value)
    except ValueError:
        raise KTMError(f"environment variable {name}={value!r} is not an integer") from None


def setup(device: str | torch.device = "cpu") -> World:
    """Join the launcher's process group (once); a run without a launcher is ``World()``.

    ``device``: where the model will live; "cuda" makes this process use ``cuda:LOCAL_RANK``.
    """
    size, local = _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0)
    if size <= 1:
        return World()
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda and dev.index is not None and dev.index != local:
        # every process would put its model on the one GPU named, and NCCL fails obscurely
        raise KTMError(f"device {str(device)!r} under a launcher: each process uses "
                       f"cuda:LOCAL_RANK (this one cuda:{local}); expected --device cuda")
    if not dist.is_initialized():
        if cuda:
            if local >= torch.cuda.device_count():
                raise KTMError(f"LOCAL_RANK={local} but this machine has "
                               f"{torch.cuda.device_count()} CUDA devices")
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo",
                                timeout=timedelta(minutes=timeout_minutes()))
        # left to interpreter shutdown, gloo's worker threads can abort the process (SIGABRT,
        # "terminate called without an active exception"): leave the group while Python is alive
        atexit.register(_leave)
    return current()


def _leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _collective(fn):
    """A failed collective is ``PeerLost``: one line naming the likely cause, not a backend
    traceback on every process but the one that failed first."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:  # gloo's errors are plain RuntimeErrors, NCCL's DistErrors
            # "[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer [addr]. This..."
            why = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip()).split(". ")[0].splitlines()
            why = why[0][:160] if why else type(e).__name__
            raise PeerLost(f"process {dist.get_rank()} of {dist.get_world_size()} lost the "
                           f"others ({why}): another process ended first (its own error names "
                           f"the cause) or waited longer than {TIMEOUT_ENV}="
                           f"{timeout_minutes():g} minutes") from e
    return wrapper


def current() -> World:
    """The process group joined so far (``World()`` when none)."""
    if not (dist.is_available() and dist.is_initialized()):
        return World()
    return World(dist.get_rank(), dist.get_world_size(), _env_int("LOCAL_RANK", 0))


@_collective
def sum_numbers(values: list[float], world: World, device: torch.device) -> list[float]:
    """Sums over processes of a few numbers (token counts, loss sums), in float64."""
    if world.size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


@_collective
def from_main(values: list[float], world: World, device: torch.device) -> list[float]:
    """Rank 0's ``values`` on every process (what the others pass is ignored): a decision
    every process must take alike, made from one process's numbers."""
    if world.size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.broadcast(t, src=0)
    return t.tolist()


@_collective
def broadcast_params(params: list[torch.nn.Parameter], world: World) -> None:
    """Rank 0's values for ``params`` everywhere (as DDP does at construction): processes that
    initialised LoRA or the encoder from different random states start equal."""
    if world.size == 1:
        return
    with torch.no_grad():
        for p in params:
            dist.broadcast(p.data, src=0)


@_collective
def sum_grads(params: list[torch.nn.Parameter], world: World) -> None:
    """Replace each gradient by its sum over processes (one flat all-reduce per dtype).

    A parameter this process did not reach counts as a zero gradient, so every process
    reduces the same tensors in the same order.
    """
    if world.size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    for group in by_dtype.values():
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in group])
        dist.all_reduce(flat)
        offset = 0
        for p in group:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n


@_collective
def gather(t: torch.Tensor, world: World) -> list[torch.Tensor]:
    """Every process's tensor of the same shape (RNG states), in rank order, on the CPU."""
    if world.size == 1:
        return [t.cpu()]
    dev = torch.device("cuda", torch.cuda.current_device()) if (
        dist.get_backend() == "nccl") else torch.device("cpu")
    parts = [torch.empty_like(t, device=dev) for _ in range(world.size)]
    dist.all_gather(parts, t.to(dev))
    return [p.cpu() for p in parts]


@_collective
def sum_by_key(d: dict[str, list[float]], world: World) -> dict[str, list[float]]:
    """Per-key sums over processes of ``{name: [values...]}`` whose keys may differ between
    processes (each process sees the objectives its shard drew). Exchanged as JSON."""
    if world.size == 1:
        return d
    data = torch.tensor(list(json.dumps(d).encode()), dtype=torch.uint8)
    dev = torch.device("cuda", torch.cuda.current_device()) if (
        dist.get_backend() == "nccl") else torch.device("cpu")
    sizes = gather(torch.tensor([len(data)], device=dev), world)
    longest = int(max(sizes).item())
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:len(data)] = data
    out: dict[str, list[float]] = {}
    for n, t in zip(sizes, gather(padded, world)):
        for k, vals in json.loads(bytes(t[: int(n.item())].tolist()).decode()).items():
            acc = out.setdefault(k, [0.0] * len(vals))
            out[k] = [a + v for a, v in zip(acc, vals)]
    return dict(sorted(out.items()))


def on_main(fn: Callable[[], T], world: World, device: torch.device) -> T | None:
    """``fn()`` on rank 0 alone (work only it needs: the data it evaluates on); returns its
    result there, None elsewhere. When it fails, rank 0 raises its error and the others
    ``PeerLost`` naming it, rather than wait for rank 0 at the next collective."""
    if world.size == 1:
        return fn()
    result, error = None, None
    if world.is_main:
        try:
            result = fn()
        except Exception as e:  # told to the others first, then raised
            error = e
    message = _text_from_main("" if error is None else f"{type(error).__name__}: {error}",
                              world, device)
    if error is not None:
        raise error
    if message:
        raise PeerLost(f"process {world.rank} of {world.size}: rank 0 failed ({message})")
    return result


@_collective
def _text_from_main(text: str, world: World, device: torch.device) -> str:
    data = text.encode()
    n = int(from_main([float(len(data))], world, device)[0])
    if not n:
        return ""
    t = torch.tensor(list(data) if world.is_main else [0] * n, dtype=torch.uint8,
                     device=device)
    dist.broadcast(t, src=0)
    return bytes(t.cpu().tolist()).decode()


@_collective
def barrier(world: World) -> None:
    if world.size > 1:
        dist.barrier()
