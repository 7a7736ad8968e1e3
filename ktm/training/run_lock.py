"""One run per out_dir: an advisory ``flock`` on ``OUT/run.lock``, held while the run writes.

A second ``ktm train`` / ``pretrain`` / ``curriculum`` on the same folder (a user's mistake, a
scheduler's retry) would write checkpoints and metrics.jsonl into the first one's. The kernel
drops the lock when its holder exits, however it ends (a SIGKILL included), so a stale lock file
never blocks a resume. The file stays; it names the holder (``pid@host``) while it is held.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from ktm.errors import KTMError
from ktm.util.fileio import flock

LOCK = "run.lock"


class RunLocked(KTMError):
    """Another process is writing a run in the same out_dir."""


def _holder(fd: int) -> str:
    try:
        who = os.pread(fd, 256, 0).decode("utf-8", "replace").strip()
    except OSError:
        who = ""
    pid, _, host = who.partition("@")
    return f" (pid {pid} on {host})" if pid.isdigit() and host else ""


@contextmanager
def run_lock(out: str | Path) -> Iterator[None]:
    """Hold ``OUT/run.lock`` for the ``with`` block, or raise ``RunLocked`` at once.

    Where the lock cannot be taken for another reason (no ``fcntl``, a filesystem without
    locks such as some NFS mounts: ``OSError``), the run goes on without it rather than fail.
    """
    path = Path(out) / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # an unwritable folder: the run's own writes report it
        fd = None
    if fd is not None:
        try:
            held = flock(fd, wait=False)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunLocked(f"{str(Path(out))!r} is in use by another run{holder}: wait for it "
                            "to end or stop it, then --resume; or use another out_dir") from None
        if not held:  # no locks here (Windows, some NFS mounts): run unguarded
            os.close(fd)
            fd = None
    if fd is not None:
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}@{socket.gethostname()}\n".encode(), 0)
        except OSError:  # the name is a courtesy; the lock holds without it
            pass
    try:
        yield
    finally:
        if fd is not None:
            try:
                os.ftruncate(fd, 0)  # no stale name once released
            except OSError:
                pass
            os.close(fd)  # releases the lock


@contextmanager
def main_holds(out: str | Path, world, device) -> Iterator[None]:
    """``run_lock`` taken by the writing process (rank 0) alone; when it is refused, every
    process of a distributed run raises, rather than wait for rank 0 at the next collective."""
    from ktm.training import distributed

    with ExitStack() as stack:
        refused = None
        if world.is_main:
            try:
                stack.enter_context(run_lock(out))
            except RunLocked as e:
                refused = e
        if world.size > 1:
            if distributed.sum_numbers([float(refused is not None)], world, device)[0]:
                raise refused or RunLocked(f"{str(Path(out))!r} is in use by another run "
                                           "(rank 0's error names it)")
        if refused is not None:
            raise refused
        yield
