"""Markdown tables of ``results/adaptive/sweep.py`` rows: adaptive against uniform K at equal ratio.

    python results/adaptive/tables.py results/adaptive/k8mix.json [more.json ...]

One table per file: a row per reading (uniform K, or an allocator at a ratio), continuation R and
recall R per held-out set, and the ratio each set was read at.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def fmt(v: float | None) -> str:
    return "–" if v is None else f"{v:.3f}"


def table(rows: list[dict]) -> str:
    sets = list(rows[0]["sets"])
    head = ("| reading | " + " | ".join(f"{s}: R / recall R (ratio read)" for s in sets) + " |")
    lines = [head, "|---|" + "---|" * len(sets)]
    order = sorted(rows, key=lambda r: (r["ratio"] or r.get("k") or 0,
                                        r["layout"] != "uniform", r.get("plain_suffix") or 0,
                                        r.get("allocator") or ""))
    for r in order:
        suffix = f", plain suffix {r['plain_suffix']}" if r.get("plain_suffix") else ""
        what = (f"uniform K={r['k']}" if r["layout"] == "uniform"
                else f"r={r['ratio']:g}, {r['allocator']}{suffix}")
        cells = [f"{fmt(r['sets'][s]['R'])} / {fmt(r['sets'][s].get('R_recall'))} "
                 f"({r['sets'][s]['ratio_read']:.2f})" for s in sets]
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(paths: list[str]) -> int:
    for p in paths:
        rows = json.loads(Path(p).read_text())
        print(f"### {p} ({rows[0]['checkpoint']}, {rows[0]['n_windows']} windows per set, "
              f"revision {rows[0]['git']})\n")
        print(table(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
