"""``ktm eval`` as a library function: ``ktm.evaluation.runner.run(EvalConfig)`` gives the row the
command gives, and the model spec it reads is checked as the command's flags are."""

from __future__ import annotations

import json

import pytest

from ktm.core.config import ModelSpec
from ktm.errors import KTMError
from ktm.evaluation.runner import EvalConfig, run
from ktm.tasks.spec import TaskSpec

VOLATILE = ("eval_wall_s", "wall_s", "compression_s", "compression_ms_per_1k_tokens",
            "prefill_s", "command", "versions", "git")


def _stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in VOLATILE}


def test_the_library_call_gives_the_command_row(tiny_model_dir, tmp_path, capsys):
    from ktm.cli.main import main
    from ktm.model import KTMModel

    ckpt = tmp_path / "ck"
    KTMModel.from_base(tiny_model_dir, k=2, use_mlp=False).save(str(ckpt))
    out = tmp_path / "cli.json"
    assert main(["eval", "--checkpoint", str(ckpt), "--task", "tree", "--stage", "small",
                 "--n-eval", "4", "--task-option", "positive_fraction=0.25", "--json",
                 str(out)]) == 0
    capsys.readouterr()
    row = run(EvalConfig(model=ModelSpec(str(ckpt)),
                         task=TaskSpec("tree", stage="small", n_eval=4),
                         task_options={"positive_fraction": 0.25}), progress=False)
    assert _stable(row) == _stable(json.loads(out.read_text()))
    assert row["k"] == 2 and row["n"] == 4


def test_a_setting_that_contradicts_the_checkpoint_is_refused(tiny_model_dir, tmp_path):
    from ktm.model import KTMModel, open_model

    ckpt = tmp_path / "ck"
    KTMModel.from_base(tiny_model_dir, k=2, use_mlp=False).save(str(ckpt))
    with pytest.raises(KTMError, match=r"--mlp True contradicts checkpoint .*use_mlp=False|"
                                       r"--mlp True contradicts checkpoint .*mlp=False"):
        open_model(ModelSpec(str(ckpt), {"mlp": True}))
    # how it is read (base folder, dtype, layout) may differ from how it was saved
    assert open_model(ModelSpec(str(ckpt), {"plain_suffix": 3})).config.plain_suffix == 3


def test_an_unknown_model_setting_is_named():
    with pytest.raises(KTMError, match=r"unknown model settings \['lora_rank'\].*lora_r"):
        ModelSpec(None, {"lora_rank": 8})


def test_an_optional_config_left_at_its_defaults_stays_none():
    from ktm.model import RuntimeSpec
    from ktm.util.flags import from_flags

    assert from_flags(RuntimeSpec, {"llamacpp_threads": None, "backend": "torch"}) \
        == RuntimeSpec()
    spec = from_flags(RuntimeSpec, {"llamacpp_threads": 3, "backend": "llamacpp"})
    assert spec.llamacpp.threads == 3 and spec.vllm is None
