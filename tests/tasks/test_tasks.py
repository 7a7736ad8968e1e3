"""Task registry, data-file errors, evaluation-only guards and label parsing, on tiny fixtures."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from ktm.core.prompt import Segment
from ktm.errors import KTMError
from ktm.tasks import TASKS, get_task
from ktm.tasks.amazon import OTHER_CATEGORIES_FILE, AmazonTask
from ktm.tasks.base import Example
from ktm.tasks.commitpack import HELDOUT_FILE, CommitPackTask, commit_prompt
from ktm.tasks.jsonl import data_root, read_jsonl
from ktm.tasks.labels import parse_label
from ktm.tasks.split import cycle_balanced
from ktm.tasks.tree import TreeTask
from ktm.tasks.tree_gen import generate_trees, stage_config


def _write(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def _reviews(n: int = 40) -> list[dict]:
    return [{"text": f"review number {i} " + "x" * i, "rating": float(1 + i % 5)} for i in range(n)]


def _commits(n: int = 40) -> list[dict]:
    return [
        {"old_contents": f"x = {i}\n", "new_contents": f"x = {i + 1}\n" * (1 + i % 3),
         "subject": f"Bump x past {i}"}
        for i in range(n)
    ]


def _own_rows(n: int = 40) -> list[dict]:
    return [{"context": f"item {i} " + "y" * i, "prompt": "Even or odd?",
             "target": ("even", "odd")[i % 2]} for i in range(n)]


def _modules(folder: Path, n: int = 6) -> Path:
    """A folder of small Python modules: functions that return, classes of methods."""
    folder.mkdir(parents=True, exist_ok=True)
    for m in range(n):
        body = "".join(f"def f{m}_{i}(x):\n    y = x + {i}\n    return y * {m + 2}\n\n\n"
                       f"class C{m}_{i}:\n    def a{i}(self):\n        return {i}\n\n"
                       f"    def b{i}(self):\n        return {m}\n\n\n" for i in range(12))
        (folder / f"mod{m}.py").write_text(body)
    return folder


@pytest.fixture
def fixture_kwargs(tmp_path: Path) -> dict[str, dict]:
    trees = [
        {"indent_tree": t.text, "edges": [list(e) for e in t.edges]}
        for t in generate_trees(stage_config("medium"), 30)
    ]
    questions = {"source": str(_modules(tmp_path / "src")),
                 "train_source": str(_modules(tmp_path / "train")), "length": 128}
    return {
        "tree": {"data_path": _write(tmp_path / "trees.jsonl", trees), "stage": "medium"},
        "amazon": {"data_path": _write(tmp_path / "reviews.jsonl.gz", _reviews()), "test_size": 8},
        "commitpack": {"data_path": _write(tmp_path / "commits.jsonl", _commits()), "test_size": 8},
        "custom": {"data_path": _write(tmp_path / "own.jsonl", _own_rows()), "test_size": 8},
        **dict.fromkeys(("needle", "vartrack", "codeqa"), questions),
    }


def _built(name: str, kwargs: dict, tiny_model_dir: str, **more):
    """The task, bound to the tiny model's tokenizer where it counts lengths in tokens."""
    task = get_task(name, **kwargs, **more)
    if task.kind == "qa":
        from helpers import fresh_model

        task.bind(fresh_model(tiny_model_dir).tokenizer)
    return task


@pytest.mark.parametrize("name", sorted(TASKS))
def test_registry_builds_every_task_with_the_contract(name: str, fixture_kwargs,
                                                     tiny_model_dir) -> None:
    task = _built(name, fixture_kwargs[name], tiny_model_dir)
    assert isinstance(task, TASKS[name]) and task.name == name
    assert task.kind in ("classification", "perplexity", "qa")
    assert (task.kind == "classification") == bool(task.labels)
    train, evals = task.train_examples(12, seed=0), task.eval_examples(6, seed=0)
    assert len(train) == 12 and len(evals) == 6
    for ex in train + evals:
        assert isinstance(ex, Example) and ex.target
        assert ex.segments and all(isinstance(s, Segment) for s in ex.segments)
        assert ex.segments[0].compress and not ex.segments[-1].compress  # context mode default
        if task.labels:
            assert ex.label in task.labels and ex.target.strip() == ex.label
    assert task.train_examples(12, seed=0) == train  # same seed, same examples
    assert task.eval_examples(6, seed=0) == evals


@pytest.mark.parametrize("name", sorted(TASKS))
def test_paper_mode_is_one_compressed_segment(name: str, fixture_kwargs, tiny_model_dir) -> None:
    task = _built(name, fixture_kwargs[name], tiny_model_dir, prompt_mode="paper")
    for ex in task.eval_examples(4, seed=1):
        assert len(ex.segments) == 1 and ex.segments[0].compress


def test_get_task_errors_name_the_bad_value() -> None:
    names = "amazon, codeqa, commitpack, custom, needle, tree, vartrack"
    with pytest.raises(KTMError, match=f"unknown task 'trees'.*{names}"):
        get_task("trees")
    with pytest.raises(KTMError, match="has no option stages.*stage"):
        get_task("tree", stages="small")


@pytest.mark.parametrize(
    "name, option, expected",
    [
        ("amazon", {"max_chars": "abc"}, r"max_chars='abc': expected int or None"),
        ("amazon", {"test_size": True}, r"test_size=True: expected int"),  # bool is not an int
        ("amazon", {"balance_train": "false"}, r"balance_train='false': expected bool"),
        ("commitpack", {"test_fraction": "x"}, r"test_fraction='x': expected float"),
        ("tree", {"source": "web"}, r"source='web': expected 'auto' or 'file' or 'generate'"),
        ("tree", {"prompt_mode": "full"}, r"prompt_mode='full': expected 'paper' or 'context'"),
    ],
)
def test_get_task_checks_option_types(name, option, expected) -> None:
    with pytest.raises(KTMError, match=f"task '{name}' option {expected}"):
        get_task(name, **option)


def test_get_task_widens_an_int_to_a_float_option(fixture_kwargs) -> None:
    task = get_task("tree", positive_fraction=1, **fixture_kwargs["tree"])
    assert task.positive_fraction == 1.0 and isinstance(task.positive_fraction, float)


@pytest.mark.parametrize(
    "line, expected",
    [
        ('{"text": "ok", "rating": 4', "bad JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"text": "ok"}', "missing field 'rating'"),
        ('{"text": 5, "rating": 4}', "field 'text' must be str, got int"),
        ('{"text": "ok", "rating": true}', "field 'rating' must be float, got bool"),
    ],
)
def test_malformed_row_names_file_and_line(tmp_path: Path, line: str, expected: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "a", "rating": 1}\n\n' + line + "\n")
    with pytest.raises(KTMError, match=rf"bad\.jsonl line 3: .*{expected}"):
        list(read_jsonl(path, {"text": str, "rating": float}))


def test_malformed_rows_inside_tasks(tmp_path: Path) -> None:
    bad_tree = tmp_path / "t.jsonl"
    bad_tree.write_text('{"indent_tree": "AA\\n+BB", "edges": [["AA", "BB"]]}\n'
                        '{"indent_tree": "AA", "edges": [["AA"]]}\n')
    with pytest.raises(KTMError, match=r"t\.jsonl line 2: field 'edges'"):
        TreeTask(data_path=bad_tree).train_examples(1, 0)
    bad_review = _write(tmp_path / "r.jsonl", [{"text": "fine", "rating": 5}, {"text": "no"}])
    with pytest.raises(KTMError, match=r"r\.jsonl line 2: field 'rating' must be a number"):
        AmazonTask(data_path=bad_review, test_size=1).train_examples(1, 0)
    bad_commit = _write(tmp_path / "c.jsonl", [{"old_contents": "", "subject": "Add x"}])
    with pytest.raises(KTMError, match=r"c\.jsonl line 1: missing field 'new_contents'"):
        CommitPackTask(data_path=bad_commit, test_size=1).train_examples(1, 0)


@pytest.mark.parametrize(
    ("tree", "edges", "expected"),
    [
        ("AA\n+BB\n+CC", [["AA", "BB"], ["AA", "ZZ"]], "'edges' does not match"),
        ("AA\n+BB\n\n+CC", [["AA", "BB"], ["AA", "CC"]], "tree line 3 '': expected"),
        ("AA\n+BB\n+BB", [["AA", "BB"], ["AA", "BB"]], "name 'BB' appears twice"),
        ("AA\n++BB", [["AA", "BB"]], "depth 2 does not follow"),
        ("AA\nBB", [], "depth 0 does not follow"),
    ],
)
def test_tree_text_and_edges_must_agree(tmp_path: Path, tree, edges, expected) -> None:
    path = _write(tmp_path / "t.jsonl", [{"indent_tree": "AA\n+BB", "edges": [["AA", "BB"]]},
                                         {"indent_tree": tree, "edges": edges}])
    with pytest.raises(KTMError, match=rf"t\.jsonl line 2: .*{expected}"):
        _ = TreeTask(data_path=path).trees


@pytest.mark.parametrize("end", ["\r\n", "\r"])  # Windows, and classic Mac (was an error)
def test_tree_trailing_newline_and_crlf_are_not_nodes(tmp_path: Path, end: str) -> None:
    tree = f"AA{end}+BB{end}+CC\n"
    rows = [{"indent_tree": tree, "edges": [["AA", "BB"], ["AA", "CC"]]}] * 2
    task = TreeTask(data_path=_write(tmp_path / "t.jsonl", rows))
    assert task.trees[0].nodes == ("AA", "BB", "CC")
    for ex in task.train_examples(50, seed=0):
        assert ex.meta["parent"] in "AA BB CC" and ex.meta["child"] in "AA BB CC"
        assert "\r" not in ex.segments[0].text


def test_missing_file_says_which_path_and_how_to_fix(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(KTMError, match=r"not found: .*nope\.jsonl \(pass an existing file\)"):
        AmazonTask(data_path=tmp_path / "nope.jsonl")
    monkeypatch.setenv("KTM_DATA", str(tmp_path))
    assert data_root() == tmp_path
    with pytest.raises(KTMError, match="set KTM_DATA"):
        CommitPackTask()
    with pytest.raises(KTMError, match="set KTM_DATA"):
        TreeTask(stage="small", source="file")
    # Without the shipped file, "auto" falls back to the generator (same trees as the file).
    task = TreeTask(stage="small", num_trees=40)
    assert task.path is None and len(task.trees) == 40


def test_eval_only_files_are_refused_for_training(tmp_path: Path) -> None:
    other = _write(tmp_path / "amazon_reviews_other" / "cats.jsonl", _reviews())
    with pytest.raises(KTMError, match="evaluation-only"):
        AmazonTask(data_path=other)
    renamed = _write(
        tmp_path / "copy.jsonl", [r | {"category": "Gift_Cards"} for r in _reviews()]
    )
    with pytest.raises(KTMError, match=r"copy\.jsonl line 1: category 'Gift_Cards'"):
        AmazonTask(data_path=renamed, test_size=4).train_examples(1, 0)
    heldout = _write(tmp_path / "heldout_repos_test.jsonl.gz", _commits())
    with pytest.raises(KTMError, match="evaluation-only"):
        CommitPackTask(data_path=heldout)


def test_eval_only_files_are_accepted_as_eval_path(tmp_path: Path) -> None:
    train = _write(tmp_path / "fashion.jsonl", _reviews())
    other = _write(
        tmp_path / "amazon_reviews_other" / "cats.jsonl",
        [{"text": "other category", "rating": 2.0, "category": "Appliances"}] * 3,
    )
    task = AmazonTask(data_path=train, test_size=4, eval_path=other)
    evals = task.eval_examples(10, seed=0)
    assert len(evals) == 3 and all("other category" in ex.segments[0].text for ex in evals)
    heldout = _write(tmp_path / "heldout_repos_test.jsonl.gz", _commits(5))
    commits = CommitPackTask(data_path=_write(tmp_path / "c.jsonl", _commits()), test_size=4,
                             eval_path=heldout)
    assert len(commits.eval_examples(100, seed=0)) == 5


def test_a_copy_gzipped_or_not_is_read_and_still_held_out(tmp_path: Path, monkeypatch) -> None:
    """$KTM_DATA may hold the files uncompressed (or gzipped under a plain name): the default file
    is found either way, and an uncompressed held-out set is still refused as training data."""
    monkeypatch.setenv("KTM_DATA", str(tmp_path))
    _write(tmp_path / "amazon_reviews_fashion" / "amazon_fashion_2018_combined.jsonl", _reviews())
    assert len(AmazonTask(test_size=4).reviews) == 40
    plain_named = tmp_path / "commitpackft_python" / "commitpackft_style_python_mined.jsonl.gz"
    plain_named.parent.mkdir()
    plain_named.write_text("".join(json.dumps(r) + "\n" for r in _commits()))  # not gzipped
    assert len(CommitPackTask(test_size=4).all_commits) == 40
    trees = [{"indent_tree": t.text, "edges": [list(e) for e in t.edges]}
             for t in generate_trees(stage_config("small"), 5)]
    _write(tmp_path / "textualized_tree" / "trees_small_seed42_first10000.jsonl", trees)
    task = TreeTask(stage="small")  # "auto" reads the copy instead of generating 10,000 trees
    assert task.path is not None and len(task.trees) == 5
    heldout = _write(tmp_path / "heldout_repos_test.jsonl", _commits())
    with pytest.raises(KTMError, match="evaluation-only"):
        CommitPackTask(data_path=heldout)
    other = _write(tmp_path / "amazon_other_categories_2018.jsonl", _reviews())
    with pytest.raises(KTMError, match="evaluation-only"):
        AmazonTask(data_path=other)


def test_missing_default_file_names_folder_and_ktm_data(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KTM_DATA", str(tmp_path))
    with pytest.raises(KTMError) as e:
        AmazonTask()
    msg = str(e.value)
    assert "amazon_fashion_2018_combined.jsonl.gz" in msg and f"$KTM_DATA={tmp_path}" in msg
    assert f"data folder {tmp_path}" in msg


@pytest.mark.data("amazon_reviews_other", "commitpackft_python")
def test_shipped_eval_only_files_are_refused() -> None:
    with pytest.raises(KTMError, match="evaluation-only"):
        AmazonTask(data_path=data_root() / OTHER_CATEGORIES_FILE)
    with pytest.raises(KTMError, match="evaluation-only"):
        CommitPackTask(data_path=data_root() / HELDOUT_FILE)


def test_amazon_labels_truncation_and_empty_reviews(tmp_path: Path) -> None:
    rows = [{"text": "  ", "rating": 5.0}, {"reviewText": "old schema", "overall": 4.0},
            {"text": "meh", "rating": 3.0}, {"text": "y" * 50, "rating": 4.0}]
    task = AmazonTask(data_path=_write(tmp_path / "r.jsonl", rows), test_size=1, max_chars=10)
    by_line = {r.line_no: r for r in task.reviews}
    assert sorted(by_line) == [2, 3, 4]  # the blank review is skipped
    assert by_line[2].label == "positive" and by_line[3].label == "negative"
    assert by_line[4].text == "y" * 10
    ex = task._example(by_line[2])
    assert ex.segments == (Segment("Review: old schema"), Segment(", Label:", compress=False))
    assert ex.target == " positive" and ex.label == "positive"


@pytest.mark.parametrize("rating", [10, 0, 0.8, "NaN"])
def test_amazon_rating_on_another_scale_is_an_error(tmp_path: Path, rating) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text('{"text": "good", "rating": 5}\n' + f'{{"text": "meh", "rating": {rating}}}\n')
    with pytest.raises(KTMError, match=r"r\.jsonl line 2: field 'rating' is .*expected 1 to 5"):
        AmazonTask(data_path=path, test_size=1).train_examples(1, 0)


def test_amazon_eval_keeps_natural_distribution(tmp_path: Path) -> None:
    rows = [{"text": f"r{i}", "rating": 5.0 if i % 4 else 1.0} for i in range(100)]
    task = AmazonTask(data_path=_write(tmp_path / "r.jsonl", rows), test_size=40)
    evals = task.eval_examples(1000, seed=0)
    assert len(evals) == 40 and len({ex.segments[0].text for ex in evals}) == 40
    train_texts = {r.text for r in task.train_reviews}
    assert not train_texts & {r.text for r in task.eval_reviews}
    assert len(task.train_examples(130, seed=0)) == 130  # passes over the 60 training reviews


def test_amazon_balance_train_draws_each_label_equally(tmp_path: Path) -> None:
    rows = [{"text": f"r{i}", "rating": 5.0 if i % 5 else 1.0} for i in range(200)]  # 4:1
    path = _write(tmp_path / "r.jsonl", rows)
    natural = AmazonTask(data_path=path, test_size=50).train_examples(400, seed=3)
    assert sum(ex.label == "negative" for ex in natural) < 120  # about 80 of 400
    task = AmazonTask(data_path=path, test_size=50, balance_train=True)
    drawn = task.train_examples(401, seed=3)
    assert sorted(Counter(ex.label for ex in drawn).values()) == [200, 201]
    negatives = {r.text for r in task.train_reviews if r.label == "negative"}
    counts = Counter(ex.segments[0].text.removeprefix("Review: ") for ex in drawn
                     if ex.label == "negative")
    assert set(counts) == negatives and max(counts.values()) - min(counts.values()) <= 1  # passes
    assert [ex.label for ex in drawn[:20]] != sorted(ex.label for ex in drawn[:20])  # shuffled
    assert task.train_examples(401, seed=3) == drawn and task.train_examples(401, seed=4) != drawn
    assert task.eval_examples(50, seed=0) == AmazonTask(data_path=path, test_size=50).eval_examples(
        50, seed=0)  # the test set keeps its natural balance


def test_cycle_balanced_errors_and_uneven_groups() -> None:
    with pytest.raises(KTMError, match="non-empty training set"):
        cycle_balanced(4, [[], []], seed=0)
    with pytest.raises(KTMError, match="balance_train='yes': expected true or false"):
        AmazonTask(data_path="unused.jsonl", balance_train="yes")
    out = cycle_balanced(5, [[7], [1, 2, 3], []], seed=0)  # the empty group is skipped
    assert sorted(out).count(7) == 3 and len(out) == 5


def test_commitpack_blank_new_contents_is_not_an_example(tmp_path: Path) -> None:
    rows = _commits(10) + [{"old_contents": "x = 1\n", "new_contents": " \n", "subject": "Drop x"}]
    task = CommitPackTask(data_path=_write(tmp_path / "c.jsonl", rows), test_size=2)
    assert len(task.all_commits) == 10
    assert all(ex.target.strip() for ex in task.train_examples(30, 0) + task.eval_examples(9, 0))


def test_too_few_records_for_the_split_names_the_file(tmp_path: Path) -> None:
    reviews = _write(tmp_path / "few_reviews.jsonl", _reviews(5))
    with pytest.raises(KTMError, match=r"few_reviews\.jsonl has 5 non-empty reviews: test_size"):
        AmazonTask(data_path=reviews).train_examples(1, 0)
    commits = _write(tmp_path / "one_commit.jsonl", _commits(1))
    with pytest.raises(KTMError, match=r"one_commit\.jsonl has 1 records: test_size"):
        CommitPackTask(data_path=commits).train_examples(1, 0)


def test_commitpack_prompt_and_length_filter(tmp_path: Path) -> None:
    header = "Update the old python code content based on the instrutions.\nOld Content: "
    tail = "\nInstructions: Fix it\nNew Content:\n"
    assert commit_prompt("a = 1\n", "Fix it", "paper") == (Segment(header + "a = 1\n" + tail),)
    assert commit_prompt("a = 1\n", "Fix it", "context") == (
        Segment(header + "a = 1\n"), Segment(tail, compress=False)
    )
    rows = _commits(10) + [{"old_contents": "o" * 60, "new_contents": "n" * 50, "subject": "Grow"}]
    path = _write(tmp_path / "c.jsonl", rows)
    assert len(CommitPackTask(data_path=path, test_size=2, max_chars=100).commits) == 10
    assert len(CommitPackTask(data_path=path, test_size=2, max_chars=None).commits) == 11
    task = CommitPackTask(data_path=path, test_size=2)
    assert task.kind == "perplexity" and task.labels == ()
    assert task.eval_examples(1, 0)[0].target in {r["new_contents"] for r in rows}


@pytest.mark.parametrize(
    "text, labels, expected",
    [
        (" positive", ("positive", "negative"), "positive"),
        ("Negative! It broke.", ("positive", "negative"), "negative"),
        ("\n\"True\"", ("true", "false"), "true"),
        ("neutral", ("positive", "negative"), None),
        ("positively", ("positive", "negative"), None),
        ("   ", ("true", "false"), None),
    ],
)
def test_parse_label(text: str, labels: tuple[str, ...], expected: str | None) -> None:
    assert parse_label(text, labels) == expected


@pytest.mark.parametrize("text", ["true…", "«true»", "true。", "**true**", "「true」", "¡true!",
                                  "true🙂", "\u200btrue", "“True”,", "\ufefftrue"])
def test_parse_label_strips_punctuation_and_symbols_of_any_script(text: str) -> None:
    """Only ASCII punctuation was stripped: "true…", "«true»" or "**true**" parsed as no
    answer (an ellipsis, guillemets and markdown bold are common in generated text)."""
    assert parse_label(text + " more words", ("true", "false")) == "true"


def test_parse_label_reads_ascii_answers_as_before() -> None:
    """Every ASCII punctuation character around the first word is stripped, as it was; inside
    it, or a letter or digit, is not."""
    import string

    for mark in string.punctuation:
        assert parse_label(f"{mark}{mark}true{mark}", ("true", "false")) == "true", mark
        assert parse_label(f"tr{mark}ue", ("true", "false")) is None, mark
    assert parse_label("true2", ("true", "false")) is None
    assert parse_label("xtrue", ("true", "false")) is None
