"""Tables and the frontier plot of the presses' results, into results/presses/README.md.

    python results/presses/tables.py            # rewrites the generated blocks and the plot

Reads ``heldout.json`` (``sweep.py``: R and recall R per reading) and, if present,
``speed.json`` and ``speed-more.json`` (``ktm bench --presses``: prefill, time to first token,
decode, memory, KV).
Rows are grouped by the share of the plain prompt's KV the reading keeps: every press point
beside the ktm readings that keep as much or less.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).parent
BANDS = (0.5, 0.25, 0.125)  # shares of the plain prompt's KV, compared within 10 %
SPEED = ("speed-more.json", "speed.json")  # ktm bench --presses runs, the later first


def name(r: dict) -> str:
    reader = (r["model"].replace("smollm2-135m-", "")
              .replace("runs/presses/k2-stack/checkpoint", "k2-stack (trained stacked)"))
    if r["kind"] == "press":
        return f"{r['press']} {r['ratio']:g}"
    if r["kind"] == "reader":
        return f"ktm {reader}"
    return f"ktm {reader} + {r['press']} {r['ratio']:g}"


def fmt(v) -> str:
    return "–" if v is None else f"{v:.2f}"


def kv(r: dict) -> float:
    """The share of the plain prompt's KV kept, averaged over the sets."""
    return sum(s["kv_kept"] for s in r["sets"].values()) / len(r["sets"])


def band(share: float) -> float | None:
    return next((b for b in BANDS if abs(share / b - 1) < 0.1), None)


def heldout(rows: list[dict]) -> str:
    out = []
    for ctx in sorted({r["context_tokens"] for r in rows}):
        part = [r for r in rows if r["context_tokens"] == ctx]
        sets = list(part[0]["sets"])
        n = sorted({r["n_windows"] for r in part})
        out.append(f"**{ctx}-token contexts** ({', '.join(map(str, n))} windows per set; "
                   f"revision {part[0]['git'][:7]})\n")
        out.append("| reading | KV kept | " + " | ".join(
            f"{s}: continuation R | {s}: recall R" for s in sets) + " | CPU s |")
        out.append("|---|---|" + "---|---|" * len(sets) + "---|")
        for r in sorted(part, key=lambda r: (-round(kv(r), 2), r["kind"] != "press", name(r))):
            cells = [f"{fmt(r['sets'][s]['R'])} | {fmt(r['sets'][s]['R_recall'])}"
                     for s in sets]
            out.append(f"| {name(r)} | {kv(r):.1%} | " + " | ".join(cells)
                       + f" | {r['cpu_s']:.0f} |")
        out.append("")
    return "\n".join(out)


def mean(r: dict, key: str) -> float | None:
    vals = [s[key] for s in r["sets"].values() if s[key] is not None]
    return sum(vals) / len(vals) if vals else None


def beats(group: list[dict], pc: dict, pr: dict) -> bool:
    """Whether one reading of ``group`` is at least as good as ``pc`` on continuation R and
    as ``pr`` on recall R."""
    return any(mean(r, "R") >= mean(pc, "R") and mean(r, "R_recall") >= mean(pr, "R_recall")
               for r in group)


def top(group: list[dict]) -> str:
    """The best continuation and the best recall of ``group``, each with its reading."""
    if not group:
        return "–"
    oc = max(group, key=lambda r: mean(r, "R"))
    orr = max(group, key=lambda r: mean(r, "R_recall"))
    return f"{mean(oc, 'R'):.2f} ({name(oc)}) / {mean(orr, 'R_recall'):.2f} ({name(orr)})"


def best(rows: list[dict], timed: list[dict]) -> str:
    """Per context and KV band: the best press on each measure against the best ktm reading,
    and against the best ktm reading whose prefill the bench timed at no more than half of
    plain's (``prefill_share``)."""
    out = ["| context | KV kept | best press: continuation / recall (mean over sets) | "
           "best ktm: continuation / recall | ktm at least as good on both | best ktm at ≤ ½ "
           "plain's prefill (timed): continuation / recall | that too |",
           "|---|---|---|---|---|---|---|"]
    for ctx in sorted({r["context_tokens"] for r in rows}):
        for b in BANDS:
            part = [r for r in rows if r["context_tokens"] == ctx and band(kv(r)) == b]
            press = [r for r in part if r["kind"] == "press"]
            ours = [r for r in part if r["kind"] != "press"]
            if not press or not ours:
                continue
            pc = max(press, key=lambda r: mean(r, "R"))
            pr = max(press, key=lambda r: mean(r, "R_recall"))

            fast = [r for r in ours if (prefill_share(r, timed) or 1.0) <= 0.5]
            out.append(f"| {ctx} | {b:.1%} | {mean(pc, 'R'):.2f} ({name(pc)}) / "
                       f"{mean(pr, 'R_recall'):.2f} ({name(pr)}) | {top(ours)} | "
                       f"{'yes' if beats(ours, pc, pr) else 'no'} | {top(fast)} | "
                       f"{'yes' if beats(fast, pc, pr) else 'no'} |")
    return "\n".join(out)


def speed(rows: list[dict]) -> str:
    out = ["| reading | input tokens | positions read | prefill s | TTFT s | decode tok/s | "
           "KV kept | peak memory MB | prefill vs plain |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        what = ("plain" if r["method"] == "uncompressed" else f"ktm K={r['k']}")
        what += f" + {r['press']}" if r.get("press") else ""
        out.append(f"| {what} | {r['input_tokens']} | {r['compressed_tokens']} | "
                   f"{r['prefill_s']:.2f} | {r['ttft_s']:.2f} | {r['decode_tokens_per_s']:.1f} | "
                   f"{r['kv_ratio']:.1%} | {r['peak_mem_bytes'] / 2**20:.0f} | "
                   f"{r['speedup_prefill']:.2f}× |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctxs = sorted({r["context_tokens"] for r in rows})
    fig, axes = plt.subplots(2, len(ctxs), figsize=(5 * len(ctxs), 8), squeeze=False)
    marks = {"press": ("o", "tab:gray"), "reader": ("s", "tab:red"),
             "stacked": ("^", "tab:orange")}
    for j, ctx in enumerate(ctxs):
        for i, key in enumerate(("R", "R_recall")):
            ax = axes[i][j]
            for r in (r for r in rows if r["context_tokens"] == ctx):
                vals = [s[key] for s in r["sets"].values() if s[key] is not None]
                m, c = marks[r["kind"]]
                ax.scatter(kv(r), sum(vals) / len(vals), marker=m, color=c)
                ax.annotate(name(r), (kv(r), sum(vals) / len(vals)), fontsize=6)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("share of the plain prompt's KV kept")
            ax.set_ylabel("continuation R" if key == "R" else "recall R")
            ax.set_title(f"{ctx}-token contexts")
            ax.grid(alpha=0.3)
    fig.suptitle("KV presses (gray) against ktm readers (red) and stacked (orange)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def timed_rows(r: dict, speed: list[dict]) -> tuple[list[dict], dict | None]:
    """The bench rows at a reading's context length and K, and the one timing it as it is (the
    same press; None: not timed)."""
    k = 1 if r["kind"] == "press" else r["model_config"]["config"]["k"]
    press = None if r["kind"] == "reader" else f"{r['press']}={r['ratio']:g}"
    rows = [b for b in speed if b["input_tokens"] == r["context_tokens"]
            and (b["k"] if b["method"] != "uncompressed" else 1) == k]
    return rows, next((b for b in rows if b.get("press") == press), None)


def prefill_share(r: dict, speed: list[dict]) -> float | None:
    """A reading's prefill as a share of plain's in the same bench run, at its context length
    (None: the bench did not time it as it is)."""
    _, same = timed_rows(r, speed)
    return None if same is None else 1 / same["speedup_prefill"]


def prefill_of(r: dict, speed: list[dict]) -> tuple[float, bool] | None:
    """A reading's prefill seconds at its context length from the bench rows (the same press
    and K; a press the bench did not time: plain's, which it reads whole), and whether it was
    timed as it is."""
    rows, same = timed_rows(r, speed)
    if same is not None:
        return same["prefill_s"], True
    unpressed = next((b for b in rows if b.get("press") is None), None)
    return (unpressed["prefill_s"], False) if unpressed else None


def plot_prefill(rows: list[dict], speed: list[dict], path: Path) -> None:
    """Quality against prefill time, at each KV share: a point per reading timed by the bench
    at its context length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctxs = sorted({r["context_tokens"] for r in rows
                   if any(b["input_tokens"] == r["context_tokens"] for b in speed)})
    if not ctxs:
        return
    fig, axes = plt.subplots(2, len(BANDS), figsize=(5 * len(BANDS), 8), squeeze=False)
    colors = {"press": "tab:gray", "reader": "tab:red", "stacked": "tab:orange"}
    for j, b in enumerate(BANDS):
        for i, key in enumerate(("R", "R_recall")):
            ax = axes[i][j]
            for r in rows:
                if r["context_tokens"] not in ctxs or band(kv(r)) != b:
                    continue
                t = prefill_of(r, speed)
                if t is None:
                    continue
                vals = [s[key] for s in r["sets"].values() if s[key] is not None]
                ax.scatter(t[0], sum(vals) / len(vals), color=colors[r["kind"]],
                           marker="o" if t[1] else "x")
                ax.annotate(f"{name(r)} ({r['context_tokens']})", (t[0], sum(vals) / len(vals)),
                            fontsize=6)
            ax.set_xscale("log")
            ax.set_xlabel("prefill seconds (ktm bench; x: a press it did not time, at its "
                          "unpressed reading's)")
            ax.set_ylabel("continuation R" if key == "R" else "recall R")
            ax.set_title(f"KV kept {b:.1%}")
            ax.grid(alpha=0.3)
    fig.suptitle("Quality against prefill time at equal KV: presses (gray), ktm (red), "
                 "stacked (orange)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def render(text: str, blocks: dict[str, str]) -> str:
    for key, body in blocks.items():
        text = re.sub(rf"(<!-- generated: {key} -->\n).*?(<!-- /generated -->)",
                      lambda m, b=body: m.group(1) + b.strip() + "\n" + m.group(2), text,
                      flags=re.S)
    return text


def main() -> int:
    rows = json.loads((HERE / "heldout.json").read_text())
    # the later bench run first: where both timed a reading, its row is the one read
    timed = [r for f in SPEED for r in (json.loads((HERE / f).read_text())
                                        if (HERE / f).exists() else [])]
    blocks = {"heldout": heldout(rows), "best": best(rows, timed)}
    if timed:
        blocks["speed"] = speed(timed)
    page = HERE / "README.md"
    page.write_text(render(page.read_text(), blocks))
    plot(rows, HERE / "frontier.png")
    plot_prefill(rows, timed, HERE / "prefill.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
