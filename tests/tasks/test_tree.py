"""Textualized Tree: the generator reproduces the shipped files; sampling, splits and prompts."""

from __future__ import annotations

import json

import pytest

from ktm.core.prompt import Segment
from ktm.errors import KTMError
from ktm.tasks.jsonl import data_root
from ktm.tasks.tree import TreeTask, load_trees, next_stage, parse_label, stage_file, tree_prompt
from ktm.tasks.tree_gen import STAGE_CONFIGS, STAGES, expand_pairs, generate_trees, stage_config


@pytest.mark.data("textualized_tree")
@pytest.mark.parametrize("stage", STAGES)
def test_generator_reproduces_shipped_file(stage: str) -> None:
    shipped = load_trees(data_root() / stage_file(stage), limit=50)
    generated = list(generate_trees(stage_config(stage), 50))
    assert [t.text for t in generated] == [t.text for t in shipped]
    assert [t.edges for t in generated] == [t.edges for t in shipped]


@pytest.mark.data("textualized_tree")
def test_pair_expansion_matches_reference_example() -> None:
    path = data_root() / "textualized_tree" / "example_large_seed46_tree_000000.json"
    example = json.loads(path.read_text())
    tree = next(generate_trees(stage_config("large"), 1))
    assert {row["indent_tree"] for row in example} == {tree.text}
    assert expand_pairs(tree) == [(r["parent"], r["child"], r["label"]) for r in example]


@pytest.mark.parametrize("stage", STAGES)
def test_generated_trees_respect_stage_limits(stage: str) -> None:
    config = STAGE_CONFIGS[stage]
    for tree in generate_trees(config, 30):
        depths = [len(line) - len(line.lstrip("+")) for line in tree.text.split("\n")]
        assert len(tree.nodes) == len(set(tree.nodes)) <= config.max_nodes
        assert max(depths) <= config.max_depth and depths[0] == 0
        assert len(tree.edges) == len(tree.nodes) - 1
        # Each edge's parent is the nearest earlier line one level up (pre-order text).
        parent_of = {}
        for i, (name, d) in enumerate(zip(tree.nodes, depths, strict=True)):
            if d:
                j = max(k for k in range(i) if depths[k] == d - 1)
                parent_of[name] = tree.nodes[j]
        assert set(tree.edges) == {(p, c) for c, p in parent_of.items()}


def test_expand_pairs_order_on_small_tree() -> None:
    tree = next(t for t in generate_trees(stage_config("small"), 20) if len(t.nodes) == 3)
    root, a, b = tree.nodes
    assert expand_pairs(tree) == [
        (root, a, "true"), (root, b, "true"),
        (a, root, "false"), (a, b, "false"), (b, root, "false"), (b, a, "false"),
    ]


def _task(**kw) -> TreeTask:
    return TreeTask(**{"stage": "medium", "source": "generate", "num_trees": 200} | kw)


def _true_label(task: TreeTask, ex) -> str:
    tree = task.trees[ex.meta["tree_index"]]
    return "true" if (ex.meta["parent"], ex.meta["child"]) in tree.edge_set else "false"


def test_train_sampling_follows_positive_fraction_and_labels_are_right() -> None:
    task = _task()
    examples = task.train_examples(200, seed=1)
    assert sum(ex.label == "true" for ex in examples) == 100
    assert all(ex.label == ex.target == _true_label(task, ex) for ex in examples)
    skewed = _task(positive_fraction=0.25).train_examples(200, seed=1)
    assert sum(ex.label == "true" for ex in skewed) == 50
    assert task.train_examples(50, seed=1) != task.train_examples(50, seed=2)
    assert task.train_examples(50, seed=3) == task.train_examples(50, seed=3)


def test_eval_is_balanced_and_natural_eval_is_mostly_false() -> None:
    task = _task()
    balanced = task.eval_examples(101, seed=0)
    assert sum(ex.label == "true" for ex in balanced) == 50
    natural = task.natural_eval_examples(400, seed=0)
    assert all(ex.label == _true_label(task, ex) for ex in natural)
    # medium trees average ~6 nodes: about 1 ordered pair in 6 is a parent/child edge.
    assert 0.05 < sum(ex.label == "true" for ex in natural) / 400 < 0.35


def test_split_is_disjoint_deterministic_and_seeded() -> None:
    a, b = _task(), _task()
    assert a.test_trees == b.test_trees and a.train_trees == b.train_trees
    assert not set(a.train_trees) & set(a.test_trees)
    assert sorted(a.train_trees + a.test_trees) == list(range(200))
    assert len(a.test_trees) == 20  # test_fraction=0.1
    assert _task(split_seed=7).test_trees != a.test_trees
    assert {ex.meta["tree_index"] for ex in a.train_examples(300, 0)} <= set(a.train_trees)
    test = set(a.test_trees)
    assert {ex.meta["tree_index"] for ex in a.eval_examples(300, 0)} <= test
    assert {ex.meta["tree_index"] for ex in a.natural_eval_examples(300, 0)} <= test


@pytest.mark.data("textualized_tree")
def test_file_and_generator_give_the_same_trees() -> None:
    from_file = TreeTask(stage="xsmall", source="file", num_trees=100)
    generated = TreeTask(stage="xsmall", source="generate", num_trees=100)
    assert from_file.trees == generated.trees
    assert from_file.eval_examples(20, 0) == generated.eval_examples(20, 0)


def test_prompt_templates_are_exact() -> None:
    tree = "AB\n+CD"
    question = ", Task: Parent/Child Relationship, Parent: AB, Child: CD, Answer: "
    assert tree_prompt(tree, "AB", "CD", "paper") == (Segment("Tree: AB\n+CD" + question),)
    assert tree_prompt(tree, "AB", "CD", "context") == (
        Segment("Tree: AB\n+CD"), Segment(question, compress=False)
    )
    ex = _task(prompt_mode="paper").eval_examples(1, 0)[0]
    assert len(ex.segments) == 1 and ex.segments[0].text.endswith("Answer: ")


def test_curriculum_order() -> None:
    assert STAGES == ("small", "xsmall", "medium", "xmedium", "large", "x3large")
    assert [next_stage(s) for s in STAGES] == [*STAGES[1:], None]
    with pytest.raises(KTMError, match="'huge'.*small"):
        next_stage("huge")


@pytest.mark.parametrize(
    "text, label",
    [("true", "true"), (" False.", "false"), ("TRUE, because", "true"), ("yes", None), ("", None)],
)
def test_parse_label(text: str, label: str | None) -> None:
    assert parse_label(text) == label


def test_bad_options_are_refused() -> None:
    with pytest.raises(KTMError, match="prompt_mode='full'"):
        _task(prompt_mode="full")
    with pytest.raises(KTMError, match="positive_fraction=1.5"):
        _task(positive_fraction=1.5)
    with pytest.raises(KTMError, match="test_fraction=0"):
        _task(test_fraction=0.0)
    with pytest.raises(KTMError, match="unknown tree stage 'tiny'"):
        TreeTask(stage="tiny")
