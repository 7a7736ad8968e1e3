"""Training steps through the compiled LM body (``ktm.training.compiled``): the same loss and
gradients as eager, one compile for windows of every length, the body eager again outside."""

import pytest
import torch
from helpers import (
    DEVICE,
    DTYPE,
    PROMPTS,
    fresh_model,
    perturb,
    require_device,
    trains_compiled_as_eager,
)

from ktm import KTMError
from ktm.core.config import LoraSettings
from ktm.training import compiled

# the group of the Llama layer's compiled graphs (why: tests/decode/test_compiled.py)
pytestmark = pytest.mark.xdist_group("compile")


def test_compiled_body_trains_as_eager_for_every_length(tiny_model_dir):
    import pytest

    require_device()
    # LoRA dropout off: eager and compiled draw their dropout masks differently
    model = fresh_model(tiny_model_dir, lora=LoraSettings(dropout=0.0), device=DEVICE,
                        dtype=DTYPE)
    perturb(model)  # LoRA's B starts at zero, and with it A's gradient
    model.train()
    layers = compiled.decoder_layers(model)
    assert len(layers) == model.lm_config.num_hidden_layers
    for prompts, targets in [(PROMPTS, [" yes", " no", " EF"]),
                             ([PROMPTS[2] + " and a few more words here"], [" maybe not"])]:
        trains_compiled_as_eager(model, prompts, targets)
        assert type(layers[0]) in compiled._COMPILED
        assert not any("forward" in vars(layer) for layer in layers)  # eager outside
    with pytest.raises(KTMError, match="compile must be one of"):
        compiled.resolve("fast", model.device)
    from ktm.training.config import TrainConfig

    with pytest.raises(KTMError, match="compile must be one of"):
        TrainConfig(compile="fast")  # refused on construction
    assert compiled.resolve("on", model.device) and not compiled.resolve("off", model.device)
    assert not compiled.resolve("auto", torch.device("cpu"))
    assert compiled.resolve("auto", torch.device("cuda"))  # measured to pay there


@pytest.mark.sweep  # Jamba's layers compiled: a family of the sweep (tests/core/test_families.py)
def test_a_layer_class_inductor_cannot_compile_trains_eager_and_says_so(tmp_path, capfd,
                                                                       monkeypatch):
    """Jamba's Mamba layers fail to compile with dynamic shapes (their scan tests a symbolic
    length): those layers train eager from then on, with a line saying so, and the step's loss
    and gradients are eager's; the attention layers stay compiled."""
    from helpers import save_tiny

    from ktm.model import KTMModel

    monkeypatch.setattr(compiled, "_COMPILED", {})  # as if no Jamba had trained compiled yet
    save_tiny("jamba", tmp_path)
    torch.manual_seed(0)
    model = KTMModel.from_base(str(tmp_path), k=4, lora=LoraSettings(dropout=0.0))
    perturb(model)
    model.train()
    kinds = {type(layer) for layer in compiled.decoder_layers(model)}
    assert len(kinds) == 2  # attention and Mamba layers
    prompts, targets = [PROMPTS[0], PROMPTS[1]], [" yes", " no"]
    mamba = ("JambaMambaDecoderLayer",)
    trains_compiled_as_eager(model, prompts, targets, eager=mamba)
    assert "did not compile for training" in capfd.readouterr().err
    trains_compiled_as_eager(model, prompts, targets, eager=mamba)  # no new attempt
    assert "did not compile" not in capfd.readouterr().err


@pytest.mark.sweep  # Falcon's layer compiled: a family of the sweep (tests/core/test_families.py)
def test_a_multi_query_layer_trains_compiled_as_eager_on_several_threads(tmp_path, monkeypatch):
    """Inductor's C++ code for several threads scatter-adds into the wrong elements in torch 2.13
    (pytorch/pytorch#191837), and Falcon's multi-query attention meets it in its backward: its
    LoRA gradients came out 0.6 off eager's. The code is made for the thread count torch has when
    it compiles, so two threads here, whatever the machine gives the suite."""
    from helpers import save_tiny

    from ktm.model import KTMModel

    monkeypatch.setattr(compiled, "_COMPILED", {})  # compiled anew, under two threads
    save_tiny("falcon", tmp_path)
    torch.manual_seed(0)
    model = KTMModel.from_base(str(tmp_path), k=4, lora=LoraSettings(dropout=0.0))
    perturb(model)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        trains_compiled_as_eager(model, [PROMPTS[0], PROMPTS[2]], [" yes", " no"])
    finally:
        torch.set_num_threads(threads)


def test_a_lora_of_merged_rows_trains_compiled_as_eager(tiny_model_dir):
    """The gate that keeps the LoRA off the plain rows (``ktm.core.lora_scope``) holds inside
    the compiled layers too."""
    from ktm import Segment

    model = fresh_model(tiny_model_dir, lora=LoraSettings(scope="merged", dropout=0.0),
                        plain_prefix=1)
    perturb(model)
    model.train()
    trains_compiled_as_eager(model, [[Segment(PROMPTS[0]), Segment(" Answer:", compress=False)],
                                     PROMPTS[2]], [" yes", " no"])
