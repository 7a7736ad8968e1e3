"""The llama.cpp commands end to end on the tiny model: export, then generate and eval on the
backend; a refused export exits non-zero with one line and writes nothing."""

import json

import pytest
from helpers import fresh_model, perturb

from ktm.cli.main import main

pytestmark = pytest.mark.llamacpp


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def checkpoint(tiny_model_dir, tmp_path):
    model = fresh_model(tiny_model_dir, k=2)
    perturb(model)
    model.save(tmp_path / "ckpt")
    return str(tmp_path / "ckpt")


def test_export_then_generate_on_llama_cpp_equals_torch(capsys, checkpoint, tmp_path,
                                                        monkeypatch):
    monkeypatch.setenv("KTM_CACHE", str(tmp_path / "cache"))
    out = str(tmp_path / "gguf")
    code, text, err = run(capsys, "export", "--format", "gguf", out, "--model", checkpoint)
    assert code == 0, err
    assert "ktm generate --checkpoint" in text and (tmp_path / "gguf" / "adapter.gguf").is_file()
    ask = ("generate", "--checkpoint", out, "--prompt", "Tree: AB\n+CD\n++EF", "--plain",
           " Answer:", "--max-new-tokens", "12", "--no-stop-at-eos")
    code, on_torch, err = run(capsys, *ask)
    assert code == 0, err
    code, on_llama, err = run(capsys, *ask, "--backend", "llamacpp", "--llamacpp-kv-type", "f32")
    assert code == 0, err
    assert on_llama == on_torch
    assert not (tmp_path / "cache" / "gguf").exists()  # the export folder served itself


def test_eval_on_llama_cpp_records_its_backend(capsys, checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("KTM_CACHE", str(tmp_path / "cache"))
    code, _, err = run(capsys, "eval", "--checkpoint", checkpoint, "--task", "tree", "--stage",
                       "small", "--n-eval", "4", "--backend", "llamacpp", "--json",
                       str(tmp_path / "r.json"))
    assert code == 0, err
    backend = json.loads((tmp_path / "r.json").read_text())["config"]["eval"]["backend"]
    assert backend["name"] == "llamacpp" and backend["model_gguf"].endswith("model.gguf")
    assert backend["adapter_gguf"] is None and backend["folded_types"] == ["F32"]


def test_a_refused_export_exits_non_zero_with_one_line_and_writes_nothing(capsys,
                                                                         tiny_model_dir,
                                                                         tmp_path):
    model = fresh_model(tiny_model_dir, k=2, spread_positions=True)
    model.save(tmp_path / "spread")
    out = tmp_path / "gguf"
    code, _, err = run(capsys, "export", "--format", "gguf", str(out), "--model",
                       str(tmp_path / "spread"))
    assert code != 0
    assert "consecutive positions" in err and "smollm2-135m-k4-seq" in err
    assert not out.exists()
    code, _, err = run(capsys, "export", "--format", "vllm", str(out), "--model",
                       str(tmp_path / "spread"), "--write-base")
    assert code != 0 and "options of --format gguf" in err and not out.exists()
    code, _, err = run(capsys, "export", "--format", "gguf", str(out), "--model",
                       str(tmp_path / "spread"), "--fold-type", "Q3_K")
    assert code != 0 and "fold type must be auto, same or one of" in err and not out.exists()
