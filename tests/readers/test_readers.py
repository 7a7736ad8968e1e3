"""Shipped readers: packing a run as a 16-bit reader, loading it by name, save -> load parity."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import ktm.readers as readers
from ktm import KTMError
from ktm.cli.main import main
from ktm.core.prompt import Segment
from ktm.model import KTMModel, prompt_logits

PROMPT = [Segment("Tree: AB\n+CD\n++EF"), Segment(", Parent: AB, Answer:", compress=False)]


def text_corpus(model_dir, folder) -> str:
    """The tiny model's tokenizer file as a plain-text source (enough tokens for a few windows;
    a .json source is read as records, so it goes in as .txt)."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    path = Path(folder) / "corpus.txt"
    shutil.copyfile(Path(model_dir) / "tokenizer.json", path)
    return str(path)


@pytest.fixture
def registry(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "HERE", tmp_path / "pkg")
    monkeypatch.setattr(readers, "READERS", {"tiny-k2": "tiny-k2"})
    return tmp_path / "pkg"


def test_pack_reader_then_load_by_name(tiny_model_dir, tmp_path, registry, capsys):
    run = tmp_path / "run"
    assert main(["pretrain", "--model", tiny_model_dir, "--k", "2", "--slot-weights",
                 "--sources", text_corpus(tiny_model_dir, tmp_path), "--objectives", "lm",
                 "--context-tokens", "16", "--target-tokens", "4", "--min-tokens", "8",
                 "--eval-sets", "none", "--max-steps", "2", "--batch-size", "2",
                 "--lr", "1e-2", "--out-dir", str(run), "--no-progress"]) == 0
    # resumed with a longer schedule: both starts are in the reader's record
    assert main(["pretrain", "--model", tiny_model_dir, "--k", "2", "--slot-weights",
                 "--sources", text_corpus(tiny_model_dir, tmp_path), "--objectives", "lm",
                 "--context-tokens", "16", "--target-tokens", "4", "--min-tokens", "8",
                 "--eval-sets", "none", "--max-steps", "3", "--batch-size", "2",
                 "--lr", "1e-2", "--out-dir", str(run), "--no-progress", "--resume"]) == 0
    assert main(["pack-reader", str(run), "--name", "tiny-k2"]) == 0
    assert "reader 'tiny-k2'" in capsys.readouterr().out
    info = json.loads((registry / "tiny-k2" / "reader.json").read_text())
    assert info["steps"] == 3 and info["command"].startswith("ktm pretrain")
    assert info["lineage"] == [] and info["cpu_minutes_total"] == info["cpu_minutes"]
    assert [(s["step"], "--resume" in s["command"]) for s in info["starts"]] == [(0, False),
                                                                                 (2, True)]
    enc = (registry / "tiny-k2" / "encoder.safetensors")
    from safetensors.torch import load_file

    assert {v.dtype for v in load_file(str(enc)).values()} == {torch.float16}
    trained = KTMModel.load(str(run / "checkpoint"))
    shipped = KTMModel.load("tiny-k2")
    want, got = prompt_logits(trained, PROMPT), prompt_logits(shipped, PROMPT)
    torch.testing.assert_close(got, want, atol=5e-2, rtol=1e-2)  # fp16 storage
    shipped.save(str(tmp_path / "again"))
    torch.testing.assert_close(prompt_logits(KTMModel.load(str(tmp_path / "again")), PROMPT),
                               got, atol=0, rtol=0)


def test_pack_reader_records_the_earlier_stages(tiny_model_dir, tmp_path, registry, capsys):
    flags = ["--model", tiny_model_dir, "--k", "2", "--sources",
             text_corpus(tiny_model_dir, tmp_path), "--objectives", "lm", "--context-tokens",
             "16", "--target-tokens", "4", "--min-tokens", "8", "--eval-sets", "none",
             "--batch-size", "2", "--lr", "1e-2", "--no-progress"]
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(["pretrain", *flags, "--max-steps", "2", "--out-dir", str(first)]) == 0
    assert main(["pretrain", *flags, "--max-steps", "1", "--out-dir", str(second),
                 "--init", str(first / "checkpoint")]) == 0
    assert main(["pack-reader", str(second), "--name", "tiny-k2", "--after", str(first)]) == 0
    assert "with 1 earlier stages" in capsys.readouterr().out
    info = json.loads((registry / "tiny-k2" / "reader.json").read_text())
    assert "--init" in info["command"] and info["steps"] == 1
    [stage] = info["lineage"]
    assert stage["run"] == str(first) and stage["steps"] == 2
    assert "--init" not in stage["command"] and stage["git"] == info["git"]
    assert info["cpu_minutes_total"] == pytest.approx(info["cpu_minutes"] + stage["cpu_minutes"])
    with pytest.raises(KTMError, match="not a finished ktm run"):
        readers.lineage_info([tmp_path / "nowhere"], info)


def test_pack_reader_refuses_unregistered_name_and_unfinished_run(tmp_path, registry):
    with pytest.raises(KTMError, match="not a finished ktm run"):
        readers.run_info(tmp_path)
    with pytest.raises(KTMError, match="unknown reader 'nope'"):
        readers.reader_path("nope")


def test_run_info_drops_a_metrics_line_a_crash_cut(tmp_path):
    """A run killed mid-append leaves half a last line in metrics.jsonl; ``train --resume`` and
    ``read_metrics`` drop it, but pack-reader's run info failed on it ("not a finished run")."""
    (tmp_path / "run.json").write_text(json.dumps({"command": "ktm pretrain", "config": {}}))
    rows = [{"step": 1, "loss": 2.0, "cpu_s": 60.0}, {"step": 2, "loss": 1.5, "cpu_s": 120.0},
            {"step": 2, "cpu_s": 120.0, "eval": {"readability": 0.5}}]
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "metrics.jsonl").write_text(lines + '{"step": 3, "lo')
    info = readers.run_info(tmp_path)
    assert (info["steps"], info["cpu_minutes"], info["readability"]) == (2, 2.0,
                                                                         {"readability": 0.5})
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "lo\n' + lines)  # not a crash's cut
    with pytest.raises(KTMError, match="line 1 is not JSON"):
        readers.run_info(tmp_path)


def tiny_pretrain(model_dir, run, *flags) -> int:
    """``ktm pretrain`` of a K=2 reader on the tiny model's own tokenizer file (as text); its
    exit code."""
    return main(["pretrain", "--model", model_dir, "--k", "2", "--sources",
                 text_corpus(model_dir, Path(run).parent), "--objectives", "lm", "--context-tokens",
                 "16", "--target-tokens", "4", "--min-tokens", "8", "--eval-sets", "none",
                 "--batch-size", "2", "--out-dir", str(run), "--no-progress", *flags])


def test_pack_reader_names_a_corrupt_source_not_a_failed_write(tiny_model_dir, tmp_path,
                                                               registry, capsys):
    run = tmp_path / "run"
    assert tiny_pretrain(tiny_model_dir, run, "--max-steps", "1") == 0
    weights = run / "checkpoint" / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a truncated copy
    capsys.readouterr()
    assert main(["pack-reader", str(run), "--name", "tiny-k2"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {str(run / 'checkpoint')!r} is incomplete or corrupt" in err, err
    assert not registry.exists() or list(registry.iterdir()) == []


def test_pack_reader_carries_the_surprisal_table_and_names_a_corrupt_one(tiny_model_dir,
                                                                          tmp_path, registry,
                                                                          capsys):
    from ktm.core.checkpoint import SURPRISAL
    from ktm.core.surprisal import SurprisalTable

    run = tmp_path / "run"
    assert tiny_pretrain(tiny_model_dir, run, "--max-steps", "1") == 0
    vocab = len(KTMModel.load(str(run / "checkpoint")).tokenizer)
    table = SurprisalTable.count([[1, 2, 3, 2, 3], [4, 2, 3]], vocab)
    table.save(run / "checkpoint" / SURPRISAL)
    assert main(["pack-reader", str(run), "--name", "tiny-k2"]) == 0
    packed = SurprisalTable.load(registry / "tiny-k2" / SURPRISAL)
    assert torch.equal(packed.unigram, table.unigram) and torch.equal(packed.bigram, table.bigram)
    assert KTMModel.load("tiny-k2").scorer("surprisal", [1, 2, 3]) == table.scores([1, 2, 3])

    (run / "checkpoint" / SURPRISAL).write_bytes(b"not safetensors")
    capsys.readouterr()
    assert main(["pack-reader", str(run), "--name", "tiny-k2"]) == 2
    assert f"cannot read surprisal table {str(run / 'checkpoint' / SURPRISAL)!r}" in \
        capsys.readouterr().err
    assert SurprisalTable.load(registry / "tiny-k2" / SURPRISAL).unigram.sum() == \
        table.unigram.sum()  # the packed reader is left as it was


def test_pack_reader_refuses_a_run_of_another_model_or_k(tiny_model_dir, tmp_path, monkeypatch,
                                                        capsys):
    """A run packed under a reader name of another K, or of the embedded model while it trained
    a local folder, would replace the shipped reader with one its users cannot load."""
    monkeypatch.setattr(readers, "HERE", tmp_path / "pkg")
    monkeypatch.setattr(readers, "READERS", {"tiny-k4": "tiny-k4",
                                             "smollm2-135m-k2": "smollm2-135m-k2"})
    run = tmp_path / "run"
    assert tiny_pretrain(tiny_model_dir, run, "--max-steps", "1") == 0
    capsys.readouterr()
    assert main(["pack-reader", str(run), "--name", "tiny-k4"]) == 2
    assert "says K=4, but the run has K=2" in capsys.readouterr().err
    assert main(["pack-reader", str(run), "--name", "smollm2-135m-k2"]) == 2
    assert "is for the embedded model 'smollm2-135m'" in capsys.readouterr().err
    assert not (tmp_path / "pkg").exists()


def test_registered_but_missing_reader_says_how_to_train_it(registry):
    with pytest.raises(KTMError, match="train_readers.sh"):
        KTMModel.load("tiny-k2")


def test_pack_reader_refuses_a_run_killed_before_its_last_step(tiny_model_dir, tmp_path,
                                                                registry, monkeypatch, capsys):

    import ktm.training.train as train_module
    real, calls = train_module.train_step, []

    def dies_at_step_3(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the run is killed after its step-2 checkpoint
        return real(*a, **kw)

    monkeypatch.setattr(train_module, "train_step", dies_at_step_3)
    run = tmp_path / "run"
    assert tiny_pretrain(tiny_model_dir, run, "--max-steps", "4", "--save-every", "2") == 130
    capsys.readouterr()
    # it was packed as a finished reader of 2 steps
    assert main(["pack-reader", str(run), "--name", "tiny-k2"]) == 2
    assert "is unfinished: its checkpoint is at step 2 of 4" in capsys.readouterr().err
    assert not (registry / "tiny-k2").exists()


def test_demo_auto_finds_the_reader_of_a_local_copy_of_its_base_by_content(
        tiny_model_dir, tiny_bos_model_dir, tmp_path, registry, capsys):
    """``--reader auto`` matched readers by model name only: a local folder holding a copy of
    the reader's base model fell back to mean pooling. Now the base is known by its sizes and
    tokenizer; another model (same sizes, another tokenizer) never gets the reader."""
    import shutil

    run = tmp_path / "run"
    assert tiny_pretrain(tiny_model_dir, run, "--max-steps", "1") == 0
    assert main(["pack-reader", str(run), "--name", "tiny-k2"]) == 0
    copy = str(shutil.copytree(tiny_model_dir, tmp_path / "copy"))
    flags = ["--k", "2", "--stage", "small", "--steps", "1", "--batch-size", "2", "--n-eval", "2"]
    capsys.readouterr()
    assert main(["demo", "--model", copy, *flags, "--out-dir", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "loading reader tiny-k2 (K=2)" in out and "| reader tiny-k2" in out
    assert main(["demo", "--model", tiny_bos_model_dir, *flags, "--out-dir",
                 str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert f"no shipped reader fits {tiny_bos_model_dir} at K=2" in out
    assert "pass --reader NAME" in out and "| untrained (mean pooling)" in out
    assert readers.find_reader(copy, 2) == "tiny-k2"  # the API the demo uses
    assert readers.find_reader(copy, 4) is None
    assert readers.find_reader(tiny_bos_model_dir, 2) is None


def test_auto_falls_back_to_a_recursive_readers_inner_k(tiny_model_dir, tmp_path, registry,
                                                        monkeypatch, capsys):
    """``--reader auto --k 2`` found no reader where only a recursive K=4 one (inner K=2)
    fits the base, though that one loads at K=2; an exact K is still preferred."""
    import shutil

    torch.manual_seed(0)
    KTMModel.from_base(tiny_model_dir, k=4, inner_k=2).save(str(registry / "a-k4r"))
    monkeypatch.setattr(readers, "READERS", {"a-k4r": "a-k4r", "tiny-k2": "tiny-k2"})
    copy = str(shutil.copytree(tiny_model_dir, tmp_path / "copy"))
    assert readers.find_reader(copy, 2) == "a-k4r"
    assert readers.find_reader(copy, 4) == "a-k4r"
    assert readers.find_reader(copy, 3) is None
    assert main(["demo", "--model", copy, "--k", "2", "--stage", "small", "--steps", "1",
                 "--batch-size", "2", "--n-eval", "2", "--out-dir", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "reader a-k4r (K=4) is recursive, and read at its inner K=2" in out
    assert "loading reader a-k4r (K=2)" in out
    KTMModel.from_base(tiny_model_dir, k=2).save(str(registry / "tiny-k2"))
    assert readers.find_reader(copy, 2) == "tiny-k2"  # an exact K always wins
    assert readers.find_reader(copy, 1) is None  # a plain reader has no inner level


def test_auto_falls_back_to_the_shipped_recursive_reader_by_name(monkeypatch):
    monkeypatch.setattr(readers, "READERS", {"smollm2-135m-k4": "smollm2-135m-k4"})
    assert readers.find_reader("smollm2-135m", 2) == "smollm2-135m-k4"
    assert readers.find_reader("smollm2-135m", 3) is None


def test_a_packed_reader_may_carry_a_default_layout(tiny_model_dir, tmp_path, monkeypatch):
    """``ktm pack-reader --ratio R --allocator A``: the reader reads at R with A unless told
    otherwise; a field that is not a layout setting is refused."""
    from helpers import fresh_model

    import ktm.readers as readers
    from ktm.errors import KTMError
    from ktm.model import KTMModel

    monkeypatch.setattr(readers, "HERE", tmp_path / "pkg")
    monkeypatch.setattr(readers, "READERS", {"tiny-k4": "tiny-k4"})
    (tmp_path / "pkg").mkdir()
    fresh_model(tiny_model_dir, k=4).save(tmp_path / "run")
    readers.pack_reader(tmp_path / "run", "tiny-k4", {"command": "x"},
                        {"ratio": 4.0, "allocator": "question"})
    model = KTMModel.load("tiny-k4")
    assert (model.config.ratio, model.config.allocator) == (4.0, "question")
    assert readers.reader_info("tiny-k4")["layout"] == {"ratio": 4.0, "allocator": "question"}
    with pytest.raises(KTMError, match="default layout takes ratio, allocator, got \\['k'\\]"):
        readers.pack_reader(tmp_path / "run", "tiny-k4", {}, {"k": 2})
