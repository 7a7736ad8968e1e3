"""Question tasks over long documents (needle, vartrack, codeqa): documents of the length asked,
facts where they were put, and the qa evaluation's hits."""

import pytest
from helpers import fresh_model

from ktm import Segment
from ktm.errors import KTMError
from ktm.evaluation.evaluate import evaluate_task, hit
from ktm.tasks import get_task
from ktm.tasks.base import Example, bind
from ktm.tasks.haystack import Tokens, cut, insert


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return fresh_model(tiny_model_dir).tokenizer


def test_a_cut_holds_at_most_its_length_and_inserts_land_at_their_depth(tokenizer):
    import random

    lines = [f"line {i} of the quick brown fox\n" for i in range(400)]
    tokens = Tokens(tokenizer)
    text = cut(lines, 300, tokens, random.Random(0))
    assert 280 <= tokens.count(text) <= 300 and text.endswith("\n")
    doc, where = insert(text, [(0.0, "FIRST"), (1.0, "LAST"), (0.5, "MIDDLE")])
    assert doc.startswith("FIRST\n") and doc.endswith("LAST\n")
    assert doc[where[2]:].startswith("MIDDLE\n")
    assert abs(where[2] / len(doc) - 0.5) < 0.05
    with pytest.raises(KTMError, match="depth must be in"):
        insert(text, [(1.5, "x")])


@pytest.mark.parametrize("options", [{}, {"variant": "multikey"}, {"variant": "multivalue"}])
def test_needles_sit_at_their_depth_and_are_asked_about(tokenizer, options):
    task = get_task("needle", length=512, **options)
    with pytest.raises(KTMError, match="bind it to the model's tokenizer"):
        task.eval_examples(2, seed=0)
    task.bind(tokenizer)
    examples = task.eval_examples(3, seed=0)
    assert [e.meta["depth"] for e in examples] == [0.0, 0.5, 1.0]
    for e in examples:
        doc, question = e.segments
        assert question.compress is False and doc.compress
        assert 0.85 * 512 <= e.meta["tokens"] <= 512  # whole lines: up to a line short
        for value in e.meta["answers"]:
            assert f"is {value}." in doc.text and value in e.target
        assert abs(e.meta["at_token"] / e.meta["tokens"] - e.meta["depth"]) < 0.1
    asked = len(examples[0].meta["answers"])
    assert asked == (4 if options.get("variant") == "multivalue" else 1)
    # multikey: four needles of four keys in the document, one asked about
    needles = examples[0].segments[0].text.count("# The secret code for ")
    assert needles == (1 if not options else 4)
    # the same seed, the same examples; stdlib never trains
    assert task.eval_examples(3, seed=0) == examples
    only_eval = get_task("needle", train_source="stdlib")
    only_eval.bind(tokenizer)
    with pytest.raises(KTMError, match="evaluation-only"):
        only_eval.train_examples(1, 0)


def test_vartrack_chains_its_assignments_in_order(tokenizer):
    task = get_task("vartrack", length=400, hops=3)
    task.bind(tokenizer)
    e = task.eval_examples(1, seed=0)[0]
    a, b, c = e.meta["answers"]
    doc = e.segments[0].text
    assert doc.index(f"{b} = {a}") < doc.index(f"{c} = {b}")
    assert f"{a} = " in doc and e.target == f" {a}, {b}, {c}."


@pytest.mark.parametrize("variant", ["returns", "methods", "params"])
def test_codeqa_asks_about_real_code_in_the_document(tokenizer, variant):
    task = get_task("codeqa", length=600, variant=variant)
    task.bind(tokenizer)
    for e in task.eval_examples(2, seed=0):
        doc, question = e.segments
        name = question.text.split(" the class " if variant == "methods" else
                                   " the function ")[1].split()[0].rstrip("?")
        assert (f"class {name}" if variant == "methods" else f"def {name}(") in doc.text
        assert all(a in doc.text for a in e.meta["answers"])
        assert e.meta["tokens"] <= 600


@pytest.mark.parametrize("variant", ["assign", "default"])
def test_codeqa_asks_what_a_name_is_set_to_and_a_parameters_default(tokenizer, variant):
    import re

    task = get_task("codeqa", length=600, variant=variant)
    task.bind(tokenizer)
    for e in task.eval_examples(3, seed=0):
        doc, question = e.segments
        [value] = e.meta["answers"]
        assert e.target == f" {value}" and value not in ("None", "True", "False")
        if variant == "assign":
            name = re.search(r"what is (\w+) set to\?", question.text)[1]
            assert re.search(rf"\b{name}\s*=\s*{re.escape(value)}", doc.text)
        else:
            param, function = re.search(r"parameter (\w+) of the function (\w+)\?",
                                        question.text).groups()
            head = doc.text[doc.text.index(f"def {function}("):]
            assert re.search(rf"\b{param}\s*(:[^=]*)?=\s*{re.escape(value)}", head)
        assert e.meta["tokens"] <= 600


def test_codeqa_asks_which_function_a_quoted_line_is_in(tokenizer):
    import re

    task = get_task("codeqa", length=600, variant="within")
    task.bind(tokenizer)
    for e in task.eval_examples(3, seed=0):
        doc, question = e.segments
        line = re.search(r"the line `(.+)` in\?", question.text)[1]
        [name] = e.meta["answers"]
        assert e.target == f" {name}" and name not in line
        head = doc.text.index(f"def {name}(")
        at = doc.text.index(line)
        assert doc.text.count(line) == 1 and head < at
        # no other function starts between the one asked about and its line
        assert "def " not in doc.text[head + 4:at]
        assert e.meta["tokens"] <= 600


def test_codeqa_natural_deals_out_each_kinds_own_questions_in_turn(tokenizer):
    from ktm.tasks.codeqa import NATURAL

    task = get_task("codeqa", length=600, variant="natural")
    task.bind(tokenizer)
    mixed = task.eval_examples(6, seed=1)
    assert [e.meta["variant"] for e in mixed] == [*NATURAL, *NATURAL[:2]]
    for kind in NATURAL:
        alone = get_task("codeqa", length=600, variant=kind)
        alone.bind(tokenizer)
        n = sum(e.meta["variant"] == kind for e in mixed)
        assert [e.target for e in mixed if e.meta["variant"] == kind] == [
            e.target for e in alone.eval_examples(n, seed=1)]


def test_a_hit_holds_every_wanted_value_spaces_aside():
    assert hit(" 123, 456 and 789.", ["456", "123"])
    assert not hit(" 123 only", ["123", "456"])
    assert hit(" f(a,b)", ["f(a, b)"])


def test_qa_evaluation_scores_hits_by_depth(tiny_model_dir):
    model = fresh_model(tiny_model_dir)
    task = get_task("needle", length=200)
    bind(task, model)
    examples = task.eval_examples(3, seed=0)
    answer = model.generate([e.segments for e in examples], max_new_tokens=task.answer_tokens)
    # two examples asked about what the model answers anyway, one about what it never does
    rigged = [Example(e.segments, e.target, meta={**e.meta, "answers": [a.strip()[:3] or a]})
              for e, a in zip(examples[:2], answer)]
    rigged.append(Example(examples[2].segments, "x", meta={**examples[2].meta,
                                                           "answers": ["\x00never"]}))
    row = evaluate_task(model, task, rigged, merge=True)
    assert row["accuracy"] == pytest.approx(2 / 3)
    assert row["accuracy_by_depth"] == {"0.00": 1.0, "0.50": 1.0, "1.00": 0.0}
    assert row["prefill_s"] > 0 and row["n"] == 3
    assert row["tokens_after"] < row["tokens_before"]


def test_question_segments_stay_plain_in_context_mode():
    from ktm.tasks.base import qa_prompt

    doc, q = qa_prompt("doc", "q", "context")
    assert (doc.compress, q.compress) == (True, False)
    assert qa_prompt("doc", "q", "paper") == (Segment("docq"),)
