"""Readability against CPU-minutes, from the ``metrics.jsonl`` of pretraining runs.

The cost axis is process CPU time (``cpu_s`` in every metrics row), so runs made while other jobs
shared the machine compare fairly. A run is named by its folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from ktm.errors import KTMError


def load_curve(path: str | Path) -> dict:
    """``{"run": name, "points": [{"step", "cpu_min", "R": {set: R}}], "config": run.json}``."""
    path = Path(path)
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise KTMError(f"metrics file {str(path)!r} cannot be read as JSONL: {e}") from e
    points = []
    for r in rows:
        ev = r.get("eval")
        if isinstance(ev, dict) and "cpu_s" in r:
            sets = {k: v.get("R") for k, v in ev.items() if isinstance(v, dict) and "R" in v}
            if sets:
                points.append({"step": r["step"], "cpu_min": r["cpu_s"] / 60, "R": sets})
    if not points:
        raise KTMError(f"{str(path)!r} has no readability evaluations: expected the "
                       "metrics.jsonl of a `ktm pretrain` run with --eval-every")
    meta_path = path.with_name("run.json")
    config = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    return {"run": path.parent.name, "points": points, "config": config}


def _fmt(r: float | None) -> str:
    return "–" if r is None else f"{r:.3f}"


def curves_table(curves: list[dict]) -> str:
    sets = sorted({s for c in curves for p in c["points"] for s in p["R"]})
    head = "| run | step | CPU-min | " + " | ".join(f"R {s}" for s in sets) + " |"
    lines = ["### readability vs CPU-minutes (pretraining runs)", "", head,
             "|" + "---|" * (3 + len(sets))]
    for c in curves:
        for p in c["points"]:
            vals = " | ".join(_fmt(p["R"].get(s)) for s in sets)
            lines.append(f"| {c['run']} | {p['step']} | {p['cpu_min']:.1f} | {vals} |")
    return "\n".join(lines)


def plot_curves(curves: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ktm.fileio import save_figure

    sets = sorted({s for c in curves for p in c["points"] for s in p["R"]})
    fig, axes = plt.subplots(1, len(sets), figsize=(5.5 * len(sets), 4), squeeze=False)
    # more runs than the 10 default colours: the marker tells the repeats apart
    colours, markers = plt.get_cmap("tab10").colors, "osD^v<>"
    for ax, name in zip(axes[0], sets):
        for i, c in enumerate(curves):
            pts = [(p["cpu_min"], p["R"][name]) for p in c["points"]
                   if p["R"].get(name) is not None]
            if pts:
                ax.plot(*zip(*pts), marker=markers[i // 10 % len(markers)], ms=3,
                        color=colours[i % 10], label=c["run"])
        ax.set_xlabel("CPU-minutes of pretraining")
        ax.set_ylabel("readability R")
        ax.set_title(f"held-out {name}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
