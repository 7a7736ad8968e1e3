"""Examples too long for the model's positions are refused before a run, naming where they are."""

from __future__ import annotations

import pytest

from ktm.core.prompt import Segment
from ktm.errors import KTMError
from ktm.model import KTMModel
from ktm.tasks.base import Example
from ktm.tasks.fits import check_examples_fit


@pytest.mark.parametrize("layout", [
    {}, {"plain_prefix": 3}, {"plain_suffix": 5}, {"align_lines": True},
    {"spread_positions": True}, {"plain_prefix": 2, "plain_suffix": 3, "align_lines": True}])
def test_measuring_a_prompt_gives_what_encoding_it_gives(tiny_model_dir, layout):
    """``encode_prompts(..., embed=False)`` (tokenizing only) agrees with ``encode_prompts``
    in every count and position, for every layout, merged or not: the fit check reads the same
    numbers."""
    model = KTMModel.from_base(tiny_model_dir, k=3, **layout)
    prompts = ["def add(a, b):\n    return a + b\n# Update\n", "Hello world",
               [Segment("The quick brown fox\njumps."), Segment("\nAnswer:", compress=False)],
               [Segment("x", compress=False), Segment("The lazy\ndog.\n")]]
    for merge in (True, False):
        for enc, meas in zip(model.encode_prompts(prompts, merge),
                             model.encode_prompts(prompts, merge, embed=False), strict=True):
            assert (meas.tokens_in, meas.tokens_out, meas.mergeable, meas.merged,
                    meas.next_position) == (enc.tokens_in, enc.tokens_out, enc.mergeable,
                                            enc.merged, enc.next_position)
            assert meas.embeds.shape[0] == enc.embeds.shape[0]
            assert (meas.positions is None) == (enc.positions is None)
            assert meas.sources.tolist() == enc.sources.tolist()


def test_an_example_over_the_limit_is_named_with_the_k_that_fits(tiny_model_dir):
    model = KTMModel.from_base(tiny_model_dir, k=2)
    tok = model.tokenizer
    text = " fox" * 1100
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    assert 1024 < n < 1500  # K=2 is over 512 positions, K=3 under
    ok = Example((Segment("Hello world"),), "yes")
    long = Example((Segment(text),), "yes", meta={"line": 7, "file": "my.jsonl"})
    check_examples_fit(model, [ok] * 3, "training")
    # segments as a list or a plain string, target ids as a list: each read once all the same
    check_examples_fit(model, [Example([Segment("Hello")], [5, 6]), Example("Hello", "x")] * 2,
                       "training")
    with pytest.raises(KTMError, match=r"^my\.jsonl line 7: prompt is \d+ positions after merging "
                                       rf"\(K=2, {n} tokens before\) \+ \d target tokens, over "
                                       r"the model's limit of 512 positions; K=3 would fit"):
        check_examples_fit(model, [ok, long], "training")
    with pytest.raises(KTMError, match=r"^evaluation example 1: .* K=3 would fit"):
        check_examples_fit(model, [ok, Example((Segment(text),), "yes")], "evaluation")


def test_a_generated_answer_is_checked_as_generation_reads_its_prompt(tiny_model_dir):
    # fitted: a prompt past the window passes where generation reads it at a ratio that fits
    # (K=2 and its deeper level, 4), and is refused only past even that, with fit's error
    model = KTMModel.from_base(tiny_model_dir, k=2)
    tok = model.tokenizer
    past = Example((Segment(" fox" * 1100), Segment("\nAnswer:", compress=False)), "yes")
    with pytest.raises(KTMError, match="K=3 would fit"):
        check_examples_fit(model, [past], "evaluation", answer_tokens=0, new_tokens=4)
    check_examples_fit(model, [past], "evaluation", answer_tokens=0, new_tokens=4, fitted=True)
    n = len(tok(" fox" * 2400, add_special_tokens=False)["input_ids"])
    assert n > 4 * 512
    too_long = Example((Segment(" fox" * 2400), Segment("\nAnswer:", compress=False)), "yes")
    with pytest.raises(KTMError, match=r"^evaluation example 0: prompt of \d+ tokens cannot fit "
                                       r"the model's 512 positions"):
        check_examples_fit(model, [too_long], "evaluation", answer_tokens=0, new_tokens=4,
                           fitted=True)
