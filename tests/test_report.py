"""ktm report: balanced accuracy as P, the readability table, plot labels that never overlap."""

import json

import pytest

from ktm.report import _place_labels, report, score


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
    r = {"task": "readability", "method": "ktm-k4", "k": 4, "readability": {
        "code": {"R": 0.61, "nll_merged": 1.5, "nll_plain": 1.1, "nll_none": 2.5,
                 "tokens_in": 256.0, "tokens_out": 64.0},
        "reviews": {"R": None, "nll_merged": 3.0, "nll_plain": 3.2, "nll_none": 3.1,
                    "tokens_in": 90.0, "tokens_out": 23.0}}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(r))
    out = report([str(path)])
    assert "| ktm-k4 | 4 | code | 0.610 | 1.500 | 1.100 | 2.500 | 256.0 | 64.0 |" in out
    assert "| ktm-k4 | 4 | reviews | – |" in out


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
    anns = _place_labels(ax, fig, labels, xs, ys)
    renderer = fig.canvas.get_renderer()
    boxes = [a.get_window_extent(renderer) for a in anns]
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            assert not boxes[i].overlaps(boxes[j]), (labels[i], labels[j])
    plt.close(fig)
