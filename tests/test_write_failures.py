"""Fault injection: a write that fails midway (no space, a file where a folder should be, a kill)
is a one-line error naming the path, leaves the previous file or checkpoint intact and loadable,
and leaves no temp file behind."""

import errno
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import fresh_model as fresh

import ktm.bench.bench as bench
import ktm.evaluation.evaluate as evaluate_module
import ktm.training.state as train_state
import ktm.training.train as train_module
from ktm import KTMError
from ktm.bench.bench import main_bench
from ktm.bench.config import BenchConfig
from ktm.cli.main import main
from ktm.model import KTMModel
from ktm.tasks.tree import TreeTask
from ktm.training.config import TrainConfig
from ktm.training.train import train
from ktm.util import fileio


def no_space(*_a, **_kw):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture(scope="module")
def data():
    return TreeTask(stage="small").train_examples(8, seed=0)


def names(folder):
    return sorted(p.name for p in folder.iterdir())


def test_a_full_disk_during_a_file_write_names_the_file_and_keeps_the_old_one(tmp_path,
                                                                              monkeypatch):
    path = tmp_path / "r.json"
    path.write_text("old")
    monkeypatch.setattr(fileio.os, "fsync", no_space)
    with pytest.raises(KTMError, match=r"cannot write '.*r\.json': .*No space left"):
        fileio.write_json_atomic(path, {"a": 1})
    assert path.read_text() == "old" and names(tmp_path) == ["r.json"]


def test_a_file_where_the_folder_should_be_is_a_clear_error(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(KTMError, match=r"cannot write '.*afile/r\.json'"):
        fileio.write_json_atomic(tmp_path / "afile" / "r.json", {"a": 1})
    with pytest.raises(KTMError, match=r"'.*afile' is not a writable folder"):
        fileio.check_writable(tmp_path / "afile" / "sub" / "r.json")
    with pytest.raises(KTMError, match="it is a folder"):
        fileio.check_writable(tmp_path)


def test_a_failed_checkpoint_write_keeps_the_last_checkpoint(tiny_model_dir, data, tmp_path,
                                                              monkeypatch):
    kw = dict(batch_size=4, lr=1e-3, save_every=1, progress=False, out_dir=str(tmp_path))
    train(fresh(tiny_model_dir), data, TrainConfig(max_steps=2, **kw))
    monkeypatch.setattr(train_state, "save_file", no_space)  # the optimizer state, mid-folder
    with pytest.raises(KTMError, match=r"cannot write '.*checkpoint': .*No space left"):
        train(fresh(tiny_model_dir), data, TrainConfig(max_steps=3, resume=True, **kw))
    # no temp folder
    assert names(tmp_path) == ["checkpoint", "metrics.jsonl", "run.json", "run.lock"]
    ckpt = tmp_path / "checkpoint"
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == 2
    KTMModel.load(str(ckpt))


def test_eval_refuses_an_unwritable_result_path_before_evaluating(capsys, tiny_model_dir,
                                                                  tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("")
    monkeypatch.setattr(evaluate_module, "evaluate_task",
                        lambda *a, **k: pytest.fail("evaluated before checking --json"))
    code = main(["eval", "--model", tiny_model_dir, "--k", "4", "--task", "tree", "--stage",
                 "small", "--n-eval", "2", "--json", str(tmp_path / "afile" / "r.json")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "afile/r.json" in err, err


def test_bench_refuses_an_unwritable_result_path_before_measuring(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("")
    monkeypatch.setattr(bench, "run_bench", lambda *a: pytest.fail("measured before checking"))
    with pytest.raises(KTMError, match=r"cannot write '.*afile/b\.json'"):
        main_bench(BenchConfig(out=str(tmp_path / "afile" / "b.json"), progress=False))


def test_an_io_error_the_command_does_not_name_is_still_one_line(capsys, tiny_model_dir,
                                                                  tmp_path, monkeypatch):
    monkeypatch.setattr(train_module, "train_step", no_space)
    code = main(["train", "--model", tiny_model_dir, "--task", "tree", "--stage", "small",
                 "--n-train", "8", "--n-eval", "2", "--max-steps", "1", "--batch-size", "4",
                 "--out-dir", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and err == "ktm: error: [Errno 28] No space left on device\n", err


def test_a_resume_removes_the_temp_files_a_killed_run_left(tiny_model_dir, data, tmp_path):
    kw = dict(batch_size=4, lr=1e-3, save_every=1, progress=False, out_dir=str(tmp_path))
    train(fresh(tiny_model_dir), data, TrainConfig(max_steps=2, **kw))
    # what a SIGKILL inside save_checkpoint and inside trim_metrics leaves behind
    (tmp_path / ".checkpoint.tmp-abc123").mkdir()
    (tmp_path / ".checkpoint.tmp-abc123" / "encoder.safetensors").write_bytes(b"half")
    (tmp_path / ".metrics.jsonl.x1y2.tmp").write_text('{"step": 1}\n')
    train(fresh(tiny_model_dir), data, TrainConfig(max_steps=3, resume=True, **kw))
    assert names(tmp_path) == ["checkpoint", "metrics.jsonl", "run.json", "run.lock"]


@pytest.mark.parametrize("save_every, says", [
    (2, r"interrupted at step 3: the checkpoint of step 2 in '.*checkpoint' is intact; "
        r"--resume"),
    (0, r"interrupted at step 3: no checkpoint saved yet in '.*', nothing to resume")])
def test_ctrl_c_says_which_checkpoint_a_resume_continues_from(tiny_model_dir, data, tmp_path,
                                                              capsys, save_every, says):
    def ctrl_c_at_3(step, _):
        if step == 3:
            raise KeyboardInterrupt

    cfg = TrainConfig(max_steps=6, batch_size=4, save_every=save_every, progress=False,
                      out_dir=str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        train(fresh(tiny_model_dir), data, cfg, on_step=ctrl_c_at_3)
    assert re.search(says, capsys.readouterr().err)


def test_a_full_disk_under_metrics_jsonl_names_it(tiny_model_dir, data, tmp_path, monkeypatch):
    real_open = pathlib.Path.open

    def full_disk(self, *a, **kw):  # the append-only log, on a disk that is full
        return open("/dev/full", "a") if self.name == "metrics.jsonl" else real_open(self, *a, **kw)

    monkeypatch.setattr(pathlib.Path, "open", full_disk)
    with pytest.raises(KTMError, match=r"cannot append to '/dev/full': .*No space left"):
        train(fresh(tiny_model_dir), data, TrainConfig(max_steps=2, batch_size=4, progress=False,
                                                       out_dir=str(tmp_path)))


SLOW_SAVE = """
import pathlib, sys, time
import ktm.core.checkpoint as checkpoint
from ktm.cli.main import main
real, saves = checkpoint.replace_dir, []

def slow(tmp, dest):  # the second checkpoint (step 4): stop mid-save until killed
    saves.append(1)
    if len(saves) == 2:
        pathlib.Path(sys.argv[1]).write_text("saving")
        time.sleep(120)
    real(tmp, dest)

checkpoint.replace_dir = slow
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow  # starts a Python process
def test_sigkill_mid_checkpoint_then_resume_continues_exactly(tiny_model_dir, tmp_path, capsys):
    def argv(out):
        return ["train", "--model", tiny_model_dir, "--task", "tree", "--stage", "small",
                "--n-train", "8", "--n-eval", "2", "--batch-size", "4", "--save-every", "2",
                "--max-steps", "6", "--no-progress", "--threads", "1", "--out-dir", str(out)]

    def losses(out):
        return [(r["step"], r["loss"]) for r in train_state.read_metrics(out / "metrics.jsonl")
                if "loss" in r]

    assert main(argv(tmp_path / "straight")) == 0
    (tmp_path / "slow.py").write_text(SLOW_SAVE)
    marker, out = tmp_path / "marker", tmp_path / "killed"
    root = str(Path(fileio.__file__).parents[2])
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(tmp_path / "slow.py"), str(marker), *argv(out)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the run never reached its second checkpoint"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert any(p.name.startswith(".checkpoint.tmp-") for p in out.iterdir())  # the kill's mess
    assert json.loads((out / "checkpoint" / "trainer_state.json").read_text())["step"] == 2
    assert main([*argv(out), "--resume"]) == 0
    assert names(out) == ["checkpoint", "metrics.jsonl", "run.json", "run.lock"]
    got, want = losses(out), losses(tmp_path / "straight")
    assert [s for s, _ in got] == [s for s, _ in want] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-5)


KILLED_MID_WRITE = """
import os, signal, sys
from ktm.util.fileio import atomic_open
with atomic_open(sys.argv[1]) as f:
    f.write('{"half": ')
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow  # starts a Python process
def test_the_next_write_of_a_file_removes_the_temp_a_killed_write_left(tmp_path):
    """A single-file result (``ktm eval --json``, ``--predictions``, bench ``--out``) killed
    mid-write left ``.r.json.XXXX.tmp`` beside it for good; the temp is now named after its
    process, and the next write of the same file removes it, never a live process's, another
    machine's or another file's."""
    path = tmp_path / "r.json"
    root = str(Path(fileio.__file__).parents[2])
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_WRITE, str(path)], env=env)
    assert killed.returncode == -signal.SIGKILL
    [left] = [p.name for p in tmp_path.iterdir()]  # the kill's mess, and no r.json
    host = socket.gethostname()
    # a live process's, another machine's, and the same dead process's of another file
    kept = [f".r.json.{os.getppid()}@{host}-live0000.tmp", f".r.json.1@another-{host}-zz99.tmp",
            left.replace(".r.json.", ".r.jsonl.")]
    for name in kept:
        (tmp_path / name).write_text("x")
    fileio.write_json_atomic(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    assert names(tmp_path) == sorted(["r.json", *kept])
