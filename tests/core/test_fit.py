"""A prompt past the model's window is read at the ratio that fits it (``ktm.core.fit``)."""

import dataclasses
import warnings

import pytest
from helpers import fresh_model, perturb

from ktm import KTMError, Segment
from ktm.core.allocate import RatioWarning

LINE = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu\n"
QUESTION = Segment("\nWhat follows kappa?", question=True)


@pytest.fixture(scope="module")
def reader(tiny_model_dir):
    """K=4 over an inner K=2 (levels 4 and 2, and 8 read whole), 512 positions."""
    model = fresh_model(tiny_model_dir, k=4, inner_k=2, slot_weights=True)
    perturb(model)
    return model.eval()


def positions(model, prompt):
    return model.encode_prompts([prompt], embed=False)[0].next_position


def test_a_prompt_past_the_window_is_read_at_the_ratio_that_fits(reader):
    fits = [Segment(LINE * 20), QUESTION]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RatioWarning)  # nothing changes for a prompt that fits
        short = reader.generate(fits, max_new_tokens=4)
    assert short == reader.generate(fits, max_new_tokens=4)
    doc = LINE * 42  # 2,394 tokens: about 600 positions at K=4, over 512
    long = [Segment(doc), QUESTION]
    assert positions(reader, long) > reader.max_positions
    with pytest.warns(RatioWarning, match=r"was read at ratio [78]\.\d\d .* to leave 7 of the "
                                          r"model's 512 after it"):
        got = reader.generate(long, max_new_tokens=8)
    # a reader that leaves nothing out reads no deeper than its deeper level (8), whole
    assert got == reader.generate([Segment(doc, ratio=8), QUESTION], max_new_tokens=8)
    with pytest.raises(KTMError, match=r"even read at its densest \(8 tokens a position.*at "
                                       r"most about \d+ tokens"):
        reader.generate([Segment(LINE * 80), QUESTION], max_new_tokens=8)


def test_a_question_reader_fits_by_reading_what_the_question_needs_least_deeper(reader):
    config = reader._config
    reader._config = dataclasses.replace(config, ratio=4.0, allocator="question")
    try:
        doc = LINE * 30 + "The secret code is 7731.\n" + LINE * 12
        long = [Segment(doc), Segment("\nWhat is the secret code?", question=True)]
        assert positions(reader, long) > reader.max_positions - 15
        with pytest.warns(RatioWarning, match="to leave 15 of the model's 512 after it"):
            reader.generate(long, max_new_tokens=16)
        from ktm.core.fit import encode_fitted

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RatioWarning)
            (fitted,), (cp,) = encode_fitted(reader, [long], True, [15])
        assert cp.next_position <= reader.max_positions - 15
        # past its largest level (4): its deeper level (8), whole, before any unit is left out
        (ratio,) = {s.ratio for s in fitted if s.compress}
        assert ratio == 8 and fitted[1:] == tuple(long[1:])
        with warnings.catch_warnings():  # the question's line is still read plain
            warnings.simplefilter("ignore", RatioWarning)
            (row,) = reader._prompt_encoder().layout([fitted])
        plain = "".join(reader.tokenizer.decode(ids) for ids, level, c in row if c and not level)
        assert "secret code is 7731" in plain
    finally:
        reader._config = config


def test_past_its_largest_level_the_question_allocator_reads_deeper_before_leaving_out(reader):
    # between the largest level (4) and the deeper one (8) nothing is left out: what the
    # question needs least is read at 8, its merges merged again; its line stays plain
    from ktm.core.config import Layout
    from ktm.core.prefix import LEFT_OUT

    doc = LINE * 30 + "The secret code is 7731.\n" + LINE * 12
    layout = Layout(allocator="question")
    prompt = (Segment(doc, ratio=6), Segment("\nWhat is the secret code?", question=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RatioWarning)
        (row,) = reader._prompt_encoder(layout).layout([prompt])
        cp = reader.encode_prompts([prompt], layout=layout)[0]
    levels = {level for _, level, c in row if c}
    assert LEFT_OUT not in levels and 8 in levels and 4 in levels
    plain = "".join(reader.tokenizer.decode(ids) for ids, level, c in row if c and not level)
    assert "secret code is 7731" in plain
    assert 5 < cp.squeezed[0] / cp.squeezed[1] < 7
