"""A metric against CPU-minutes, from the ``metrics.jsonl`` of training runs.

Pretraining runs (``ktm pretrain --eval-every``) give readability R per held-out set;
fine-tuning runs (``ktm train --eval-every``) give their task's metric: balanced accuracy on
classification tasks, perplexity on generation tasks. The cost axis is process CPU time
(``cpu_s`` in every metrics row), so runs made while other jobs shared the machine compare
fairly. A run is named by its folder, or ``folder/stem`` for a copied ``NAME.metrics.jsonl``,
with the folders above where two runs share that name; a file given twice is one run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ktm.errors import KTMError
from ktm.util.fileio import read_metrics

TASK_METRICS = ("balanced_accuracy", "perplexity", "accuracy")  # the first one an eval has


def _metrics(ev: dict) -> dict[str, float | None]:
    sets = {f"R {k}": v.get("R") for k, v in ev.items() if isinstance(v, dict) and "R" in v}
    sets |= {f"recall R {k}": v.get("R_recall") for k, v in ev.items()
             if isinstance(v, dict) and "R_recall" in v}
    if sets:
        return sets
    for name in TASK_METRICS:
        if name in ev:
            return {name: ev[name]}
    return {}


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _check_point(path: Path, i: int, row: dict, metrics: dict) -> None:
    """An evaluation row's step, CPU time and values, so a bad one is named, not a traceback."""
    fields = {"step": (row["step"], isinstance(row["step"], int)
                       and not isinstance(row["step"], bool), "an integer"),
              "cpu_s": (row["cpu_s"], _number(row["cpu_s"]), "a finite number")}
    fields |= {m: (v, v is None or _number(v), "a finite number or null")
               for m, v in metrics.items()}
    for name, (v, ok, expected) in fields.items():
        if not ok:
            raise KTMError(f"metrics file {str(path)!r} row {i}: {name}={v!r}: expected {expected}")


def _name(path: Path, depth: int = 1) -> str:
    """The run's folder (its last ``depth`` folders), with the stem of a renamed metrics file."""
    folders = list(path.absolute().parent.parts[1:][-depth:])  # "metrics.jsonl" in the run too
    if path.name != "metrics.jsonl":
        folders.append(path.name.removesuffix(".jsonl").removesuffix(".metrics"))
    return "/".join(folders)


def _names_apart(paths: list[Path]) -> list[str]:
    """Each run's name, with as many more folders as it takes to tell it from another run of
    the same name (``seed1/amazon``, ``seed2/amazon``)."""
    depth = [1] * len(paths)
    while True:
        names = [_name(p, d) for p, d in zip(paths, depth)]
        clash = [i for i, n in enumerate(names) if names.count(n) > 1
                 and depth[i] < len(paths[i].absolute().parent.parts) - 1]
        if not clash:
            return names
        for i in clash:
            depth[i] += 1


def load_curves(paths: list[str | Path]) -> list[dict]:
    """``load_curve`` of each distinct file, the runs named apart."""
    distinct = list({Path(p).resolve(): Path(p) for p in paths}.values())
    curves = [load_curve(p) for p in distinct]
    for c, name in zip(curves, _names_apart(distinct)):
        c["run"] = name
    return curves


def load_curve(path: str | Path) -> dict:
    """``{"run": name, "points": [{"step", "cpu_min", "metrics": {name: value}}], "config"}``."""
    path = Path(path)
    if not path.is_file():
        raise KTMError(f"metrics file {str(path)!r} cannot be read as JSONL: no such file")
    try:
        rows = read_metrics(path)  # a half line a killed run left is dropped, as a resume does
    except (OSError, UnicodeDecodeError) as e:
        raise KTMError(f"metrics file {str(path)!r} cannot be read as JSONL: {e}") from e
    points = []
    for i, r in enumerate(rows, 1):
        ev = r.get("eval") if isinstance(r, dict) else None
        if isinstance(ev, dict) and "cpu_s" in r and "step" in r:
            metrics = _metrics(ev)
            if metrics:
                _check_point(path, i, r, metrics)
                points.append({"step": r["step"], "cpu_min": r["cpu_s"] / 60, "metrics": metrics})
    if not points:
        raise KTMError(f"{str(path)!r} has no evaluations: expected the metrics.jsonl of a "
                       "`ktm pretrain` or `ktm train` run with --eval-every")
    meta_path = path.with_name("run.json")
    try:  # what started the run, for the record only
        config = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        config = {}
    return {"run": _name(path), "points": points, "config": config}


def _names(curves: list[dict]) -> list[str]:
    return sorted({m for c in curves for p in c["points"] for m in p["metrics"]})


def _fmt(r: float | None) -> str:
    return "–" if r is None else f"{r:.3f}"


def curves_table(curves: list[dict]) -> str:
    names = _names(curves)
    head = "| run | step | CPU-min | " + " | ".join(names) + " |"
    lines = ["### metric vs CPU-minutes (training runs)", "", head,
             "|" + "---|" * (3 + len(names))]
    for c in curves:
        for p in c["points"]:
            vals = " | ".join(_fmt(p["metrics"].get(m)) for m in names)
            lines.append(f"| {c['run']} | {p['step']} | {p['cpu_min']:.1f} | {vals} |")
    return "\n".join(lines)


def plot_curves(curves: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ktm.util.fileio import save_figure

    names = _names(curves)
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    # more runs than the 10 default colours: the marker tells the repeats apart
    colours, markers = plt.get_cmap("tab10").colors, "osD^v<>"
    for ax, name in zip(axes[0], names):
        for i, c in enumerate(curves):
            pts = [(p["cpu_min"], p["metrics"][name]) for p in c["points"]
                   if p["metrics"].get(name) is not None]
            if pts:
                ax.plot(*zip(*pts), marker=markers[i // 10 % len(markers)], ms=3,
                        color=colours[i % 10], label=c["run"])
        ax.set_xlabel("CPU-minutes of the run")
        if name.startswith(("R ", "recall R ")):
            kind, _, held = name.partition("R ")
            ax.set_ylabel(f"{kind}readability R")
            ax.set_title(f"held-out {held}", parse_math=False)
        else:
            ax.set_ylabel(name.replace("_", " "))
            ax.set_title(name.replace("_", " "), parse_math=False)
        ax.grid(alpha=0.3)
        for text in ax.legend(fontsize=7).get_texts():
            text.set_parse_math(False)  # a run's folder name is text: "$1 vs $2" is not TeX
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
