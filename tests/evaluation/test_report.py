"""ktm report: balanced accuracy as P, comparable rows, the readability table, odd result files."""

import json
import re

import pytest

from ktm.evaluation.report import report, score


def row(method, acc, bal, red, k=None):
    return {"task": "amazon", "method": method, "k": k, "accuracy": acc,
            "balanced_accuracy": bal, "length_reduction": red}


def test_classification_p_is_balanced_accuracy():
    # a majority-class answerer: high accuracy, chance balanced accuracy
    rows = score([row("uncompressed", 0.89, 0.75, 0.0), row("k4", 0.82, 0.50, 0.67, 4)])
    k4 = next(r for r in rows["amazon"] if r["method"] == "k4")
    assert k4["P"] == 0.50
    assert k4["pl_f1"] == pytest.approx(2 * 0.5 * 0.67 / 1.17)


def test_readability_rows_get_their_own_table(tmp_path):
    r = {"task": "readability", "method": "ktm-k4", "k": 4, "git": "0123abcd", "readability": {
        "code": {"R": 0.61, "R_ci95": [0.55, 0.66], "nll_merged": 1.5, "nll_plain": 1.1,
                 "nll_none": 2.5, "tokens_in": 256.0, "tokens_out": 64.0},
        "reviews": {"R": None, "nll_merged": 3.0, "nll_plain": 3.2, "nll_none": 3.1,
                    "tokens_in": 90.0, "tokens_out": 23.0}}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(r))
    out = report([str(path)])
    assert ("| ktm-k4 | 4 | code | 0.610 [0.550, 0.660] | 1.500 | 1.100 | 2.500 | 256.0 | 64.0 |"
            in out)
    assert "| ktm-k4 | 4 | reviews | – |" in out


def test_report_on_pretraining_metrics_gives_r_per_cpu_minute(tmp_path):
    from ktm.cli.main import main

    run = tmp_path / "k4-probe"
    run.mkdir()
    rows = [{"step": 1, "loss": 3.0, "cpu_s": 30.0},
            {"step": 1, "cpu_s": 30.0, "eval": {"code": {"R": 0.2}, "reviews": {"R": None}}},
            {"step": 2, "cpu_s": 90.0, "eval": {"code": {"R": 0.45}, "reviews": {"R": 0.3}}}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = report([str(run / "metrics.jsonl")], str(tmp_path / "c.png"))
    assert "| k4-probe | 1 | 0.5 | 0.200 | – |" in out
    assert "| k4-probe | 2 | 1.5 | 0.450 | 0.300 |" in out
    assert (tmp_path / "c.png").stat().st_size > 1000
    assert "| run | step | CPU-min | R code | R reviews |" in out
    (tmp_path / "bad.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    assert main(["report", str(tmp_path / "bad.jsonl")]) == 2


def test_report_on_fine_tuning_metrics_gives_the_task_metric_per_cpu_minute(tmp_path):
    # ktm train --eval-every: classification runs give balanced accuracy, generation perplexity
    (tmp_path / "tree").mkdir()
    (tmp_path / "commitpack").mkdir()
    tree = [{"step": 30, "loss": 1.0, "cpu_s": 60.0},
            {"step": 30, "cpu_s": 60.0, "eval": {"accuracy": 0.9, "balanced_accuracy": 0.75}},
            {"step": 60, "cpu_s": 120.0, "eval": {"accuracy": 0.9, "balanced_accuracy": 0.875}}]
    code = [{"step": 30, "cpu_s": 30.0, "eval": {"perplexity": 4.25, "nll": 1.45}}]
    for path, rows in ((tmp_path / "tree" / "k4.metrics.jsonl", tree),
                       (tmp_path / "commitpack" / "k4.metrics.jsonl", code)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = report([str(tmp_path / "tree" / "k4.metrics.jsonl"),
                  str(tmp_path / "commitpack" / "k4.metrics.jsonl")], str(tmp_path / "f.png"))
    assert "| run | step | CPU-min | balanced_accuracy | perplexity |" in out
    assert "| tree/k4 | 30 | 1.0 | 0.750 | – |" in out
    assert "| tree/k4 | 60 | 2.0 | 0.875 | – |" in out
    assert "| commitpack/k4 | 30 | 0.5 | – | 4.250 |" in out
    assert (tmp_path / "f.png").stat().st_size > 1000


def test_results_from_a_dirty_tree_are_flagged(tmp_path):
    rows = [{**row("uncompressed", 0.9, 0.8, 0.0), "git": "0123abcd"},
            {**row("k4", 0.8, 0.7, 0.7, 4), "git": "0123abcd-dirty"},
            {**row("k2", 0.85, 0.75, 0.5, 2), "git": "4567ef01"},
            {**row("llmlingua", 0.6, 0.6, 0.5), "git": None}]
    paths = []
    for i, r in enumerate(rows):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(r))
    out = report([str(p) for p in paths])
    assert "| k4 † | 4 |" in out and "| uncompressed | – |" in out and "| k2 | 2 |" in out
    assert "| llmlingua ‡ | – |" in out
    assert "† from a dirty tree" in out and ": k4" in out
    assert "‡ no git revision recorded: llmlingua" in out
    assert "results come from 2 revisions: 0123abcd, 4567ef01" in out


def test_tree_stages_are_separate_tables():
    small = {**row("uncompressed", 0.9, 0.9, 0.0), "task": "tree",
             "config": {"task": {"name": "tree", "stage": "small"}}}
    xmed = {**row("uncompressed", 0.8, 0.8, 0.0), "task": "tree",
            "config": {"task": {"name": "tree", "stage": "xmedium"}}}
    assert set(score([small, xmed])) == {"tree small", "tree xmedium"}
    assert set(score([row("k4", 0.8, 0.5, 0.6)])) == {"amazon"}  # no stage: the task alone


def test_a_result_file_that_is_not_one_object_is_a_clear_error(tmp_path, capsys):
    from ktm.cli.main import main

    (tmp_path / "r.json").write_text("[1, 2]")  # was an AttributeError traceback
    assert main(["report", str(tmp_path / "r.json")]) == 2
    assert "holds a JSON list: expected one object" in capsys.readouterr().err


def test_one_task_scored_by_accuracy_and_by_perplexity_gets_two_tables(tmp_path):
    # custom data with few distinct targets is scored by accuracy, other data by perplexity;
    # the one table of the task looked up 'perplexity' in the accuracy row (KeyError)
    acc = {**row("k4", 0.8, 0.7, 0.6, 4), "task": "custom"}
    ppl = {"task": "custom", "method": "k2", "k": 2, "perplexity": 3.0, "length_reduction": 0.5}
    paths = []
    for i, r in enumerate((acc, ppl)):
        paths.append(str(tmp_path / f"{i}.json"))
        (tmp_path / f"{i}.json").write_text(json.dumps(r))
    out = report(paths, str(tmp_path / "p.png"))
    assert "### custom (accuracy)" in out and "### custom (perplexity)" in out
    assert "| k2 ‡ | 2 | 3.000 | 1.000 | 50.0% |" in out
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_metrics_of_a_run_killed_mid_write_are_read(tmp_path):
    run = tmp_path / "killed"
    run.mkdir()
    row1 = {"step": 1, "cpu_s": 60.0, "eval": {"code": {"R": 0.2}}}
    (run / "metrics.jsonl").write_text(json.dumps(row1) + '\n{"step": 2, "cpu')  # half a line
    (run / "run.json").write_text('{"config": ')  # and a half-written run.json
    out = report([str(run / "metrics.jsonl")], str(tmp_path / "c.png"))
    assert "| killed | 1 | 1.0 | 0.200 |" in out


ODD_ROWS = {  # each was a traceback (KeyError / TypeError) or a silent wrong number
    "null length reduction": (row("k4", 0.8, 0.7, None), "length_reduction=None"),
    "accuracy as text": (row("k4", "0.8", 0.7, 0.5), "accuracy='0.8'"),
    "NaN accuracy": (row("k4", float("nan"), 0.7, 0.5), "accuracy=nan"),
    "null balanced accuracy": (row("k4", 0.8, None, 0.5), "balanced_accuracy=None"),
    # P of a classification row is balanced accuracy: plain accuracy would rank a
    # majority-class answerer as if it were balanced
    "no balanced accuracy": ({k: v for k, v in row("k4", 0.8, 0.7, 0.5).items()
                              if k != "balanced_accuracy"}, "lacks \\['balanced_accuracy'\\]"),
    "null perplexity": ({"task": "c", "method": "m", "perplexity": None,
                         "length_reduction": 0.5}, "perplexity=None"),
    "zero perplexity": ({"task": "c", "method": "m", "perplexity": 0.0,
                         "length_reduction": 0.5}, "perplexity=0.0"),
    "no task": ({**row("k4", 0.8, 0.7, 0.5), "task": None}, "task=None"),
    "no method": ({**row("k4", 0.8, 0.7, 0.5), "method": ""}, "method=''"),
    "text k": (row("k4", 0.8, 0.7, 0.5, k="4"), "k='4'"),
    "readability without method": ({"task": "readability", "readability": {"code": {"R": 0.5}}},
                                   "method=None"),
    "readability without NLLs": ({"task": "readability", "method": "m",
                                  "readability": {"code": {"R": 0.5}}}, "code.*nll_merged=None"),
    "readability as a list": ({"task": "readability", "method": "m", "readability": [1]},
                              "readability=\\[1\\]"),
}


@pytest.mark.parametrize("name", ODD_ROWS)
def test_odd_result_rows_are_clear_errors_naming_the_file(name, tmp_path, capsys):
    from ktm.cli.main import main

    bad, match = ODD_ROWS[name]
    path = tmp_path / "odd.json"
    path.write_text(json.dumps(bad))
    assert main(["report", str(path), "--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert "odd.json" in err and re.search(match, err), err
    assert not (tmp_path / "p.png").exists()


def test_a_result_given_twice_is_one_row(tmp_path):
    # overlapping globs (results/*/*.json results/amazon/*.json) or a copied file
    path, copy = tmp_path / "a.json", tmp_path / "copy.json"
    path.write_text(json.dumps(row("k4", 0.8, 0.7, 0.5, 4)))
    copy.write_text(path.read_text())
    out = report([str(path), str(path), str(copy)])
    assert out.count("| k4 ‡ | 4 |") == 1


@pytest.mark.parametrize("bad, match", [
    ({"step": 1, "cpu_s": None, "eval": {"accuracy": 0.5}}, "cpu_s=None"),
    ({"step": 1, "cpu_s": 5, "eval": {"balanced_accuracy": "0.5"}}, "balanced_accuracy='0.5'"),
    ({"step": 1, "cpu_s": 5, "eval": {"code": {"R": "x"}}}, "R code='x'"),
    ({"step": "1", "cpu_s": 5, "eval": {"accuracy": 0.5}}, "step='1'"),
])
def test_odd_metrics_rows_are_clear_errors(bad, match, tmp_path, capsys):
    # were TypeError / ValueError tracebacks
    from ktm.cli.main import main

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps(bad) + "\n")
    assert main(["report", str(tmp_path / "run" / "metrics.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl" in err and match in err and "row 1" in err, err


def test_a_plot_asked_of_readability_rows_alone_is_an_error(tmp_path, capsys):
    # the plot is of task rows; asked for with none, nothing was written and nothing said
    from ktm.cli.main import main

    r = {"task": "readability", "method": "ktm-k4", "k": 4, "readability": {"code": {
        "R": 0.6, "nll_merged": 1.5, "nll_plain": 1.1, "nll_none": 2.5, "tokens_in": 256.0,
        "tokens_out": 64.0}}}
    (tmp_path / "r.json").write_text(json.dumps(r))
    assert main(["report", str(tmp_path / "r.json"), "--plot", str(tmp_path / "p.png")]) == 2
    assert "no task results to plot" in capsys.readouterr().err


def _amazon(method, bal, n=300, scoring=None, **task):
    """A row as `ktm eval` writes it: the task's settings and the evaluation protocol."""
    ev = {"n_eval": n, "seed": 1, "merge": method == "uncompressed", "device": "cpu"}
    if scoring:
        ev.update(scoring=scoring, n_calibrate=300 if scoring == "likelihood" else 0)
    settings = {"name": "amazon", "data_path": None, "prompt_mode": "context", "test_size": 2000,
                "max_chars": 400, "split_seed": 42, "eval_path": None, **task}
    return {**row(method, 0.8, bal, 0.6, 4), "n": n,
            "config": {"task": settings, "eval": ev, "compressor": None}}


def test_rows_scored_on_other_examples_or_another_way_are_separate_tables():
    # all of these were one "amazon" table and one Pareto frontier
    groups = score([_amazon("uncompressed", 0.8), _amazon("k4", 0.6),
                    _amazon("k4-n1000", 0.7, n=1000),
                    _amazon("k4-lik", 0.78, scoring="likelihood"),
                    _amazon("k4-short", 0.5, max_chars=200)])
    assert {name: sorted(r["method"] for r in rows) for name, rows in groups.items()} == {
        "amazon (n=300, scoring=generate, max_chars=400)": ["k4", "uncompressed"],
        "amazon (n=1000, scoring=generate, max_chars=400)": ["k4-n1000"],
        "amazon (n=300, scoring=likelihood, n_calibrate=300, max_chars=400)": ["k4-lik"],
        "amazon (n=300, scoring=generate, max_chars=200)": ["k4-short"]}


def test_rows_that_differ_only_in_training_or_record_format_share_a_table():
    # balance_train changes the training examples only; a row written before an option or
    # `scoring` was recorded ran with its default
    groups = score([_amazon("uncompressed", 0.8), _amazon("k4", 0.6, balance_train=False),
                    _amazon("k4-bal", 0.7, scoring="generate", balance_train=True)])
    assert list(groups) == ["amazon"] and len(groups["amazon"]) == 3


def test_namesakes_of_one_table_are_told_apart_by_their_files(tmp_path):
    # results/amazon/k4.json and results/amazon-seed1/k4.json were two rows named "k4"
    files = {"amazon/k4.json": 0.60, "amazon-seed1/k4.json": 0.56, "amazon-long/k4.json": 0.63,
             "amazon-long/k4r.json": 0.70, "amazon/uncompressed.json": 0.84}
    paths = []
    for name, bal in files.items():
        method = "uncompressed" if "uncompressed" in name else "k4"
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(json.dumps(_amazon(method, bal)))
        paths.append(str(tmp_path / name))
    out = report(paths)
    for label, bal in (("amazon/k4", 0.600), ("amazon-seed1/k4", 0.560),
                       ("k4 (amazon-long/k4.json)", 0.630), ("k4 (amazon-long/k4r.json)", 0.700),
                       ("uncompressed", 0.840)):
        assert re.search(rf"^\| {re.escape(label)} ‡ \| .* \| {bal:.3f} \|", out, re.M), label


def test_a_perplexity_table_without_the_uncompressed_row_says_so(tmp_path):
    # P = ppl_min / ppl silently made the best compressed method P = 1
    k4 = {"task": "commitpack", "method": "k4", "k": 4, "perplexity": 3.8, "length_reduction": 0.5}
    k2 = {**k4, "method": "k2", "k": 2, "perplexity": 3.6}
    plain = {**k4, "method": "uncompressed", "k": None, "perplexity": 3.4, "length_reduction": 0}
    paths = []
    for r in (k4, k2, plain):
        paths.append(str(tmp_path / f"{r['method']}.json"))
        (tmp_path / f"{r['method']}.json").write_text(json.dumps(r))
    out = report(paths[:2])
    assert ("No uncompressed row: P is relative to the best method given, k2 (perplexity 3.600)"
            in out)
    assert "No uncompressed row" not in report(paths)


def test_a_glob_over_a_results_folder_sets_aside_what_other_commands_wrote(tmp_path, capsys):
    # `ktm report results/*/*.json` (the README's example) stopped at results/bench/*.json
    from ktm.cli.main import main

    for d in ("amazon", "bench", "demo"):
        (tmp_path / d).mkdir()
    (tmp_path / "amazon" / "k4.json").write_text(json.dumps(row("k4", 0.8, 0.7, 0.6, 4)))
    (tmp_path / "bench" / "quick.json").write_text(json.dumps(
        [{"mode": "infer", "method": "uncompressed", "k": 1, "batch": 1}]))
    (tmp_path / "demo" / "demo.json").write_text(json.dumps(
        {"config": {}, "start": {"accuracy": 0.5}, "trained": {"accuracy": 0.9}}))
    # a `ktm train` run folder holding its eval result: its run.json was "lacks ['method', ...]"
    (tmp_path / "amazon" / "run.json").write_text(json.dumps(
        {"config": {}, "model": {}, "n_examples": 2000, "task": {"name": "amazon"},
         "history": []}))
    paths = sorted(str(p) for p in tmp_path.glob("*/*.json"))
    assert main(["report", *paths]) == 0
    out = capsys.readouterr().out
    assert "| k4 ‡ | 4 |" in out
    assert (f"skipped, not `ktm eval` results: 1 `ktm train/pretrain` file in "
            f"{tmp_path / 'amazon'}; 1 `ktm bench` file in {tmp_path / 'bench'}; "
            f"1 `ktm demo` file in {tmp_path / 'demo'}") in out
    assert main(["report", paths[2]]) == 2  # nothing to report is still an error
    assert "no `ktm eval` result files given: skipped" in capsys.readouterr().err


def test_readability_namesakes_are_told_apart_and_a_missing_k_is_a_dash(tmp_path):
    # two folders' ktm-k4 rows were two identical-looking lines; a base model's k: null was "None"
    paths = []
    for folder, method, k, r in (("a", "ktm-k4", 4, 0.6), ("b", "ktm-k4", 4, 0.5),
                                 ("b", "base", None, 0.1)):
        sets = {"code": {"R": r, "nll_merged": 1.5, "nll_plain": 1.1, "nll_none": 2.5,
                         "tokens_in": 256.0, "tokens_out": 64.0}}
        (tmp_path / folder).mkdir(exist_ok=True)
        path = tmp_path / folder / f"{method}.json"
        path.write_text(json.dumps({"task": "readability", "method": method, "k": k,
                                    "readability": sets}))
        paths.append(str(path))
    out = report(paths)
    assert "| a/ktm-k4 ‡ | 4 | code | 0.600 |" in out and "| b/ktm-k4 ‡ | 4 | code | 0.500 |" in out
    assert "| base ‡ | – | code |" in out
    assert "no git revision recorded: a/ktm-k4, b/ktm-k4, base" in out


def test_a_name_with_a_bar_or_a_line_break_stays_one_table_cell(tmp_path):
    # "a|b" split its row into one column too many; a line break cut the row in two
    r = {"task": "readability", "method": "k4\nreader", "k": 4, "readability": {"co|de": {
        "R": 0.6, "nll_merged": 1.5, "nll_plain": 1.1, "nll_none": 2.5, "tokens_in": 256.0,
        "tokens_out": 64.0}}}
    paths = [str(tmp_path / "r.json"), str(tmp_path / "t.json")]
    (tmp_path / "r.json").write_text(json.dumps(r))
    (tmp_path / "t.json").write_text(json.dumps(row("k4|k2", 0.8, 0.7, 0.6, 4)))
    lines = report(paths).splitlines()
    assert "| k4\\|k2 ‡ | 4 | 0.800 | 0.700 | 60.0% |" in "\n".join(lines)
    assert any(line.startswith("| k4 reader ‡ | 4 | co\\|de | 0.600 |") for line in lines)


def test_namesakes_given_by_relative_paths_are_labelled_by_their_real_folders(tmp_path,
                                                                              monkeypatch):
    # in results/amazon, "k4.json ../amazon-seed1/k4.json" labelled the first row "k4" alone,
    # and "../k4.json" gave "../k4"
    for folder, bal in (("amazon", 0.6), ("amazon-seed1", 0.5)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "k4.json").write_text(json.dumps(row("k4", 0.8, bal, 0.6, 4)))
    monkeypatch.chdir(tmp_path / "amazon")
    out = report(["k4.json", "../amazon-seed1/k4.json"])
    assert "| amazon/k4 ‡ | 4 | 0.800 | 0.600 |" in out
    assert "| amazon-seed1/k4 ‡ | 4 | 0.800 | 0.500 |" in out
