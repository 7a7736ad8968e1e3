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
