"""ktm report's plots on other people's files: the plot path, and labels that are method names."""

import json

import pytest


def _row(method, bal, red, k=None):
    return {"task": "amazon", "method": method, "k": k, "accuracy": bal,
            "balanced_accuracy": bal, "length_reduction": red}


def _write(tmp_path, rows) -> list[str]:
    paths = []
    for i, r in enumerate(rows):
        paths.append(str(tmp_path / f"r{i}.json"))
        (tmp_path / f"r{i}.json").write_text(json.dumps(r))
    return paths


@pytest.mark.parametrize("metrics", [False, True])
def test_a_plot_path_of_an_unknown_format_is_a_clear_error(metrics, tmp_path, capsys):
    # was a matplotlib ValueError traceback, exit 1, after all the work
    from ktm.cli import main

    if metrics:
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps(
            {"step": 1, "cpu_s": 6.0, "eval": {"balanced_accuracy": 0.5}}) + "\n")
        paths = [str(tmp_path / "run" / "metrics.jsonl")]
    else:
        paths = _write(tmp_path, [_row("k4", 0.7, 0.6, 4)])
    assert main(["report", *paths, "--plot", str(tmp_path / "p.xyz")]) == 2
    err = capsys.readouterr().err
    assert "p.xyz" in err and "'xyz'" in err and ".png" in err, err
    assert not list(tmp_path.glob("*p.xyz*"))


def test_method_and_run_names_with_dollar_signs_are_plotted_as_text(tmp_path, capsys):
    # matplotlib read "$...$" in a label as TeX: "$1 vs $2" lost its dollars, and a name
    # that is not valid TeX was a ValueError traceback
    from ktm.cli import main

    odd = r"k4 $\frac$ run"
    paths = _write(tmp_path, [_row("uncompressed", 0.8, 0.0), _row(odd, 0.7, 0.6, 4)])
    assert main(["report", *paths, "--plot", str(tmp_path / "p.png")]) == 0
    assert odd in capsys.readouterr().out
    run = tmp_path / odd
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps(
        {"step": 1, "cpu_s": 6.0, "eval": {"r $\\frac$": {"R": 0.5}}}) + "\n")
    assert main(["report", str(run / "metrics.jsonl"), "--plot", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 1000
