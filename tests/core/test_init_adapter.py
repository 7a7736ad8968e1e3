"""``--init-adapter`` from a folder that is not a K-token merging checkpoint says what it holds."""

import warnings

import pytest
import torch

from ktm.cli.main import main
from ktm.compressors.record import write_record
from ktm.model import KTMModel


def _train(tiny_model_dir, init_adapter, out):
    return main(["train", "--model", tiny_model_dir, "--k", "2", "--init-adapter",
                 str(init_adapter), "--task", "tree", "--stage", "small", "--max-steps", "1",
                 "--batch-size", "2", "--n-train", "4", "--n-eval", "2", "--out-dir", str(out),
                 "--no-progress"])


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    torch.manual_seed(0)
    for name, k in (("reader", 2), ("baseline", 2), ("plain", 1)):
        KTMModel.from_base(tiny_model_dir, k=k).save(str(root / name))
    write_record(root / "baseline", "selective_context", {"ratio": 0.5})
    return root


@pytest.mark.parametrize("name,says", [
    ("baseline", "--compressor selective_context baseline (compressor.json): its LoRA learned "
                 "to read prompts rewritten by selective_context"),
    ("plain", "an uncompressed (K=1) checkpoint"),
])
def test_init_adapter_from_a_baseline_or_uncompressed_checkpoint_warns(
        tiny_model_dir, checkpoints, tmp_path, name, says):
    with pytest.warns(UserWarning, match="--init-adapter") as caught:
        assert _train(tiny_model_dir, checkpoints / name, tmp_path / "run") == 0
    text = " ".join(str(w.message) for w in caught)
    assert says in text and "starts from it anyway" in text


def test_init_adapter_from_a_reader_does_not_warn(tiny_model_dir, checkpoints, tmp_path):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*--init-adapter")
        assert _train(tiny_model_dir, checkpoints / "reader", tmp_path / "run") == 0
