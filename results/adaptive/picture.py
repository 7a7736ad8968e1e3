"""Where the positions went: held-out texts coloured by the level each unit of tokens was read at.

For a reader, a ratio and an allocator, a few held-out windows (code and reviews) are laid out as
the prompt encoder lays them out, and each token is drawn in a monospace grid on the colour of
its unit's level: plain, 2, 4 or 8 tokens per position.

    python results/adaptive/picture.py --checkpoint runs/adaptive/k8mix/checkpoint --ratio 4 \\
        --allocator surprisal --out results/adaptive/levels_r4.png
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

COLOURS = {0: "#f4a582", 2: "#fddbc7", 4: "#d1e5f0", 8: "#92c5de", 16: "#4393c3"}
NAMES = {0: "plain", 2: "2 per position", 4: "4 per position", 8: "8 per position",
         16: "16 per position"}


def token_levels(model, ids: tuple[int, ...], ratio: float) -> list[tuple[int, int]]:
    """(token id, level) of each token of a context read at ``ratio`` (level 0: plain)."""
    from ktm.core.prompt import Segment

    pieces = model._prompt_encoder().layout([(Segment("", ids=ids, ratio=ratio),)])[0]
    return [(t, level) for piece, level, _ in pieces for t in piece]


def draw(ax, model, tokens: list[tuple[int, int]], width: int = 96, max_lines: int = 22) -> None:
    """The tokens on a grid of ``width`` columns, each on its level's colour."""
    from matplotlib.patches import Rectangle

    # a monospace glyph advances 0.6 em: the font size that puts one character in one column
    box = ax.get_window_extent()
    size = min(box.width / width / 0.602, box.height / max_lines / 1.25) * 72 / ax.figure.dpi
    col, row = 0, 0
    for t, level in tokens:
        text = model.tokenizer.decode([t]).replace("\t", "    ")
        for part_i, part in enumerate(text.split("\n")):
            if part_i:
                col, row = 0, row + 1
            while part:
                room = width - col
                if room <= 0:
                    col, row = 0, row + 1
                    room = width
                chunk, part = part[:room], part[room:]
                if row < max_lines:
                    ax.add_patch(Rectangle((col, -row - 1), len(chunk), 1, color=COLOURS[level],
                                           linewidth=0))
                    ax.text(col, -row - 0.8, chunk, family="DejaVu Sans Mono",
                            fontsize=size, va="bottom", ha="left", zorder=3)
                col += len(chunk)
    ax.set_xlim(0, width)
    ax.set_ylim(-max_lines, 0)
    ax.axis("off")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--ratio", type=float, required=True)
    ap.add_argument("--allocator", default=None)
    ap.add_argument("--n", type=int, default=2, help="windows per held-out set")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from ktm.evaluation.readability import heldout_sets
    from ktm.model import KTMModel
    from ktm.util.fileio import save_figure

    model = KTMModel.load(args.checkpoint)
    if args.allocator:
        model._config = dataclasses.replace(model._config, allocator=args.allocator)
    sets = heldout_sets(model.tokenizer, ("code", "reviews"), args.n, seed=1)
    windows = [(name, w) for name in ("code", "reviews") for w in sets[name]]
    fig, axes = plt.subplots(len(windows), 1, figsize=(10, 5.0 * len(windows)))
    for ax, (name, w) in zip(axes, windows):
        tokens = token_levels(model, model.lead_ids + w.context, args.ratio)
        read = len(tokens) / sum(1 for i, (_, lv) in enumerate(tokens)
                                 if lv == 0 or _starts_block(tokens, i))
        ax.axis("off")
        ax.set_title(f"held-out {name}: {len(tokens)} tokens read at ratio {read:.2f} "
                     f"({model.config.allocator})", fontsize=8, loc="left")
    fig.legend(handles=[Patch(color=c, label=NAMES[lv]) for lv, c in COLOURS.items()
                        if lv == 0 or lv in model.config.levels],
               loc="lower center", ncol=5, fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    for ax, (_, w) in zip(axes, windows):  # drawn once the axes have their final size
        draw(ax, model, token_levels(model, model.lead_ids + w.context, args.ratio))
    save_figure(fig, args.out)
    return 0


def _starts_block(tokens: list[tuple[int, int]], i: int) -> bool:
    """Whether token ``i`` opens a merged block: the first of a run of its level, or K after the
    last opening within that run."""
    level = tokens[i][1]
    j = i
    while j > 0 and tokens[j - 1][1] == level:
        j -= 1
    return (i - j) % level == 0


if __name__ == "__main__":
    sys.exit(main())
