"""A baseline's checkpoint records its compressor (compressor.json); eval, generate and serve read
the checkpoint with it, refuse a contradicting one, and old checkpoints read as before."""

import json
import re
from pathlib import Path

import pytest

from ktm.cli.main import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def train_baseline(capsys, model_dir, out_dir, method, *options) -> str:
    opts = [a for o in options for a in ("--compressor-option", o)]
    code, _, err = run(capsys, "train", "--model", model_dir, "--task", "tree", "--stage",
                       "small", "--n-train", "8", "--n-eval", "2", "--max-steps", "1",
                       "--batch-size", "2", "--out-dir", str(out_dir), "--no-progress",
                       "--compressor", method, *opts)
    assert code == 0, err
    return str(out_dir / "checkpoint")


@pytest.fixture(scope="module")
def sc_checkpoint(tiny_model_dir, tmp_path_factory) -> str:
    """A checkpoint trained with Selective Context at ratio 0.4 (one step)."""
    out_dir = tmp_path_factory.mktemp("sc")
    code = main(["train", "--model", tiny_model_dir, "--task", "tree", "--stage", "small",
                 "--n-train", "8", "--n-eval", "2", "--max-steps", "1", "--batch-size", "2",
                 "--out-dir", str(out_dir), "--no-progress",
                 "--compressor", "selective_context", "--compressor-option", "ratio=0.4"])
    assert code == 0
    return str(out_dir / "checkpoint")


def eval_row(capsys, ckpt, tmp_path, *flags):
    out = tmp_path / "row.json"
    code, _, err = run(capsys, "eval", "--checkpoint", ckpt, "--task", "tree", "--stage",
                       "small", "--n-train", "8", "--n-eval", "4", "--json", str(out), *flags)
    return code, err, (json.loads(out.read_text()) if out.exists() else None)


def test_a_baseline_checkpoint_records_its_compressor(sc_checkpoint):
    record = json.loads((Path(sc_checkpoint) / "compressor.json").read_text())
    assert record == {"name": "selective_context", "options": {"ratio": 0.4}}


def test_eval_reads_a_baseline_checkpoint_with_its_recorded_compressor(capsys, sc_checkpoint,
                                                                       tmp_path):
    # it was scored on plain prompts and its row said "uncompressed"
    code, err, row = eval_row(capsys, sc_checkpoint, tmp_path)
    assert code == 0, err
    assert row["method"] == "selective_context" and row["length_reduction"] > 0.0
    assert row["config"]["compressor"]["name"] == "selective_context"
    assert row["config"]["compressor"]["options"] == {"ratio": 0.4, "unit": "word"}


@pytest.mark.parametrize("flags,names", [
    (["--compressor", "llmlingua"], ["--compressor llmlingua", "--compressor selective_context"]),
    (["--compressor-option", "ratio=0.2"], ["ratio=0.2", "ratio=0.4"]),
    (["--compressor", "selective_context", "--compressor-option", "unit=token"],
     ["unit='token'", "unit='word'"]),
])
def test_eval_refuses_a_compressor_that_contradicts_the_checkpoint(capsys, sc_checkpoint,
                                                                   tmp_path, flags, names):
    code, err, row = eval_row(capsys, sc_checkpoint, tmp_path, *flags)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert all(n in err for n in names) and "compressor.json" in err
    assert row is None


def test_eval_agrees_with_the_recorded_compressor_given_again(capsys, sc_checkpoint, tmp_path):
    code, err, row = eval_row(capsys, sc_checkpoint, tmp_path, "--compressor",
                              "selective_context", "--compressor-option", "ratio=0.4")
    assert code == 0, err
    assert row["config"]["compressor"]["options"]["ratio"] == 0.4


def test_generate_applies_the_recorded_compressor(capsys, sc_checkpoint):
    # it read the plain prompt without saying so
    code, out, err = run(capsys, "generate", "--checkpoint", sc_checkpoint, "--prompt",
                         "Tree: AB\n+CD\n++EF\n+GH\n++IJ", "--plain", ", Parent: AB, Answer: ",
                         "--max-new-tokens", "2")
    assert code == 0, err
    m = re.search(r"prompt tokens (\d+) -> (\d+) \(selective_context: (\d+) tokens rewritten to "
                  r"(\d+)\)", err)
    assert m, err
    before, _, again, after = map(int, m.groups())
    assert before == again and after < before


def test_generate_refuses_a_contradicting_compressor(capsys, sc_checkpoint):
    code, _, err = run(capsys, "generate", "--checkpoint", sc_checkpoint, "--prompt", "Tree: AB",
                       "--compressor", "mean_pool")
    assert code == 2 and "--compressor mean_pool" in err and "selective_context" in err


def test_ltsc_checkpoint_eval_and_generate_use_it_old_ones_are_refused(capsys, monkeypatch,
                                                                       tiny_model_dir, tmp_path):
    from ktm.serving.app import Server

    monkeypatch.setattr(Server, "run", lambda self, **kw: None)  # never served for long
    ckpt = train_baseline(capsys, tiny_model_dir, tmp_path / "r", "ltsc", "max_meta_tokens=8")
    code, err, row = eval_row(capsys, ckpt, tmp_path)
    assert code == 0, err
    assert row["method"] == "ltsc"
    assert row["config"]["compressor"]["options"]["max_meta_tokens"] == 8
    prompt = ["--prompt", "Tree: AB\n+CD\n++EF, Task: Parent/Child Relationship, Parent: AB",
              "--max-new-tokens", "1"]
    code, _, err = run(capsys, "generate", "--checkpoint", ckpt, *prompt)
    assert code == 0 and "(ltsc: " in err, err
    # a checkpoint from before the record: refused (eval as before), generate now too
    (tmp_path / "r" / "checkpoint" / "compressor.json").unlink()
    code, err, row = eval_row(capsys, ckpt, tmp_path)
    assert code == 2 and "expected --compressor ltsc" in err and "ltsc.json" in err
    code, _, err = run(capsys, "generate", "--checkpoint", ckpt, *prompt)
    assert code == 2 and "expected --compressor ltsc" in err
    code, _, err = run(capsys, "serve", "--model", ckpt)
    assert code == 2 and "--compressor ltsc (its ltsc.json)" in err
    code, _, err = run(capsys, "generate", "--checkpoint", ckpt, *prompt, "--compressor", "ltsc",
                       "--compressor-option", "max_meta_tokens=8")
    assert code == 0 and "(ltsc: " in err, err


def test_serve_refuses_a_checkpoint_whose_prompts_a_baseline_rewrote(capsys, monkeypatch,
                                                                      tiny_model_dir, tmp_path,
                                                                      sc_checkpoint):
    from ktm.compressors.record import write_record
    from ktm.model import KTMModel
    from ktm.serving.app import Server

    served = []
    monkeypatch.setattr(Server, "run", lambda self, **kw: served.append(self.config.app))
    code, _, err = run(capsys, "serve", "--model", sc_checkpoint)
    assert code == 2 and not served
    assert "--compressor selective_context (its compressor.json)" in err
    assert "reads prompts as given" in err
    # mean pooling rewrites nothing: its checkpoint is served as trained
    ckpt = tmp_path / "mp"
    KTMModel.from_base(tiny_model_dir, k=2, use_mlp=False).save(str(ckpt))
    write_record(ckpt, "mean_pool", {})
    code, _, err = run(capsys, "serve", "--model", str(ckpt))
    assert code == 0 and len(served) == 1, err


def test_a_checkpoint_without_a_record_reads_as_before(capsys, tiny_model_dir, tmp_path):
    from ktm.model import KTMModel

    ckpt = tmp_path / "plain"
    KTMModel.from_base(tiny_model_dir, k=2).save(str(ckpt))
    code, err, row = eval_row(capsys, str(ckpt), tmp_path)
    assert code == 0, err
    assert row["method"] == "ktm-k2" and row["config"]["compressor"] is None


def test_export_refuses_a_checkpoint_whose_prompts_a_baseline_rewrote(capsys, sc_checkpoint,
                                                                       tmp_path):
    # it exported the LM, which vLLM then served on plain prompts
    out = tmp_path / "export"
    code, _, err = run(capsys, "export", str(out), "--model", sc_checkpoint)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--compressor selective_context (its compressor.json)" in err
    assert "an exported model reads prompts as given" in err and not out.exists()


def test_eval_readability_refuses_a_checkpoint_whose_prompts_a_baseline_rewrote(
        capsys, sc_checkpoint, tmp_path):
    # R was measured on plain held-out text and labelled as if the checkpoint were plain
    out = tmp_path / "read.json"
    code, _, err = run(capsys, "eval", "--checkpoint", sc_checkpoint, "--readability", "reviews",
                       "--n-windows", "2", "--json", str(out))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "not rewritten by selective_context" in err and "compressor.json" in err
    assert not out.exists()


@pytest.mark.parametrize("flags,now", [
    ([], "this run has no --compressor"),
    (["--compressor", "selective_context", "--compressor-option", "ratio=0.2"],
     "this run has --compressor selective_context --compressor-option ratio=0.2"),
    (["--compressor", "mean_pool"], "this run has --compressor mean_pool"),
])
def test_resume_names_the_compressor_the_run_was_trained_with(capsys, tiny_model_dir, tmp_path,
                                                               flags, now):
    # refused only as "trained with examples=the checkpoint's", naming no method
    train_baseline(capsys, tiny_model_dir, tmp_path / "r", "selective_context", "ratio=0.4")
    code, _, err = run(capsys, "train", "--model", tiny_model_dir, "--task", "tree", "--stage",
                       "small", "--n-train", "8", "--n-eval", "2", "--max-steps", "2",
                       "--batch-size", "2", "--out-dir", str(tmp_path / "r"), "--no-progress",
                       "--resume", *flags)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert ("trained with --compressor selective_context --compressor-option ratio=0.4 "
            "(compressor.json)") in err and now in err


def test_resume_with_the_recorded_compressor_continues(capsys, tiny_model_dir, tmp_path):
    train_baseline(capsys, tiny_model_dir, tmp_path / "r", "selective_context", "ratio=0.4")
    code, _, err = run(capsys, "train", "--model", tiny_model_dir, "--task", "tree", "--stage",
                       "small", "--n-train", "8", "--n-eval", "2", "--max-steps", "2",
                       "--batch-size", "2", "--out-dir", str(tmp_path / "r"), "--no-progress",
                       "--resume", "--compressor", "selective_context",
                       "--compressor-option", "ratio=0.4")
    assert code == 0, err


def test_init_from_a_baseline_checkpoint_carries_its_options_and_ltsc_state(capsys,
                                                                            tiny_model_dir,
                                                                            tmp_path):
    # the new run fitted LTSC afresh with its default options and wrote them as its record
    init = train_baseline(capsys, tiny_model_dir, tmp_path / "a", "ltsc", "max_meta_tokens=8")
    code, out, err = run(capsys, "train", "--init", init, "--task", "tree", "--stage", "small",
                         "--n-train", "8", "--n-eval", "2", "--max-steps", "1", "--batch-size",
                         "2", "--out-dir", str(tmp_path / "b"), "--no-progress",
                         "--compressor", "ltsc")
    assert code == 0, err
    assert json.loads(out)["eval"]["compressor"]["state_restored"] is True
    record = json.loads((tmp_path / "b" / "checkpoint" / "compressor.json").read_text())
    assert record == {"name": "ltsc", "options": {"max_meta_tokens": 8}}
    before = json.loads((Path(init) / "ltsc.json").read_text())
    after = json.loads((tmp_path / "b" / "checkpoint" / "ltsc.json").read_text())
    assert after["vocab"] == before["vocab"] and after["meta_ids"] == before["meta_ids"]


@pytest.mark.parametrize("command,flags,message", [
    ("train", [], "this run has no --compressor: its LoRA reads prompts as selective_context "
                  "rewrote them; give --compressor selective_context"),
    ("train", ["--compressor", "llmlingua"], "this run has --compressor llmlingua"),
    ("train", ["--compressor", "selective_context", "--compressor-option", "ratio=0.2"],
     "--compressor-option ratio=0.2 contradicts"),
    ("pretrain", [], "this run has ktm pretrain, which reads prompts as given"),
])
def test_init_from_a_baseline_checkpoint_refuses_another_method(capsys, sc_checkpoint, tmp_path,
                                                                 command, flags, message):
    # it trained the baseline's LoRA on plain (or other) prompts and wrote no record
    task = (["--task", "tree", "--stage", "small", "--n-train", "8", "--n-eval", "2"]
            if command == "train" else [])
    code, _, err = run(capsys, command, "--init", sc_checkpoint, *task, "--max-steps", "1",
                       "--batch-size", "2", "--out-dir", str(tmp_path / "b"), "--no-progress",
                       *flags)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert message in err and "compressor.json" in err
    assert not (tmp_path / "b" / "checkpoint").exists()


def test_the_python_api_exposes_the_record_and_warns_once_when_generate_reads_plain(
        sc_checkpoint, tiny_model_dir, tmp_path):
    # KTMModel.load ignored the record: a baseline checkpoint silently answered plain prompts
    import warnings

    from ktm.compressors.apply import apply_compressor
    from ktm.core.prompt import Segment
    from ktm.model import KTMModel
    from ktm.tasks.base import Example

    model = KTMModel.load(sc_checkpoint)
    assert model.compressor_record == {"name": "selective_context", "options": {"ratio": 0.4}}
    with pytest.warns(UserWarning, match=r"--compressor selective_context \(compressor.json\)"):
        model.generate("Tree: AB", max_new_tokens=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.generate("Tree: AB", max_new_tokens=1)  # said once
        # the method applied (as ktm generate does): nothing to warn about
        applied = KTMModel.load(sc_checkpoint)
        ex = apply_compressor("selective_context", {"ratio": 0.4}, applied, [],
                              [Example((Segment("Tree: AB\n+CD"),), "")],
                              state_dir=sc_checkpoint, replace_encoder=False,
                              compress_train=False).eval_examples[0]
        applied.generate(list(ex.segments), max_new_tokens=1)
        # a plain checkpoint has no record
        KTMModel.from_base(tiny_model_dir, k=2).save(str(tmp_path / "plain"))
        plain = KTMModel.load(str(tmp_path / "plain"))
        assert plain.compressor_record is None
        plain.generate("Tree: AB", max_new_tokens=1)


def test_the_core_knows_which_methods_only_set_the_encoder():
    from ktm.compressors import COMPRESSORS
    from ktm.core.checkpoint import SETTING_ONLY

    assert set(SETTING_ONLY) == {n for n, c in COMPRESSORS.items() if not c.rewrites_prompts}


def test_init_from_a_mean_pool_baseline_without_its_method_warns(capsys, tiny_model_dir,
                                                                  tmp_path):
    """A baseline that only sets the encoder (mean pooling) continued without --compressor was
    silently no longer a baseline: its checkpoint had no record (--init-adapter warned of it)."""
    import warnings

    init = train_baseline(capsys, tiny_model_dir, tmp_path / "a", "mean_pool")
    flags = ["--init", init, "--task", "tree", "--stage", "small", "--n-train", "8", "--n-eval",
             "2", "--max-steps", "1", "--batch-size", "2", "--no-progress"]
    with pytest.warns(UserWarning, match=r"--compressor mean_pool baseline \(compressor.json\); "
                                         r"this run has no --compressor.*give --compressor "
                                         r"mean_pool to continue the baseline"):
        code, _, err = run(capsys, "train", *flags, "--out-dir", str(tmp_path / "b"))
    assert code == 0, err
    assert not (tmp_path / "b" / "checkpoint" / "compressor.json").exists()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        code, _, err = run(capsys, "train", *flags, "--out-dir", str(tmp_path / "c"),
                           "--compressor", "mean_pool")
    assert code == 0, err
    assert not [w for w in seen if "--init" in str(w.message)]
    assert json.loads((tmp_path / "c" / "checkpoint" / "compressor.json").read_text())[
        "name"] == "mean_pool"
