import json
import re
from pathlib import Path

import pytest
from helpers import opens_under

from ktm.cli.main import main

PROVENANCE = ("config", "versions", "git")  # what each saved curriculum row adds


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_train_then_generate_from_checkpoint(capsys, tiny_model_dir, tmp_path):
    out_dir = tmp_path / "run"
    code, out, _ = run(capsys, "train", "--model", tiny_model_dir, "--task", "tree",
                       "--stage", "small", "--n-train", "16", "--n-eval", "4", "--max-steps", "2",
                       "--batch-size", "4", "--out-dir", str(out_dir), "--no-progress")
    assert code == 0
    assert json.loads(out)["step"] == 2
    assert (out_dir / "checkpoint" / "ktm_config.json").is_file()
    rows = [json.loads(r) for r in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("eval" in r for r in rows)
    code, out, err = run(capsys, "generate", "--checkpoint", str(out_dir / "checkpoint"),
                         "--prompt", "Tree: AB\n+CD", "--plain", ", Parent: AB, Answer: ",
                         "--max-new-tokens", "3")
    assert code == 0 and out.strip() != "" and "prompt tokens" in err


@pytest.mark.parametrize("argv,match", [
    (["generate", "--model", "no-such-model", "--prompt", "hi"], "unknown model 'no-such-model'"),
    (["generate", "--model", "{tiny}", "--k", "0", "--prompt", "hi"], "k must be an integer >= 1"),
    (["generate", "--model", "{tiny}", "--prompt", ""], "prompt is empty"),
    (["generate", "--checkpoint", "{tmp}", "--prompt", "hi"], "not a ktm checkpoint"),
    # generation options and the prompt are checked before the model is loaded
    (["generate", "--model", "no-such-model", "--prompt", "hi", "--top-p", "0"], "top_p must be"),
    (["generate", "--model", "no-such-model", "--prompt", "", "--plain", ""], "prompt is empty"),
    (["train", "--model", "{tiny}", "--batch-size", "0", "--out-dir", "{tmp}/x"], "batch_size"),
    (["generate", "--model", "{tiny}", "--ratio", "0.5", "--prompt", "hi"],
     "ratio must be a finite number >= 1"),
    (["generate", "--model", "{tiny}", "--ratio", "nan", "--prompt", "hi"],
     "ratio must be a finite number >= 1"),
    (["generate", "--model", "{tiny}", "--k", "4", "--ratio", "9", "--prompt",
      "The quick brown fox jumps over the lazy dog."], "ratio 9 is more than this reader allows"),
    (["generate", "--model", "{tiny}", "--allocator", "best", "--prompt", "hi"],
     "allocator must be one of"),
    (["generate", "--model", "{tiny}", "--backend", "llamacpp", "--compile", "on", "--prompt",
      "hi"], "--compile on is an option of the torch backend, not --backend llamacpp"),
    (["generate", "--model", "{tiny}", "--backend", "llamacpp", "--weights", "int8",
      "--prompt", "hi"], "--weights int8 is an option of the torch backend, not --backend "
     "llamacpp"),
])
def test_bad_input_is_one_line_and_nonzero(capsys, tiny_model_dir, tmp_path, argv, match):
    argv = [a.format(tiny=tiny_model_dir, tmp=tmp_path) for a in argv]
    code, _, err = run(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert lines[-1].startswith("ktm: error:") and match in lines[-1]
    assert "Traceback" not in err


def test_a_prompt_file_or_stdin_reads_as_the_same_prompt_given_inline(capsys, tiny_model_dir,
                                                                      tmp_path, monkeypatch):
    import io

    text = "Tree: AB\n+CD\n++EF\n" * 20
    doc = tmp_path / "doc.txt"
    doc.write_text(text, encoding="utf-8")
    args = ["generate", "--model", tiny_model_dir, "--plain", " Answer:", "--max-new-tokens", "4"]
    inline = run(capsys, *args, "--prompt", text)
    assert inline[0] == 0
    assert run(capsys, *args, "--prompt-file", str(doc)) == inline
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    assert run(capsys, *args, "--prompt-file", "-") == inline


def test_a_question_is_read_plain_after_the_prompt(capsys, tiny_model_dir):
    # the same rows as a plain tail (a uniform reader reads no question), and not the prompt alone
    args = ["generate", "--model", tiny_model_dir, "--prompt", "Tree: AB\n+CD\n" * 8,
            "--max-new-tokens", "3"]
    asked = run(capsys, *args, "--question", " Who is B's parent? Answer:")
    assert asked[0] == 0 and asked == run(capsys, *args, "--plain", " Who is B's parent? Answer:")
    alone = run(capsys, *args)[2]

    def tokens(err):  # "[prompt tokens IN -> OUT, K=..]": (IN, OUT)
        got = re.search(r"prompt tokens (\d+) -> (\d+),", err)
        return int(got[1]), int(got[2])

    (n_in, n_out), (alone_in, alone_out) = tokens(asked[2]), tokens(alone)
    # the question's tokens are each a position of their own
    assert n_in - alone_in == n_out - alone_out > 0


@pytest.mark.parametrize("extra,match", [
    (["--chat", "{tmp}/chat.jsonl", "--question", "Who?"], "--plain and --question go with"),
    (["--prompt-file", "{tmp}/missing.txt"], "cannot read prompt file '{tmp}/missing.txt'"),
    (["--prompt-file", "{tmp}/latin1.txt"], "is not UTF-8 text: byte 0xe9 at offset 3"),
    (["--prompt-file", "{tmp}/latin1.txt", "--prompt", "hi"], "expected one of them, got 2"),
])
def test_a_bad_prompt_file_is_one_line_and_nonzero(capsys, tiny_model_dir, tmp_path, extra,
                                                   match):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    extra = [a.format(tmp=tmp_path) for a in extra]
    code, _, err = run(capsys, "generate", "--model", tiny_model_dir, *extra)
    assert code == 2 and "Traceback" not in err
    assert match.format(tmp=tmp_path) in err.strip().splitlines()[-1]


def test_an_unknown_task_is_argparses_usage_error_naming_the_choices(capsys, tiny_model_dir,
                                                                    tmp_path):
    """``--task`` lists its choices, so argparse refuses another name: exit 2, the usage line
    and one error line naming the value and the choices, before anything is loaded."""
    with pytest.raises(SystemExit) as e:
        main(["train", "--model", tiny_model_dir, "--task", "nope", "--out-dir",
              str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert "invalid choice: 'nope'" in err.strip().splitlines()[-1] and "'tree'" in err
    assert not (tmp_path / "x").exists()


def test_eval_then_report_end_to_end(capsys, tiny_model_dir, tmp_path):
    from ktm.model import KTMModel

    ckpt = tmp_path / "ck"
    KTMModel.from_base(tiny_model_dir, k=2).save(str(ckpt))
    results = []
    for extra, name in ([], "k2"), (["--no-merge"], "plain"):
        out = tmp_path / f"{name}.json"
        code, _, _ = run(capsys, "eval", "--checkpoint", str(ckpt), "--task", "tree", "--stage",
                         "small", "--prompt-mode", "paper", "--n-eval", "6", "--json", str(out),
                         *extra)
        assert code == 0
        row = json.loads(out.read_text())
        assert row["task"] == "tree" and row["n"] == 6
        assert {"accuracy", "balanced_accuracy", "natural_accuracy", "length_reduction",
                "tokens_before", "tokens_after", "compression_ms_per_1k_tokens", "versions", "git",
                "config"} <= set(row)
        results.append(str(out))
    plain = json.loads((tmp_path / "plain.json").read_text())
    merged = json.loads((tmp_path / "k2.json").read_text())
    assert plain["method"] == "uncompressed" and plain["length_reduction"] == 0.0
    # paper mode compresses the whole prompt: K=2 roughly halves it
    assert merged["method"] == "ktm-k2" and 0.4 < merged["length_reduction"] <= 0.5
    assert merged["tokens_before"] == plain["tokens_before"]
    plot = tmp_path / "plot.png"
    code, out, _ = run(capsys, "report", *results, "--plot", str(plot))
    assert code == 0
    # a run from a dirty tree (as during development) is marked †
    assert re.search(r"\| ktm-k2( †)? \| 2 \|", out)
    assert re.search(r"\| uncompressed( †)? \| – \|", out)
    assert plot.stat().st_size > 1000


def test_report_refuses_a_file_that_is_not_a_result(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"task": "tree"}')
    code, _, err = run(capsys, "report", str(bad))
    assert code == 2 and "expected a file written by `ktm eval`" in err


def test_demo_runs_end_to_end_on_tiny_model(capsys, tiny_model_dir, tmp_path):
    out_dir = tmp_path / "demo"
    code, out, _ = run(capsys, "demo", "--model", tiny_model_dir, "--stage", "small", "--steps",
                       "2", "--batch-size", "2", "--n-eval", "4", "--out-dir", str(out_dir))
    assert code == 0
    assert "| untrained (mean pooling)" in out and "| trained K=4 merger" in out
    assert re.search(r"-> \d+\.\d\dx (faster|slower)\n", out) and "generated:" in out
    result = json.loads((out_dir / "demo.json").read_text())
    assert result["trained"]["n"] == 4 and result["prefill"]["plain_s"] > 0
    assert result["last_step"]["step"] == 2
    assert (out_dir / "checkpoint" / "ktm_config.json").is_file()
    # the long prompt: as long as the tiny model's 512 positions allow with a 64-token answer,
    # a multiple of K, read merged into a quarter of the positions
    long = result["long_prompt"]
    assert long["plain"]["tokens_in"] == long["merged"]["tokens_in"] == 444
    assert long["plain"]["tokens_out"] == 444 and long["merged"]["tokens_out"] == 111
    assert long["R_windows"] == 4 and long["answer_tokens"] == 64
    assert all(long[m][t] > 0 for m in ("merged", "plain") for t in ("ttft_s", "e2e_s"))
    assert re.search(r"\| merged \(K=4\) +\| +444 \| +111 \|", out)
    assert "no long question: no shipped question reader" in out
    assert result["long_question"] is None


def test_demo_ends_with_a_question_about_a_document_past_the_window(capsys, tiny_model_dir,
                                                                   tmp_path):
    """The question reader fits a document over the model's 512 positions by itself; the plain
    model reads the document's last tokens that fit. No shipped question reader serves the
    tiny model (the run above says so): a saved reader of it is named."""
    from helpers import fresh_model

    reader = tmp_path / "reader"
    fresh_model(tiny_model_dir).save(reader)
    code, out, _ = run(capsys, "demo", "--model", tiny_model_dir, "--steps", "1",
                       "--batch-size", "1", "--n-eval", "2", "--long-tokens", "0",
                       "--question-tokens", "3000", "--question-reader", str(reader),
                       "--out-dir", str(tmp_path / "demo"))
    assert code == 0 and "long question: " in out and "| question reader    |" in out
    q = json.loads((tmp_path / "demo" / "demo.json").read_text())["long_question"]
    merged, plain = q["readings"]["question reader"], q["readings"]["plain, last tokens"]
    assert q["document_tokens"] > 2 * 512 and merged["tokens_in"] > 2 * 512
    assert merged["positions"] + 23 <= 512 and plain["positions"] + 23 <= 512
    assert 400 < plain["tokens_in"] == plain["positions"] < 512  # the document's tail, plain
    assert all(r["first_token_s"] > 0 and isinstance(r["found"], bool) for r in (merged, plain))
    assert q["question"].startswith("What is the secret code for ")


def test_demo_long_prompt_can_be_left_out(capsys, tiny_model_dir, tmp_path):
    code, out, _ = run(capsys, "demo", "--model", tiny_model_dir, "--steps", "1", "--batch-size",
                       "1", "--n-eval", "2", "--long-tokens", "0", "--out-dir", str(tmp_path))
    assert code == 0 and "long prompt" not in out
    assert json.loads((tmp_path / "demo.json").read_text())["long_prompt"] is None


def test_demo_refuses_a_negative_long_prompt(capsys, tiny_model_dir, tmp_path):
    code, _, err = run(capsys, "demo", "--model", tiny_model_dir, "--long-tokens", "-1",
                       "--out-dir", str(tmp_path))
    assert code == 2 and "long_tokens must be >= 0" in err


def test_demo_refuses_to_delete_another_commands_run(capsys, tiny_model_dir, tmp_path):
    """The demo starts fresh by deleting OUT/checkpoint and metrics.jsonl: with --out-dir of a
    `ktm train` run it deleted that run's checkpoint; a demo's own folder is still reused."""
    run_dir, demo_dir = tmp_path / "run", tmp_path / "demo"
    assert run(capsys, "train", "--model", tiny_model_dir, "--task", "tree", "--stage", "small",
               "--n-train", "4", "--n-eval", "2", "--max-steps", "1", "--batch-size", "2",
               "--out-dir", str(run_dir), "--no-progress")[0] == 0
    flags = ["--model", tiny_model_dir, "--stage", "small", "--steps", "1", "--batch-size", "2",
             "--n-eval", "2"]
    code, _, err = run(capsys, "demo", *flags, "--out-dir", str(run_dir))
    assert code == 2 and "holds a run of 'ktm train" in err, err
    assert (run_dir / "checkpoint" / "ktm_config.json").is_file()
    for _ in range(2):  # the demo's own folder: started fresh each time
        assert run(capsys, "demo", *flags, "--out-dir", str(demo_dir))[0] == 0


def test_demo_says_slower_when_merging_was_slower(capsys, monkeypatch, tiny_model_dir,
                                                  tmp_path):
    import ktm.cli.demo

    # it printed "0.50x faster"
    monkeypatch.setattr(ktm.cli.demo, "time_prefill", lambda model, prompts: {
        "merged_s": 0.2, "plain_s": 0.1, "speedup": 0.5, "batch": len(prompts)})
    code, out, _ = run(capsys, "demo", "--model", tiny_model_dir, "--stage", "small", "--steps",
                       "1", "--batch-size", "2", "--n-eval", "2", "--long-tokens", "0",
                       "--out-dir", str(tmp_path / "demo"))
    assert code == 0
    assert "plain 100.0 ms -> 2.00x slower" in out and "faster" not in out


def test_demo_reads_its_reader_on_the_model_given(capsys, tiny_model_dir, tmp_path):
    """--model with --reader: the reader is read on that folder (a copy of its base), not on the
    reader's own base (which the demo once used silently while demo.json recorded --model)."""
    import shutil

    first, again = tmp_path / "first", tmp_path / "again"
    copy = str(shutil.copytree(tiny_model_dir, tmp_path / "copy"))
    flags = ["--stage", "small", "--steps", "1", "--batch-size", "2", "--n-eval", "2",
             "--long-tokens", "0", "--question-tokens", "0"]  # what is read is not the point
    assert run(capsys, "demo", "--model", tiny_model_dir, *flags, "--out-dir", str(first))[0] == 0
    code, _, err = run(capsys, "demo", "--model", copy, "--reader",
                       str(first / "checkpoint"), *flags, "--out-dir", str(again))
    assert code == 0, err
    saved = json.loads((again / "checkpoint" / "ktm_config.json").read_text())
    assert saved["config"]["base_model"] == str(Path(copy).resolve())
    assert json.loads((again / "demo.json").read_text())["base_model"] == saved["config"][
        "base_model"]
    # without --model the reader brings its own base, and demo.json names that one
    alone = tmp_path / "alone"
    assert run(capsys, "demo", "--reader", str(first / "checkpoint"), *flags, "--out-dir",
               str(alone))[0] == 0
    assert json.loads((alone / "demo.json").read_text())["base_model"] == str(
        Path(tiny_model_dir).resolve())


def test_a_checkpoint_of_another_size_is_named_in_the_error(capsys, tiny_model_dir, tmp_path):
    """--init / --checkpoint / --reader on a --model of another size: the error names the
    checkpoint and its own base model (it named neither, e.g. for a shipped reader)."""
    from ktm.model import KTMModel

    ckpt = tmp_path / "ck"
    KTMModel.from_base(tiny_model_dir, k=2).save(str(ckpt))
    meta = json.loads((ckpt / "ktm_config.json").read_text())
    meta["hidden_size"], meta["config"]["base_model"] = 99, "/elsewhere/wide-model"
    (ckpt / "ktm_config.json").write_text(json.dumps(meta))
    capsys.readouterr()  # the save's own progress bar
    code, _, err = run(capsys, "generate", "--checkpoint", str(ckpt), "--model", tiny_model_dir,
                       "--prompt", "Hello world")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"checkpoint {str(ckpt)!r} expects hidden_size=99" in err
    assert "'/elsewhere/wide-model' or a local copy" in err


@pytest.mark.parametrize("method,options", [
    ("selective_context", ["ratio=0.5"]), ("ltsc", ["max_meta_tokens=8"]), ("mean_pool", []),
])
def test_baseline_train_then_eval(capsys, tiny_model_dir, tmp_path, method, options):
    out_dir = tmp_path / method
    opts = [a for o in options for a in ("--compressor-option", o)]
    code, _, err = run(capsys, "train", "--model", tiny_model_dir, "--task", "tree", "--stage",
                       "small", "--n-train", "16", "--n-eval", "4", "--max-steps", "2",
                       "--batch-size", "4", "--out-dir", str(out_dir), "--no-progress",
                       "--compressor", method, *opts)
    assert code == 0, err
    res = tmp_path / f"{method}.json"
    code, _, err = run(capsys, "eval", "--checkpoint", str(out_dir / "checkpoint"), "--task",
                       "tree", "--stage", "small", "--n-train", "16", "--n-eval", "6",
                       "--json", str(res), "--compressor", method, *opts)
    assert code == 0, err
    row = json.loads(res.read_text())
    assert row["method"] == method
    assert row["length_reduction"] > 0.0
    assert row["tokens_after"] < row["tokens_before"]
    assert "compression_ms_per_1k_tokens" in row and "natural_accuracy" in row


def test_curriculum_rounds_and_stop(capsys, tiny_model_dir, tmp_path):
    code, out, _ = run(capsys, "curriculum", "--model", tiny_model_dir, "--start-stage", "small",
                       "--final-stage", "xsmall", "--threshold", "1.0", "--steps-per-round", "1",
                       "--max-rounds", "2", "--n-eval", "4", "--batch-size", "2",
                       "--out-dir", str(tmp_path), "--no-progress")
    rows = [json.loads(r) for r in out.strip().splitlines()]
    if rows[-1]["passed"]:  # a perfect score on 4 pairs can happen; then the next stage runs
        assert code == 0
    else:  # a stage that does not pass stops the curriculum after max_rounds
        assert code == 1 and len([r for r in rows if r["stage"] == rows[-1]["stage"]]) == 2
    assert rows[0]["stage"] == "small" and rows[0]["round"] == 1
    assert (tmp_path / "small-r1" / "checkpoint").is_dir()
    saved = [json.loads(r) for r in (tmp_path / "curriculum.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in r.items() if k not in PROVENANCE} for r in saved] == rows
    # each saved row says what made it
    assert all(r["git"] and r["versions"]["torch"] for r in saved)
    assert saved[0]["config"]["curriculum"]["steps_per_round"] == 1
    assert saved[0]["config"]["model"]["config"]["base_model"]


def test_curriculum_starts_from_a_reader(capsys, tiny_model_dir, tmp_path):
    import torch

    from ktm.model import KTMModel

    reader = KTMModel.from_base(tiny_model_dir, k=2, slot_weights=True)
    with torch.no_grad():
        reader.encoder.slots.mul_(3.0)
    reader.save(str(tmp_path / "reader"))
    code, out, err = run(capsys, "curriculum", "--init", str(tmp_path / "reader"), "--model",
                       tiny_model_dir, "--start-stage", "small", "--final-stage", "small",
                       "--threshold", "1.0", "--steps-per-round", "1", "--max-rounds", "1",
                       "--n-eval", "4", "--batch-size", "2", "--lr", "1e-9", "--threads", "1",
                       "--out-dir", str(tmp_path / "cur"), "--no-progress")
    assert code in (0, 1), err
    assert json.loads(out.splitlines()[0])["stage"] == "small"
    after = KTMModel.load(str(tmp_path / "cur" / "small-r1" / "checkpoint"))
    assert after.k == 2  # the reader's K and weights, not a fresh default model
    torch.testing.assert_close(after.encoder.slots, reader.encoder.slots)
    code, _, err = run(capsys, "curriculum", "--init", "smollm2-135m-k9", "--out-dir",
                       str(tmp_path / "x"))
    assert code == 2 and "no shipped reader of that name" in err


def test_curriculum_rejects_bad_stage_order(capsys, tiny_model_dir, tmp_path):
    code, _, err = run(capsys, "curriculum", "--model", tiny_model_dir, "--start-stage", "large",
                       "--final-stage", "small", "--out-dir", str(tmp_path))
    assert code == 2 and "comes after final_stage" in err


def write_heldout_sets(root):
    """Tiny stand-ins for the two evaluation-only files, in the shipped layout."""
    import gzip

    text = "The quick brown fox jumps over the lazy dog. Hello world, my name is ktm. " * 3
    files = {
        "amazon_reviews_other/amazon_other_categories_2018.jsonl.gz": [
            {"category": "Gift_Cards", "rating": 5.0, "text": text[i:]} for i in range(3)],
        "commitpackft_python/heldout_repos_test.jsonl.gz": [
            {"old_contents": "", "new_contents": "def add(a, b):\n    return a + b\n" * 8,
             "subject": "Add add function"} for _ in range(3)],
    }
    for rel, rows in files.items():
        (root / rel).parent.mkdir(parents=True)
        with gzip.open(root / rel, "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def test_eval_readability_then_report(capsys, tiny_model_dir, tmp_path, monkeypatch):
    from ktm.model import KTMModel

    write_heldout_sets(tmp_path / "data")
    monkeypatch.setenv("KTM_DATA", str(tmp_path / "data"))
    ckpt = tmp_path / "ck"
    KTMModel.from_base(tiny_model_dir, k=4).save(str(ckpt))
    out = tmp_path / "read.json"
    code, _, _ = run(capsys, "eval", "--checkpoint", str(ckpt), "--readability", "reviews",
                     "code", "--n-windows", "2", "--json", str(out))
    assert code == 0
    row = json.loads(out.read_text())
    assert row["task"] == "readability" and row["k"] == 4
    for name in ("reviews", "code"):
        r = row["readability"][name]
        assert r["windows"] == 2 and r["tokens_out"] == pytest.approx(r["tokens_in"] / 4, abs=1)
        assert {"R", "R_ci95", "nll_merged", "nll_plain", "nll_none"} <= set(r)
    assert row["config"]["readability"]["ci_bootstrap"]["resamples"] == 1000
    code, text, _ = run(capsys, "report", str(out))
    assert code == 0 and re.search(r"\| ktm-k4( †)? \| 4 \| code \|", text)


def test_eval_readability_of_a_mean_pool_checkpoint_is_labelled_mean_pool(
        capsys, tiny_model_dir, tmp_path, monkeypatch):
    # its record was ignored: the row said ktm-k2 and held no compressor
    from ktm.compressors.record import write_record
    from ktm.model import KTMModel

    write_heldout_sets(tmp_path / "data")
    monkeypatch.setenv("KTM_DATA", str(tmp_path / "data"))
    ckpt = tmp_path / "mp"
    KTMModel.from_base(tiny_model_dir, k=2, use_mlp=False).save(str(ckpt))
    write_record(ckpt, "mean_pool", {})
    out = tmp_path / "read.json"
    code, _, err = run(capsys, "eval", "--checkpoint", str(ckpt), "--readability", "reviews",
                       "--n-windows", "2", "--json", str(out))
    assert code == 0, err
    row = json.loads(out.read_text())
    assert row["method"] == "mean_pool" and row["k"] == 2
    assert row["config"]["compressor"] == {"name": "mean_pool", "options": {}}


def test_ltsc_state_is_inside_the_atomic_checkpoint(capsys, tiny_model_dir, tmp_path,
                                                    checkpoint_swaps):
    code, _, err = run(capsys, "train", "--model", tiny_model_dir, "--task", "tree", "--stage",
                       "small", "--n-train", "16", "--n-eval", "4", "--max-steps", "2",
                       "--batch-size", "4", "--save-every", "1", "--out-dir",
                       str(tmp_path / "r"), "--no-progress", "--compressor", "ltsc",
                       "--compressor-option", "max_meta_tokens=8")
    assert code == 0, err
    assert len(checkpoint_swaps) == 2 and all(
        {"ltsc.json", "ltsc_meta.safetensors"} <= set(names) for names in checkpoint_swaps)


def test_eval_rows_record_what_was_really_used(capsys, tiny_model_dir, tmp_path):
    """The model's K and MLP come from the checkpoint, the task's options and the compressor's
    options are recorded; flag defaults that were never used are not."""
    from ktm.model import KTMModel

    ckpt = tmp_path / "ck"
    KTMModel.from_base(tiny_model_dir, k=2, use_mlp=False).save(str(ckpt))
    out = tmp_path / "r.json"
    with opens_under(ckpt) as opens:
        code, _, err = run(capsys, "eval", "--checkpoint", str(ckpt), "--task", "tree",
                           "--stage", "small", "--n-eval", "4", "--task-option",
                           "positive_fraction=0.25", "--json", str(out))
    assert code == 0, err
    assert max(opens.values()) == 1 and len(opens) >= 4, opens  # each file read once
    cfg = json.loads(out.read_text())["config"]
    assert (cfg["model"]["config"]["k"], cfg["model"]["config"]["use_mlp"]) == (2, False)
    assert "k" not in cfg and "mlp" not in cfg  # no unused CLI defaults (they said 4, True)
    assert cfg["task"]["positive_fraction"] == 0.25 and cfg["task"]["stage"] == "small"
    assert cfg["eval"] == {"n_eval": 4, "seed": 1, "merge": True, "device": "cpu",
                           "scoring": "generate", "n_calibrate": 0,
                           "backend": {"name": "torch"}}
    assert cfg["compressor"] is None


def test_a_task_option_of_the_wrong_type_exits_2_and_writes_nothing(capsys, tiny_model_dir,
                                                                     tmp_path):
    out = tmp_path / "r.json"
    code, _, err = run(capsys, "eval", "--model", tiny_model_dir, "--task", "tree", "--stage",
                       "small", "--n-eval", "4", "--task-option", "positive_fraction=half",
                       "--json", str(out))
    assert code == 2 and "positive_fraction='half': expected float" in err
    assert not out.exists()


def test_eval_rows_record_the_compressor_options(capsys, tiny_model_dir, tmp_path):
    out = tmp_path / "sc.json"
    code, _, err = run(capsys, "eval", "--model", tiny_model_dir, "--task", "tree", "--stage",
                       "small", "--n-eval", "4", "--n-train", "4", "--compressor",
                       "selective_context", "--compressor-option", "ratio=0.4", "--json",
                       str(out))
    assert code == 0, err
    comp = json.loads(out.read_text())["config"]["compressor"]
    assert comp["name"] == "selective_context" and comp["options"] == {"ratio": 0.4,
                                                                        "unit": "word"}


def test_model_flags_that_contradict_a_checkpoint_are_an_error(capsys, tiny_model_dir,
                                                               tmp_path):
    from ktm.model import KTMModel

    KTMModel.from_base(tiny_model_dir, k=2).save(str(tmp_path / "ck"))
    code, _, err = run(capsys, "generate", "--checkpoint", str(tmp_path / "ck"), "--lora-r", "8",
                       "--prompt", "hi")
    assert code == 2 and "--lora-r 8 contradicts checkpoint" in err and "lora_r=4" in err
    # the plain suffix and line alignment are a prompt layout, not weights: a checkpoint reads
    # with another
    code, out, err = run(capsys, "generate", "--checkpoint", str(tmp_path / "ck"),
                         "--plain-suffix", "2", "--align-lines", "--prompt", "hi\nho",
                         "--max-new-tokens", "1")
    assert code == 0, err


def test_lora_targets_flag_and_record(capsys, tiny_model_dir, tmp_path):
    out_dir = tmp_path / "run"
    code, _, err = run(capsys, "train", "--model", tiny_model_dir, "--task", "tree", "--stage",
                       "small", "--n-train", "8", "--n-eval", "2", "--max-steps", "1",
                       "--batch-size", "4", "--lora-target-modules", "q_proj", "v_proj",
                       "--out-dir", str(out_dir), "--no-progress")
    assert code == 0, err
    saved = json.loads((out_dir / "checkpoint" / "ktm_config.json").read_text())
    assert saved["lora_modules"] == {"q_proj": 2, "v_proj": 2}
    run_info = json.loads((out_dir / "run.json").read_text())
    assert run_info["task"]["stage"] == "small" and run_info["command"].startswith("ktm train")


def test_data_dir_flag_points_the_tasks_at_a_data_folder(capsys, tiny_model_dir, tmp_path,
                                                         monkeypatch):
    import gzip

    # --data-dir sets $KTM_DATA for the process: monkeypatch puts the original back afterwards
    monkeypatch.setenv("KTM_DATA", str(tmp_path / "unset"))
    folder = tmp_path / "data" / "amazon_reviews_fashion"
    folder.mkdir(parents=True)
    with gzip.open(folder / "amazon_fashion_2018_combined.jsonl.gz", "wt") as f:
        for i in range(24):
            f.write(json.dumps({"text": f"review number {i} fits well", "rating": 1 + i % 5})
                    + "\n")
    out = tmp_path / "r.json"
    code, _, err = run(capsys, "eval", "--model", tiny_model_dir, "--task", "amazon",
                       "--data-dir", str(tmp_path / "data"), "--task-option", "test_size=6",
                       "--n-eval", "4", "--json", str(out))
    assert code == 0, err
    assert json.loads(out.read_text())["config"]["task"]["file"].startswith(
        str(tmp_path / "data"))
    code, _, err = run(capsys, "eval", "--model", tiny_model_dir, "--task", "amazon",
                       "--data-dir", str(tmp_path / "nowhere"), "--n-eval", "4")
    assert code == 2 and "data dir" in err and "is not a folder" in err
    monkeypatch.setenv("KTM_DATA", str(tmp_path / "data"))
    code, _, err = run(capsys, "eval", "--model", tiny_model_dir, "--task", "commitpack",
                       "--n-eval", "2")
    assert code == 2 and "set KTM_DATA (or --data-dir)" in err


def test_tree_runs_without_the_data_folder(capsys, tiny_model_dir, tmp_path, monkeypatch):
    """An empty data folder (a plain pip install): tree trees are generated on the fly."""
    monkeypatch.setenv("KTM_DATA", str(tmp_path / "unset"))
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "r.json"
    code, _, err = run(capsys, "eval", "--model", tiny_model_dir, "--task", "tree", "--stage",
                       "small", "--n-eval", "4", "--data-dir", str(empty), "--json", str(out))
    assert code == 0, err
    task = json.loads(out.read_text())["config"]["task"]
    assert task["file"] is None and task["source"] == "auto"  # generated, not read


@pytest.mark.parametrize("command,config", [("generate", "GenerationConfig"),
                                            ("eval", "EvalConfig")])
def test_generate_and_eval_flags_come_from_their_configs(command, config):
    from ktm.cli.main import _parser
    from ktm.decode.generate import GenerationConfig
    from ktm.evaluation.runner import EvalConfig
    from ktm.util.flags import flag_fields

    cls = {"GenerationConfig": GenerationConfig, "EvalConfig": EvalConfig}[config]
    sub = _parser([command])._subparsers._group_actions[0].choices[command]
    dests = {a.dest for a in sub._actions}
    wanted = {name for name, *_ in flag_fields(cls)}
    assert wanted and wanted <= dests


def test_the_same_train_command_gives_the_same_model(capsys, tiny_model_dir, tmp_path):
    import torch

    from ktm.model import KTMModel

    def run_once(name, seed):
        torch.manual_seed(len(name) * 1000 + seed)  # the caller's RNG must not matter
        argv = ["train", "--model", tiny_model_dir, "--task", "tree", "--stage", "small",
                "--n-train", "8", "--n-eval", "2", "--max-steps", "1", "--batch-size", "4",
                "--seed", str(seed), "--out-dir", str(tmp_path / name), "--no-progress"]
        assert main(argv) == 0
        return dict(KTMModel.load(str(tmp_path / name / "checkpoint")).named_parameters())

    a, b, c = run_once("a", 0), run_once("bb", 0), run_once("c", 1)
    for n in a:
        if "lora_A" in n:
            torch.testing.assert_close(a[n], b[n], rtol=0, atol=0)
    assert any(not torch.equal(a[n], c[n]) for n in a if "lora_A" in n)  # the seed does matter


def test_eval_predictions_file_one_line_per_example(capsys, tiny_model_dir, tmp_path):
    res, preds = tmp_path / "r.json", tmp_path / "p.jsonl"
    code, _, err = run(capsys, "eval", "--model", tiny_model_dir, "--k", "2", "--task", "tree",
                       "--stage", "small", "--n-eval", "6", "--json", str(res),
                       "--predictions", str(preds))
    assert code == 0, err
    row = json.loads(res.read_text())
    lines = [json.loads(x) for x in preds.read_text().splitlines()]
    assert len(lines) == row["n"] == 6 and [x["i"] for x in lines] == list(range(6))
    assert "predictions" not in row and "answers" not in row
    assert sum(x["correct"] for x in lines) / 6 == pytest.approx(row["accuracy"])
    first = lines[0]
    assert first["gold"] in ("true", "false") and isinstance(first["answer"], str)
    assert [s["compress"] for s in first["prompt"]] == [True, False]  # tree merged, question plain
    assert first["prompt"][0]["text"].startswith("Tree: ")
    commits = tmp_path / "c.jsonl"
    commits.write_text("".join(json.dumps({"old_contents": f"a = {i}\n", "new_contents":
                                           f"a = {i + 1}\n", "subject": "Bump"}) + "\n"
                               for i in range(10)))
    code, _, err = run(capsys, "eval", "--model", tiny_model_dir, "--task", "commitpack",
                       "--data-path", str(commits), "--task-option", "test_size=2", "--n-eval",
                       "2", "--predictions", str(tmp_path / "x.jsonl"))
    assert code == 2 and "--predictions is for classification tasks" in err
    assert not (tmp_path / "x.jsonl").exists()


def test_eval_by_label_likelihood_records_its_scoring(capsys, tiny_model_dir, tmp_path):
    out = tmp_path / "r.json"
    code, _, err = run(capsys, "eval", "--model", tiny_model_dir, "--k", "2", "--task", "tree",
                       "--stage", "small", "--n-eval", "4", "--scoring", "likelihood",
                       "--n-calibrate", "4", "--json", str(out))
    assert code == 0, err
    row = json.loads(out.read_text())
    assert row["unparsed"] == 0 and row["scoring"]["n_calibrate"] == 4
    assert set(row["scoring"]["prior"]) == {"true", "false"}
    assert row["config"]["eval"]["scoring"] == "likelihood"
    code, _, err = run(capsys, "eval", "--model", tiny_model_dir, "--task", "tree", "--stage",
                       "small", "--n-eval", "4", "--n-calibrate", "4", "--json", str(out) + "2")
    assert code == 2 and "n_calibrate=4 needs scoring='likelihood'" in err
    assert not (tmp_path / "r.json2").exists()


def test_curriculum_resumes_a_run_killed_in_a_later_round(capsys, tiny_model_dir, tmp_path,
                                                           monkeypatch):

    import ktm.training.train as train_module
    real, calls = train_module.train_step, []

    def killed_once_at_the_second_step(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the second round dies before its checkpoint
        return real(*a, **kw)

    monkeypatch.setattr(train_module, "train_step", killed_once_at_the_second_step)
    argv = ["curriculum", "--model", tiny_model_dir, "--start-stage", "small",
            "--final-stage", "xsmall", "--threshold", "1.0", "--steps-per-round", "1",
            "--max-rounds", "2", "--n-eval", "4", "--batch-size", "2", "--out-dir",
            str(tmp_path), "--no-progress"]
    assert run(capsys, *argv)[0] == 130
    # the resume failed with "cannot resume: no checkpoint" in the round it had not saved yet,
    # and curriculum.jsonl got the finished rounds' rows twice
    code, out, err = run(capsys, *argv, "--resume")
    assert code in (0, 1), err
    rows = [json.loads(r) for r in out.strip().splitlines()]
    saved = [json.loads(r) for r in (tmp_path / "curriculum.jsonl").read_text().splitlines()]
    saved = [{k: v for k, v in r.items() if k not in PROVENANCE} for r in saved]
    assert saved == rows and len(rows) >= 2
    assert len({(r["stage"], r["round"]) for r in rows}) == len(rows)


@pytest.mark.parametrize("flag", ["--n-eval", "--n-train"])
def test_no_training_or_evaluation_examples_is_refused_before_training(capsys, tiny_model_dir,
                                                                       tmp_path, flag):
    # --n-eval 0 trained every step, then failed at the final evaluation, before the last save
    code, _, err = run(capsys, "train", "--model", tiny_model_dir, "--task", "tree", "--stage",
                       "small", "--max-steps", "1", "--batch-size", "2", "--n-eval", "2",
                       flag, "0", "--out-dir", str(tmp_path / "x"), "--no-progress")
    assert code == 2 and f"{flag} must be >= 1, got 0" in err
    assert not (tmp_path / "x").exists()


def test_a_checkpoint_read_on_another_tokenizer_of_the_same_size_is_refused(
        capsys, tiny_model_dir, tiny_bos_model_dir, tmp_path):
    from ktm.model import KTMModel

    ckpt = tmp_path / "ck"
    KTMModel.from_base(tiny_model_dir, k=2).save(str(ckpt))
    capsys.readouterr()
    code, _, err = run(capsys, "generate", "--checkpoint", str(ckpt), "--model",
                       tiny_bos_model_dir, "--prompt", "Hello world")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"trained on base model {str(Path(tiny_model_dir).resolve())!r}" in err
    assert f"but base model {str(Path(tiny_bos_model_dir).resolve())!r} is another model" in err


def test_resuming_a_complete_run_says_so_and_changes_nothing(capsys, tiny_model_dir, tmp_path):
    """``ktm train --resume`` on a run at max_steps printed ``{}`` and recorded a new start."""
    out_dir = tmp_path / "run"
    argv = ["train", "--model", tiny_model_dir, "--task", "tree", "--stage", "small",
            "--n-train", "8", "--n-eval", "2", "--max-steps", "2", "--batch-size", "4",
            "--out-dir", str(out_dir), "--no-progress"]
    code, first, _ = run(capsys, *argv)
    assert code == 0
    files = {p.name: p.read_bytes() for p in out_dir.iterdir() if p.is_file()}
    code, again, err = run(capsys, *argv, "--resume")
    assert code == 0
    assert f"{str(out_dir)!r} is already complete at step 2 (max_steps 2)" in err
    assert repr(str(out_dir / "checkpoint")) in err
    assert json.loads(again) == json.loads(first) and "eval" in json.loads(again)
    assert {p.name: p.read_bytes() for p in out_dir.iterdir() if p.is_file()} == files


@pytest.mark.parametrize("flag", ["--max-steps", "--eval-every"])
def test_curriculum_refuses_the_train_flags_it_would_ignore(capsys, tiny_model_dir, tmp_path,
                                                            flag):
    # each round takes --steps-per-round steps and is evaluated at its end
    with pytest.raises(SystemExit) as e:
        run(capsys, "curriculum", "--model", tiny_model_dir, "--start-stage", "small",
            "--final-stage", "small", "--steps-per-round", "1", "--max-rounds", "1",
            "--n-eval", "2", "--batch-size", "2", "--out-dir", str(tmp_path), "--no-progress",
            flag, "5")
    assert e.value.code == 2 and f"unrecognized arguments: {flag} 5" in capsys.readouterr().err


@pytest.mark.parametrize("argv,dest,value", [
    (["eval", "--readability", "code", "--n-eval-windows", "3"], "n_windows", 3),  # pretrain's
    (["demo", "--max-steps", "7"], "steps", 7),  # train's name
    (["bench", "--json", "b.json"], "out", "b.json"),  # eval's name
])
def test_a_flag_answers_to_the_name_another_command_gives_it(argv, dest, value):
    from ktm.cli.main import _parser

    assert getattr(_parser(argv).parse_args(argv), dest) == value


def test_curriculum_rows_are_printed_by_rank_0_alone(capsys, tiny_model_dir, tmp_path,
                                                     monkeypatch):
    import ktm.training.curriculum as curriculum
    from ktm.training import distributed

    monkeypatch.setattr(distributed, "setup", lambda device: distributed.World(1, 2))
    monkeypatch.setattr(distributed, "current", lambda: distributed.World(1, 2))
    monkeypatch.setattr(distributed, "sum_numbers", lambda values, world, device: [0.0])
    monkeypatch.setattr(distributed, "from_main", lambda values, world, device: [1.0])
    monkeypatch.setattr(curriculum, "train", lambda model, examples, cfg: None)
    monkeypatch.setattr(curriculum, "evaluate_classification",
                        lambda model, examples, labels: {"balanced_accuracy": 1.0})
    code, out, _ = run(capsys, "curriculum", "--model", tiny_model_dir, "--start-stage", "small",
                       "--final-stage", "small", "--steps-per-round", "1", "--n-eval", "2",
                       "--batch-size", "2", "--out-dir", str(tmp_path))
    assert code == 0 and out == ""


def test_ratio_reads_every_command_s_merged_segments_at_it(capsys, tiny_model_dir, tmp_path,
                                                          monkeypatch):
    """--ratio (a prompt layout): generate and eval --readability read at it, and the eval row
    reports the ratio read; a checkpoint can be read at one it was not saved with."""
    from ktm.model import KTMModel

    ckpt = tmp_path / "k8"
    KTMModel.from_base(tiny_model_dir, k=8, inner_k=(4, 2)).save(str(ckpt))
    prompt = "The quick brown fox jumps over the lazy dog. Hello world, my name is ktm. " * 2
    code, _, err = run(capsys, "generate", "--checkpoint", str(ckpt), "--ratio", "3",
                       "--prompt", prompt, "--max-new-tokens", "2")
    n_in, n_out = map(int, re.search(r"prompt tokens (\d+) -> (\d+)", err).groups())
    assert code == 0 and abs(n_in / n_out / 3 - 1) <= 0.05
    write_heldout_sets(tmp_path / "data")
    monkeypatch.setenv("KTM_DATA", str(tmp_path / "data"))
    out = tmp_path / "read.json"
    code, _, _ = run(capsys, "eval", "--checkpoint", str(ckpt), "--readability", "code",
                     "--n-windows", "2", "--ratio", "2", "--allocator", "even", "--json",
                     str(out))
    row = json.loads(out.read_text())
    assert code == 0 and row["config"]["model"]["config"]["ratio"] == 2.0
    r = row["readability"]["code"]
    assert {"R", "R_recall", "ratio_read"} <= set(r) and abs(r["ratio_read"] / 2 - 1) <= 0.05


def test_the_program_says_a_library_caveat_as_one_ktm_warning_line(tiny_model_dir):
    """The library warns through ``warnings``; the ``ktm`` program prints it as one line (not
    Python's file:line form with the source line under it), and ``main`` called from Python
    leaves the warnings machinery to its caller."""
    import subprocess
    import sys
    import warnings

    flags = ["generate", "--model", tiny_model_dir, "--k", "8", "--inner-k", "4", "2",
             "--ratio", "2", "--prompt", "The quick brown fox jumps over", "--max-new-tokens",
             "1"]
    r = subprocess.run([sys.executable, "-m", "ktm.cli", *flags], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stderr.splitlines() if "ratio" in line]
    assert said == ["ktm: warning: a segment of 9 tokens was read at ratio 3.00, not 2: its "
                    "units of up to 8 tokens allow no closer split"], r.stderr
    with pytest.warns(UserWarning, match="read at ratio 3.00, not 2"):
        assert main(flags) == 0
    assert warnings.showwarning is warnings._showwarning_orig


def test_press_flags_on_generate_and_eval(capsys, tiny_model_dir, tmp_path):
    """--press reads like KTMModel.use_press; eval --readability takes the user's own text at
    another context length and reports the KV a press keeps; other backends refuse a press."""
    from helpers import TEXT, fresh_model, require_module

    from ktm import Segment

    require_module("kvpress", "the [kvpress] extra and kvpress (the README's test command)")
    doc = TEXT * 3
    code, out, _ = run(capsys, "generate", "--model", tiny_model_dir, "--k", "4", "--prompt",
                       doc, "--plain", " Answer:", "--max-new-tokens", "6", "--press", "tova",
                       "--press-ratio", "0.5")
    model = fresh_model(tiny_model_dir, k=4, use_mlp=False, press="tova", press_ratio=0.5)
    assert code == 0
    assert out.strip() == model.generate([Segment(doc), Segment(" Answer:", compress=False)],
                                         max_new_tokens=6).strip()
    (tmp_path / "mine.txt").write_text(doc * 12)
    code, out, _ = run(capsys, "eval", "--model", tiny_model_dir, "--readability",
                       str(tmp_path / "mine.txt"), "--context-tokens", "128", "--n-windows", "2",
                       "--press", "knorm", "--press-ratio", "0.5", "--no-merge")
    r = json.loads(out)["readability"][str(tmp_path / "mine.txt")]
    assert code == 0 and r["tokens_in"] == 128 and r["kv_kept"] == pytest.approx(64 / 128)
    code, _, err = run(capsys, "eval", "--model", "no-such-model", "--readability",
                       str(tmp_path / "nothing-here"))
    assert code != 0 and "neither a held-out set" in err
    code, _, err = run(capsys, "generate", "--model", tiny_model_dir, "--prompt", doc,
                       "--press", "knorm", "--backend", "vllm")
    assert code != 0 and "torch runtime only" in err and len(err.strip().splitlines()) == 1


def _chat_file(tmp_path, model_dir) -> tuple:
    """A chat of four parts written as --chat reads it: its messages, the file, the model
    ``ktm generate --k 4 --no-mlp`` makes, and the chat's positions read plain."""
    from helpers import TEXT, fresh_model

    import ktm

    messages = [{"role": "system", "content": "Be brief."}]
    for t in range(4):
        messages += [{"role": "user", "content": f"Part {t}: {TEXT}"},
                     {"role": "assistant", "content": f"Noted {t}."}]
    messages.append({"role": "user", "content": "Which part was first?"})
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(m) for m in messages) + "\n\n")
    model = fresh_model(model_dir, k=4, use_mlp=False)
    plain = model.encode_prompts([ktm.chat_prompt(model, messages, merge=False)],
                                 embed=False)[0].tokens_out
    return messages, path, model, plain


def test_generate_reads_a_chat_file_within_a_history_budget(capsys, tiny_model_dir, tmp_path):
    """--chat FILE.jsonl reads as ktm.chat_prompt (the server's reading); --history-budget as
    its budget; bad files and flags are one-line errors."""
    import ktm

    messages, path, model, plain = _chat_file(tmp_path, tiny_model_dir)
    budget = plain * 3 // 4
    code, out, err = run(capsys, "generate", "--model", tiny_model_dir, "--k", "4", "--no-mlp",
                         "--chat", str(path), "--history-budget", str(budget),
                         "--max-new-tokens", "6")
    segs = ktm.chat_prompt(model, messages, history_budget=budget)
    assert code == 0
    assert out.strip() == model.generate(segs, max_new_tokens=6).strip()
    shown = model.encode_prompts([segs], embed=False)[0].tokens_out
    assert f"-> {shown}," in err and shown <= budget < plain
    path.write_text('{"role": "user", "content": "hi"}\nnot json\n')
    for flags, said in ((["--chat", str(path)], "chat.jsonl:2: not JSON"),
                        (["--chat", str(path), "--history-press", "knorm"], "--history-budget N"),
                        (["--chat", str(path), "--prompt", "x"], "one of them"),
                        (["--prompt", "x", "--history-budget", "9"], "reads a chat"),
                        ([], "one of them")):
        code, _, err = run(capsys, "generate", "--model", tiny_model_dir, *flags)
        assert code != 0 and said in err and len(err.strip().splitlines()) == 1


def test_generate_presses_a_chat_file_to_its_history_budget(capsys, tiny_model_dir, tmp_path):
    """--history-press: the older messages read plain, their KV pressed to the budget."""
    from helpers import require_module

    import ktm
    from ktm.serving.prompts import press_to_fit

    require_module("kvpress", "the [kvpress] extra and kvpress (the README's test command)")
    messages, path, model, plain = _chat_file(tmp_path, tiny_model_dir)
    budget = plain // 3
    code, out, err = run(capsys, "generate", "--model", tiny_model_dir, "--k", "4", "--no-mlp",
                         "--chat", str(path), "--history-budget", str(budget),
                         "--history-press", "knorm", "--max-new-tokens", "6")
    segs = ktm.chat_prompt(model, messages, history_budget=budget, pressed=True)
    model.use_press(press_to_fit(model, segs, budget, "knorm"))
    assert code == 0 and out.strip() == model.generate(segs, max_new_tokens=6).strip()
    assert f"-> {plain}; KV of {budget} kept (knorm" in err


@pytest.mark.parametrize("command,groups", [
    ("eval", ["evaluation", "task", "model", "runtime", "machine"]),
    ("serve", ["model", "server", "batching", "chat history", "runtime"]),
    ("train", ["task", "training", "teacher", "model", "machine"]),
    ("pretrain", ["pretraining", "training", "model", "machine"]),
    ("curriculum", ["curriculum", "training", "model", "machine"])])
def test_help_groups_the_flags_with_the_command_own_first(command, groups):
    from ktm.cli.main import _parser

    sub = _parser([command])._subparsers._group_actions[0].choices[command]
    titled = [g for g in sub._action_groups if g.title not in ("options", "positional arguments")]
    assert [g.title for g in titled] == groups
    flags = {g.title: {a.dest for a in g._group_actions} for g in titled}
    assert all(flags.values())  # no empty group
    if "runtime" in flags:
        assert {"backend", "press", "llamacpp_threads", "vllm_url"} <= flags["runtime"]
    if "model" in flags and command != "serve":
        assert {"k", "lora_r", "device"} <= flags["model"]
    assert not [a.dest for g in sub._action_groups if g.title == "options"
                for a in g._group_actions if a.dest != "help"]  # every flag in a group


def test_a_prompt_past_the_window_is_fitted_and_says_so(capsys, tiny_model_dir, tmp_path):
    """``ktm generate`` reads a document past the window at the ratio that fits it: a warning
    names the ratio, and the summary counts the positions it was read in."""
    doc = tmp_path / "long.txt"
    doc.write_text("alpha beta gamma delta epsilon zeta eta theta\n" * 80, encoding="utf-8")
    from ktm.core.allocate import RatioWarning

    with pytest.warns(RatioWarning, match=r"was read at ratio [\d.]+ .* to leave 3 of the "
                                          r"model's 512 after it"):
        code, out, err = run(capsys, "generate", "--model", tiny_model_dir, "--prompt-file",
                             str(doc), "--question", "What follows zeta?", "--max-new-tokens", "4")
    assert code == 0 and "Traceback" not in err
    n_in, n_out = map(int, re.search(r"prompt tokens (\d+) -> (\d+),", err).groups())
    assert n_out + 3 <= 512 < n_in / 4
