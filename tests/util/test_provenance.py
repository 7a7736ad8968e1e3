"""git_revision: the revision of the code that ran, '-dirty' when that code differs from it."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import IN_CI

from ktm.util.provenance import git_revision

# without git a development install skips these; CI has git, and fails them if it had not
pytestmark = pytest.mark.skipif(shutil.which("git") is None and not IN_CI, reason="needs git")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    _git(tmp_path, "init", "-q")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("x = 1\n")
    (tmp_path / ".gitignore").write_text("venv/\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "first")
    return tmp_path


def test_clean_and_dirty(repo: Path) -> None:
    head = _git(repo, "rev-parse", "HEAD")
    assert git_revision(repo / "pkg") == head
    (repo / "pkg" / "__init__.py").write_text("x = 2\n")
    assert git_revision(repo / "pkg") == head + "-dirty"


def test_an_untracked_module_of_the_package_is_dirty(repo: Path) -> None:
    # a new, not yet added ktm/tasks/x.py ran: the revision alone cannot reproduce the result
    (repo / "pkg" / "new_task.py").write_text("y = 1\n")
    assert git_revision(repo / "pkg").endswith("-dirty")
    (repo / "notes.txt").write_text("outside the package: not code that ran\n")
    (repo / "pkg" / "new_task.py").unlink()
    assert not git_revision(repo / "pkg").endswith("-dirty")


def test_a_copy_installed_inside_another_repo_has_no_revision(repo: Path) -> None:
    # pip install (not -e) into a venv inside a clone: the clone's HEAD is not this code's
    site = repo / "venv" / "lib" / "site-packages" / "pkg"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("x = 0\n")
    assert git_revision(site) is None


def test_outside_any_repo(tmp_path: Path) -> None:
    assert git_revision(tmp_path) is None


def test_eval_records_the_revision_it_started_from(capsys, tiny_model_dir, tmp_path, monkeypatch):
    # an eval of many minutes read git at its end: a commit or an edit made meanwhile was
    # recorded as the code that ran
    import ktm.evaluation.runner as runner
    from ktm.cli.main import main
    from ktm.model import KTMModel

    state, evaluate = {"git": "start"}, runner.evaluate_task

    def evaluate_then_commit(*args, **kwargs):
        row = evaluate(*args, **kwargs)
        state["git"] = "a commit made during the eval"
        return row

    # the names the evaluation calls
    monkeypatch.setattr(runner, "git_revision", lambda: state["git"])
    monkeypatch.setattr(runner, "evaluate_task", evaluate_then_commit)
    ckpt = tmp_path / "ck"
    KTMModel.from_base(tiny_model_dir, k=2).save(str(ckpt))
    out = tmp_path / "r.json"
    assert main(["eval", "--checkpoint", str(ckpt), "--task", "tree", "--stage", "small",
                 "--n-eval", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["git"] == "start"


def test_demo_records_the_revision_it_started_from(capsys, tiny_model_dir, tmp_path, monkeypatch):
    import ktm.cli.demo
    from ktm.cli.main import main

    state, train = {"git": "start"}, ktm.cli.demo.train

    def train_then_commit(*args, **kwargs):
        out = train(*args, **kwargs)
        state["git"] = "a commit made during the demo"
        return out

    monkeypatch.setattr(ktm.cli.demo, "git_revision", lambda: state["git"])
    monkeypatch.setattr(ktm.cli.demo, "train", train_then_commit)
    out = tmp_path / "demo"
    assert main(["demo", "--model", tiny_model_dir, "--stage", "small", "--steps", "1",
                 "--batch-size", "2", "--n-eval", "2", "--out-dir", str(out)]) == 0
    assert json.loads((out / "demo.json").read_text())["git"] == "start"


def test_versions_name_the_libraries_that_shape_the_numbers() -> None:
    # tokenizers decides every token count (length reduction); numpy/matplotlib make the plots
    from ktm.util.provenance import versions

    v = versions()
    assert {"python", "ktm", "torch", "transformers", "tokenizers", "peft", "safetensors",
            "numpy"} <= set(v)
    assert v["tokenizers"] != "not installed"
