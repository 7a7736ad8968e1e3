"""``ktm train`` as a library function: ``finetune(FinetuneConfig)`` trains the model the command
trains, and ``open_trainable`` refuses what the command refuses."""

from __future__ import annotations

import json

import pytest
import torch

from ktm.core.config import ModelSpec
from ktm.errors import KTMError
from ktm.tasks.spec import TaskSpec
from ktm.training.config import TrainConfig
from ktm.training.finetune import FinetuneConfig, finetune
from ktm.training.start import open_trainable
from ktm.training.teacher import TeacherConfig


def test_the_library_call_trains_the_command_model(tiny_model_dir, tmp_path, capsys):
    from ktm.cli.main import main
    from ktm.model import KTMModel

    assert main(["train", "--model", tiny_model_dir, "--task", "tree", "--stage", "small",
                 "--n-train", "8", "--n-eval", "2", "--max-steps", "1", "--batch-size", "4",
                 "--out-dir", str(tmp_path / "cli"), "--no-progress"]) == 0
    capsys.readouterr()
    finetune(FinetuneConfig(model=ModelSpec(settings={"model": tiny_model_dir}),
                            task=TaskSpec("tree", stage="small", n_train=8, n_eval=2),
                            train=TrainConfig(out_dir=str(tmp_path / "lib"), max_steps=1,
                                              batch_size=4, progress=False)))
    cli, lib = (dict(KTMModel.load(str(tmp_path / d / "checkpoint")).named_parameters())
                for d in ("cli", "lib"))
    assert cli.keys() == lib.keys()
    for name in cli:
        torch.testing.assert_close(cli[name], lib[name], rtol=0, atol=0)
    runs = [json.loads((tmp_path / d / "run.json").read_text()) for d in ("cli", "lib")]
    assert runs[0]["task"] == runs[1]["task"]


def test_a_question_task_trains_its_lengths_counted_in_the_models_tokens(tiny_model_dir,
                                                                         tmp_path, capsys):
    from ktm.cli.main import main

    code = tmp_path / "code"
    code.mkdir()
    (code / "mod.py").write_text("".join(f"def fn_{i}(alpha_{i}, beta_{i}):\n"
                                         f"    return alpha_{i} + beta_{i} * {i}\n\n\n"
                                         for i in range(40)))
    assert main(["train", "--model", tiny_model_dir, "--task", "codeqa",
                 "--task-option", "variant=params", "--task-option", "length=128",
                 "--task-option", f"train_source={code}", "--n-train", "2", "--n-eval", "1",
                 "--max-steps", "1", "--batch-size", "2", "--out-dir", str(tmp_path / "run"),
                 "--no-progress"]) == 0
    capsys.readouterr()
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["task"]["name"] == "codeqa" and run["n_examples"] == 2


def test_an_init_and_an_init_adapter_together_are_refused(tiny_model_dir):
    with pytest.raises(KTMError, match="give --init or --init-adapter, not both"):
        open_trainable(ModelSpec(tiny_model_dir), init_adapter=tiny_model_dir)


def test_a_teacher_with_a_baseline_or_a_weight_without_one_is_refused():
    with pytest.raises(KTMError, match="--teacher with --compressor mean_pool"):
        FinetuneConfig(compressor="mean_pool", teacher=TeacherConfig(teacher="t"))
    with pytest.raises(KTMError, match="--teacher-weight without --teacher"):
        TeacherConfig(teacher_weight=0.5)
    assert TeacherConfig(teacher="t").teacher_weight == 0.5
