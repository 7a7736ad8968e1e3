"""ktm report on training runs' metrics.jsonl: which run is which."""

import json

from ktm.evaluation.report import report


def _run(folder, bal: float) -> str:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text(json.dumps(
        {"step": 1, "cpu_s": 60.0, "eval": {"balanced_accuracy": bal}}) + "\n")
    return str(folder / "metrics.jsonl")


def test_runs_of_one_folder_name_are_told_apart_and_a_file_given_twice_is_one_run(tmp_path):
    # seed1/amazon and seed2/amazon were both "amazon": two runs no reader could tell apart
    a, b = _run(tmp_path / "seed1" / "amazon", 0.5), _run(tmp_path / "seed2" / "amazon", 0.6)
    c = _run(tmp_path / "other", 0.7)
    out = report([a, b, c, a, str(tmp_path / "seed1" / ".." / "seed1" / "amazon" /
                                  "metrics.jsonl")])
    rows = [line for line in out.splitlines() if line.startswith("| ") and "step" not in line]
    assert rows == ["| seed1/amazon | 1 | 1.0 | 0.500 |", "| seed2/amazon | 1 | 1.0 | 0.600 |",
                    "| other | 1 | 1.0 | 0.700 |"]


def test_a_run_reported_from_inside_its_folder_is_named_by_it(tmp_path, monkeypatch):
    # `ktm report metrics.jsonl` in the run's folder named the run "" (an empty parent)
    _run(tmp_path / "amazon-k4", 0.5)
    monkeypatch.chdir(tmp_path / "amazon-k4")
    assert "| amazon-k4 | 1 | 1.0 | 0.500 |" in report(["metrics.jsonl"])
