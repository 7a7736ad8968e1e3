"""ktm report's plots: labels that never overlap, the frontier, the plot path, odd names."""

import json

import pytest

from ktm.evaluation.report import _place_labels


def row(method, acc, bal, red, k=None):
    return {"task": "amazon", "method": method, "k": k, "accuracy": acc,
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
    from ktm.cli.main import main

    if metrics:
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps(
            {"step": 1, "cpu_s": 6.0, "eval": {"balanced_accuracy": 0.5}}) + "\n")
        paths = [str(tmp_path / "run" / "metrics.jsonl")]
    else:
        paths = _write(tmp_path, [row("k4", 0.7, 0.7, 0.6, 4)])
    assert main(["report", *paths, "--plot", str(tmp_path / "p.xyz")]) == 2
    err = capsys.readouterr().err
    assert "p.xyz" in err and "'xyz'" in err and ".png" in err, err
    assert not list(tmp_path.glob("*p.xyz*"))


def test_method_and_run_names_with_dollar_signs_are_plotted_as_text(tmp_path, capsys):
    # matplotlib read "$...$" in a label as TeX: "$1 vs $2" lost its dollars, and a name
    # that is not valid TeX was a ValueError traceback
    from ktm.cli.main import main

    odd = r"k4 $\frac$ run"
    paths = _write(tmp_path, [row("uncompressed", 0.8, 0.8, 0.0), row(odd, 0.7, 0.7, 0.6, 4)])
    assert main(["report", *paths, "--plot", str(tmp_path / "p.png")]) == 0
    assert odd in capsys.readouterr().out
    run = tmp_path / odd
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps(
        {"step": 1, "cpu_s": 6.0, "eval": {"r $\\frac$": {"R": 0.5}}}) + "\n")
    assert main(["report", str(run / "metrics.jsonl"), "--plot", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 1000


def test_plot_labels_do_not_overlap():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # a crowded cluster, as mean pooling and K=4 sit on the same point
    xs = [0.674, 0.674, 0.670, 0.45, 0.449, 0.46, 0.1, 0.0]
    ys = [0.50, 0.50, 0.505, 0.63, 0.634, 0.62, 0.63, 0.75]
    labels = ["k4", "mean_pool", "k3", "selective_context", "k2", "llmlingua", "ltsc",
              "uncompressed"]
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.scatter(xs, ys)
    ax.margins(0.15)
    anns, collisions = _place_labels(ax, fig, labels, xs, ys)
    assert collisions == 0
    renderer = fig.canvas.get_renderer()
    boxes = [a.get_window_extent(renderer) for a in anns]
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            assert not boxes[i].overlaps(boxes[j]), (labels[i], labels[j])
    plt.close(fig)


def _crowded(task: str, n: int) -> list[dict]:
    """An uncompressed row far away and ``n`` methods in a tight 4-high cluster."""
    out = [{**row("uncompressed", 0.9, 0.9, 0.0), "task": task, "P": 0.9}]
    for i in range(n):
        bal = 0.5 + 0.004 * (i % 4)
        out.append({**row(f"m{i}-selective", 0.6, bal, 0.6 + 0.004 * (i // 4)), "task": task,
                    "P": bal})
    return out


@pytest.mark.parametrize("n, tasks, long", [(8, 3, False), (12, 1, False), (36, 1, False),
                                            (4, 1, True)])
def test_crowded_plot_labels_overlap_no_label_marker_or_legend(n, tasks, long, monkeypatch,
                                                               tmp_path):
    # the 14 fixed offsets ran out on a cluster of 8: the fallback stacked labels on each other;
    # 36 methods (results/*/*.json's amazon likelihood table) had no free place in a 5 x 4 inch
    # panel at all, and a 150-character name none inside one
    import ktm.evaluation.report as rep

    seen = []

    def check(fig, path):
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            boxes = [rep.label_box(t, renderer) for t in ax.texts]
            assert len(boxes) == n + 1
            legend = ax.get_legend().get_window_extent(renderer)
            offsets = ax.collections[0].get_offsets()
            marks = [ax.transData.transform(p) for p in offsets]
            for i, b in enumerate(boxes):
                assert not b.overlaps(legend), ax.texts[i].get_text()
                assert ax.bbox.contains(b.x0, b.y0) and ax.bbox.contains(b.x1, b.y1)
                assert not any(b.contains(mx, my) for mx, my in marks), ax.texts[i].get_text()
                for j in range(i):
                    assert not b.overlaps(boxes[j]), (ax.texts[i].get_text(),
                                                      ax.texts[j].get_text())
        seen.append(path)

    monkeypatch.setattr(rep, "save_figure", check)
    by_task = {f"t{j}": _crowded(f"t{j}", n) for j in range(tasks)}
    if long:
        by_task["t0"][1]["method"] = "m0-" + "x" * 150
    rep.plot(by_task, str(tmp_path / "p.png"))
    assert seen


def test_a_single_point_frontier_is_drawn(monkeypatch, tmp_path):
    # a dashed line through one point draws nothing: one method had no visible frontier
    import ktm.evaluation.report as rep

    lines = []
    monkeypatch.setattr(rep, "save_figure", lambda fig, path: lines.extend(fig.axes[0].lines))
    rep.plot({"amazon": [{**row("k4", 0.8, 0.7, 0.5, 4), "P": 0.7}]}, str(tmp_path / "p.png"))
    assert lines and lines[0].get_marker() not in ("None", None, "")
