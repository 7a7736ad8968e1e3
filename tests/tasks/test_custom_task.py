"""The ``custom`` task: a user's JSONL in, merged context + plain prompt, metric chosen by data."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from ktm.cli.main import main
from ktm.core.loss import target_ids
from ktm.core.prompt import Segment
from ktm.errors import KTMError
from ktm.tasks import get_task
from ktm.tasks.custom import AUTO_MAX_LABELS, CustomTask


def _write(path: Path, rows: list, raw: str = "") -> str:
    text = "".join(json.dumps(r) + "\n" for r in rows) + raw
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return str(path)


def _labelled(n: int = 30) -> list[dict]:
    """Two labels; every third row has no prompt (absent or empty)."""
    rows = []
    for i in range(n):
        row = {"context": f"The quick brown fox {i} jumps.", "target": ("yes", "no")[i % 2]}
        if i % 3 == 1:
            row["prompt"] = "Is it even?"
        elif i % 3 == 2:
            row["prompt"] = ""
        rows.append(row)
    return rows


def _free_text(n: int = 30) -> list[dict]:
    return [{"context": f"def add(a, b):\n    return a + {i}\n", "prompt": "Rewrite it.",
             "target": f"def add(a, b):\n    return b + {i}\n"} for i in range(n)]


def test_row_becomes_merged_context_then_plain_prompt(tmp_path):
    rows = [{"context": "Hello world", "prompt": "Answer:", "target": " yes "},
            {"context": "Lazy dog", "target": "no"}, {"context": "Fox", "target": "no"},
            {"context": "Quick", "target": "yes"}]  # whichever row is held out, both labels train
    path = _write(tmp_path / "d.jsonl", rows)
    task = CustomTask(data_path=path, test_size=1, split_seed=0)
    by_line = {r.line_no: task._example(r) for r in task.rows}
    assert by_line[1].segments == (Segment("Hello world"), Segment("\nAnswer:\n", compress=False))
    assert by_line[2].segments == (Segment("Lazy dog"), Segment("\n", compress=False))
    # labels are the stripped targets, and the answer text is the bare label
    assert task.kind == "classification"
    assert (by_line[1].target, by_line[1].label) == ("yes", "yes")
    paper = CustomTask(data_path=path, prompt_mode="paper", test_size=1, split_seed=0)
    assert paper._example(paper.rows[0]).segments == (Segment("Hello world\nAnswer:\n"),)
    ppl = CustomTask(data_path=path, metric="perplexity", test_size=1, split_seed=0)
    assert ppl._example(ppl.rows[0]).target == " yes "  # scored verbatim
    assert ppl._example(ppl.rows[0]).label is None and ppl.labels == ()


def test_custom_field_names_and_gzip(tmp_path):
    rows = [{"doc": f"text {i}", "q": "Which?", "a": "A" if i % 2 else "B"} for i in range(10)]
    path = _write(tmp_path / "d.jsonl.gz", rows)
    task = get_task("custom", data_path=path, context_field="doc", prompt_field="q",
                    target_field="a", test_size=2)
    ex = task.train_examples(1, seed=0)[0]
    assert ex.segments[0].text.startswith("text ") and ex.segments[1].text == "\nWhich?\n"
    assert task.labels == ("A", "B")


def test_split_is_deterministic_disjoint_and_follows_the_seed(tmp_path):
    path = _write(tmp_path / "d.jsonl", _labelled(30))
    a, b = CustomTask(data_path=path), CustomTask(data_path=path)
    lines = [[r.line_no for r in t.train_rows] for t in (a, b)]
    test = [r.line_no for r in a.eval_rows]
    assert lines[0] == lines[1] and len(test) == 6  # ceil(0.2 * 30)
    assert sorted(lines[0] + test) == list(range(1, 31))
    other = CustomTask(data_path=path, split_seed=7)
    assert [r.line_no for r in other.eval_rows] != test
    assert len(CustomTask(data_path=path, test_size=4).eval_rows) == 4
    assert a.train_examples(10, seed=3) == b.train_examples(10, seed=3)
    assert a.eval_examples(4, seed=3) == b.eval_examples(4, seed=3)
    assert len(a.eval_examples(100, seed=0)) == 6  # distinct rows, no repeats


def test_eval_path_scores_a_separate_file_and_all_rows_train(tmp_path):
    path = _write(tmp_path / "d.jsonl", _labelled(12))
    held = _write(tmp_path / "e.jsonl", _labelled(5))
    task = CustomTask(data_path=path, eval_path=held)
    assert len(task.train_rows) == 12 and [r.line_no for r in task.eval_rows] == [1, 2, 3, 4, 5]


def test_auto_metric_picks_accuracy_for_a_label_set(tmp_path):
    task = CustomTask(data_path=_write(tmp_path / "d.jsonl", _labelled()))
    assert (task.chosen_metric, task.kind, task.labels) == ("accuracy", "classification",
                                                           ("no", "yes"))


def test_auto_metric_picks_perplexity_for_free_text(tmp_path):
    task = CustomTask(data_path=_write(tmp_path / "d.jsonl", _free_text()))
    assert (task.chosen_metric, task.kind, task.labels) == ("perplexity", "perplexity", ())
    ex = task.eval_examples(1, seed=0)[0]
    assert ex.label is None and ex.target.startswith("def add")


def test_auto_metric_boundary_and_unseen_eval_labels(tmp_path):
    rows = [{"context": f"c{i}", "target": f"t{i % AUTO_MAX_LABELS}"} for i in range(100)]
    task = CustomTask(data_path=_write(tmp_path / "a.jsonl", rows), test_size=1)
    assert task.chosen_metric == "accuracy" and len(task.labels) == AUTO_MAX_LABELS
    rows = [{"context": f"c{i}", "target": f"t{i % (AUTO_MAX_LABELS + 1)}"} for i in range(100)]
    assert CustomTask(data_path=_write(tmp_path / "b.jsonl", rows),
                      test_size=1).chosen_metric == "perplexity"
    # few labels, but the evaluation file has one training never saw: not a label set
    train = _write(tmp_path / "t.jsonl", _labelled(10))
    held = _write(tmp_path / "h.jsonl", [{"context": "x", "target": "maybe"}])
    assert CustomTask(data_path=train, eval_path=held).chosen_metric == "perplexity"
    with pytest.raises(KTMError, match=r"metric='accuracy' but evaluation targets \['maybe'\]"):
        _ = CustomTask(data_path=train, eval_path=held, metric="accuracy").kind
    assert CustomTask(data_path=train, metric="perplexity").kind == "perplexity"


def test_parse_label_is_an_exact_match_of_the_stripped_answer(tmp_path):
    rows = [{"context": f"c{i}", "target": ("very good", "bad")[i % 2]} for i in range(10)]
    task = CustomTask(data_path=_write(tmp_path / "d.jsonl", rows), test_size=2)
    assert task.parse_label("  very good\n") == "very good"
    assert task.parse_label("very") is None  # the first-word rule would not do for these labels
    assert task.parse_label("Very good") is None and task.parse_label("bad bad") is None


def test_a_label_with_a_combining_accent_matches_a_normalizing_tokenizers_answer(tmp_path):
    """A tokenizer with an NFC normalizer answers "café" composed, whichever way the label spelt
    it; the exact match never matched a label written with a combining accent."""
    from helpers import build_tokenizer
    from tokenizers import normalizers

    decomposed = "cafe\u0301 noir"
    tok = build_tokenizer()
    tok.backend_tokenizer.normalizer = normalizers.NFC()
    answer = tok.decode(tok(decomposed, add_special_tokens=False)["input_ids"])
    assert answer == "caf\u00e9 noir" != decomposed
    rows = [{"context": f"c{i}", "target": (decomposed, "\u4e2d\u6587 \U0001f642")[i % 2]}
            for i in range(10)]
    task = CustomTask(data_path=_write(tmp_path / "d.jsonl", rows), test_size=2)
    assert task.parse_label(answer + "\n") == decomposed
    assert task.parse_label(" \u4e2d\u6587 \U0001f642 ") == "\u4e2d\u6587 \U0001f642"
    assert task.parse_label("cafe noir") is None


@pytest.mark.parametrize("line, expected", [
    ('{"context": "a"}', "line 2: missing field 'target'"),
    ('{"target": "a"}', "line 2: missing field 'context'"),
    ('{"context": 3, "target": "a"}', "line 2: field 'context' must be str, got int"),
    ('{"context": "a", "target": ["a"]}', "line 2: field 'target' must be str, got list"),
    ('{"context": "a", "target": "b", "prompt": 1}', "line 2: field 'prompt' must be str or"),
    ('{"context": " ", "target": "b"}', "line 2: field 'context' must be a non-empty string"),
    ('{"context": "a", "target": ""}', "line 2: field 'target' must be a non-empty string"),
    ('{"context": "a", "target": "b"', "line 2: expected a JSON object, got bad JSON"),
    # JSON may escape half a UTF-16 pair; the tokenizer's TypeError was a traceback
    ('{"context": "a\\ud800b", "target": "b"}', r"line 2: field 'context' holds a lone "
                                                r"surrogate '\\ud800' \(half of a UTF-16 pair"),
    ('{"context": "a", "target": "\\udc00"}', "line 2: field 'target' holds a lone surrogate"),
])
def test_bad_rows_name_the_line_and_field(tmp_path, line, expected):
    path = _write(tmp_path / "bad.jsonl", [{"context": "ok", "target": "ok"}], raw=line + "\n")
    with pytest.raises(KTMError, match=rf"bad\.jsonl {expected}"):
        _ = CustomTask(data_path=path).rows


def test_option_errors_are_clear(tmp_path):
    with pytest.raises(KTMError, match="task 'custom' needs the option data_path"):
        get_task("custom")
    with pytest.raises(KTMError, match="data file not found"):
        get_task("custom", data_path=str(tmp_path / "nope.jsonl"))
    path = _write(tmp_path / "d.jsonl", _labelled(10))
    with pytest.raises(KTMError, match="option metric='f1': expected 'auto' or 'accuracy' or "
                                       "'perplexity'"):
        get_task("custom", data_path=path, metric="f1")
    with pytest.raises(KTMError, match="has no option context"):
        get_task("custom", data_path=path, context="text")
    with pytest.raises(KTMError, match="test_fraction=1.5"):
        get_task("custom", data_path=path, test_fraction=1.5)


def test_evaluate_task_reads_answers_with_the_tasks_parser(tmp_path, ktm_model, monkeypatch):
    """Generated answers are matched whole, the generation has room for the longest label, and
    the row records the chosen metric."""
    from ktm.evaluation.evaluate import evaluate_task

    long_label = "the quick brown fox jumps over the lazy dog"
    rows = [{"context": f"c{i}", "target": (long_label, "no")[i % 2]} for i in range(10)]
    task = CustomTask(data_path=_write(tmp_path / "d.jsonl", rows), test_size=4)
    examples = task.eval_examples(4, seed=0)
    seen = {}

    def fake_generate(prompts, max_new_tokens, **kwargs):
        seen["max_new_tokens"] = max_new_tokens
        return [" " + e.target + "\n" for e in examples[:len(prompts)]]

    monkeypatch.setattr(ktm_model, "generate", fake_generate)
    row = evaluate_task(ktm_model, task, examples)
    assert row["metric"] == "accuracy" and row["accuracy"] == 1.0 and row["unparsed"] == 0
    assert seen["max_new_tokens"] == len(target_ids(ktm_model, long_label)) > 4


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_train_then_eval_on_own_jsonl(capsys, tiny_model_dir, tmp_path):
    data = _write(tmp_path / "own.jsonl", _labelled(24))
    run_dir = tmp_path / "run"
    code, out, err = _run(capsys, "train", "--model", tiny_model_dir, "--k", "2", "--task",
                          "custom", "--task-option", f"data_path={data}", "--n-train", "8",
                          "--n-eval", "4", "--max-steps", "2", "--batch-size", "4",
                          "--out-dir", str(run_dir), "--no-progress")
    assert code == 0, err
    assert json.loads(out)["eval"]["metric"] == "accuracy"
    ckpt = str(run_dir / "checkpoint")
    res = tmp_path / "r.json"
    code, _, err = _run(capsys, "eval", "--checkpoint", ckpt, "--task", "custom",
                        "--task-option", f"data_path={data}", "--n-eval", "4",
                        "--scoring", "likelihood", "--json", str(res))
    assert code == 0, err
    row = json.loads(res.read_text())
    assert (row["task"], row["metric"], row["n"], row["unparsed"]) == ("custom", "accuracy", 4, 0)
    assert 0.0 <= row["balanced_accuracy"] <= 1.0 and row["tokens_after"] < row["tokens_before"]
    assert row["config"]["task"]["metric"] == "auto"
    assert set(row["scoring"]["targets"]) == {"yes", "no"}
    free = _write(tmp_path / "free.jsonl", _free_text(10))
    code, _, err = _run(capsys, "eval", "--checkpoint", ckpt, "--task", "custom", "--data-path",
                        free, "--n-eval", "2", "--json", str(res))
    assert code == 0, err
    row = json.loads(res.read_text())
    assert row["metric"] == "perplexity" and row["perplexity"] > 1.0 and "accuracy" not in row


def test_cli_without_data_path_exits_2_naming_the_option(capsys, tiny_model_dir, tmp_path):
    code, _, err = _run(capsys, "eval", "--model", tiny_model_dir, "--task", "custom",
                        "--n-eval", "2", "--json", str(tmp_path / "r.json"))
    assert code == 2 and "needs the option data_path" in err and "Traceback" not in err
    assert not (tmp_path / "r.json").exists()


def test_the_shipped_evaluation_only_sets_are_refused_as_training_data(tmp_path):
    held = tmp_path / "amazon_reviews_other"
    held.mkdir()
    path = held / "reviews.jsonl"
    path.write_text(json.dumps({"context": "a", "target": "b"}) + "\n")
    with pytest.raises(KTMError, match="evaluation-only"):
        CustomTask(data_path=str(path))
    ok = tmp_path / "mine.jsonl"
    ok.write_text(path.read_text())
    assert CustomTask(data_path=str(ok), eval_path=str(path)).eval_rows[0].target == "b"


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_a_byte_order_mark_and_crlf_lines_are_read(tmp_path, suffix):
    """A file saved by a Windows editor: BOM first, CRLF line ends, blank lines. The BOM made
    line 1 'bad JSON'."""
    rows = [{"context": f"text {i} é 中文 🙂", "target": "yes" if i % 2 else "no"}
            for i in range(6)]
    text = "\ufeff" + "".join(json.dumps(r, ensure_ascii=False) + "\r\n\r\n" for r in rows)
    path = tmp_path / f"d{suffix}"
    data = text.encode("utf-8")
    path.write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)
    task = CustomTask(data_path=str(path), test_size=2)
    assert [r.context for r in task.rows] == [r["context"] for r in rows]
    assert [r.line_no for r in task.rows] == [1, 3, 5, 7, 9, 11]
    assert task.labels == ("no", "yes")


@pytest.mark.parametrize("long_in", ["eval", "train"])
def test_a_row_over_the_position_limit_is_refused_before_training(capsys, tiny_model_dir,
                                                                 tmp_path, long_in):
    """A row whose prompt does not fit the model's 512 positions at K=2 failed only when the
    run evaluated it, after training (or at the training step that drew it), naming no line;
    now before anything is written, naming the file, the line, the length, the limit and the
    K that fits."""
    rows, long_row = _labelled(12), {"context": " fox" * 1100, "target": "yes"}
    train_rows = rows[:3] + [long_row] + rows[3:] if long_in == "train" else rows
    eval_rows = rows[:1] + [long_row] if long_in == "eval" else rows[:2]
    data = _write(tmp_path / "own.jsonl", train_rows)
    held = _write(tmp_path / "held.jsonl", eval_rows)
    bad, line = (held, 2) if long_in == "eval" else (data, 4)
    run_dir = tmp_path / "run"
    code, _, err = _run(capsys, "train", "--model", tiny_model_dir, "--k", "2", "--task",
                        "custom", "--task-option", f"data_path={data}", "--task-option",
                        f"eval_path={held}", "--n-train", "40", "--n-eval", "4",
                        "--max-steps", "1", "--batch-size", "2", "--out-dir", str(run_dir),
                        "--no-progress")
    assert code == 2, err
    assert f"{bad} line {line}: prompt is " in err and "K=3 would fit" in err, err
    assert "over the model's limit of 512 positions" in err and "Traceback" not in err
    assert not run_dir.exists()


def test_labels_that_differ_only_by_invisible_format_characters_are_one_label(tmp_path):
    """A zero-width space, a word joiner or a BOM pasted into a target (Unicode category Cf)
    is invisible and not whitespace to ``strip()``: "yes" and "yes\\u200b" were two labels,
    splitting the class's rows; now they are one, spelled as most rows spell it, and an answer
    with or without them matches it. A target of format characters alone is empty."""
    spellings = ["yes", "yes\u200b", "\ufeffyes", "y\u2060es", "yes"]
    rows = [{"context": f"c{i}", "target": (spellings[i % 5] if i % 2 else "no")}
            for i in range(20)]
    task = CustomTask(data_path=_write(tmp_path / "d.jsonl", rows), test_size=2, split_seed=0)
    assert task.labels == ("no", "yes") and task.kind == "classification"
    assert {e.label for e in task.train_examples(20, 0)} == {"no", "yes"}
    assert task.parse_label("yes\u200b\n") == "yes" == task.parse_label("\u2060yes")
    bad = _write(tmp_path / "bad.jsonl", [{"context": "a", "target": "\u200b\ufeff "}])
    with pytest.raises(KTMError, match="line 1: field 'target' must be a non-empty string"):
        _ = CustomTask(data_path=bad).rows
