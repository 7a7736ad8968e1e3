"""Reader pretraining: objectives, the distillation teacher, the window stream, error paths."""

import json

import pytest
import torch
from helpers import assert_one_step_lowers, fresh_model
from transformers import AutoModelForCausalLM

from ktm import KTMError
from ktm.cli.main import main
from ktm.core.levels import merging_at
from ktm.core.loss import target_logits
from ktm.core.prompt import Segment
from ktm.model import KTMModel, trainable_parameters
from ktm.tasks.corpus import WindowSpec, continuation_window, path_texts, source_texts
from ktm.training.config import TrainConfig
from ktm.training.pretrain import (
    PretrainConfig,
    WindowStream,
    _context_gap,
    load_docs,
    pretrain,
    pretrain_loss,
    teacher_logits,
)
from ktm.training.train import adamw


def small_cfg(corpus, objectives=("lm",), **kw):
    return PretrainConfig(sources=(corpus,), objectives=objectives, context_tokens=24,
                          target_tokens=8, ae_tokens=16, min_tokens=8, eval_sets=(), **kw)


def fresh(tiny_model_dir, k=4, **kw):
    return fresh_model(tiny_model_dir, k, slot_weights=True, **kw)


def randomize_lora(model, seed=1):
    """Non-zero LoRA B, so that the adapter really changes the LM's outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


@pytest.mark.parametrize("objective,hidden", [("lm", 0), ("distill", 0), ("distill", 1.0),
                                              ("ae", 0), ("align", 0)])
def test_one_pretraining_step_lowers_the_loss(tiny_model_dir, corpus, objective, hidden):
    model = fresh(tiny_model_dir)
    cfg = small_cfg(corpus, (objective,))
    stream = WindowStream(load_docs(model.tokenizer, cfg), cfg, 8, 0, model.tokenizer.eos_token_id)
    batch = [stream[i] for i in range(8)]
    assert {e.meta["objective"] for e in batch} == {objective}
    model.train()
    before = pretrain_loss(model, batch, hidden)
    assert set(before.parts) == {objective}
    if hidden:  # the hidden-state gap adds to the KL
        assert before.loss.item() > pretrain_loss(model, batch).loss.item() + 1e-3
    if objective == "align":  # the context gap adds to the cross-entropy
        assert before.loss.item() > pretrain_loss(model, batch, align_weight=0).loss.item() + 1e-3
    opt = adamw([p for _, p in trainable_parameters(model)], lr=2e-3)
    before.loss.backward()
    opt.step()
    with torch.no_grad():
        after = pretrain_loss(model, batch, hidden)
    assert after.loss.item() < before.loss.item() - 1e-3, (before.loss.item(), after.loss.item())


@pytest.mark.parametrize("objective,hidden", [("distill", 1.0), ("align", 0)])
def test_hidden_state_losses_of_a_batch_are_its_samples_one_by_one(tiny_model_dir, corpus,
                                                                    objective, hidden):
    """The hidden-state gaps are relative to each token's own teacher norm: an example's loss
    must not depend on the others in its batch (nor 2 processes differ from 1)."""
    model = fresh(tiny_model_dir)
    randomize_lora(model)
    cfg = small_cfg(corpus, (objective,))
    stream = WindowStream(load_docs(model.tokenizer, cfg), cfg, 3, 0, model.tokenizer.eos_token_id)
    batch = [stream[i] for i in range(3)]
    model.eval()
    with torch.no_grad():
        whole = pretrain_loss(model, batch, hidden).nll
        alone = torch.cat([pretrain_loss(model, [e], hidden).nll for e in batch])
    torch.testing.assert_close(whole, alone, atol=1e-4, rtol=1e-4)


def test_distillation_teacher_is_the_base_model_exactly(tiny_model_dir, corpus):
    model = fresh(tiny_model_dir)
    randomize_lora(model)
    cfg = small_cfg(corpus, ("distill",))
    stream = WindowStream(load_docs(model.tokenizer, cfg), cfg, 3, 0, model.tokenizer.eos_token_id)
    batch = [stream[i] for i in range(3)]
    model.train()  # the teacher must not depend on the student's mode
    got = teacher_logits(model, batch)
    assert model.training
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    want = []
    with torch.no_grad():
        for e in batch:
            ctx, tgt = list(e.segments[0].ids), list(e.target)
            logits = base(torch.tensor([ctx + tgt])).logits[0]
            want.append(logits[len(ctx) - 1:len(ctx) - 1 + len(tgt)])
    torch.testing.assert_close(got.logits, torch.cat(want), atol=1e-4, rtol=1e-4)
    # the adapter really is on outside the teacher: otherwise this test could not fail
    with torch.no_grad():
        student_plain = target_logits(model, [e.segments for e in batch],
                                      [e.target for e in batch], merge=False)
    assert (student_plain.logits - got.logits).abs().max() > 1e-2


def test_context_gap_is_against_the_plain_reading_at_each_blocks_last_token(
        tiny_model_dir, corpus):
    """Hand-computed: the base LM's hidden states on the plain context at the last token of
    each merged block (position 0, the sink, left out) against the student's there."""
    model = fresh(tiny_model_dir, plain_prefix=1)
    randomize_lora(model)
    cfg = small_cfg(corpus, ("align",))
    stream = WindowStream(load_docs(model.tokenizer, cfg), cfg, 2, 0, model.tokenizer.eos_token_id)
    batch = [stream[i] for i in range(2)]
    model.train()
    prefixes = model.encode_prompts([e.segments for e in batch])
    n = len(batch[0].segments[0].ids)
    want_src = [0] + [min(j + 4, n - 1) for j in range(0, n - 1, 4)]  # 1 plain, then blocks of 4
    assert prefixes[0].sources.tolist() == want_src
    t = target_logits(model, [e.segments for e in batch], [e.target for e in batch],
                      prefixes=prefixes, prompt_hidden=True)
    got = _context_gap(model, batch, prefixes, t.prompt_hidden)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    s_all, t_all, rows, off = [], [], [], 0
    for i, (e, cp) in enumerate(zip(batch, prefixes)):
        with torch.no_grad():
            plain = base(torch.tensor([list(e.segments[0].ids)]),
                         output_hidden_states=True).hidden_states[1:]
        keep = [j for j, w in enumerate(cp.sources.tolist()) if w > 0]
        src = cp.sources[keep]
        s_all.append([h[off + torch.tensor(keep)] for h in t.prompt_hidden])
        t_all.append([h[0, src] for h in plain])
        rows += [i] * len(keep)
        off += cp.tokens_out
    layers = len(t.prompt_hidden)
    s_cat = [torch.cat([s[layer] for s in s_all]) for layer in range(layers)]
    t_cat = [torch.cat([x[layer] for x in t_all]) for layer in range(layers)]
    per_pos = torch.stack([((a - b) ** 2).sum(-1) / (b ** 2).sum(-1)
                           for a, b in zip(s_cat, t_cat)]).mean(0)
    rows = torch.tensor(rows)
    want = torch.stack([per_pos[rows == i].mean() for i in range(len(batch))])
    torch.testing.assert_close(got, want.detach(), atol=1e-4, rtol=1e-4)
    assert (got > 1e-3).all()


def test_context_gap_is_zero_when_the_merged_reading_is_the_plain_one(tiny_model_dir, corpus):
    """K=1 with the LoRA at zero reads exactly the plain prompt: nothing to align. A gather
    one position off, or a student state against the wrong row, would make it non-zero."""
    model = fresh(tiny_model_dir, k=1)
    cfg = small_cfg(corpus, ("align",))
    stream = WindowStream(load_docs(model.tokenizer, cfg), cfg, 3, 0, model.tokenizer.eos_token_id)
    batch = [stream[i] for i in range(3)]
    prefixes = model.encode_prompts([e.segments for e in batch])
    t = target_logits(model, [e.segments for e in batch], [e.target for e in batch],
                      prefixes=prefixes, prompt_hidden=True)
    gap = _context_gap(model, batch, prefixes, t.prompt_hidden)
    assert gap.abs().max().item() < 1e-8
    randomize_lora(model)  # a student that reads differently is not aligned: the test can fail
    t = target_logits(model, [e.segments for e in batch], [e.target for e in batch],
                      prefixes=prefixes, prompt_hidden=True)
    assert (_context_gap(model, batch, prefixes, t.prompt_hidden) > 1e-3).all()


def test_window_stream_is_a_pure_function_of_seed_and_index(tiny_model_dir, corpus):
    model = fresh(tiny_model_dir)
    cfg = small_cfg(corpus, ("lm", "ae=2", "distill"))
    docs = load_docs(model.tokenizer, cfg)
    a = WindowStream(docs, cfg, 50, 3, 1)
    b = WindowStream(docs, cfg, 50, 3, 1)
    assert [a[i] for i in (7, 0, 49)] == [b[i] for i in (7, 0, 49)]
    assert a[5] != WindowStream(docs, cfg, 50, 4, 1)[5]
    objectives = {a[i].meta["objective"] for i in range(50)}
    assert objectives == {"lm", "ae", "distill"}
    for i in range(50):
        e = a[i]
        if e.meta["objective"] == "ae":  # regenerate the merged context, then EOS
            assert tuple(e.target) == e.segments[0].ids + (1,)
            assert e.segments[1].compress is False
    with pytest.raises(IndexError):
        a[50]


def test_a_step_mix_gives_every_window_of_a_step_one_objective(tiny_model_dir, corpus):
    """objective_mix="step" (ARC-Encoder's alternation): the windows of one optimizer step share
    an objective, steps differ by weight; a window whose objective is the same is the same
    window as in the per-example mix, and the signature tells the two mixes apart."""
    model = fresh(tiny_model_dir)
    docs = load_docs(model.tokenizer, small_cfg(corpus))
    per_example = WindowStream(docs, small_cfg(corpus, ("lm", "ae")), 96, 3, 1)
    cfg = small_cfg(corpus, ("lm", "ae"), objective_mix="step")
    stream = WindowStream(docs, cfg, 96, 3, 1, per_step=4)
    steps = [{stream[i].meta["objective"] for i in range(s, s + 4)} for s in range(0, 96, 4)]
    assert all(len(objs) == 1 for objs in steps)
    assert {o for objs in steps for o in objs} == {"lm", "ae"}
    mixed = [{per_example[i].meta["objective"] for i in range(s, s + 4)} for s in range(0, 96, 4)]
    assert any(len(objs) == 2 for objs in mixed)  # else the first assertion could not fail
    same = [i for i in range(96) if stream[i].meta == per_example[i].meta]
    assert same and all(stream[i] == per_example[i] for i in same)
    assert stream.signature != per_example.signature
    assert stream.signature != WindowStream(docs, cfg, 96, 3, 1, per_step=8).signature
    with pytest.raises(KTMError, match="objective_mix must be example or step, got 'batch'"):
        small_cfg(corpus, objective_mix="batch")


def test_continuation_window_shapes():
    import random

    import numpy as np

    spec = WindowSpec(context_tokens=10, target_tokens=4, min_tokens=4)
    doc = np.arange(100)
    w = continuation_window(doc, spec, random.Random(0), "x")
    assert len(w.context) == 10 and len(w.target) == 4
    assert w.target[0] == w.context[-1] + 1  # the target continues the context
    short = continuation_window(np.arange(8), spec, random.Random(0), "x")
    assert (len(short.context), len(short.target)) == (6, 2)  # a quarter is the target


def test_pretrain_run_writes_metrics_and_resumes_exactly(tiny_model_dir, corpus, tmp_path):
    cfg = small_cfg(corpus, ("lm", "ae"))

    def run(out, steps, resume=False, model=None):
        model = model or fresh(tiny_model_dir)
        tc = TrainConfig(out_dir=str(out), max_steps=steps, batch_size=2, lr=1e-3,
                         save_every=2, progress=False, resume=resume)
        pretrain(model, cfg, tc)
        return model

    straight = run(tmp_path / "a", 4)
    run(tmp_path / "b", 2)
    resumed = run(tmp_path / "b", 4, resume=True)
    for (n, p), (_, q) in zip(trainable_parameters(straight), trainable_parameters(resumed)):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=n)
    info = json.loads((tmp_path / "a" / "run.json").read_text())
    assert info["pretrain"]["objectives"] == ["lm", "ae"]
    rows = [json.loads(r) for r in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["cpu_s"] > 0 for r in rows)


def test_pretraining_windows_start_with_the_tokenizers_bos(tiny_bos_model_dir, corpus, tmp_path,
                                                          monkeypatch):
    """As a task prompt's first segment does; the autoencoding target is the text, no BOS."""
    import ktm.training.pretrain as module

    seen = {}
    monkeypatch.setattr(module, "train", lambda m, stream, *a, **kw: seen.update(s=stream))
    model = fresh(tiny_bos_model_dir)
    bos = model.tokenizer.bos_token_id
    pretrain(model, small_cfg(corpus, ("lm", "ae")),
             TrainConfig(out_dir=str(tmp_path), max_steps=4, batch_size=2, progress=False))
    examples = [seen["s"][i] for i in range(8)]
    assert {e.meta["objective"] for e in examples} == {"lm", "ae"}
    for e in examples:
        ids = e.segments[0].ids
        assert ids[0] == bos and bos not in ids[1:]
        if e.meta["objective"] == "ae":
            assert tuple(e.target) == ids[1:] + (model.tokenizer.eos_token_id,)


def test_user_jsonl_source_and_field(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"body": "hello"}) + "\n" + json.dumps({"body": "world"}) + "\n")
    assert path_texts(str(path), "body") == ["hello", "world"]
    # the message named only the missing field, not the fields there nor --text-field
    with pytest.raises(KTMError, match=r"line 1: no field 'text' \(its fields: 'body'\); "
                                       r"expected .* or --text-field"):
        path_texts(str(path))
    path.write_text(json.dumps({"text": 3}) + "\n")
    with pytest.raises(KTMError, match="line 1: expected a string field 'text', got int"):
        path_texts(str(path))
    path.write_text('{"text": "ok"}\n{"text": "a \\ud83d b"}\n')  # half a UTF-16 pair
    with pytest.raises(KTMError, match=r"line 2: field 'text' holds a lone surrogate '\\ud83d'"):
        path_texts(str(path))
    path.write_text('{"text": "a \\ud83d\\ude00 b"}\n')  # a whole pair is a character
    assert path_texts(str(path)) == ["a \U0001f600 b"]


def test_a_corpus_folder_skips_hidden_folders_and_reads_gzipped_text(tmp_path):
    import gzip

    (tmp_path / "c" / "sub").mkdir(parents=True)
    (tmp_path / "c" / ".venv" / "lib").mkdir(parents=True)
    (tmp_path / "c" / "sub" / "a.txt").write_text("plain text")
    (tmp_path / "c" / ".venv" / "lib" / "site.py").write_text("not the corpus")
    with gzip.open(tmp_path / "c" / "sub" / "b.txt.gz", "wt", encoding="utf-8") as f:
        f.write("gzipped text")  # was 'not UTF-8 text'
    assert path_texts(str(tmp_path / "c")) == ["plain text", "gzipped text"]


def test_empty_corpus_is_a_clear_error(tiny_model_dir, tmp_path):
    model = fresh(tiny_model_dir)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(KTMError, match="has no text files"):
        load_docs(model.tokenizer, PretrainConfig(sources=(str(empty),), eval_sets=()))
    jsonl = tmp_path / "none.jsonl"
    jsonl.write_text("")
    with pytest.raises(KTMError, match="is empty"):
        load_docs(model.tokenizer, PretrainConfig(sources=(str(jsonl),), eval_sets=()))


def test_text_shorter_than_one_window_is_a_clear_error(tiny_model_dir, tmp_path):
    model = fresh(tiny_model_dir)
    short = tmp_path / "short.txt"
    short.write_text("hello world")
    with pytest.raises(KTMError, match="none of its 1 texts has 32 tokens"):
        load_docs(model.tokenizer, PretrainConfig(sources=(str(short),), eval_sets=()))


def test_evaluation_only_sets_are_refused_as_training_text(tmp_path):
    folder = tmp_path / "amazon_reviews_other"
    folder.mkdir()
    (folder / "a.txt").write_text("some review text")
    with pytest.raises(KTMError, match="evaluation-only"):
        source_texts(str(folder))
    with pytest.raises(KTMError, match="evaluation-only"):
        source_texts(str(folder / "a.txt"))


def test_bad_objective_and_weight_are_clear_errors(corpus):
    with pytest.raises(KTMError, match="unknown objective 'mse'"):
        small_cfg(corpus, ("mse",))
    with pytest.raises(KTMError, match="weight 'x' is not a number"):
        small_cfg(corpus, ("lm=x",))
    with pytest.raises(KTMError, match="positive weight"):
        small_cfg(corpus, ("lm=0",))


def test_one_name_for_a_list_field_is_one_item_not_its_letters():
    # tuple("code") made the sources c, o, d, e ("unknown objective 'l'" for objectives="lm")
    cfg = PretrainConfig(sources="code", objectives="lm", eval_sets="reviews", k_mix=4)
    assert (cfg.sources, cfg.objectives, cfg.eval_sets, cfg.k_mix) == (
        ("code",), ("lm",), ("reviews",), ("4",))


def test_pretrain_refuses_its_configs_swapped(tiny_model_dir, tmp_path):
    model = KTMModel.from_base(tiny_model_dir, k=2)
    with pytest.raises(KTMError, match=r"got \(TrainConfig, PretrainConfig\)"):
        pretrain(model, TrainConfig(out_dir=str(tmp_path / "r")), PretrainConfig(eval_sets=()))
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("field,spec", [("sources", "x=nan"), ("sources", "x=inf"),
                                        ("objectives", "lm=nan"), ("k_mix", "4=inf"),
                                        ("distill_hidden", float("nan"))])
def test_a_weight_that_is_not_finite_is_a_clear_error(field, spec):
    # NaN was taken as a weight (random.choices then fails mid-run, or draws one name always)
    value = spec if isinstance(spec, float) else (spec,)
    with pytest.raises(KTMError, match="finite number >= 0"):
        PretrainConfig(**{field: value}, eval_sets=())


def test_a_source_without_a_name_is_a_clear_error():
    # '=0.5' named the source '', the current folder, and read every text file under it
    with pytest.raises(KTMError, match="has no name"):
        PretrainConfig(sources=("=0.5",), eval_sets=())


def test_pretraining_needs_merging(tiny_model_dir, corpus, tmp_path):
    model = KTMModel.from_base(tiny_model_dir, k=1, use_mlp=False)
    with pytest.raises(KTMError, match="needs merging"):
        pretrain(model, small_cfg(corpus), TrainConfig(out_dir=str(tmp_path / "x"), max_steps=1))


def test_a_model_too_short_for_the_readability_windows_is_refused_before_training(
        tmp_path, corpus):
    """R reads 256-token held-out contexts plain before a 64-token continuation: a model with
    fewer positions is refused up front, not after training to the end (where R runs before
    the last checkpoint is written) with a hint about K."""
    from helpers import save_tiny

    base, tok = save_tiny("gpt2", tmp_path / "gpt2", positions=256)
    model = KTMModel.from_base(base, k=4, tokenizer=tok)
    cfg = PretrainConfig(sources=(corpus,), context_tokens=24, target_tokens=8, min_tokens=8,
                         eval_sets=("code",))
    with pytest.raises(KTMError, match=r"readability R .* 320 positions .* over this model's "
                                       r"limit of 256: expected no R for this model \(ktm "
                                       r"pretrain --eval-sets none; ktm eval without "
                                       r"--readability\)"):
        pretrain(model, cfg, TrainConfig(out_dir=str(tmp_path / "x"), max_steps=1,
                                         progress=False))
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


def test_eval_readability_on_a_model_too_short_says_what_to_drop(tmp_path, capsys):
    """`ktm eval --readability` on a local model of 256 positions: the refusal named only
    `ktm pretrain --eval-sets none`, a flag of another command."""
    from helpers import save_tiny

    from ktm.cli.main import main

    save_tiny("gpt2", tmp_path / "gpt2", positions=256)
    capsys.readouterr()
    assert main(["eval", "--model", str(tmp_path / "gpt2"), "--readability", "code",
                 "--n-eval", "2", "--json", str(tmp_path / "r.json")]) == 2
    assert "ktm eval without --readability" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_cli_pretrain_then_train_from_it(tiny_model_dir, corpus, tmp_path, capsys):
    out = tmp_path / "reader"
    code = main(["pretrain", "--model", tiny_model_dir, "--k", "2", "--slot-weights",
                 "--sources", corpus, "--objectives", "lm", "ae", "--context-tokens", "24",
                 "--target-tokens", "8", "--ae-tokens", "16", "--min-tokens", "8",
                 "--eval-sets", "none", "--max-steps", "2", "--batch-size", "2",
                 "--out-dir", str(out), "--no-progress"])
    assert code == 0
    reader = KTMModel.load(str(out / "checkpoint"))
    assert reader.k == 2 and reader.encoder.slots is not None
    code = main(["train", "--model", tiny_model_dir, "--k", "4", "--init",
                 str(out / "checkpoint"), "--task", "tree", "--stage", "small", "--max-steps",
                 "1", "--out-dir", str(tmp_path / "t"), "--no-progress"])
    assert code == 2
    assert "trained with K=2, but K=4 was requested" in capsys.readouterr().err
    code = main(["train", "--model", tiny_model_dir, "--k", "2", "--init",
                 str(out / "checkpoint"), "--task", "tree", "--stage", "small", "--max-steps",
                 "1", "--batch-size", "2", "--n-train", "4", "--n-eval", "2",
                 "--out-dir", str(tmp_path / "t"), "--no-progress"])
    assert code == 0
    trained = KTMModel.load(str(tmp_path / "t" / "checkpoint"))
    assert trained.encoder.slots is not None  # the reader's encoder settings carried over


def test_unknown_reader_name_is_a_clear_error(capsys):
    with pytest.raises(KTMError, match="no shipped reader of that name.*smollm2-135m-k4"):
        KTMModel.load("smollm2-135m-k9")
    assert main(["train", "--init", "smollm2-135m-k9", "--max-steps", "1"]) == 2
    assert "no shipped reader of that name" in capsys.readouterr().err


def test_init_adapter_starts_lora_from_another_k(tiny_model_dir, tmp_path):
    from ktm.core.checkpoint import load_adapter_into

    k2 = fresh(tiny_model_dir, k=2)
    randomize_lora(k2)
    k2.save(str(tmp_path / "k2"))
    k4 = fresh(tiny_model_dir, k=4)
    load_adapter_into(k4, tmp_path / "k2")
    lora = {n: p for n, p in k2.named_parameters() if "lora_" in n}
    for n, p in k4.named_parameters():
        if "lora_" in n:
            torch.testing.assert_close(p, lora[n])
    assert k4.k == 4 and torch.all(k4.encoder.slots == 0.25)  # the encoder starts fresh
    other = KTMModel.from_base(tiny_model_dir, k=4, lora=__import__("ktm").LoraSettings(r=2))
    with pytest.raises(KTMError, match="r=4, but the model has r=2: expected a rank at least"):
        load_adapter_into(other, tmp_path / "k2")


def _logits(model, texts=("the quick brown fox jumps", "over the lazy dog")):
    prompts = [(Segment(t), Segment(" and", compress=False)) for t in texts]
    with torch.no_grad():
        return target_logits(model, prompts, [" then it ran"] * len(prompts)).logits


def test_grown_lora_computes_the_same_function_then_trains_its_new_rank(tiny_model_dir,
                                                                       tmp_path):
    from ktm import LoraSettings
    from ktm.core.checkpoint import load_adapter_into

    small = fresh(tiny_model_dir, k=2)
    randomize_lora(small)
    small.save(str(tmp_path / "r4"))
    want = _logits(small.eval())
    big = fresh(tiny_model_dir, k=2, lora=LoraSettings(r=8, alpha=8))  # other alpha/r too
    assert (_logits(big.eval()) - want).abs().max() > 1e-2  # so the check below can fail
    big.encoder.load_state_dict(small.encoder.state_dict())
    load_adapter_into(big, tmp_path / "r4")
    torch.testing.assert_close(_logits(big.eval()), want, atol=1e-5, rtol=1e-5)
    b = next(p for n, p in big.peft.named_parameters() if "lora_B" in n)
    a = next(p for n, p in big.peft.named_parameters() if "lora_A" in n)
    assert torch.all(b[:, 4:] == 0) and a[4:].abs().sum() > 0
    big.train()
    out = target_logits(big, [(Segment("the quick brown fox"),)], [" jumps"])
    torch.nn.functional.cross_entropy(out.logits, out.labels).backward()
    assert b.grad[:, 4:].abs().sum() > 0  # the new rank is trainable from the first step


def test_init_with_a_larger_lora_rank_grows_the_checkpoint(tiny_model_dir, tmp_path, corpus):
    small = fresh(tiny_model_dir, k=2)
    randomize_lora(small)
    small.save(str(tmp_path / "r4"))
    common = ["--init", str(tmp_path / "r4"), "--model", tiny_model_dir, "--max-steps", "1",
              "--no-progress", "--sources", corpus, "--batch-size", "1", "--eval-sets", "none",
              "--context-tokens", "24", "--target-tokens", "8", "--min-tokens", "8"]
    assert main(["pretrain", *common, "--lora-r", "8", "--lora-alpha", "32",
                 "--out-dir", str(tmp_path / "grown")]) == 0
    grown = KTMModel.load(str(tmp_path / "grown" / "checkpoint"))
    assert (grown.config.lora.r, grown.config.lora.alpha) == (8, 32)
    assert main(["pretrain", *common, "--lora-r", "2", "--out-dir", str(tmp_path / "x")]) == 2


def test_init_with_a_larger_mlp_ratio_widens_the_encoder_exactly(tiny_model_dir, tmp_path,
                                                                  corpus):
    from ktm.cli.args import init_or_build
    from ktm.cli.main import _parser

    small = fresh(tiny_model_dir, k=2, mlp_ratio=0.5)
    randomize_lora(small)
    for p in small.encoder.parameters():
        p.data.normal_(0, 0.05)
    small.save(str(tmp_path / "narrow"))
    want = _logits(small.eval())
    common = ["--init", str(tmp_path / "narrow"), "--model", tiny_model_dir, "--seed", "3"]
    argv = ["pretrain", *common, "--mlp-ratio", "1.5",
            "--lora-r", "8", "--sources", corpus]
    args = _parser(argv).parse_args(argv)
    wide = init_or_build(args)
    assert wide.encoder.config.mlp_hidden == 3 * small.encoder.config.mlp_hidden
    torch.testing.assert_close(_logits(wide.eval()), want, atol=1e-5, rtol=1e-5)
    again = init_or_build(args)  # the new units' init comes from --seed: the same model twice
    torch.testing.assert_close(again.encoder.mlp[0].weight, wide.encoder.mlp[0].weight)
    run = [*common, "--max-steps", "1", "--no-progress", "--sources", corpus, "--batch-size", "1",
           "--eval-sets", "none", "--context-tokens", "24", "--target-tokens", "8",
           "--min-tokens", "8"]
    assert main(["pretrain", *run, "--mlp-ratio", "1.0", "--out-dir", str(tmp_path / "w")]) == 0
    assert KTMModel.load(str(tmp_path / "w" / "checkpoint")).config.mlp_ratio == 1.0
    assert main(["pretrain", *run, "--mlp-ratio", "0.25", "--out-dir", str(tmp_path / "x")]) == 2


@pytest.mark.parametrize("name", ["distill_hidden", "align_weight"])
def test_negative_hidden_state_weights_are_clear_errors(name):
    with pytest.raises(KTMError, match=f"{name} must be a finite number >= 0, got -0.5"):
        PretrainConfig(eval_sets=(), **{name: -0.5})
    PretrainConfig(eval_sets=(), **{name: 0.0})  # zero turns the term off


def test_a_text_files_byte_order_mark_is_not_text(tmp_path):
    (tmp_path / "bom.txt").write_bytes("\ufeffhello world".encode("utf-8"))
    assert path_texts(str(tmp_path / "bom.txt")) == ["hello world"]


def test_an_unknown_held_out_set_is_refused_before_training():
    # it was found only at the first evaluation, after the training steps
    with pytest.raises(KTMError, match="unknown held-out set 'review' in eval_sets"):
        PretrainConfig(sources=("x",), eval_sets=("review",))


def test_missing_held_out_data_fails_before_training(tiny_model_dir, corpus, tmp_path,
                                                     monkeypatch):
    # without the data folder the default eval sets failed at the end, the steps lost
    monkeypatch.setenv("KTM_DATA", str(tmp_path / "no-data"))
    cfg = PretrainConfig(sources=(corpus,), context_tokens=24, target_tokens=8, min_tokens=8,
                         eval_sets=("reviews",), n_eval_windows=2)
    out = tmp_path / "run"
    with pytest.raises(KTMError, match="data file not found"):
        pretrain(fresh(tiny_model_dir), cfg, TrainConfig(out_dir=str(out), max_steps=1,
                                                         batch_size=2, progress=False))
    assert not (out / "metrics.jsonl").exists()


def test_resume_with_another_mix_is_refused_even_when_the_first_window_is_the_same(
        tiny_model_dir, corpus, tmp_path):
    from ktm.training.state import data_signature

    def run(objectives, steps, resume=False, **kw):
        cfg = small_cfg(corpus, objectives, **kw)
        tc = TrainConfig(out_dir=str(tmp_path / "r"), max_steps=steps, batch_size=2,
                         save_every=1, progress=False, resume=resume)
        pretrain(fresh(tiny_model_dir), cfg, tc)

    run(("lm", "ae"), 1)
    model = fresh(tiny_model_dir)
    first = [data_signature(WindowStream(load_docs(model.tokenizer, small_cfg(corpus, o)),
                                         small_cfg(corpus, o), 8, 0, model.eos_id))["fingerprint"]
             for o in (("lm", "ae"), ("lm", "ae=0.5"))]
    assert first[0] == first[1]  # the first window alone does not tell the two mixes apart
    with pytest.raises(KTMError, match=r"cannot resume .*objectives=\{'lm': 1.0, 'ae': 1.0\}"):
        run(("lm", "ae=0.5"), 2, resume=True)
    run(("lm", "ae"), 2, resume=True, n_eval_windows=4)  # the eval settings may change


def test_windows_longer_than_the_models_positions_are_refused_before_training(tmp_path):
    """Only long documents give full windows: one long text among short ones failed at the
    first step that drew it, mid-run. The full window is checked up front, naming the flags."""
    from helpers import save_tiny

    base, tok = save_tiny("gpt2", tmp_path / "gpt2", positions=48)
    model = KTMModel.from_base(base, k=4, tokenizer=tok)
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(40):
        (texts / f"short{i:02d}.txt").write_text(f"The quick brown fox {i} jumps.")
    (texts / "long.txt").write_text("The quick brown fox jumps over the lazy dog. " * 60)
    cfg = PretrainConfig(sources=(str(texts),), context_tokens=160, target_tokens=16,
                         min_tokens=4, eval_sets=())
    out = tmp_path / "x"
    with pytest.raises(KTMError, match=r"a full lm window does not fit .* "
                                       r"\(--context-tokens / --target-tokens\)"):
        pretrain(model, cfg, TrainConfig(out_dir=str(out), max_steps=6, batch_size=2,
                                         progress=False))
    assert not (out / "metrics.jsonl").exists()
    cfg = PretrainConfig(sources=(str(texts),), objectives=("ae",), ae_tokens=64, min_tokens=4,
                         eval_sets=())
    with pytest.raises(KTMError, match=r"a full ae window .* \(--ae-tokens\)"):
        pretrain(model, cfg, TrainConfig(out_dir=str(out), max_steps=1, progress=False))


def test_plain_tokens_covering_every_window_are_refused(tiny_model_dir, corpus, tmp_path):
    # --plain-prefix 100 with 24-token contexts trained a 'reader' on plain text only
    model = fresh(tiny_model_dir, plain_prefix=20, plain_suffix=4)
    with pytest.raises(KTMError, match=r"plain_prefix \+ plain_suffix = 24 keep every token"):
        pretrain(model, small_cfg(corpus), TrainConfig(out_dir=str(tmp_path / "x"), max_steps=1,
                                                       progress=False))
    assert not (tmp_path / "x").exists()


def test_uncompressed_heldout_copy_is_refused_as_training_text(tmp_path) -> None:
    for name in ("heldout_repos_test.jsonl", "amazon_other_categories_2018.jsonl"):
        (tmp_path / name).write_text(json.dumps({"text": "held out"}) + "\n")
        with pytest.raises(KTMError, match="evaluation-only"):
            path_texts(str(tmp_path / name))


def test_gzipped_text_under_a_plain_name_is_read_as_text(tmp_path) -> None:
    import gzip

    path = tmp_path / "notes.txt"
    path.write_bytes(gzip.compress(b"plain words"))
    assert path_texts(str(path)) == ["plain words"]


def _saved_block_reader(tiny_model_dir, path, **kw) -> torch.Tensor:
    """A trained-looking block reader (non-zero LoRA and encoder) saved at ``path``; its
    logits, which a reader grown from it must give at its start."""
    block = fresh(tiny_model_dir, mlp_ratio=0.5, **kw)
    randomize_lora(block)
    for p in block.encoder.parameters():
        p.data.normal_(0, 0.05)
    block.save(str(path))
    return _logits(block.eval())


def test_init_with_context_blocks_gives_a_block_reader_context_exactly(tiny_model_dir, tmp_path,
                                                                       corpus):
    """``--init READER --context-blocks W``: the same function at the start (the new weights
    are zero), then a run trains them; a contextual checkpoint keeps its own W."""
    from ktm.cli.args import init_or_build
    from ktm.cli.main import _parser

    want = _saved_block_reader(tiny_model_dir, tmp_path / "block", k=4, inner_k=2)
    argv = ["pretrain", "--init", str(tmp_path / "block"), "--model", tiny_model_dir,
            "--context-blocks", "2", "--sources", corpus]
    ctx = init_or_build(_parser(argv).parse_args(argv))
    assert ctx.encoder.config.context_blocks == 2 and len(ctx.encoder.context_parameters()) == 2
    torch.testing.assert_close(_logits(ctx.eval()), want, atol=1e-6, rtol=1e-6)
    run = ["--max-steps", "2", "--no-progress", "--sources", corpus, "--batch-size", "2",
           "--eval-sets", "none", "--context-tokens", "24", "--target-tokens", "8",
           "--min-tokens", "8", "--context-lr", "1e-2"]
    assert main(["pretrain", "--init", str(tmp_path / "block"), "--context-blocks", "2", *run,
                 "--out-dir", str(tmp_path / "c")]) == 0
    trained = KTMModel.load(str(tmp_path / "c" / "checkpoint"))
    assert trained.encoder.config.context_blocks == 2
    assert all(p.any() for p in trained.encoder.context_parameters())
    assert main(["pretrain", "--init", str(tmp_path / "c" / "checkpoint"), "--context-blocks",
                 "1", *run, "--out-dir", str(tmp_path / "x")]) == 2


def test_init_with_pooled_queries_starts_as_the_block_reader(tiny_model_dir, tmp_path, corpus):
    """``--init READER --context-layers L --context-pool query``: a block reader gains ARC's
    pooled-query context and computes exactly what it did; a mean-pool layer reader does not
    turn into a query one."""
    from ktm.cli.args import init_or_build
    from ktm.cli.main import _parser

    want = _saved_block_reader(tiny_model_dir, tmp_path / "block", k=2)
    argv = ["pretrain", "--init", str(tmp_path / "block"), "--model", tiny_model_dir,
            "--context-layers", "1", "--context-pool", "query", "--sources", corpus]
    ctx = init_or_build(_parser(argv).parse_args(argv))
    assert ctx.encoder.states.attend is not None and len(ctx.encoder.context_parameters()) == 7
    torch.testing.assert_close(_logits(ctx.eval()), want, atol=1e-6, rtol=1e-6)
    layers = fresh(tiny_model_dir, k=2, mlp_ratio=0.5, context_layers=1)
    layers.save(str(tmp_path / "layers"))
    argv[2] = str(tmp_path / "layers")
    with pytest.raises(KTMError, match="context_pool 'query' \\(--context-pool\\) differs from "
                                       "checkpoint .*'s 'mean': only a block encoder "
                                       "\\(context_layers=0\\)"):
        init_or_build(_parser(argv).parse_args(argv))


def test_init_with_a_token_mixer_starts_as_the_block_reader_and_clips_it_apart(tiny_model_dir,
                                                                              tmp_path, corpus):
    """``--init READER --context-transformer N``: the same function at the start (the mixer's
    output projections are zero); ``--clip-context-apart`` logs the mixer's own gradient norm."""
    from ktm.cli.args import init_or_build
    from ktm.cli.main import _parser

    want = _saved_block_reader(tiny_model_dir, tmp_path / "block", k=2)
    argv = ["pretrain", "--init", str(tmp_path / "block"), "--model", tiny_model_dir,
            "--context-transformer", "1", "--sources", corpus]
    ctx = init_or_build(_parser(argv).parse_args(argv))
    assert ctx.encoder.config.context_transformer == 1
    torch.testing.assert_close(_logits(ctx.eval()), want, atol=1e-6, rtol=1e-6)
    run = ["--max-steps", "2", "--no-progress", "--sources", corpus, "--batch-size", "2",
           "--eval-sets", "none", "--context-tokens", "24", "--target-tokens", "8",
           "--min-tokens", "8", "--context-lr", "1e-2", "--clip-context-apart"]
    assert main(["pretrain", "--init", str(tmp_path / "block"), "--context-transformer", "1",
                 *run, "--out-dir", str(tmp_path / "m")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "m" / "metrics.jsonl").open()]
    steps = [r for r in rows if "grad_norm" in r]
    assert len(steps) == 2 and all(r["grad_norm_encoder_context"] > 0 for r in steps)
    trained = KTMModel.load(str(tmp_path / "m" / "checkpoint"))
    assert trained.encoder.mixer.layers[0].down.weight.any()
    # a block reader without context weights: clipping them apart is refused, nothing written
    assert main(["pretrain", "--init", str(tmp_path / "block"), *run,
                 "--out-dir", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


def test_mixed_windows_read_their_context_at_a_ratio_and_keep_other_windows(tiny_model_dir,
                                                                            corpus):
    """--mixed-share: a share of windows read at a ratio within --ratio-range (and within what
    the context allows), by an allocator of the mix; the other windows, and a run without the
    option, are the windows they were."""
    model = fresh(tiny_model_dir, k=8, inner_k=(4, 2))
    plain = small_cfg(corpus, ("lm", "ae"))
    mixed = small_cfg(corpus, ("lm", "ae"), mixed_share=0.5, ratio_range=(1.5, 6),
                      mixed_signals=("random", "even=2"))
    docs = load_docs(model.tokenizer, plain)
    a = WindowStream(docs, plain, 80, 3, 1, top_k=8)
    b = WindowStream(docs, mixed, 80, 3, 1, top_k=8)
    assert "mixed" not in a.signature and b.signature["mixed"][0] == 0.5
    read_mixed = [i for i in range(80) if "signal" in b[i].meta]
    assert 20 < len(read_mixed) < 60
    for i in range(80):
        ctx = b[i].segments[0]
        if i in read_mixed:
            assert b[i].meta["signal"] in ("random", "even")
            assert 1.0 <= ctx.ratio <= 6.0
            assert ctx.ratio <= len(ctx.ids) / -(-len(ctx.ids) // 8) + 1e-9
            assert ctx.ids == a[i].segments[0].ids and b[i].target == a[i].target
        else:
            assert b[i] == a[i]


def test_a_mixed_pretraining_run_learns_and_saves_its_surprisal_table(tiny_model_dir, corpus,
                                                                     tmp_path):
    from ktm.core.checkpoint import SURPRISAL

    model = fresh(tiny_model_dir, k=8, inner_k=(4, 2))
    cfg = small_cfg(corpus, ("lm", "ae"), mixed_share=1.0, mixed_signals=("surprisal",
                                                                          "rules"))
    batch = [WindowStream(load_docs(model.tokenizer, cfg), cfg, 8, 0, 1, top_k=8)[i]
             for i in range(8)]
    out = tmp_path / "run"
    pretrain(model, cfg, TrainConfig(out_dir=str(out), max_steps=3, batch_size=4, lr=3e-3,
                                     progress=False))
    assert (out / "checkpoint" / SURPRISAL).is_file()
    loaded = KTMModel.load(out / "checkpoint")
    assert loaded.scorer.table is not None
    assert loaded.scorer.table.unigram.sum() == model.scorer.table.unigram.sum() > 0
    with torch.no_grad():
        assert torch.isfinite(pretrain_loss(loaded, batch).loss)


def test_init_with_an_outer_level_reads_as_the_reader_at_its_own_levels(tiny_model_dir,
                                                                        tmp_path, corpus, capsys):
    """--init READER --k 8 --inner-k 4 2 on a K=4 reader of inner K 2: the same vectors at K=4
    and K=2, the same LoRA, and at K=8 the mean of two of its K=4 vectors."""
    from ktm.cli.args import init_or_build
    from ktm.cli.main import _parser

    reader = fresh(tiny_model_dir, k=4, inner_k=2)
    randomize_lora(reader)
    with torch.no_grad():
        for p in reader.encoder.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    reader.save(tmp_path / "k4")
    common = ["--init", str(tmp_path / "k4"), "--model", tiny_model_dir, "--sources", corpus,
              "--slot-weights", "--k", "8"]
    argv = ["pretrain", *common, "--inner-k", "4", "2"]
    grown = init_or_build(_parser(argv).parse_args(argv)).eval()
    reader.eval()
    assert grown.config.levels == (8, 4, 2)
    text = "The quick brown fox jumps over the lazy dog. Hello world, my name is"
    with torch.no_grad():
        for k in (4, 2):
            with merging_at(grown, k), merging_at(reader, k):
                torch.testing.assert_close(grown.compress(text).embeds,
                                           reader.compress(text).embeds)
        four = reader.compress(text).embeds
        eight = grown.compress(text).embeds
        n = four.shape[0] // 2
        torch.testing.assert_close(eight[:n], (four[0:2 * n:2] + four[1:2 * n:2]) / 2)
    bad = ["pretrain", *common, "--inner-k", "4", "--out-dir", str(tmp_path / "bad")]
    assert main(bad) == 2
    assert "(--inner-k 4 2)" in capsys.readouterr().err


def test_a_reader_learns_to_be_read_pressed(tiny_model_dir, corpus):
    """--press: the marked windows read their merged context's KV pressed, with gradients; the
    training reading equals the scoring one (the runtime's, in eval mode), and a step lowers
    the pressed loss."""
    from helpers import require_module

    from ktm.decode.press import PressConfig, pressed_as

    require_module("kvpress", "the [kvpress] extra and kvpress (the README's test command)")
    model = fresh(tiny_model_dir, k=2)
    randomize_lora(model)
    cfg = small_cfg(corpus, ("lm", "ae"), press="knorm", press_ratio=0.5, press_share=1.0)
    stream = WindowStream(load_docs(model.tokenizer, cfg), cfg, 8, 0, model.tokenizer.eos_token_id)
    batch = [stream[i] for i in range(8)]
    assert all(e.meta.get("press") for e in batch)
    press = PressConfig("knorm", 0.5)
    model.eval()
    with torch.no_grad():
        trained = pretrain_loss(model, batch, press=press)
        unpressed = pretrain_loss(model, batch)
        with pressed_as(model.runtime, press):
            scored = model([e.segments for e in batch], [e.target for e in batch])
    torch.testing.assert_close(trained.nll, scored.nll, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(trained.nll, unpressed.nll)
    model.train()
    before = pretrain_loss(model, batch, press=press)
    opt = adamw([p for _, p in trainable_parameters(model)], lr=2e-3)
    before.loss.backward()
    assert all(p.grad is not None for n, p in trainable_parameters(model) if "lora" in n)
    opt.step()
    with torch.no_grad():
        after = pretrain_loss(model, batch, press=press)
    assert after.loss.item() < before.loss.item() - 1e-3, (before.loss.item(), after.loss.item())


def test_press_settings_are_checked(corpus):
    with pytest.raises(KTMError, match="unknown press"):
        small_cfg(corpus, press="nope")
    with pytest.raises(KTMError, match="press_share"):
        small_cfg(corpus, press="knorm", press_share=1.5)


def test_chat_windows_read_merged_messages_between_plain_role_text(tiny_model_dir, corpus):
    """chat_share: a window's context read as a chat (``chat_window``): some of its oldest
    messages merged, everything after them plain; lm continues the window's text, ae repeats a
    merged message then EOS. chat_share 0 leaves every window as it was."""
    import random

    from ktm.serving.prompts import chat_prompt
    from ktm.tasks.corpus import Window
    from ktm.training.pretrain import chat_window

    model = fresh(tiny_model_dir)
    chat = (model.tokenizer.decode, lambda messages: chat_prompt(model, messages))
    ids = tuple(model.tokenizer("one two three four five six seven eight nine ten " * 8,
                                add_special_tokens=False)["input_ids"][:96])
    w = Window(ids, (7, 8, 9), "x")
    seen = set()
    for seed in range(12):
        segs, target = chat_window(w, "lm", random.Random(seed), *chat, 1)
        merged = [i for i, s in enumerate(segs) if s.compress]
        assert merged and all(not s.compress for s in segs[merged[-1] + 1:])
        assert merged == list(range(merged[0], merged[0] + 2 * len(merged), 2))  # role text
        assert "Continue the text" in segs[-1].text + segs[-2].text and target == (7, 8, 9)
        seen.add(len(merged))
        segs, target = chat_window(w, "ae", random.Random(seed), *chat, 1)
        repeated = model.tokenizer.decode(list(target[:-1])).strip()
        assert target[-1] == 1 and repeated in {s.text.strip() for s in segs if s.compress}
        assert "word for word" in "".join(s.text for s in segs if not s.compress)
    assert len(seen) > 1  # how many are merged varies
    cfg = small_cfg(corpus, ("lm", "ae"))
    docs = load_docs(model.tokenizer, cfg)
    chatty = small_cfg(corpus, ("lm", "ae"), chat_share=0.5)
    with pytest.raises(KTMError, match="chat_share > 0 and the answer objective need"):
        WindowStream(docs, chatty, 40, 3, 1)
    plain, mixed = WindowStream(docs, cfg, 40, 3, 1), WindowStream(docs, chatty, 40, 3, 1,
                                                                   chat=chat)
    flagged = [i for i in range(40) if mixed[i].meta.get("chat")]
    assert 0 < len(flagged) < 40
    assert all(mixed[i] == plain[i] for i in range(40) if i not in flagged)
    assert plain.signature != mixed.signature
    with pytest.raises(KTMError, match=r"chat_share must be in \[0, 1\], got 1.5"):
        small_cfg(corpus, chat_share=1.5)


def test_a_pretraining_step_on_chat_windows_lowers_the_loss(tiny_model_dir, corpus):
    from ktm.serving.prompts import chat_prompt

    model = fresh(tiny_model_dir)
    cfg = PretrainConfig(sources=(corpus,), objectives=("lm", "ae"), context_tokens=48,
                         target_tokens=8, ae_tokens=32, min_tokens=8, eval_sets=(),
                         chat_share=1.0)
    stream = WindowStream(load_docs(model.tokenizer, cfg), cfg, 8, 0, 1, chat=(
        model.tokenizer.decode, lambda messages: chat_prompt(model, messages)))
    batch = [stream[i] for i in range(8)]
    assert all(e.meta["chat"] for e in batch)
    assert_one_step_lowers(model, lambda: pretrain_loss(model, batch).loss)


def test_a_chat_share_without_a_chat_reading_is_refused_before_training(tiny_model_dir, corpus,
                                                                      tmp_path):
    tc = TrainConfig(out_dir=str(tmp_path / "r"), max_steps=1, batch_size=2, progress=False)
    with pytest.raises(KTMError, match=r"chat_share=0.5 and the answer objective read windows "
                                       r"as chats: expected "
                                       r"chat=functools.partial\(ktm.chat_prompt, model\)"):
        pretrain(fresh(tiny_model_dir), small_cfg(corpus, chat_share=0.5), tc)
    assert not (tmp_path / "r").exists()


def test_an_answer_window_is_distilled_on_the_base_models_own_answer(tiny_model_dir, corpus):
    """The answer objective: a chat asking about the merged context, its target the base LM's
    greedy answer to the plain chat (through the end-of-turn id, at most ANSWER_TOKENS), and a
    step on the KL to that reading lowers it; without a chat reading it is refused."""
    from ktm.core.prompt import Segment
    from ktm.serving.prompts import chat_prompt
    from ktm.training.pretrain import ANSWER_TOKENS, as_base, teacher_answers

    model = fresh(tiny_model_dir)
    cfg = PretrainConfig(sources=(corpus,), objectives=("answer",), context_tokens=160,
                         target_tokens=8, min_tokens=8, eval_sets=())
    docs = load_docs(model.tokenizer, cfg)
    with pytest.raises(KTMError, match="the answer objective need"):
        WindowStream(docs, cfg, 4, 0, 1)
    stream = WindowStream(docs, cfg, 4, 0, 1, chat=(
        model.tokenizer.decode, lambda messages: chat_prompt(model, messages)))
    batch = [stream[i] for i in range(4)]
    assert all(e.meta["objective"] == "answer" and any(s.compress for s in e.segments)
               and any(s.question for s in e.segments) for e in batch)
    answered = teacher_answers(model, batch)
    with as_base(model):
        plain = model.generate([list(e.segments) for e in batch], merge=False,
                               max_new_tokens=ANSWER_TOKENS)
    for e, a, text in zip(batch, answered, plain):
        assert a.segments == e.segments and 0 < len(a.target) <= ANSWER_TOKENS
        ended = a.target[-1] in model.eos_ids
        body = a.target[:-1] if ended else a.target
        assert ended or len(a.target) == ANSWER_TOKENS
        assert model.tokenizer.decode(list(body)).strip() == text.strip()
    assert isinstance(batch[0].segments[0], Segment)
    assert_one_step_lowers(model, lambda: pretrain_loss(model, batch).loss)


def test_answer_windows_take_their_own_longer_context(tiny_model_dir, corpus):
    """--answer-context-tokens: an answer window's document as long as a pasted one, while the
    other objectives' windows, and a stream without it, stay as they were."""
    from ktm.serving.prompts import chat_prompt

    model = fresh(tiny_model_dir)
    chat = (model.tokenizer.decode, lambda messages: chat_prompt(model, messages))
    kw = dict(sources=(corpus,), objectives=("lm", "answer"), context_tokens=32,
              target_tokens=8, min_tokens=8, eval_sets=())
    short, long_ = (PretrainConfig(**kw, answer_context_tokens=n) for n in (0, 96))
    docs = load_docs(model.tokenizer, short)
    a, b = (WindowStream(docs, c, 24, 0, 1, chat=chat) for c in (short, long_))

    def merged(e) -> int:
        return sum(len(model.tokenizer(s.text, add_special_tokens=False)["input_ids"])
                   for s in e.segments if s.compress)

    answers = [i for i in range(24) if a[i].meta["objective"] == "answer"]
    assert 0 < len(answers) < 24
    assert all(a[i] == b[i] for i in range(24) if i not in answers)
    assert max(merged(a[i]) for i in answers) <= 32 + 4  # a decoded id may split in two
    assert max(merged(b[i]) for i in answers) > 32 + 4
    assert a.signature != b.signature
    with pytest.raises(KTMError, match="answer_context_tokens must be >= 0"):
        PretrainConfig(**kw, answer_context_tokens=-1)


def test_cli_pretrain_reads_a_chat_share_of_its_windows_as_chats(tiny_model_dir, corpus,
                                                                 tmp_path):
    out = tmp_path / "chat-reader"
    code = main(["pretrain", "--model", tiny_model_dir, "--k", "2", "--sources", corpus,
                 "--objectives", "lm", "ae", "--chat-share", "1", "--context-tokens", "32",
                 "--target-tokens", "8", "--ae-tokens", "16", "--min-tokens", "8",
                 "--eval-sets", "none", "--max-steps", "2", "--batch-size", "2",
                 "--out-dir", str(out), "--no-progress"])
    assert code == 0
    assert json.loads((out / "run.json").read_text())["pretrain"]["chat_share"] == 1.0
    rows = (out / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 2 and all(json.loads(r)["loss"] > 0 for r in rows)


def test_a_chat_recall_window_asks_about_its_document_as_a_user_does(tiny_model_dir, corpus):
    """chat_share with recall: one user message, the document then a question quoting the cue,
    read through the chat template as ``ktm serve`` reads it: the document merged (at a mixed
    window's ratio), the question split off and marked; the target stays what follows the cue."""
    from ktm.serving.prompts import chat_prompt

    model = fresh(tiny_model_dir)
    chat = (model.tokenizer.decode, lambda messages: chat_prompt(model, messages))
    kw = dict(sources=(corpus,), objectives=("recall",), context_tokens=160, target_tokens=8,
              min_tokens=8, eval_sets=(), mixed_share=0.5, mixed_signals=("question",))
    cfg = PretrainConfig(chat_share=0.5, **kw)
    docs = load_docs(model.tokenizer, cfg)
    plain = WindowStream(docs, PretrainConfig(**kw), 40, 3, 1)
    chatty = WindowStream(docs, cfg, 40, 3, 1, chat=chat)
    flagged = [i for i in range(40) if chatty[i].meta.get("chat")]
    assert 0 < len(flagged) < 40
    for i in flagged:
        e, was = chatty[i], plain[i]
        assert e.target == was.target
        cue = " ".join(model.tokenizer.decode(list(was.segments[1].ids)).split())
        (question,) = [s for s in e.segments if s.question]
        assert cue in question.text and "text above" in question.text
        merged = [s for s in e.segments if s.compress]
        assert merged and {s.ratio for s in merged} == {was.segments[0].ratio}
        assert "<|im_start|>" not in "".join(s.text for s in merged)  # role text stays plain
    assert all(chatty[i] == plain[i] for i in range(40) if i not in flagged)
