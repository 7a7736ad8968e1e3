"""Shared fixtures: a tiny Llama-family model and tokenizer built in-process (offline, seconds)."""

from __future__ import annotations

import pytest
from helpers import fresh_model, save_tiny_llama


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A saved tiny HF causal-LM folder (2 layers, width 64), the same for every test."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_bos_model_dir(tmp_path_factory) -> str:
    """The same, with a tokenizer that puts a BOS before every text (Llama 3, Gemma)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-bos"), bos=True)


@pytest.fixture
def ktm_model(tiny_model_dir):
    return fresh_model(tiny_model_dir)


@pytest.fixture
def checkpoint_swaps(monkeypatch) -> list[list[str]]:
    """The file names in each checkpoint's temp folder at the moment it is swapped in."""
    import ktm.core.checkpoint as checkpoint

    seen: list[list[str]] = []
    real = checkpoint.replace_dir

    def watched(tmp, dest):
        seen.append(sorted(p.name for p in tmp.iterdir()))
        real(tmp, dest)

    monkeypatch.setattr(checkpoint, "replace_dir", watched)
    return seen


CORPUS_TEXT = ("The quick brown fox jumps over the lazy dog. Hello world, my name is ktm. " * 6
               + "def add(a, b):\n    return a + b\n" * 4)


@pytest.fixture
def corpus(tmp_path) -> str:
    """A folder of three small text files: a user corpus for reader pretraining."""
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(3):
        (folder / f"doc{i}.txt").write_text(CORPUS_TEXT[i * 7:])
    return str(folder)
