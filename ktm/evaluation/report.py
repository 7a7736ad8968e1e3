"""``ktm report``: paper-style tables and the performance-vs-length-reduction plot.

It reads only result files written by ``ktm eval`` (one JSON object each). A table (and a plot
panel, with its Pareto frontier) holds comparable rows only: same task settings, examples and
scoring (``ktm.evaluation.result_groups``). For perplexity tasks the normalised performance
P = ppl_min / ppl uses the lowest perplexity of the table (a table without the uncompressed row
says so); for classification P is the *balanced* accuracy, since plain accuracy rewards answering
the majority class (on amazon that would put a chance-level model on the frontier). Readability rows
(``ktm eval --readability``) get their own table.
"""

from __future__ import annotations

import functools
import math

from ktm.errors import KTMError
from ktm.evaluation.metrics import normalised_performance, pareto_frontier, pl_f1
from ktm.evaluation.result_groups import group_rows, is_uncompressed, row_labels
from ktm.evaluation.result_rows import load_results, skipped_note
from ktm.util.fileio import figure_format, save_figure

DIRTY, UNKNOWN = "†", "‡"


def mark(row: dict) -> str:
    """A method name's provenance mark: † uncommitted changes, ‡ no git revision recorded."""
    git = row.get("git")
    if not git:
        return f" {UNKNOWN}"
    return f" {DIRTY}" if str(git).endswith("-dirty") else ""


def cell(text: str) -> str:
    """A name from a result file as one Markdown table cell: a ``|`` or a line break in it
    would split the row."""
    return " ".join(str(text).splitlines()).replace("|", "\\|")


def provenance_notes(rows: list[dict]) -> str:
    """Footnotes for marked rows, and a warning when the rows come from several revisions."""
    notes = []
    dirty = sorted({r.get("label", r["method"]) for r in rows if mark(r) == f" {DIRTY}"})
    unknown = sorted({r.get("label", r["method"]) for r in rows if mark(r) == f" {UNKNOWN}"})
    if dirty:
        notes.append(f"{DIRTY} from a dirty tree (uncommitted changes when it ran, so the code "
                     f"is not reproducible from its revision): {', '.join(dirty)}")
    if unknown:
        notes.append(f"{UNKNOWN} no git revision recorded: {', '.join(unknown)}")
    revisions = sorted({str(r["git"]).removesuffix("-dirty")[:12] for r in rows if r.get("git")})
    if len(revisions) > 1:
        notes.append(f"results come from {len(revisions)} revisions: {', '.join(revisions)}")
    return "\n".join(notes)


def score(rows: list[dict]) -> dict[str, list[dict]]:
    """Group comparable rows (``ktm.evaluation.result_groups``), add P (normalised performance),
    the P-L F1 and a ``label`` (the method, told apart from a namesake of the same table) to
    each row."""
    by_task = {name: [dict(r) for r in group] for name, group in group_rows(rows).items()}
    for task_rows in by_task.values():
        ppls = [r["perplexity"] for r in task_rows if "perplexity" in r]
        best = min(ppls) if ppls else None
        for r in task_rows:
            if "perplexity" in r:
                r["P"] = normalised_performance(r["perplexity"], best)
            else:
                r["P"] = r["balanced_accuracy"]
            r["pl_f1"] = pl_f1(r["P"], max(0.0, r["length_reduction"]))
        for r, label in zip(task_rows, row_labels(task_rows)):
            r["label"] = label
        # uncompressed first, then K-token merging by K, then the baselines
        task_rows.sort(key=lambda r: (r["method"] != "uncompressed", "compressor" in r,
                                      r.get("k") or 0, r["label"]))
    return by_task


def reference_note(rows: list[dict]) -> str | None:
    """For perplexity, P = ppl_min / ppl is relative to the uncompressed model only when its row
    is among ``rows``; without it the best method given gets P = 1, which the table must say."""
    if "perplexity" not in rows[0] or any(is_uncompressed(r) for r in rows):
        return None
    best = min(rows, key=lambda r: r["perplexity"])
    return (f"No uncompressed row: P is relative to the best method given, {best['label']} "
            f"(perplexity {best['perplexity']:.3f}), not to the uncompressed model.")


def table(task: str, rows: list[dict]) -> str:
    ppl = "perplexity" in rows[0]
    head = ("| method | K | perplexity | P | length reduction | P–L F1 |" if ppl else
            "| method | K | accuracy | balanced acc. | length reduction | P–L F1 |")
    head += " compression ms / 1k original tokens |"
    lines = [f"### {task}", "", head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        k = r.get("k") if r.get("k") is not None else "–"
        mid = (f"{r['perplexity']:.3f} | {r['P']:.3f}" if ppl else
               f"{r['accuracy']:.3f} | {r['balanced_accuracy']:.3f}")
        overhead = r.get("compression_ms_per_1k_tokens")
        cost = "–" if overhead is None else f"{overhead:.0f}"
        lines.append(f"| {cell(r['label'])}{mark(r)} | {k} | {mid} | {r['length_reduction']:.1%} | "
                     f"{r['pl_f1']:.3f} | {cost} |")
    note = reference_note(rows)
    return "\n".join(lines + ["", note] if note else lines)


def readability_table(rows: list[dict]) -> str:
    """The readability rows, each with its ``label`` (``report`` tells namesakes apart)."""
    lines = ["### readability (held-out text)", "",
             "| method | K | set | R [95 % CI] | NLL merged | NLL plain | NLL none | tokens in "
             "| tokens out |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r.get("k") or 0, r["label"])):
        k = "–" if r.get("k") is None else r["k"]
        for name, v in sorted(r["readability"].items()):
            rr = "–" if v.get("R") is None else f"{v['R']:.3f}"
            if v.get("R_ci95"):  # result files written before the interval existed lack it
                rr += " [{:.3f}, {:.3f}]".format(*v["R_ci95"])
            lines.append(f"| {cell(r['label'])}{mark(r)} | {k} | {cell(name)} | {rr} | "
                         f"{v['nll_merged']:.3f} | {v['nll_plain']:.3f} | {v['nll_none']:.3f} | "
                         f"{v['tokens_in']:.1f} | {v['tokens_out']:.1f} |")
    return "\n".join(lines)


@functools.cache
def _offsets(rings: int = 14) -> list[tuple[int, int]]:
    """Label offsets (points) from a point, nearest first: beside it, then ever further up,
    down and sideways, so a cluster of many methods still finds a free place for each label."""
    cands = [(dx * sx, (5 + 11 * i) * sy) for dx in (5, 20, 40, 60) for i in range(rings)
             for sx in (1, -1) for sy in (1, -1)]
    return sorted(cands, key=lambda o: (o[0] ** 2 + o[1] ** 2, -o[0], -o[1]))


_MARKER_PT = 3.5  # a scatter marker's radius in points (default size 36 pt², plus its edge)
_LABEL_CHARS = 30  # a longer method name is wrapped onto more lines, so it fits in a panel


def _place_labels(ax, fig, labels: list[str], xs: list[float], ys: list[float],
                  rings: int = 14) -> tuple[list, int]:
    """Annotate each point at the nearest offset where its label stays inside the axes and
    overlaps no other label, no marker and no legend; where none is free, the offset with the
    fewest collisions. Returns the labels and the number of collisions left (0: none overlaps).
    Call after the layout is final: positions are read in pixels."""
    from matplotlib.transforms import Bbox

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    r = _MARKER_PT * fig.dpi / 72
    markers = [Bbox.from_extents(mx - r, my - r, mx + r, my + r)
               for mx, my in (ax.transData.transform((x, y)) for x, y in zip(xs, ys))]
    legend = ax.get_legend()
    obstacles = markers + ([legend.get_window_extent(renderer)] if legend else [])
    boxes, placed, collisions = [], [], 0
    for label, x, y in zip(labels, xs, ys):
        best = None  # (collisions, offset, box)
        for dx, dy in _offsets(rings):
            ann = _annotate(ax, label, (x, y), (dx, dy), leader=False)
            box = label_box(ann, renderer).expanded(1.05, 1.1)
            ann.remove()
            inside = ax.bbox.contains(box.x0, box.y0) and ax.bbox.contains(box.x1, box.y1)
            hits = sum(box.overlaps(b) for b in obstacles + boxes) + (0 if inside else 100)
            if best is None or hits < best[0]:
                best = (hits, (dx, dy), box)
            if hits == 0:
                break
        dx, dy = best[1]
        boxes.append(best[2])
        collisions += best[0]
        placed.append(_annotate(ax, label, (x, y), (dx, dy), leader=abs(dx) > 5 or abs(dy) > 5))
    return placed, collisions


def _annotate(ax, label: str, xy, offset, leader: bool):
    """A label ``offset`` points from ``xy``, hanging away from it; a thin leader line when far."""
    return ax.annotate(label, xy, textcoords="offset points", xytext=offset, fontsize=8,
                       parse_math=False,  # a method name is text: "$1 vs $2" is not TeX
                       ha="left" if offset[0] >= 0 else "right",
                       va="bottom" if offset[1] >= 0 else "top",
                       arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.5"}
                       if leader else None)


def label_box(ann, renderer):
    """The pixels of an annotation's text alone (its own extent includes the leader line)."""
    from matplotlib.text import Text

    ann.update_positions(renderer)
    return Text.get_window_extent(ann, renderer)


def figure(by_task: dict[str, list[dict]]):
    """P against length reduction per task, the Pareto frontier, each point labelled. Where the
    labels of a panel cannot all be placed apart, the figure is drawn again larger (the points
    move apart, the labels keep their size) until they can."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for attempt in range(8):
        fig, collisions = _figure(by_task, scale=1.3 ** attempt)
        if not collisions:
            break
        plt.close(fig)
    return fig


def _figure(by_task: dict[str, list[dict]], scale: float):
    """The figure at ``scale`` times the usual panel size, and the label collisions left."""
    import textwrap

    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(by_task), figsize=(5 * scale * len(by_task), 4 * scale),
                             squeeze=False)
    panels = []
    for ax, (task, rows) in zip(axes[0], sorted(by_task.items())):
        xs, ys = [r["length_reduction"] for r in rows], [r["P"] for r in rows]
        ax.scatter(xs, ys, color="tab:blue")
        front = sorted(pareto_frontier(list(zip(xs, ys))))
        # ringed points: a frontier of one point is visible too
        ax.plot([p[0] for p in front], [p[1] for p in front], "--o", color="tab:red", ms=9,
                mfc="none", label="Pareto frontier")
        ax.set_xlabel("length reduction")
        ax.set_ylabel("ppl_min / ppl" if "perplexity" in rows[0] else "balanced accuracy")
        ax.margins(0.15)
        ax.set_title(textwrap.fill(task, int(45 * scale)), parse_math=False)
        ax.legend(loc="lower left", fontsize=8)
        labels = [textwrap.fill(r.get("label", r["method"]), _LABEL_CHARS) for r in rows]
        panels.append((ax, labels, xs, ys))
    fig.tight_layout()  # first: labels are placed in the final pixels
    collisions = 0
    for ax, labels, xs, ys in panels:
        placed, left = _place_labels(ax, fig, labels, xs, ys, rings=math.ceil(14 * scale))
        collisions += left
        for t in placed:
            t.set_in_layout(False)
    return fig, collisions


def plot(by_task: dict[str, list[dict]], path: str) -> None:
    import matplotlib.pyplot as plt

    fig = figure(by_task)
    save_figure(fig, path)
    plt.close(fig)


def report(paths: list[str], plot_path: str | None = None) -> str:
    if plot_path:
        figure_format(plot_path)  # an unknown extension is refused before any work
    jsonl = [p for p in paths if str(p).endswith(".jsonl")]
    if jsonl:  # training runs: readability R or the task metric against CPU-minutes
        from ktm.evaluation.curves import curves_table, load_curves, plot_curves

        if len(jsonl) != len(paths):
            raise KTMError("give either `ktm eval` result files or training metrics.jsonl "
                           "files, not both")
        curves = load_curves(jsonl)
        if plot_path:
            plot_curves(curves, plot_path)
        return curves_table(curves)
    rows, others = load_results(paths)
    read = [r for r in rows if r.get("task") == "readability"]
    read = [{**r, "label": label} for r, label in zip(read, row_labels(read))]
    by_task = score([r for r in rows if r.get("task") != "readability"])
    if plot_path and not by_task:
        raise KTMError(f"--plot {plot_path}: no task results to plot (readability rows have a "
                       "table only): expected at least one `ktm eval --task` result file")
    parts = [table(t, task_rows) for t, task_rows in sorted(by_task.items())]
    if read:
        parts.append(readability_table(read))
    notes = provenance_notes([r for t in by_task.values() for r in t] + read)
    if notes:
        parts.append(notes)
    if others:
        parts.append(skipped_note(others))
    if plot_path:
        plot(by_task, plot_path)
    return "\n\n".join(parts)
