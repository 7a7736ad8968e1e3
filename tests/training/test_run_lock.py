"""One run per out_dir: a second train / pretrain / curriculum on a folder another process is
writing is refused at once, naming the folder and the other process; the kernel frees the lock
when its holder dies, and where locks are unavailable the run goes on unguarded."""

import errno
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import fresh_model as fresh

from ktm.tasks.tree import TreeTask
from ktm.training.config import TrainConfig
from ktm.training.curriculum import CurriculumConfig, run_curriculum
from ktm.training.run_lock import RunLocked, run_lock
from ktm.training.train import train
from ktm.util import fileio

HOLD = """
import sys, time
from ktm.training.run_lock import run_lock
with run_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


def cfg(out, **kw):
    return TrainConfig(out_dir=str(out), max_steps=1, batch_size=4, save_every=0,
                       progress=False, **kw)


@pytest.fixture(scope="module")
def data():
    return TreeTask(stage="small").train_examples(4, seed=0)


@pytest.mark.slow  # starts a Python process
def test_a_second_run_on_a_folder_in_use_is_refused_until_the_first_dies(tiny_model_dir, data,
                                                                         tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    root = str(Path(fileio.__file__).parents[2])
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    other = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        who = rf"pid {other.pid} on {socket.gethostname()}"
        with pytest.raises(RunLocked, match=rf"'{out}' is in use by another run \({who}\)"):
            train(fresh(tiny_model_dir), data, cfg(out))
        with pytest.raises(RunLocked, match="in use by another run"):
            train(fresh(tiny_model_dir), data, cfg(out, resume=True))
        assert sorted(p.name for p in out.iterdir()) == ["run.lock"]  # nothing written
    finally:
        other.send_signal(signal.SIGKILL)  # a kill, not an exit: the kernel frees the lock
        other.wait()
    train(fresh(tiny_model_dir), data, cfg(out))
    assert (out / "checkpoint").is_dir()
    assert (out / "run.lock").read_text() == ""  # released: names no holder


def test_a_second_curriculum_on_a_folder_in_use_is_refused(tiny_model_dir, tmp_path):
    out = tmp_path / "cur"
    out.mkdir()
    with run_lock(out), pytest.raises(RunLocked, match=rf"'{out}' is in use .*pid {os.getpid()}"):
        run_curriculum(fresh(tiny_model_dir), CurriculumConfig(steps_per_round=1, n_eval=2),
                       cfg(out))
    assert sorted(p.name for p in out.iterdir()) == ["run.lock"]


def test_a_run_goes_on_where_locks_are_unavailable(tiny_model_dir, data, tmp_path, monkeypatch):
    def no_locks(*_a):
        raise OSError(errno.ENOLCK, "No locks available")  # some NFS mounts

    monkeypatch.setattr(fileio.fcntl, "flock", no_locks)
    train(fresh(tiny_model_dir), data, cfg(tmp_path / "nfs"))
    monkeypatch.setattr(fileio, "fcntl", None)  # Windows
    train(fresh(tiny_model_dir), data, cfg(tmp_path / "win"))
    assert (tmp_path / "nfs" / "checkpoint").is_dir() and (tmp_path / "win" / "checkpoint").is_dir()


def test_the_lock_is_released_when_the_run_fails(tiny_model_dir, data, tmp_path):
    def fail(*_a):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        train(fresh(tiny_model_dir), data, cfg(tmp_path / "r"), on_step=fail)
    with run_lock(tmp_path / "r"):  # free again: taking it does not raise
        pass


def test_every_process_of_a_distributed_run_is_refused_when_rank_0_is(tmp_path, monkeypatch):
    import ktm.training.distributed as distributed
    from ktm.training.run_lock import main_holds

    told = []

    def sum_numbers(values, world, device):  # the all-reduce of the refusal, rank 0's said 1
        told.append(values)
        return [1.0]

    monkeypatch.setattr(distributed, "sum_numbers", sum_numbers)
    with run_lock(tmp_path):
        with pytest.raises(RunLocked, match=f"pid {os.getpid()}"):
            with main_holds(tmp_path, distributed.World(0, 2), "cpu"):
                pass
        with pytest.raises(RunLocked, match="rank 0's error names it"):  # takes no lock itself
            with main_holds(tmp_path, distributed.World(1, 2), "cpu"):
                pass
    assert told == [[1.0], [0.0]]
