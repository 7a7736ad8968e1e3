"""Low-precision base models and devices: trainable weights stay fp32, bad devices fail clearly."""

import pytest
import torch
from helpers import PROMPTS, TARGETS, require_module

from ktm import KTMError
from ktm.cli.main import main
from ktm.model import KTMModel, prompt_logits, trainable_parameters
from ktm.tasks.tree import TreeTask
from ktm.training.config import TrainConfig
from ktm.training.train import train
from ktm.util.timing import clock


def test_bf16_training_moves_fp32_trainable_weights(tiny_model_dir, tmp_path):
    """At lr 5e-5 a bf16 weight of size ~0.05 cannot move (its spacing is ~2e-4); the encoder,
    LoRA and LTSC rows are fp32 masters, the base LM stays bf16."""
    torch.manual_seed(0)
    model = KTMModel.from_base(tiny_model_dir, k=4, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert {p.dtype for _, p in trainable_parameters(model)} == {torch.float32}
    first = model.encoder.mlp[0].weight.detach().clone()
    out = model(PROMPTS, TARGETS)
    assert torch.isfinite(out.loss)
    data = TreeTask(stage="small").train_examples(8, seed=0)
    cfg = TrainConfig(out_dir=str(tmp_path), max_steps=2, batch_size=4, lr=5e-5,
                      encoder_lr=5e-5, save_every=0, progress=False)
    last = train(model, data, cfg)
    assert torch.isfinite(torch.tensor(last["loss"]))
    moved = (model.encoder.mlp[0].weight != first).float().mean().item()
    assert moved > 0.9, f"only {moved:.0%} of the encoder's first-layer weights moved"
    # the checkpoint holds the fp32 weights and loads back in bf16
    loaded = KTMModel.load(str(tmp_path / "checkpoint"), dtype="bfloat16")
    torch.testing.assert_close(loaded.encoder.mlp[0].weight, model.encoder.mlp[0].weight)


def test_fp16_training_is_refused_clearly(tiny_model_dir, tmp_path):
    model = KTMModel.from_base(tiny_model_dir, k=4, dtype="float16")
    data = TreeTask(stage="small").train_examples(4, seed=0)
    with pytest.raises(KTMError, match="float16 .* use --dtype bfloat16 or float32"):
        train(model, data, TrainConfig(out_dir=str(tmp_path), max_steps=1, progress=False))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_one_line(capsys, tiny_model_dir):
    code = main(["generate", "--model", tiny_model_dir, "--device", "cuda", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("ktm: error: device 'cuda' asked for, but "
                                                   "CUDA is not available")


def test_the_clock_waits_for_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    clock(torch.device("cuda:0"))
    clock(torch.device("cpu"))
    assert calls == [torch.device("cuda:0")]


def test_demo_prefill_timing_uses_the_synchronising_clock(ktm_model, monkeypatch):
    import ktm.cli.demo as demo

    seen = []
    monkeypatch.setattr(demo, "clock", lambda device: seen.append(device) or float(len(seen)))
    demo.time_prefill(ktm_model, PROMPTS, repeats=1)
    assert seen and set(seen) == {ktm_model.device}


def test_llmlingua_follows_the_model_device(monkeypatch, tiny_model_dir):
    require_module("llmlingua", "llmlingua is not installed")
    import llmlingua.prompt_compressor as lp

    from ktm.compressors.llmlingua import LLMLingua

    seen = {}

    class FakeCompressor:
        def __init__(self, **kwargs):
            seen.update(kwargs)
            self.tokenizer = None

    class OnGPU:  # a model that reports another device; LLMLingua must not assume cpu
        device = torch.device("cuda:1")
        config = KTMModel.from_base(tiny_model_dir, k=1).config

    monkeypatch.setattr(lp, "PromptCompressor", FakeCompressor)
    LLMLingua().fit([], OnGPU())
    assert seen["device_map"] == "cuda:1"


def test_bf16_model_saved_and_loaded_computes_the_same_logits(tiny_model_dir, tmp_path):
    """from_base once cast the loaded LM to bf16 a second time, which also cast the rotary
    inv_freq that from_pretrained (and so KTMModel.load, and vLLM) keep fp32: a bf16 model
    read its positions otherwise than the same checkpoint loaded back, or exported."""
    torch.manual_seed(0)
    model = KTMModel.from_base(tiny_model_dir, k=4, dtype=torch.bfloat16)
    model.save(tmp_path / "ck")
    loaded = KTMModel.load(tmp_path / "ck", dtype=torch.bfloat16)
    for m in (model, loaded):
        assert {b.dtype for n, b in m.peft.named_buffers() if "inv_freq" in n} == {torch.float32}
    with torch.no_grad():
        torch.testing.assert_close(prompt_logits(loaded, PROMPTS[0]),
                                   prompt_logits(model, PROMPTS[0]), atol=0, rtol=0)


@pytest.mark.parametrize("given", [torch.bfloat16, torch.float32])
def test_a_model_object_cast_to_bf16_reads_positions_as_loaded(tiny_model_dir, tmp_path, given):
    """from_base cast a model object with ``lm.to(dtype)``, which also cast the rotary inv_freq
    that from_pretrained keeps fp32 (even a bf16 object's, cast again): the model read
    positions otherwise than its own checkpoint loaded back (max logit gap 0.08 here)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=given)
    model = KTMModel.from_base(lm, tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir),
                               k=4, dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    assert {b.dtype for n, b in model.peft.named_buffers() if "inv_freq" in n} == {torch.float32}
    model.save(tmp_path / "ck")
    loaded = KTMModel.load(tmp_path / "ck", dtype="bfloat16")
    # far enough along for rounded frequencies to show
    prompt = "The quick brown fox jumps over the lazy dog. Hello world, my name is ktm. " * 4
    with torch.no_grad():
        torch.testing.assert_close(prompt_logits(loaded, prompt), prompt_logits(model, prompt),
                                   atol=0, rtol=0)


def test_losses_ignore_torchs_default_dtype(ktm_model, tiny_model_dir, corpus):
    """The per-example loss sums were made with torch.zeros in torch's default dtype: under
    torch.set_default_dtype(torch.float64) every loss failed ("index_add_(): self (Double) and
    source (Float) must have the same scalar type"). They now follow the fp32 losses."""
    from ktm.training.pretrain import PretrainConfig, WindowStream, load_docs, pretrain_loss
    from ktm.training.teacher import distill_loss

    cfg = PretrainConfig(sources=(corpus,), objectives=("lm", "distill", "align"),
                         context_tokens=24, target_tokens=8, min_tokens=8, eval_sets=())
    stream = WindowStream(load_docs(ktm_model.tokenizer, cfg), cfg, 6, 0, ktm_model.eos_id)
    windows = [stream[i] for i in range(6)]
    tasks = TreeTask(stage="small").train_examples(2, seed=0)
    teacher = KTMModel.from_base(tiny_model_dir, k=1, use_mlp=False)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        losses = [ktm_model(PROMPTS, TARGETS), pretrain_loss(ktm_model, windows, 1.0),
                  distill_loss(teacher)(ktm_model, tasks)]
    finally:
        torch.set_default_dtype(before)
    assert {out.nll.dtype for out in losses} == {torch.float32}
    assert all(torch.isfinite(out.loss) for out in losses)


def test_a_model_built_under_another_default_dtype_keeps_fp32_trainable_weights(tiny_model_dir):
    """The encoder's weights were made in torch's default dtype: built under
    torch.set_default_dtype(torch.float64) they were float64, and the first merge failed
    ("mat1 and mat2 must have the same dtype"). They are fp32, as every trainable weight."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = KTMModel.from_base(tiny_model_dir, k=4, slot_weights=True, mlp_gate=True)
    finally:
        torch.set_default_dtype(before)
    assert {p.dtype for _, p in trainable_parameters(model)} == {torch.float32}
    assert torch.isfinite(model(PROMPTS, TARGETS).loss)


def test_a_frozen_encoder_merges_in_the_lm_dtype_from_one_cast_copy(tiny_model_dir):
    """An encoder that does not train is read from a copy in the LM's dtype (no autocast cast
    per call), made once and again after its weights change; a training one stays fp32."""
    from helpers import perturb

    from ktm.core.encoder import cast_for_inference

    torch.manual_seed(0)
    model = KTMModel.from_base(tiny_model_dir, k=4, dtype=torch.bfloat16)
    perturb(model)
    with torch.no_grad():
        autocast = [cp.embeds for cp in model.encode_prompts(PROMPTS)]  # trainable: autocast
    assert cast_for_inference(model.encoder, torch.bfloat16) is None
    model.requires_grad_(False)
    with torch.no_grad():
        cast = [cp.embeds for cp in model.encode_prompts(PROMPTS)]
    copy = cast_for_inference(model.encoder, torch.bfloat16)
    assert copy is not None and {p.dtype for p in copy.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.encoder.parameters()} == {torch.float32}
    for a, b in zip(cast, autocast):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=2e-2)
    assert cast_for_inference(model.encoder, torch.bfloat16) is copy  # made once
    with torch.no_grad():
        model.encoder.mlp[0].weight.mul_(2)  # written in place: a new copy
    again = cast_for_inference(model.encoder, torch.bfloat16)
    assert again is not copy
    torch.testing.assert_close(again.mlp[0].weight.float(),
                               model.encoder.mlp[0].weight.bfloat16().float())
