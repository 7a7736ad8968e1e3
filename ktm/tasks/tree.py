"""Textualized Tree: is node C a direct child of node P in a tree written as indented text?

The tree is the long context worth compressing; the question is short. Trees come from the shipped
``textualized_tree/trees_<stage>_seed<seed>_first10000.jsonl.gz`` files, from a user JSONL with the
same schema (``indent_tree``, ``edges``), or from ``tree_gen`` (which reproduces the shipped files
exactly, so "file" and "generate" give the same trees).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from pathlib import Path
from typing import ClassVar, Literal

from ktm.core.prompt import Segment
from ktm.errors import KTMError
from ktm.tasks.base import Example, PromptMode, TaskKind
from ktm.tasks.jsonl import find_data_file, read_jsonl, resolve_data_path, row_error
from ktm.tasks.labels import parse_label as _parse_label
from ktm.tasks.split import split_indices, test_size_from_fraction
from ktm.tasks.tree_gen import STAGES, Tree, generate_trees, stage_config

TREE_LABELS: tuple[str, ...] = ("true", "false")
SHIPPED_TREES = 10_000  # trees per stage in the shipped files; also the default when generating
# Accuracy a stage must reach before the curriculum moves on (reference curriculum script).
PASS_ACCURACY: dict[str, float] = {stage: 0.85 for stage in STAGES} | {"x3large": 0.95}

TreeSource = Literal["auto", "file", "generate"]


def next_stage(stage: str) -> str | None:
    """The curriculum stage after ``stage``; ``None`` after the last one."""
    stage_config(stage)  # validates the name
    i = STAGES.index(stage)
    return STAGES[i + 1] if i + 1 < len(STAGES) else None


def stage_file(stage: str) -> str:
    """The shipped file for ``stage``, relative to ``data_root()``."""
    seed = stage_config(stage).seed
    return f"textualized_tree/trees_{stage}_seed{seed}_first10000.jsonl.gz"


def tree_prompt(tree_text: str, parent: str, child: str, mode: PromptMode) -> tuple[Segment, ...]:
    """The paper's prompt; "context" mode keeps the question after the tree as plain tokens."""
    question = f", Task: Parent/Child Relationship, Parent: {parent}, Child: {child}, Answer: "
    if mode == "paper":
        return (Segment(f"Tree: {tree_text}{question}"),)
    return (Segment(f"Tree: {tree_text}"), Segment(question, compress=False))


def parse_label(text: str) -> str | None:
    """``"true"``/``"false"`` from generated text (first word), or ``None``."""
    return _parse_label(text, TREE_LABELS)


def load_trees(path: Path, limit: int | None = None) -> list[Tree]:
    """The first ``limit`` trees of a JSONL file with ``indent_tree`` and ``edges`` fields."""
    trees: list[Tree] = []
    for line_no, row in read_jsonl(path, {"indent_tree": str, "edges": list}):
        if limit is not None and len(trees) >= limit:
            break
        edges = row["edges"]
        if not all(isinstance(e, list) and [type(x) for x in e] == [str, str] for e in edges):
            raise row_error(path, line_no, "field 'edges' must be a list of [parent, child] names")
        # a trailing newline or Windows (or classic Mac) line ends are not part of the tree
        text = row["indent_tree"].replace("\r\n", "\n").replace("\r", "\n").strip("\n")
        if not text:
            raise row_error(path, line_no, "field 'indent_tree' must be a non-empty tree text")
        problem = _tree_problem(text, edges)
        if problem:
            raise row_error(path, line_no, problem)
        trees.append(Tree(text, tuple((p, c) for p, c in edges)))
    return trees


def _tree_problem(text: str, edges: list[list[str]]) -> str | None:
    """Why ``text`` is not a tree in the shipped format matching ``edges``, or None.

    Checked because questions are drawn from both: a blank line, a repeated name or an edge the
    text does not show would silently give wrong labels.
    """
    seen: set[str] = set()
    stack: list[str] = []  # the names on the path from the root to the previous line
    derived: set[tuple[str, str]] = set()
    for k, line in enumerate(text.split("\n"), start=1):
        name = line.lstrip("+")
        depth = len(line) - len(name)
        if not name.strip() or name != name.strip():
            return f"tree line {k} {line!r}: expected '+' * depth then a name, no blanks"
        if name in seen:
            return f"tree line {k}: name {name!r} appears twice; expected unique node names"
        if depth > len(stack) or (k > 1 and depth == 0):
            return f"tree line {k} {line!r}: depth {depth} does not follow the line above"
        del stack[depth:]
        if stack:
            derived.add((stack[-1], name))
        stack.append(name)
        seen.add(name)
    if set(map(tuple, edges)) != derived or len(edges) != len(derived):
        return "field 'edges' does not match the tree in 'indent_tree' (parent: one '+' less)"
    return None


@dataclass
class TreeTask:
    """Parent/child questions about Textualized Trees, split by tree (no tree in train and test)."""

    stage: str = "xmedium"
    prompt_mode: PromptMode = "context"
    data_path: str | Path | None = None  # a JSONL of the shipped schema; None: the stage's file
    positive_fraction: float = 0.5  # share of "true" pairs in train_examples
    test_fraction: float = 0.1  # share of trees held out for evaluation
    source: TreeSource = "auto"  # auto: the file when it exists, else the generator
    num_trees: int | None = None  # None: every tree in the file, or 10,000 when generating
    split_seed: int = 42
    name: str = field(default="tree", init=False)
    kind: TaskKind = field(default="classification", init=False)
    labels: tuple[str, ...] = field(default=TREE_LABELS, init=False)
    # settings that change only the training examples: results differing in them are comparable
    TRAIN_ONLY: ClassVar[tuple[str, ...]] = ("positive_fraction",)

    def __post_init__(self) -> None:
        self.config = stage_config(self.stage)
        if self.prompt_mode not in ("paper", "context"):
            raise KTMError(f"prompt_mode={self.prompt_mode!r}: expected 'paper' or 'context'")
        if not 0.0 <= self.positive_fraction <= 1.0:
            raise KTMError(f"positive_fraction={self.positive_fraction}: expected 0..1")
        if self.source not in ("auto", "file", "generate"):
            raise KTMError(f"source={self.source!r}: expected 'auto', 'file' or 'generate'")
        if self.num_trees is not None and self.num_trees < 2:
            raise KTMError(f"num_trees={self.num_trees}: expected at least 2 (train and test)")
        test_size_from_fraction(2, self.test_fraction)  # validates the fraction early
        self.path: Path | None = None
        default_exists = find_data_file(stage_file(self.stage)) is not None
        if self.source == "file" or self.data_path is not None or (
            self.source == "auto" and default_exists
        ):
            if self.source == "generate":
                raise KTMError("data_path given with source='generate': expected one or the other")
            self.path = resolve_data_path(self.data_path, stage_file(self.stage))

    @cached_property
    def trees(self) -> list[Tree]:
        if self.path is None:
            return list(generate_trees(self.config, self.num_trees or SHIPPED_TREES))
        trees = load_trees(self.path, self.num_trees)
        if len(trees) < 2:
            raise KTMError(f"{self.path} holds {len(trees)} trees: expected at least 2")
        return trees

    @cached_property
    def _split(self) -> tuple[list[int], list[int]]:
        n = len(self.trees)
        return split_indices(n, test_size_from_fraction(n, self.test_fraction), self.split_seed)

    @property
    def train_trees(self) -> list[int]:
        """Indices into ``trees`` of the training trees."""
        return self._split[0]

    @property
    def test_trees(self) -> list[int]:
        """Indices into ``trees`` of the held-out trees."""
        return self._split[1]

    def parse_label(self, text: str) -> str | None:
        return parse_label(text)

    def train_examples(self, n: int, seed: int) -> list[Example]:
        """``n`` pairs from training trees, ``round(n * positive_fraction)`` of them true."""
        return self._balanced(self.train_trees, n, round(n * self.positive_fraction), seed)

    def eval_examples(self, n: int, seed: int) -> list[Example]:
        """``n`` pairs from test trees, half true (``n // 2``) and half false, shuffled."""
        return self._balanced(self.test_trees, n, n // 2, seed)

    def natural_eval_examples(self, n: int, seed: int) -> list[Example]:
        """``n`` pairs drawn uniformly over all ordered pairs of the test trees (mostly false)."""
        _check_n(n)
        rng = random.Random(seed)
        ids = [i for i in self.test_trees if self.trees[i].num_pairs > 0]
        if not ids:
            raise KTMError(f"stage {self.stage!r}: no test tree has two nodes to ask about")
        cum = list(accumulate(self.trees[i].num_pairs for i in ids))
        out = []
        for i in rng.choices(ids, cum_weights=cum, k=n):
            p, c = rng.sample(self.trees[i].nodes, 2)
            out.append(self._example(i, p, c))
        return out

    def _balanced(self, tree_ids: list[int], n: int, n_true: int, seed: int) -> list[Example]:
        """Pick a tree uniformly, then a pair of the wanted label uniformly within it."""
        _check_n(n)
        ids = [i for i in tree_ids if self.trees[i].edges]  # a lone root has no pairs at all
        if not ids and n:
            raise KTMError(f"stage {self.stage!r}: no tree with an edge in this split")
        rng = random.Random(seed)
        wants = [True] * n_true + [False] * (n - n_true)
        rng.shuffle(wants)
        out = []
        for want_true in wants:
            i = rng.choice(ids)
            tree = self.trees[i]
            if want_true:
                p, c = rng.choice(tree.edges)
            else:  # every tree with an edge has a false pair (the reversed edge), so this ends
                p, c = rng.sample(tree.nodes, 2)
                while (p, c) in tree.edge_set:
                    p, c = rng.sample(tree.nodes, 2)
            out.append(self._example(i, p, c))
        return out

    def label_target(self, label: str) -> str:
        """The answer text for ``label``: the bare word."""
        return label

    def _example(self, tree_id: int, parent: str, child: str) -> Example:
        tree = self.trees[tree_id]
        label = "true" if (parent, child) in tree.edge_set else "false"
        return Example(
            segments=tree_prompt(tree.text, parent, child, self.prompt_mode),
            target=self.label_target(label),
            label=label,
            meta={"stage": self.stage, "tree_index": tree_id, "parent": parent, "child": child},
        )


def _check_n(n: int) -> None:
    if n < 0:
        raise KTMError(f"n={n}: expected a non-negative number of examples")
