"""A K mix: one LoRA learns to read every level of a recursive encoder (K and its inner K)."""

import pytest
import torch
from helpers import assert_one_step_lowers

from ktm import KTMError
from ktm.cli.main import main
from ktm.core.levels import encoder_at, merging_at
from ktm.model import KTMModel, prompt_logits
from ktm.tasks.base import Example
from ktm.training.config import TrainConfig
from ktm.training.pretrain import PretrainConfig, WindowStream, load_docs, pretrain, pretrain_loss

PROMPT = "def add(a, b):\n    return a + b\nThe quick brown fox jumps over the lazy dog."


def cfg(corpus, **kw):
    return PretrainConfig(sources=(corpus,), objectives=("lm", "ae", "distill"),
                          context_tokens=24, target_tokens=8, ae_tokens=16, min_tokens=8,
                          eval_sets=(), **kw)


def randomize(model, seed=1):
    """Random LoRA B and encoder weights, so that every level and the adapter matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or name.startswith("encoder."):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (p if "slots" in name else 0))
    return model


@pytest.fixture
def recursive(tiny_model_dir):
    torch.manual_seed(0)
    model = KTMModel.from_base(tiny_model_dir, k=4, inner_k=2, slot_weights=True, mlp_ratio=0.5)
    return randomize(model).eval()


def k2_copy(tiny_model_dir, recursive):
    """A plain K=2 model built by hand from the recursive model's inner level and its LoRA."""
    k2 = KTMModel.from_base(tiny_model_dir, k=2, slot_weights=True, mlp_ratio=0.5)
    k2.encoder.load_state_dict(recursive.encoder.inner.state_dict())
    lora = {n: p for n, p in recursive.peft.named_parameters() if "lora_" in n}
    with torch.no_grad():
        for n, p in k2.peft.named_parameters():
            if "lora_" in n:
                p.copy_(lora[n])
    return k2.eval()


def test_a_recursive_checkpoint_loads_at_its_inner_k(tiny_model_dir, recursive, tmp_path):
    recursive.save(tmp_path / "r")
    inner = KTMModel.load(tmp_path / "r", k=2)
    assert (inner.k, inner.config.k, inner.config.inner_k) == (2, 2, 1)
    want = k2_copy(tiny_model_dir, recursive)
    with torch.no_grad():
        got, ref = prompt_logits(inner, PROMPT), prompt_logits(want, PROMPT)
        with merging_at(recursive, 2):
            via_context = prompt_logits(recursive, PROMPT)
        k4 = prompt_logits(recursive, PROMPT)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(via_context, ref, atol=1e-5, rtol=1e-5)
    assert k4.shape[0] < got.shape[0]  # K=4 really merges more, and the context restored it
    assert recursive.k == 4
    # saved at K=2 it is a plain K=2 checkpoint
    inner.save(tmp_path / "k2")
    again = KTMModel.load(tmp_path / "k2")
    assert again.config.inner_k == 1
    with torch.no_grad():
        torch.testing.assert_close(prompt_logits(again, PROMPT), got)


def test_other_ks_are_refused_clearly(tiny_model_dir, recursive, tmp_path, corpus):
    recursive.save(tmp_path / "r")
    with pytest.raises(KTMError, match=r"trained with K=4 \(or its inner K=2\), but K=3"):
        KTMModel.load(tmp_path / "r", k=3)
    with pytest.raises(KTMError, match=r"K=3 is not one of this model's merge levels.*\[2, 4\]"):
        pretrain(recursive, cfg(corpus, k_mix=("2", "3")),
                 TrainConfig(out_dir=str(tmp_path / "x"), max_steps=1))
    assert not (tmp_path / "x").exists()
    assert recursive.config.at_level(2).levels == (2,)
    with pytest.raises(KTMError, match=r"K=3 is not one of this model's merge levels \[2, 4\]"):
        recursive.config.at_level(3)
    flat = KTMModel.from_base(tiny_model_dir, k=4)
    with pytest.raises(KTMError, match=r"expected one of \[4\]"):
        encoder_at(flat, 2)
    with pytest.raises(KTMError, match="'two' in the K mix is not an integer"):
        cfg(corpus, k_mix=("two",))
    with pytest.raises(KTMError, match="no K with a positive weight"):
        cfg(corpus, k_mix=("2=0",))


def test_the_k_draw_keeps_the_windows_and_follows_the_weights(recursive, corpus):
    plain, mixed = cfg(corpus), cfg(corpus, k_mix=("2", "4=3"))
    docs = load_docs(recursive.tokenizer, plain)
    a, b = WindowStream(docs, plain, 200, 0, 1), WindowStream(docs, mixed, 200, 0, 1)
    for i in range(200):
        assert "k" not in a[i].meta
        assert (a[i].segments, a[i].target) == (b[i].segments, b[i].target)
    ks = [b[i].meta["k"] for i in range(200)]
    assert set(ks) == {2, 4} and 25 < ks.count(2) < 75  # weight 1 of 4: about 50


def test_a_mixed_batch_is_each_level_alone(tiny_model_dir, recursive, corpus):
    c = cfg(corpus, k_mix=("2", "4"))
    stream = WindowStream(load_docs(recursive.tokenizer, c), c, 12, 0, 1)
    batch = [stream[i] for i in range(12)]
    assert {e.meta["k"] for e in batch} == {2, 4}
    k2 = k2_copy(tiny_model_dir, recursive)

    def strip(e):
        return Example(e.segments, e.target, meta={"objective": e.meta["objective"]})

    with torch.no_grad():
        mixed = pretrain_loss(recursive, batch).nll
        for i, e in enumerate(batch):
            alone = pretrain_loss(k2 if e.meta["k"] == 2 else recursive, [strip(e)]).nll[0]
            torch.testing.assert_close(mixed[i], alone, atol=1e-4, rtol=1e-4)


def test_one_k_mix_step_lowers_the_loss(recursive, corpus):
    c = cfg(corpus, k_mix=("2", "4"))
    stream = WindowStream(load_docs(recursive.tokenizer, c), c, 8, 0, 1)
    batch = [stream[i] for i in range(8)]
    assert_one_step_lowers(recursive, lambda: pretrain_loss(recursive, batch).loss)


def test_cli_pretrains_a_k_mix(tiny_model_dir, corpus, tmp_path, capsys):
    out = tmp_path / "mix"
    code = main(["pretrain", "--model", tiny_model_dir, "--k", "4", "--inner-k", "2",
                 "--k-mix", "2", "4", "--sources", corpus, "--context-tokens", "24",
                 "--target-tokens", "8", "--min-tokens", "8", "--eval-sets", "none",
                 "--max-steps", "2", "--batch-size", "4", "--out-dir", str(out),
                 "--no-progress"])
    assert code == 0
    assert KTMModel.load(out / "checkpoint", k=2).k == 2
    assert KTMModel.load(out / "checkpoint").k == 4
    for k in ("2", "4"):  # every command that takes --checkpoint reads it at either level
        assert main(["generate", "--checkpoint", str(out / "checkpoint"), "--k", k, "--prompt",
                     PROMPT, "--max-new-tokens", "2"]) == 0
    assert main(["generate", "--checkpoint", str(out / "checkpoint"), "--k", "3", "--prompt",
                 PROMPT, "--max-new-tokens", "2"]) == 2
    assert "trained with K=4 (or its inner K=2), but K=3 was requested" in capsys.readouterr().err


def test_pretraining_evaluates_every_level_of_the_mix(recursive, corpus, tmp_path, monkeypatch):
    import json

    import ktm.evaluation.readability

    def fake(model, sets, n, _cache=None):  # the K it merges at, in place of R
        return {name: {"R": float(model.k)} for name in sets}

    monkeypatch.setattr(ktm.evaluation.readability, "heldout_readability", fake)
    # the held-out text is read before the run; fake has no use for it (no data folder needed)
    monkeypatch.setattr(ktm.evaluation.readability, "heldout_sets", lambda *a, **kw: {})
    c = PretrainConfig(sources=(corpus,), context_tokens=24, target_tokens=8, min_tokens=8,
                       eval_sets=("code",), k_mix=("2", "4"))
    pretrain(recursive, c, TrainConfig(out_dir=str(tmp_path / "m"), max_steps=1, batch_size=2,
                                       eval_every=1, progress=False))
    rows = [json.loads(r) for r in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    ev = next(r["eval"] for r in rows if "eval" in r)
    assert ev == {"code": {"R": 4.0}, "code@k2": {"R": 2.0}}
    assert recursive.k == 4
