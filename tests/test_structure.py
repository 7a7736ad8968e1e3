"""The package's shape: serialisation is a leaf, the core never imports a baseline."""

import ast
from pathlib import Path

import pytest

import ktm

KTM = Path(ktm.__file__).parent
CORE = ("batch", "checkpoint", "config", "encoder", "evaluate", "fileio", "generate", "lora",
        "model", "model_build", "models", "prompt", "train", "train_config", "errors")


def imports_of(module: str) -> set[str]:
    """Every ktm module a file imports, at the top or inside a function."""
    tree = ast.parse((KTM / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m == "ktm" or m.startswith("ktm.")}


def test_serialisation_never_imports_the_model_back():
    assert not {m for m in imports_of("checkpoint") if m.startswith("ktm.model")
                and m != "ktm.models"}


@pytest.mark.parametrize("module", CORE)
def test_the_core_never_imports_a_baseline(module):
    assert not {m for m in imports_of(module) if m.startswith("ktm.compressors")}


def test_report_help_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys\nfrom ktm.cli import main\ntry:\n    main(['report', '--help'])\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "results" in out.stdout  # the help text was printed
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_public_names_load_lazily_and_train_stays_the_function():
    from ktm import KTMModel, TrainConfig, train
    from ktm.train import train as train_function  # the submodule is imported by now

    assert train is train_function
    assert TrainConfig.__module__ == "ktm.train_config" and KTMModel.__module__ == "ktm.model"
    import ktm
    import ktm.pretrain as shadowed  # binds the submodule name on the package

    assert callable(ktm.pretrain) and ktm.pretrain is shadowed
    from ktm.pretrain import pretrain as pretrain_function

    assert ktm.pretrain is pretrain_function and ktm.PretrainConfig.__module__ == "ktm.pretrain"
