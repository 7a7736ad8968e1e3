"""Seeded generator of Textualized Trees, byte-compatible with the shipped benchmark files.

Format (see shared/data/textualized_tree/PROVENANCE.md): node names ``AA``..``ZZ``, each used once
per tree; one node per line in pre-order, a node at depth d prefixed by d ``+``; lines joined by
``\\n`` with no trailing newline. The stream of trees for a stage is fixed by its seed: one RNG is
seeded once and the trees are drawn one after another, so tree k depends only on (seed, k).
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

from ktm.errors import KTMError

# Order matters: ``random.choice`` indexes into this list, so it must be AA, AB, ..., ZZ.
_LETTERS = string.ascii_uppercase
NAMES: tuple[str, ...] = tuple(a + b for a in _LETTERS for b in _LETTERS)


@dataclass(frozen=True)
class StageConfig:
    max_depth: int
    max_nodes: int
    min_children: int
    max_children: int
    seed: int  # the reference curriculum seeds stage i with 42 + i

    def __post_init__(self) -> None:
        if not 1 <= self.max_nodes <= len(NAMES):
            raise KTMError(f"max_nodes={self.max_nodes}: expected 1..{len(NAMES)} (unique names)")
        if not 0 <= self.min_children <= self.max_children:
            raise KTMError(
                f"children range ({self.min_children}, {self.max_children}): "
                "expected 0 <= min_children <= max_children"
            )
        if self.max_depth < 0:
            raise KTMError(f"max_depth={self.max_depth}: expected >= 0")


# Curriculum order, easiest first.
STAGE_CONFIGS: dict[str, StageConfig] = {
    "small": StageConfig(2, 3, 0, 2, seed=42),
    "xsmall": StageConfig(3, 5, 0, 2, seed=43),
    "medium": StageConfig(3, 10, 0, 3, seed=44),
    "xmedium": StageConfig(4, 15, 1, 3, seed=45),
    "large": StageConfig(4, 30, 1, 3, seed=46),
    "x3large": StageConfig(4, 150, 3, 5, seed=47),
}
STAGES: tuple[str, ...] = tuple(STAGE_CONFIGS)


def stage_config(stage: str) -> StageConfig:
    if stage not in STAGE_CONFIGS:
        raise KTMError(f"unknown tree stage {stage!r}: expected one of {', '.join(STAGES)}")
    return STAGE_CONFIGS[stage]


@dataclass(frozen=True)
class Tree:
    """A tree as text plus its (parent, child) edges in DFS order."""

    text: str
    edges: tuple[tuple[str, str], ...]

    @cached_property
    def nodes(self) -> tuple[str, ...]:
        """Node names in pre-order (the order of the text lines)."""
        return tuple(line.lstrip("+") for line in self.text.split("\n"))

    @cached_property
    def edge_set(self) -> frozenset[tuple[str, str]]:
        return frozenset(self.edges)

    @property
    def num_pairs(self) -> int:
        """Ordered pairs of distinct nodes: the number of parent/child questions."""
        n = len(self.nodes)
        return n * (n - 1)


def generate_tree(rng: random.Random, config: StageConfig) -> Tree:
    """Draw one tree from ``rng``; the order of RNG calls is what makes the files reproducible.

    A node below max_depth draws ``randint(min_children, min(max_children, max_nodes - count))``
    children (none when that bound is below min_children); children are built depth first, and
    a sibling loop stops early once max_nodes nodes exist (the count grew inside earlier siblings).
    """
    unused = list(NAMES)
    lines: list[str] = []
    edges: list[tuple[str, str]] = []

    def size() -> int:  # nodes so far: every node took exactly one name
        return len(NAMES) - len(unused)

    def take_name() -> str:
        name = rng.choice(unused)
        unused.remove(name)  # list.remove keeps the order of the rest, which choice depends on
        return name

    def build(name: str, depth: int) -> None:
        lines.append("+" * depth + name)
        if depth >= config.max_depth:
            return
        upper = min(config.max_children, config.max_nodes - size())
        if upper < config.min_children:
            return
        for _ in range(rng.randint(config.min_children, upper)):
            if size() >= config.max_nodes:
                break
            child = take_name()
            edges.append((name, child))
            build(child, depth + 1)

    build(take_name(), 0)
    return Tree("\n".join(lines), tuple(edges))


def generate_trees(config: StageConfig, n: int) -> Iterator[Tree]:
    """The first ``n`` trees of the stream for ``config`` (seeded once, drawn in sequence)."""
    rng = random.Random(config.seed)
    for _ in range(n):
        yield generate_tree(rng, config)


def expand_pairs(tree: Tree) -> list[tuple[str, str, str]]:
    """Every ordered pair of distinct nodes as ``(parent, child, "true"|"false")``.

    Order as in the reference per-tree files: the true pairs in DFS (edge) order first, then the
    false pairs from a double loop over the pre-order node list.
    """
    out = [(p, c, "true") for p, c in tree.edges]
    for p in tree.nodes:
        for c in tree.nodes:
            if p != c and (p, c) not in tree.edge_set:
                out.append((p, c, "false"))
    return out
