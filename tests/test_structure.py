"""The package's shape: serialisation is a leaf, the core never imports a baseline."""

import ast
from pathlib import Path

import pytest

import ktm

KTM = Path(ktm.__file__).parent
CORE = ("batch", "checkpoint", "config", "encoder", "evaluate", "fileio", "generate", "lora",
        "model", "models", "prompt", "train", "errors")


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
