import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from helpers import TEXT, opens_under, perturb

from ktm import KTMError
from ktm.core.checkpoint import load_weights_into, model_record
from ktm.model import KTMModel, prompt_logits


@pytest.fixture
def saved(ktm_model, tmp_path):
    perturb(ktm_model, seed=1)
    path = tmp_path / "ckpt"
    ktm_model.save(str(path))
    return ktm_model, path


def test_save_load_round_trip_gives_identical_logits(saved):
    model, path = saved
    loaded = KTMModel.load(str(path))
    assert loaded.k == model.k
    assert not loaded.training
    torch.testing.assert_close(prompt_logits(loaded, TEXT), prompt_logits(model, TEXT),
                               atol=0, rtol=0)
    assert loaded.generate(TEXT, max_new_tokens=6) == model.generate(TEXT, max_new_tokens=6)


def test_saved_files_are_safetensors_and_json(saved):
    _, path = saved
    names = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert "ktm_config.json" in names and "encoder.safetensors" in names
    assert "adapter/adapter_model.safetensors" in names
    assert not any(n.endswith((".bin", ".pt", ".pkl")) for n in names)
    cfg = json.loads((path / "ktm_config.json").read_text())
    assert cfg["format_version"] == 2 and cfg["config"]["k"] == 4 and cfg["hidden_size"] == 64
    assert cfg["versions"]["torch"].startswith("2.")


def test_the_adapter_records_its_base_by_name_not_a_local_path(saved):
    model, path = saved
    adapter = json.loads((path / "adapter" / "adapter_config.json").read_text())
    assert "/" not in adapter["base_model_name_or_path"]
    assert adapter["base_model_name_or_path"] == os.path.basename(model.config.base_model)
    from ktm.readers import READERS, resolve_checkpoint

    for name in READERS:  # the shipped readers too
        shipped = resolve_checkpoint(name) / "adapter" / "adapter_config.json"
        assert json.loads(shipped.read_text())["base_model_name_or_path"] == "smollm2-135m"


def test_load_refuses_another_k(saved):
    _, path = saved
    with pytest.raises(KTMError, match="trained with K=4, but K=2 was requested"):
        KTMModel.load(str(path), k=2)


def test_load_refuses_encoder_weights_of_another_k(saved, tiny_model_dir, tmp_path):
    _, path = saved
    other = KTMModel.from_base(tiny_model_dir, k=2)
    other_path = tmp_path / "k2"
    other.save(str(other_path))
    (path / "encoder.safetensors").write_bytes((other_path / "encoder.safetensors").read_bytes())
    with pytest.raises(KTMError, match="do not fit K=4"):
        KTMModel.load(str(path))


def test_resume_refuses_checkpoint_of_another_k_or_size(saved, tiny_model_dir):
    _, path = saved
    other = KTMModel.from_base(tiny_model_dir, k=3)
    with pytest.raises(KTMError, match=r"saved with K=4, but this run has K=3"):
        load_weights_into(other, path)
    cfg = json.loads((path / "ktm_config.json").read_text())
    cfg["hidden_size"] = 128
    (path / "ktm_config.json").write_text(json.dumps(cfg))
    with pytest.raises(KTMError, match="hidden_size=128"):
        KTMModel.load(str(path))


@pytest.mark.parametrize("victim,match", [
    ("encoder.safetensors", "encoder file .* is missing or corrupt"),
    ("ktm_config.json", "config .* is corrupt"),
    ("adapter/adapter_model.safetensors", "adapter .* is missing or corrupt"),
])
def test_corrupt_checkpoint_file_is_a_clear_error(saved, victim, match):
    _, path = saved
    (path / victim).write_bytes(b"\x00garbage\xff" * 10)
    with pytest.raises(KTMError, match=match):
        KTMModel.load(str(path))


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(KTMError, match="is not a ktm checkpoint"):
        KTMModel.load(str(tmp_path))


def test_overwriting_a_checkpoint_leaves_no_temp_folders(saved):
    model, path = saved
    model.save(str(path))
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt"]


def test_save_never_replaces_what_is_not_a_checkpoint(saved, tmp_path):
    model, path = saved
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "notes.txt").write_text("mine")
    for target in (tmp_path / "project", path / "ktm_config.json"):
        before = sorted(p.name for p in target.parent.iterdir())
        with pytest.raises(KTMError, match="exists and is not a ktm checkpoint"):
            model.save(str(target))
        assert sorted(p.name for p in target.parent.iterdir()) == before
    assert (tmp_path / "project" / "notes.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    model.save(str(tmp_path / "empty"))  # an empty folder is fine
    KTMModel.load(str(tmp_path / "empty"))


def test_a_format_1_checkpoint_still_loads(saved):
    """Checkpoints written before KTMConfig spread it over top-level keys; fields added later
    (slot weights, the MLP gate) were absent and mean off."""
    model, path = saved
    cfg = json.loads((path / "ktm_config.json").read_text())
    c = cfg["config"]
    v1 = {"format": "ktm", "format_version": 1, "base_model": c["base_model"],
          "encoder": {"hidden_size": 64, "k": c["k"], "mlp_ratio": c["mlp_ratio"],
                      "use_mlp": c["use_mlp"]},
          "lora": {**c["lora"], "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                    "gate_proj", "up_proj", "down_proj"]},
          "add_eos": True, "hidden_size": 64, "vocab_size": cfg["vocab_size"],
          "model_type": "llama", "versions": cfg["versions"]}
    (path / "ktm_config.json").write_text(json.dumps(v1))
    loaded = KTMModel.load(str(path))
    assert loaded.k == 4 and loaded.config.lora.r == model.config.lora.r
    torch.testing.assert_close(prompt_logits(loaded, TEXT), prompt_logits(model, TEXT),
                               atol=0, rtol=0)
    load_weights_into(model, path)  # and resuming from it is accepted


@pytest.mark.parametrize("victim", ["encoder.safetensors", "adapter/adapter_model.safetensors"])
def test_truncated_weights_are_a_clear_error(saved, victim):
    _, path = saved
    data = (path / victim).read_bytes()
    (path / victim).write_bytes(data[: len(data) // 2])
    with pytest.raises(KTMError, match="missing or corrupt"):
        KTMModel.load(str(path))


def test_a_lora_size_mismatch_is_a_clear_error(saved, tiny_model_dir, tmp_path):
    from ktm.core.config import LoraSettings

    model, path = saved
    wide = KTMModel.from_base(tiny_model_dir, k=4, lora=LoraSettings(r=8))
    wide.save(str(tmp_path / "r8"))
    adapter = "adapter/adapter_model.safetensors"
    (path / adapter).write_bytes((tmp_path / "r8" / adapter).read_bytes())
    with pytest.raises(KTMError, match="adapter .* does not fit"):
        KTMModel.load(str(path))
    with pytest.raises(KTMError, match="adapter .* does not fit"):
        load_weights_into(model, path)


@pytest.mark.parametrize("field,value,match", [
    ("alpha", 32, "lora.alpha=16, but this run has lora.alpha=32"),
    ("dropout", 0.1, "lora.dropout=0.05, but this run has lora.dropout=0.1"),
    ("target_modules", ("q_proj", "v_proj"), "lora.target_modules="),
])
def test_resume_refuses_other_lora_settings(saved, tiny_model_dir, field, value, match):
    from ktm.core.config import LoraSettings

    _, path = saved
    other = KTMModel.from_base(tiny_model_dir, k=4, lora=LoraSettings(**{field: value}))
    with pytest.raises(KTMError, match=match):
        load_weights_into(other, path)


@pytest.mark.parametrize("option,value", [("spread_positions", True), ("plain_prefix", 2),
                                          ("plain_suffix", 3), ("align_lines", True)])
def test_resume_refuses_another_prompt_layout(saved, tiny_model_dir, option, value):
    _, path = saved
    other = KTMModel.from_base(tiny_model_dir, k=4, **{option: value})
    with pytest.raises(KTMError, match=f"{option}="):
        load_weights_into(other, path)


def test_a_base_model_given_by_a_relative_path_loads_from_any_folder(tiny_model_dir, tmp_path,
                                                                      monkeypatch):
    """The checkpoint records where its base model is: a relative --model path is made absolute,
    so ``--init``, ``ktm eval`` or a packed reader find it from another working directory."""
    from pathlib import Path

    base = Path(tiny_model_dir)
    monkeypatch.chdir(base.parent)
    torch.manual_seed(0)
    model = KTMModel.from_base(base.name, k=4)
    perturb(model, seed=1)
    assert model.config.base_model == str(base.resolve())
    model.save(str(tmp_path / "ck"))
    monkeypatch.chdir(tmp_path)
    loaded = KTMModel.load(tmp_path / "ck")
    torch.testing.assert_close(prompt_logits(loaded, TEXT), prompt_logits(model, TEXT),
                               atol=0, rtol=0)


def test_a_checkpoint_whose_base_model_is_gone_says_which_and_how_to_point_elsewhere(
        saved, tiny_model_dir, tmp_path):
    model, path = saved
    cfg = json.loads((path / "ktm_config.json").read_text())
    cfg["config"]["base_model"] = str(tmp_path / "moved-away")
    (path / "ktm_config.json").write_text(json.dumps(cfg))
    with pytest.raises(KTMError, match=rf"checkpoint '{path}' was trained on base model "
                                       rf"'{tmp_path / 'moved-away'}', which cannot be loaded "
                                       r"here \(unknown model .*\); expected that model, or "
                                       r"base= \(--model\) naming a local copy of it"):
        KTMModel.load(path)
    loaded = KTMModel.load(path, base=tiny_model_dir)
    torch.testing.assert_close(prompt_logits(loaded, TEXT), prompt_logits(model, TEXT),
                               atol=0, rtol=0)


def test_an_adapter_of_another_size_names_both_base_models(saved, tiny_model_dir):
    """``--init-adapter CKPT`` without ``--model`` builds the default base model: the error says
    which base model each side is, not only the two sizes."""
    from ktm.core.checkpoint import load_adapter_into

    model, path = saved
    cfg = json.loads((path / "ktm_config.json").read_text())
    cfg["hidden_size"], cfg["config"]["base_model"] = 128, "/elsewhere/wide-model"
    (path / "ktm_config.json").write_text(json.dumps(cfg))
    with pytest.raises(KTMError, match=rf"has hidden_size=128 \(base model '/elsewhere/wide-model'"
                                       rf"\), but the model has hidden_size=64 \(base model "
                                       rf"'{model.config.base_model}'\): expected the "
                                       r"checkpoint's base model \(--model\)"):
        load_adapter_into(model, path)


def test_building_and_loading_a_model_print_no_gradient_checkpointing_warning(saved,
                                                                              tiny_model_dir):
    """PEFT reads transformers' deprecated ``is_gradient_checkpointing`` of every model it wraps:
    a user's script printed its FutureWarning once per model built or loaded."""
    import warnings

    _, path = saved
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # over pytest's own filters
        KTMModel.from_base(tiny_model_dir, k=4)
        KTMModel.load(path)
        KTMModel.load(path, trainable=True)
    assert not [w for w in seen if "is_gradient_checkpointing" in str(w.message)]


def test_a_base_model_of_the_same_sizes_with_another_tokenizer_is_refused(
        saved, tiny_model_dir, tiny_bos_model_dir, tmp_path):
    """``--checkpoint X --model Y``, Y as wide and with as many tokens as X's base but another
    vocabulary: it loaded and read every id as another token. A copy of the base still loads;
    a checkpoint from before the record loads with a warning."""
    import shutil
    import warnings

    from ktm.core.checkpoint import load_adapter_into

    model, path = saved
    other = KTMModel.from_base(tiny_bos_model_dir, k=4)
    assert model_record(other)["vocab_size"] == model_record(model)["vocab_size"]
    with pytest.raises(KTMError, match=rf"checkpoint '{path}' was trained on base model "
                                       rf"'{model.config.base_model}', but base model "
                                       rf"'{other.config.base_model}' is another model of the "
                                       r"same sizes \(tokenizer vocabulary 400 tokens, sha256 "):
        KTMModel.load(path, base=tiny_bos_model_dir)
    with pytest.raises(KTMError, match="is another model of the same sizes"):
        load_adapter_into(other, path)  # --init-adapter
    copy = shutil.copytree(tiny_model_dir, tmp_path / "copy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = KTMModel.load(path, base=str(copy))
    torch.testing.assert_close(prompt_logits(loaded, TEXT), prompt_logits(model, TEXT),
                               atol=0, rtol=0)
    cfg = json.loads((path / "ktm_config.json").read_text())
    del cfg["base_identity"]
    (path / "ktm_config.json").write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match="predates the record of its base model's identity"):
        KTMModel.load(path, base=tiny_bos_model_dir)


@pytest.mark.slow  # starts a Python process
def test_a_save_removes_the_temp_folders_of_killed_saves_only(ktm_model, tmp_path):
    """A save killed midway leaves its temp folder (a whole checkpoint or exported LM); the
    next save to the same place removes it, but never one a live process is writing."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    host = socket.gethostname()
    left = [f".ckpt.tmp-{dead}@{host}-abcd1234", f".ckpt.tmp-{os.getppid()}@{host}-live0000",
            f".ckpt.tmp-{dead}@another-host-zz99zz99"]
    for name in left:
        (tmp_path / name).mkdir()
    ktm_model.save(str(tmp_path / "ckpt"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", *left[1:]])



def test_a_load_reads_each_checkpoint_file_once(saved):
    """``KTMModel.load`` reads the checkpoint's records once (``Checkpoint.open``) and each
    weight file once: no file of the folder is opened twice."""
    model, path = saved
    with opens_under(path) as counts:
        loaded = KTMModel.load(str(path))
    assert {"ktm_config.json", "encoder.safetensors", "adapter/adapter_config.json",
            "adapter/adapter_model.safetensors"} <= set(counts), counts
    assert max(counts.values()) == 1, counts
    torch.testing.assert_close(prompt_logits(loaded, TEXT), prompt_logits(model, TEXT),
                               atol=0, rtol=0)
