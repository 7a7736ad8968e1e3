"""Adaptive merging: the allocator's arithmetic, and prompts read at a level per block."""

import dataclasses
import math
import warnings

import pytest
import torch
from helpers import fresh_model, perturb

from ktm import Segment
from ktm.core.allocate import (
    RatioWarning,
    Units,
    allocate,
    max_ratio,
    positions,
    spend,
    spread_order,
)
from ktm.core.levels import encoder_at, merging_at
from ktm.core.loss import target_logits
from ktm.core.signals import rule_scores
from ktm.decode.generate import advance, generate_ids, prefill
from ktm.errors import KTMError
from ktm.model import KTMModel

TEXT = ("The quick brown fox jumps over the lazy dog. Hello world, my name is ktm. "
        "def add(a, b):\n    return a + b\n") * 3


def test_spend_refines_where_the_signal_per_position_is_highest():
    # four units of 8 tokens, one worth far more: it is refined first and furthest
    levels = spend([1.0, 10.0, 1.0, 1.0], [8, 8, 8, 8], (8, 4, 2), budget=4 + 3)
    assert levels == [8, 2, 8, 8]  # 8 -> 4 (+1), 4 -> 2 (+2): the budget of 3 spent on it
    assert sum(positions(8, lv) for lv in levels) <= 7
    # every level down to plain once the budget allows
    assert spend([1.0, 10.0], [8, 8], (8, 4, 2), budget=16) == [1, 1]
    with pytest.raises(KTMError, match="cannot hold 4 units"):
        spend([1.0] * 4, [8] * 4, (8, 4), budget=3)


def test_equal_signals_spread_the_refinements_over_the_segment():
    assert spread_order(4) == [0, 2, 1, 3]  # 0, then the middle, then the quarters
    levels = spend([1.0] * 8, [8] * 8, (8, 4), budget=8 + 2)
    assert [i for i, lv in enumerate(levels) if lv == 4] == [0, 4]


@pytest.mark.parametrize("signal", ["even", "recency", "random", "rules"])
@pytest.mark.parametrize("ratio", [1.5, 2.0, 3.0, 6.0])
def test_a_long_segment_lands_within_five_percent_of_its_ratio(signal, ratio):
    ids = list(range(1000, 1500))
    scores = [float(i % 7) for i in ids] if signal == "rules" else None
    runs = allocate([ids], 0, ratio, (8, 4, 2), signal, scores)
    assert sum(n for n, _ in runs[0]) == len(ids)  # every token in one run
    assert {lv for _, lv in runs[0]} <= {8, 4, 2, 1}
    read = len(ids) / sum(positions(n, lv) for n, lv in runs[0])
    assert abs(read / ratio - 1) <= 0.05


def test_a_ratio_beyond_the_largest_level_names_the_value():
    with pytest.raises(KTMError, match=r"ratio 9 is more than this reader allows.*K=8.*<= 8"):
        allocate([list(range(64))], 0, 9.0, (8, 4, 2), "even")
    # a segment too short for its ratio: every unit at the largest level, the closest it comes
    assert allocate([list(range(5))], 1, 8.0, (8, 4, 2), "even") == [[(5, 8)]]
    assert max_ratio(65, 1, 8) == 65 / 9


def test_rules_weigh_content_over_whitespace_punctuation_and_repeats():
    kinds = {1: "word", 2: "space", 3: "punct", 4: "word"}.get
    assert rule_scores([1, 2, 3, 4, 1], kinds) == [1.0, 0.0, 0.3, 1.0, 0.5]


def test_units_cut_each_piece_on_its_own():
    units = Units.of([[0] * 10, [0] * 3], 4)
    assert units.cuts == ((0, 0, 4), (0, 4, 4), (0, 8, 2), (1, 0, 3))


@pytest.fixture
def reader(tiny_model_dir):
    """A K=8 reader of levels 8, 4 and 2, its weights away from their no-op init."""
    model = fresh_model(tiny_model_dir, k=8, inner_k=(4, 2), slot_weights=True)
    perturb(model)
    return model.eval()


def test_segment_levels_read_each_unit_at_its_own_level(reader):
    ids = tuple(reader.tokenize(TEXT, first=True))
    n_units = math.ceil(len(ids) / 8)
    with torch.no_grad():
        uniform = reader.compress([Segment("", ids=ids)])
        same = reader.compress([Segment("", ids=ids, levels=(8,) * n_units)])
        plain = reader.compress([Segment("", ids=ids)], merge=False)
        all_one = reader.compress([Segment("", ids=ids, levels=(1,) * n_units)])
        assert torch.equal(uniform.embeds, same.embeds)
        assert torch.equal(plain.embeds, all_one.embeds)
        # a mix: each unit's vectors are its own level's merge of its own tokens
        levels = tuple([8, 1, 4, 2] * n_units)[:n_units]
        mixed = reader.compress([Segment("", ids=ids, levels=levels)])
        parts = []
        for u, level in enumerate(levels):
            unit = ids[u * 8:(u + 1) * 8]
            if level == 1:
                parts.append(reader.input_embedding(torch.tensor(unit)))
            else:
                unit_embeds = reader.input_embedding(torch.tensor([unit]))
                parts.append(encoder_at(reader, level)(unit_embeds)[0][0])
        torch.testing.assert_close(mixed.embeds, torch.cat(parts), atol=1e-6, rtol=1e-5)
    assert mixed.tokens_out == sum(positions(len(ids[u * 8:(u + 1) * 8]), lv)
                                   for u, lv in enumerate(levels))


def test_bad_levels_and_ratios_are_refused_by_name(reader):
    ids = tuple(range(5, 45))
    with pytest.raises(KTMError, match="give 2 levels, but the segment has 5 units"):
        reader.compress([Segment("", ids=ids, levels=(8, 8))])
    with pytest.raises(KTMError, match="level 3 is not one this model reads"):
        reader.compress([Segment("", ids=ids, levels=(8, 3, 8, 8, 8))])
    for bad in (0.5, float("nan"), float("inf")):
        with pytest.raises(KTMError, match="ratio must be a finite number >= 1"):
            Segment("x", ratio=bad)
    with pytest.raises(KTMError, match="expected compress=True"):
        Segment("x", compress=False, ratio=2)
    with pytest.raises(KTMError, match="not both"):
        Segment("x", ratio=2, levels=(8,))
    with pytest.raises(KTMError, match="ratio 12 is more than this reader allows"):
        reader.compress([Segment("", ids=ids, ratio=12)])


def test_a_short_segment_says_the_ratio_it_was_read_at(reader):
    # 10 tokens: 3 positions give 3.33, the closest a unit of 8 and one of 2 allow
    with pytest.warns(RatioWarning, match=r"a segment of 10 tokens was read at ratio 3\.33, "
                                          r"not 3"):
        cp = reader.compress([Segment("", ids=tuple(range(5, 15)), ratio=3)])
    assert (cp.tokens_in, cp.tokens_out) == (10, 3)


@pytest.mark.parametrize("allocator", ["even", "rules", "recency", "random", "lm", "attention"])
def test_a_ratio_prompt_reads_at_that_ratio(reader, allocator):
    reader._config = dataclasses.replace(reader._config, allocator=allocator)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RatioWarning)
        cp = reader.compress([Segment(TEXT, ratio=3.0), Segment(" Answer:", compress=False)])
    plain = len(reader.tokenize(" Answer:"))
    read = (cp.tokens_in - plain) / (cp.tokens_out - plain)
    assert abs(read / 3.0 - 1) <= 0.05


def test_mixed_level_prompts_keep_the_parity_properties(reader):
    """A batch equals its rows, and cached decoding equals a full re-run, with mixed levels and
    spread positions."""
    prompts = [[Segment(TEXT, ratio=2.5), Segment(" Answer:", compress=False)],
               [Segment(TEXT[:70], ratio=1.5)], TEXT[20:]]
    for spread in (False, True):
        reader._config = dataclasses.replace(reader._config, spread_positions=spread)
        with torch.no_grad():
            logits = target_logits(reader, prompts, ["a b", "c", "d e f"]).logits
            rows = [target_logits(reader, [p], [t]).logits
                    for p, t in zip(prompts, ["a b", "c", "d e f"])]
            torch.testing.assert_close(logits, torch.cat(rows), atol=1e-4, rtol=1e-4)
            cps = reader.encode_prompts(prompts)
            cached, full = prefill(reader, cps), prefill(reader, cps, use_cache=False)
            for _ in range(3):
                torch.testing.assert_close(cached.logits, full.logits, atol=1e-4, rtol=1e-4)
                nxt = cached.logits.argmax(-1)
                advance(reader, cached, nxt)
                advance(reader, full, nxt)
        assert generate_ids(reader, prompts, max_new_tokens=4, stop_at_eos=False) == [
            generate_ids(reader, p, max_new_tokens=4, stop_at_eos=False)[0] for p in prompts]


def test_a_nested_reader_saves_loads_and_reads_at_each_level(reader, tmp_path):
    assert reader.config.levels == (8, 4, 2)
    reader.save(tmp_path / "ck")
    again = KTMModel.load(tmp_path / "ck")
    assert again.config.inner_k == (4, 2)
    with torch.no_grad():
        for k in (8, 4, 2):
            with merging_at(reader, k), merging_at(again, k):
                assert torch.equal(reader.compress(TEXT).embeds, again.compress(TEXT).embeds)
        at4 = KTMModel.load(tmp_path / "ck", k=4)
        assert at4.config.levels == (4, 2)
        with merging_at(reader, 4):
            assert torch.equal(at4.compress(TEXT).embeds, reader.compress(TEXT).embeds)


def test_a_prompt_reports_the_ratio_its_compressed_segments_were_read_at(reader):
    plain = " Question: who? Answer:"
    cp = reader.compress([Segment(TEXT, ratio=2.0), Segment(plain, compress=False)])
    n_plain = len(reader.tokenize(plain))
    assert cp.squeezed == (cp.tokens_in - n_plain, cp.tokens_out - n_plain)
    assert abs(cp.ratio_read / 2.0 - 1) <= 0.05
    assert reader.compress([Segment(plain, compress=False)]).ratio_read is None
    assert reader.compress([Segment(TEXT)], merge=False).ratio_read == 1.0


def test_the_attention_oracle_scores_what_the_last_tokens_attend(reader):
    """The attention allocator's signal: per token, the base LM's attention from the last
    tokens, read plain; the LM's own attention implementation is back afterwards, and a
    layout planned with it differs from an even one."""
    from ktm.model import lm_attention

    lm = reader.peft.get_base_model()
    before = lm.config._attn_implementation
    ids = reader.tokenize(TEXT)
    scores = lm_attention(reader, ids)
    assert len(scores) == len(ids) and min(scores) >= 0
    # each of the last queries spreads a weight of 1 over the tokens up to it
    assert abs(sum(scores) - 1) < 1e-4
    assert lm.config._attn_implementation == before
    layouts = {}
    for allocator in ("attention", "even"):
        reader._config = dataclasses.replace(reader._config, allocator=allocator)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RatioWarning)
            layouts[allocator] = reader.compress([Segment(TEXT * 3, ratio=2.0)])
    assert not torch.equal(layouts["attention"].embeds, layouts["even"].embeds)


def test_a_signal_is_one_class_registered_by_name(reader):
    """Adding an allocator signal is adding one class to ``ktm.core.signals``: registered, its
    name is an allocator a config takes, and it spends a segment's positions by its scores."""
    from ktm.core.signals import SIGNALS, Signal, register

    @register
    class First(Signal):
        name = "test-first"

        def per_unit(self, lengths, seed):
            return [100.0] + [1.0] * (len(lengths) - 1)

    ids = tuple(range(5, 45))  # 5 units of 8: 12 positions read the first plain, the rest at 8
    try:
        reader._config = dataclasses.replace(reader._config, allocator="test-first")
        with torch.no_grad():
            got = reader.compress([Segment("", ids=ids, ratio=40 / 12)])
            want = reader.compress([Segment("", ids=ids, levels=(1, 8, 8, 8, 8))])
        assert got.tokens_out == 12 and torch.equal(got.embeds, want.embeds)
        with pytest.raises(KTMError, match="'test-first' is registered twice"):
            register(First)
    finally:
        del SIGNALS["test-first"]
    with pytest.raises(KTMError, match="allocator must be one of surprisal, .*got 'test-first'"):
        dataclasses.replace(reader._config, allocator="test-first")


def test_a_reading_plan_is_passed_with_a_call_and_leaves_the_model_as_it_is(reader):
    """``layout=`` on ``encode_prompts``, ``generate`` and ``stream`` reads that call as a model
    of that layout would, and the model's own layout is untouched."""
    from ktm.core.config import Layout

    plan = Layout(ratio=3.0, allocator="recency")
    prompt = [Segment(TEXT), Segment(" Answer:", compress=False)]
    own = reader._config
    with torch.no_grad():
        got = reader.encode_prompts([prompt], layout=plan)[0]
        text = reader.generate(prompt, layout=plan, max_new_tokens=3, stop_at_eos=False)
        pieces = "".join(reader.stream(prompt, layout=plan, max_new_tokens=3, stop_at_eos=False))
        assert reader._config is own
        uniform = reader.encode_prompts([prompt])[0]
        reader._config = plan.apply(own)
        try:
            want = reader.encode_prompts([prompt])[0]
            want_text = reader.generate(prompt, max_new_tokens=3, stop_at_eos=False)
        finally:
            reader._config = own
    assert torch.equal(got.embeds, want.embeds) and got.tokens_out == want.tokens_out
    assert got.tokens_out != uniform.tokens_out  # the plan was read, not the model's own
    assert text == want_text == pieces
