"""Task distillation (``ktm train --teacher``): the loss formula, the teacher reading plain
prompts and staying frozen, a run whose loss falls, the CLI and its error paths."""

import json

import pytest
import torch
from torch import nn

from ktm import KTMError
from ktm.cli.main import main
from ktm.core.loss import target_logits
from ktm.core.prompt import Segment
from ktm.model import KTMModel
from ktm.tasks.base import Example
from ktm.training.config import TrainConfig
from ktm.training.teacher import TeacherConfig, check_teacher, distill_loss, kl_per_token
from ktm.training.train import train

BATCH = [Example(segments=(Segment("Tree: AB\n+CD\n++EF"), Segment(", Parent: CD, Answer:",
                                                                    compress=False)),
                 target=" true", label="true"),
         Example(segments=(Segment("Review: the zip broke after a week"),
                           Segment(", Label:", compress=False)), target=" negative",
                 label="negative")]


def model(tiny_model_dir, k, seed):
    torch.manual_seed(seed)
    m = KTMModel.from_base(tiny_model_dir, k=k, slot_weights=k > 1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a LoRA that changes the outputs, so student and teacher differ
        for name, p in m.peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return m


def test_loss_is_the_weighted_mix_of_ce_and_kl_to_the_plain_teacher(tiny_model_dir):
    student, teacher = model(tiny_model_dir, 2, 0), model(tiny_model_dir, 2, 1)
    prompts, targets = [e.segments for e in BATCH], [e.target for e in BATCH]
    s = target_logits(student, prompts, targets)
    plain = target_logits(teacher, prompts, targets, merge=False)
    merged = target_logits(teacher, prompts, targets)  # what a teacher must NOT read
    ce = nn.functional.cross_entropy(s.logits, s.labels, reduction="none")
    want = 0.7 * ce + 0.3 * kl_per_token(s.logits, plain.logits)
    out = distill_loss(teacher, 0.3)(student, BATCH)
    assert torch.allclose(out.loss, want.mean(), atol=1e-5)
    rows = torch.zeros(2).index_add(0, s.rows, want)
    assert torch.allclose(out.nll, rows, atol=1e-5) and out.n_tokens.tolist() == s.lengths
    wrong = 0.7 * ce + 0.3 * kl_per_token(s.logits, merged.logits)
    assert not torch.allclose(out.loss, wrong.mean(), atol=1e-3)
    assert out.parts["ce"][1] == out.parts["kl"][1] == sum(s.lengths)


def test_kl_vanishes_when_the_student_is_the_teacher(tiny_model_dir):
    a, b = model(tiny_model_dir, 1, 0), model(tiny_model_dir, 1, 0)  # K=1: merging is a no-op
    out = distill_loss(b, 1.0)(a, BATCH)
    assert out.loss.abs() < 1e-5
    assert distill_loss(model(tiny_model_dir, 1, 1), 1.0)(a, BATCH).loss > 1e-3


def test_a_distilled_run_lowers_the_loss_and_leaves_the_teacher_frozen(tiny_model_dir, tmp_path):
    student, teacher = model(tiny_model_dir, 2, 0), model(tiny_model_dir, 1, 1)
    before = {n: p.clone() for n, p in teacher.peft.named_parameters()}
    cfg = TrainConfig(out_dir=str(tmp_path / "run"), max_steps=12, batch_size=2, lr=3e-3,
                      encoder_lr=3e-3, progress=False, save_every=0)
    train(student, BATCH * 4, cfg, loss_fn=distill_loss(teacher, 0.5))
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"]
    assert rows[-1]["loss_kl"] < rows[0]["loss_kl"]
    assert all(torch.equal(p, before[n]) for n, p in teacher.peft.named_parameters())
    assert not teacher.training


def test_config_and_vocabulary_errors(tiny_model_dir, monkeypatch):
    for w in (0.0, 1.5, -1.0):
        with pytest.raises(KTMError, match=f"teacher_weight={w}: expected 0 < W <= 1"):
            TeacherConfig(teacher="x", teacher_weight=w)
    student, teacher = model(tiny_model_dir, 2, 0), model(tiny_model_dir, 1, 0)
    check_teacher(student, teacher)
    import ktm.training.teacher as teaching

    monkeypatch.setattr(teaching, "model_record", lambda m: {"vocab_size": id(m)})
    with pytest.raises(KTMError, match="teacher vocabulary has .* tokens, the student's"):
        check_teacher(student, teacher)


def test_cli_train_with_a_teacher_checkpoint(capsys, tiny_model_dir, tmp_path):
    teacher = model(tiny_model_dir, 1, 1)
    teacher.save(tmp_path / "teacher")
    base = ["train", "--model", tiny_model_dir, "--task", "tree", "--stage", "small",
            "--n-train", "8", "--n-eval", "2", "--max-steps", "2", "--batch-size", "4",
            "--no-progress", "--k", "2"]
    code = main([*base, "--out-dir", str(tmp_path / "run"), "--teacher", str(tmp_path / "teacher"),
                 "--teacher-weight", "0.25"])
    assert code == 0
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["teacher"] == {"teacher": str(tmp_path / "teacher"), "teacher_weight": 0.25}
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"loss_ce", "loss_kl"} <= set(rows[0])
    capsys.readouterr()
    for extra, match in [(["--teacher-weight", "0.5"], "--teacher-weight without --teacher"),
                         (["--teacher", str(tmp_path / "teacher"), "--compressor", "ltsc"],
                          "--teacher with --compressor ltsc"),
                         (["--teacher", str(tmp_path / "nope")], "nope")]:
        assert main([*base, "--out-dir", str(tmp_path / "bad"), *extra]) == 2
        assert match in capsys.readouterr().err
