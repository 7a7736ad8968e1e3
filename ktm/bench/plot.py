"""Plots of a ``ktm bench`` result file (they read only the JSON rows).

    infer rows -> PREFIX_prefill.png   prefill time vs input length per K (log-log)
               -> PREFIX_speedup.png   prefill speed-up vs K per input length, ideal K x dashed
    train rows -> PREFIX_train.png     training tokens/s speed-up vs K, ideal K x dashed

    python -m ktm.bench.plot results/bench/quick.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter, ScalarFormatter  # noqa: E402

from ktm.errors import KTMError  # noqa: E402
from ktm.util.fileio import save_figure  # noqa: E402

PLOTTED = ("method", "k", "mlp_ratio", "input_tokens", "batch")  # what every infer/train row has
VALUES = ("prefill_s", "speedup_prefill", "speedup_train")  # the y axes: a number or null


def _number(v: object, positive: bool = False, integer: bool = False) -> bool:
    if isinstance(v, bool) or not isinstance(v, int if integer else int | float):
        return False
    return math.isfinite(v) and (v > 0 or not positive)


def _check_row(path: Path, i: int, r: dict) -> None:
    """An infer/train row's plotted fields, so a bad one is named, not a matplotlib traceback."""
    checks = {"method": (isinstance(r["method"], str), "a string"),
              "k": (_number(r["k"], positive=True, integer=True), "a positive integer"),
              "mlp_ratio": (r["mlp_ratio"] is None or _number(r["mlp_ratio"], positive=True),
                            "a positive number or null"),
              "input_tokens": (_number(r["input_tokens"], positive=True, integer=True),
                               "a positive integer"),
              "batch": (_number(r["batch"], positive=True, integer=True), "a positive integer")}
    checks |= {k: (r.get(k) is None or _number(r[k], positive=True), "a positive number or null")
               for k in VALUES}
    for key, (ok, expected) in checks.items():
        if not ok:
            raise KTMError(f"{str(path)!r} row {i}: {key}={r.get(key)!r}: expected {expected}")


def load_rows(path: str | Path) -> list[dict]:
    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KTMError(f"cannot read bench results {str(path)!r}: {e}") from e
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "mode" in r for r in rows):
        raise KTMError(f"{str(path)!r} is not a ktm bench result file (a JSON list of rows)")
    for i, r in enumerate(rows):
        if r["mode"] in ("infer", "train"):
            missing = [k for k in PLOTTED if k not in r]
            if missing:
                raise KTMError(f"{str(path)!r} row {i} lacks {missing}: expected the rows `ktm "
                               "bench` writes")
            _check_row(Path(path), i, r)
    if not any(r["mode"] in ("infer", "train") for r in rows):
        held = f"mode {', '.join(sorted({str(r['mode']) for r in rows}))}" if rows else "none"
        raise KTMError(f"{str(path)!r} has no rows to plot (rows: {held}): expected the infer "
                       "or train rows of `ktm bench` (serve rows have a table only)")
    return rows


def _label(row: dict, ratios: set, backends: set = frozenset()) -> str:
    on = f" on {row.get('backend', 'torch')}" if len(backends) > 1 else ""
    if row["method"] == "uncompressed":
        return "uncompressed" + on
    return (f"K={row['k']}" + (f" (mlp ratio {row['mlp_ratio']:g})" if len(ratios) > 1 else "")
            + on)


def _series(rows: list[dict], x: str, y: str) -> dict[str, tuple[list, list]]:
    """Label -> (xs, ys) sorted by x; batch sizes other than the smallest are left out."""
    batch = min(r["batch"] for r in rows)
    ratios = {r["mlp_ratio"] for r in rows if r["method"] != "uncompressed"}
    backends = {r.get("backend", "torch") for r in rows}
    out: dict[str, list] = {}
    for r in rows:
        if r["batch"] == batch and r.get(y) is not None:
            out.setdefault(_label(r, ratios, backends), []).append((r[x], r[y]))
    return {k: tuple(map(list, zip(*sorted(v)))) for k, v in out.items()}


def _speedup_plot(rows: list[dict], y: str, title: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4.5))
    merged = [r for r in rows if r["method"] != "uncompressed"]
    ks = sorted({r["k"] for r in merged})
    ax.plot(ks, ks, "k--", label="ideal (K x)")
    groups: dict[tuple, list] = {}
    for r in merged:
        groups.setdefault((r["input_tokens"], r["batch"], r["mlp_ratio"],
                           r.get("backend", "torch")), []).append(r)
    ratios = {r["mlp_ratio"] for r in merged}
    backends = {g[3] for g in groups}
    for (length, batch, ratio, backend), rs in sorted(groups.items()):
        pts = sorted((r["k"], r[y]) for r in rs if r.get(y) is not None)
        if pts:
            tail = f", mlp ratio {ratio:g}" if len(ratios) > 1 else ""
            tail += f", {backend}" if len(backends) > 1 else ""
            ax.plot(*zip(*pts), "o-", label=f"{length} tokens, batch {batch}{tail}")
    ax.set(xlabel="K", ylabel="speed-up vs uncompressed", title=title, xticks=ks)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path


def _e2e_plot(rows: list[dict], path: Path) -> Path:
    """End-to-end time (prompt in, whole answer out) per input length: every method on every
    runtime side by side, the smallest batch."""
    batch = min(r["batch"] for r in rows)
    rows = [r for r in rows if r["batch"] == batch]
    lengths = sorted({r["input_tokens"] for r in rows})
    ratios = {r["mlp_ratio"] for r in rows if r["method"] != "uncompressed"}
    backends = {r.get("backend", "torch") for r in rows}
    labels = list(dict.fromkeys(_label(r, ratios, backends) for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        ys = [next((r["e2e_s"] for r in rows if r["input_tokens"] == n
                    and _label(r, ratios, backends) == label), 0.0) for n in lengths]
        ax.bar([i + j * width for i in range(len(lengths))], ys, width, label=label)
    outs = sorted({r.get("output_tokens") for r in rows} - {None})
    ax.set(xticks=[i + 0.4 - width / 2 for i in range(len(lengths))],
           xticklabels=[str(n) for n in lengths], xlabel="input tokens",
           ylabel="end-to-end time (s)",
           title=f"Prompt in, {'/'.join(map(str, outs))}-token answer out, batch {batch}")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path


def plot_results(path: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the plots of one result file next to it (or into ``out_dir``); returns their paths."""
    path = Path(path)
    rows = load_rows(path)
    out = Path(out_dir) if out_dir else path.parent
    out.mkdir(parents=True, exist_ok=True)
    written = []
    infer = [r for r in rows if r["mode"] == "infer"]
    if infer:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for label, (xs, ys) in _series(infer, "input_tokens", "prefill_s").items():
            ax.plot(xs, ys, "o-" if label != "uncompressed" else "ks-", label=label)
        lengths = sorted({r["input_tokens"] for r in infer})
        ax.set(xscale="log", yscale="log", xticks=lengths, xlabel="input tokens",
               ylabel="prefill time (s), encoder included",
               title=f"Prefill time, batch {min(r['batch'] for r in infer)}")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(out / f"{path.stem}_prefill.png")
        save_figure(fig, written[-1])
        plt.close(fig)
        written.append(_speedup_plot(infer, "speedup_prefill", "Prefill speed-up (encoder incl.)",
                                     out / f"{path.stem}_speedup.png"))
        if len({r.get("backend", "torch") for r in infer}) > 1:
            written.append(_e2e_plot(infer, out / f"{path.stem}_e2e.png"))
    train = [r for r in rows if r["mode"] == "train"]
    if train:
        written.append(_speedup_plot(train, "speedup_train", "Training tokens/s speed-up",
                                     out / f"{path.stem}_train.png"))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ktm bench-plot", description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="+", help="bench JSON result files")
    parser.add_argument("--out-dir", default=None, help="folder for the PNGs (default: beside)")
    args = parser.parse_args(argv)
    try:
        for p in args.results:
            for f in plot_results(p, args.out_dir):
                print(f"wrote {f}")
    except KTMError as e:
        print(f"ktm bench-plot: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
