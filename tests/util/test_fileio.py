"""Crash-safe writes: temp + fsync + rename for files, an atomic swap for folders."""

import json
import os
import re
from pathlib import Path

import pytest

from ktm.errors import KTMError
from ktm.training.state import trim_metrics as _trim_metrics
from ktm.util import fileio
from ktm.util.fileio import read_metrics

KTM = Path(fileio.__file__).parents[1]


def test_replace_dir_never_leaves_a_moment_without_the_destination(tmp_path, monkeypatch):
    dest, new = tmp_path / "ckpt", tmp_path / "new"
    dest.mkdir()
    (dest / "a.txt").write_text("old")
    new.mkdir()
    (new / "a.txt").write_text("new")
    real_replace, seen = os.replace, []

    def watched(src, dst):
        real_replace(src, dst)
        seen.append(dest.exists())

    monkeypatch.setattr(fileio.os, "replace", watched)
    fileio.replace_dir(new, dest)
    assert all(seen), "the destination was missing between two renames"
    assert (dest / "a.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_replace_dir_into_a_new_destination(tmp_path):
    new = tmp_path / "new"
    new.mkdir()
    (new / "x").write_text("1")
    fileio.replace_dir(new, tmp_path / "dest")
    assert (tmp_path / "dest" / "x").read_text() == "1" and not new.exists()


def test_atomic_write_fsyncs_before_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(fileio.os, "fsync", lambda fd: events.append("fsync") or real_fsync(fd))
    monkeypatch.setattr(fileio.os, "replace",
                        lambda a, b: events.append("rename") or real_replace(a, b))
    fileio.write_json_atomic(tmp_path / "r.json", {"a": 1})
    assert events.index("fsync") < events.index("rename")
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": 1}


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "r.json"
    path.write_text("old")
    with pytest.raises(RuntimeError), fileio.atomic_open(path) as f:
        f.write("half")
        raise RuntimeError("crash")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_every_file_write_in_the_package_goes_through_fileio():
    """Writes that replace a file (text, bytes, JSON, plots) must use ``ktm.util.fileio``; appends
    to a log (metrics.jsonl) are the only direct writes."""
    direct = re.compile(r"\.write_text\(|\.write_bytes\(|\.savefig\(|open\([^)]*[\"']wb?[\"']|"
                        r"json\.dump\(")
    offenders = [f"{p.relative_to(KTM)}:{i}" for p in KTM.rglob("*.py") if p.name != "fileio.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if direct.search(line)]
    assert offenders == []


def test_trim_metrics_survives_a_half_written_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    _trim_metrics(path, 2)
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    assert path.read_text().endswith("}\n")


def test_a_corrupt_line_inside_the_metrics_is_a_clear_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(KTMError, match="line 2 is not JSON"):
        _trim_metrics(path, 2)


def test_the_fallback_swap_never_deletes_the_only_copy_a_crash_left(tmp_path, monkeypatch):
    """A crash between the fallback's two renames leaves only DEST.old; the next save must not
    delete it before the new folder is in place."""
    dest, new = tmp_path / "ckpt", tmp_path / "new"
    fileio.old_copy(dest).mkdir()
    (fileio.old_copy(dest) / "a.txt").write_text("old")
    new.mkdir()
    (new / "a.txt").write_text("new")
    monkeypatch.setattr(fileio, "_exchange", lambda a, b: False)  # no renameat2
    real_rmtree, seen = fileio.shutil.rmtree, []

    def watched(path, *a, **kw):
        real_rmtree(path, *a, **kw)
        seen.append(fileio.existing_dir(dest).exists())

    monkeypatch.setattr(fileio.shutil, "rmtree", watched)
    fileio.replace_dir(new, dest)
    assert seen and all(seen), "a deletion left no copy of the folder"
    assert (dest / "a.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_new_run_sees_the_checkpoint_copy_a_crash_mid_swap_left(tmp_path):
    from ktm.training.state import check_fresh

    (tmp_path / "checkpoint.old").mkdir()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(KTMError, match="already holds a run: pass --resume"):
        check_fresh(tmp_path)
