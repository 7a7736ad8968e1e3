"""KV presses (kvpress) on the torch runtime: against kvpress's own pipeline, the identities a
press must keep, what it presses and what it never does, and its errors."""

import math

import pytest
import torch
from helpers import FAMILIES, TEXT, close, fresh_model, require_module, save_tiny

from ktm.core.prompt import Segment
from ktm.decode.generate import generate_ids
from ktm.decode.press import (
    LEFT_OUT,
    REPLAYS,
    SCORERS,
    WRAPPERS,
    PressConfig,
    kept_positions,
    kvpress_compatible,
    press_names,
)
from ktm.errors import KTMError

LONG = TEXT * 3  # 70-odd tokens of the tiny tokenizer: longer than SnapKV's 64-token window
PROMPT = [Segment(LONG), Segment(" Answer:", compress=False)]


@pytest.fixture(autouse=True)
def _kvpress():
    require_module("kvpress", "the [kvpress] extra and kvpress (the README's test command)")


def test_press_config_refuses_bad_names_and_ratios():
    for name in ("nope", "adakv", "nope:snapkv", "adakv:nope", ""):
        with pytest.raises(KTMError, match="unknown press"):
            PressConfig(name, 0.5)
    for ratio in (1.0, -0.1, math.nan, True, "0.5"):
        with pytest.raises(KTMError, match=r"in \[0, 1\)"):
            PressConfig("snapkv", ratio)
    assert "adakv:snapkv" in press_names() and "expected_attention" in press_names()


def test_every_kvpress_press_is_offered_or_left_out_with_a_reason():
    import kvpress

    exported = {n for n in kvpress.__all__ if n.endswith("Press")} - {"BasePress", "ScorerPress"}
    assert exported == (set(SCORERS.values()) | set(REPLAYS.values()) | set(WRAPPERS.values())
                        | set(LEFT_OUT))


@pytest.mark.parametrize("name", press_names())
def test_every_offered_press_generates_and_scores(tiny_model_dir, name):
    """Each press drops its share of the pressable positions from what decoding reads (cut
    from the cache, or hidden per layer and head), and scoring reads through it."""
    model = fresh_model(tiny_model_dir, k=2, press=name, press_ratio=0.5)
    prompts = [[Segment(LONG * 2), Segment(" Answer:", compress=False)], [Segment(LONG * 3)]]
    texts = model.generate(prompts, max_new_tokens=4)
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    nll = model(prompts, ["true", "false"]).nll
    assert torch.isfinite(nll).all()
    heads = model.lm_config.num_hidden_layers * model.lm_config.num_key_value_heads
    for prompt in prompts:
        cp = model.compress(prompt)
        kept = kept_positions(cp, model.runtime.press)
        assert kept < cp.tokens_out  # long enough to be pressed
        state = model.runtime.prefill([cp])
        hidden = 0 if state.hidden is None else len(state.hidden)
        # the keys attention reads, summed over layers and heads: those kept, each once; a
        # head-wise press rounds the share over all heads (KVzip) or per head (AdaKV)
        read = state.cache.get_seq_length() * heads - hidden
        assert kept * heads <= read < (kept + 1) * heads, (cp.tokens_out, kept, read / heads)
    model.use_press(None)
    plain = model(prompts, ["true", "false"]).nll
    # what a press drops moves each row's loss past the float rounding of reading the prefix
    # in two forwards (test_ratio_zero_reads_as_no_press): by 1.2e-4 of it at the least, seen
    assert ((nll - plain).abs() > 1e-5 * plain.abs()).all(), (nll, plain)


def test_ratio_zero_reads_as_no_press(tiny_model_dir):
    model = fresh_model(tiny_model_dir, k=4)
    prompts = [PROMPT, [Segment(TEXT)]]
    plain = model.generate(prompts, max_new_tokens=12)
    nll = model(prompts, ["true", "false"]).nll
    model.use_press("expected_attention", 0.0)
    assert model.generate(prompts, max_new_tokens=12) == plain
    # the pressed path reads the prefix in two forwards: the same numbers up to float rounding
    torch.testing.assert_close(model(prompts, ["true", "false"]).nll, nll, rtol=1e-5, atol=1e-5)


def test_a_press_changes_what_is_read_and_keeps_its_share(tiny_model_dir):
    model = fresh_model(tiny_model_dir, k=1)
    cp = model.compress(PROMPT)
    before = model([PROMPT], ["true"]).nll
    model.use_press("knorm", 0.5)
    state = model.runtime.prefill([cp])
    split = cp.pressable  # a plain segment follows: every compressed row is pressed
    assert split == cp.tokens_out - len(model.tokenize(" Answer:"))
    assert state.cache.get_seq_length() == PressConfig("knorm", 0.5).kept(split) + (
        cp.tokens_out - split) == kept_positions(cp, PressConfig("knorm", 0.5))
    assert int(state.pos[0, -1]) == cp.tokens_out - 1  # the plain rows at their true positions
    assert not torch.allclose(model([PROMPT], ["true"]).nll, before)


def test_the_last_row_is_read_after_the_press_when_nothing_plain_follows(tiny_model_dir):
    model = fresh_model(tiny_model_dir, k=1)
    cp = model.compress([Segment(LONG)])
    assert cp.pressable == cp.tokens_out
    model.use_press("streaming_llm", 0.5)
    state = model.runtime.prefill([cp])
    assert state.cache.get_seq_length() == PressConfig("streaming_llm", 0.5).kept(
        cp.tokens_out - 1) + 1


def test_a_press_at_k1_equals_the_press_on_the_plain_prompt(tiny_model_dir):
    k1 = fresh_model(tiny_model_dir, k=1, press="expected_attention", press_ratio=0.5)
    k4 = fresh_model(tiny_model_dir, k=4, press="expected_attention", press_ratio=0.5)
    assert k1.generate(PROMPT, max_new_tokens=12) == k4.generate(PROMPT, max_new_tokens=12,
                                                                 merge=False)
    torch.testing.assert_close(k1([PROMPT], ["true"]).nll,
                               k4([PROMPT], ["true"], merge=False).nll, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["tova", "adakv:knorm", "criticaladakv:keydiff"])
def test_a_pressed_batch_equals_its_prompts_one_by_one(tiny_model_dir, name):
    """Head-wise presses (AdaKV) hide keys per row and head: each row's stay its own."""
    model = fresh_model(tiny_model_dir, k=4, press=name, press_ratio=0.5)
    prompts = [PROMPT, [Segment(TEXT), Segment(" Q:", compress=False)], [Segment(LONG * 2)]]
    together = model.generate(prompts, max_new_tokens=10)
    assert together == [model.generate(p, max_new_tokens=10) for p in prompts]
    streamed = "".join(model.stream(prompts[1], max_new_tokens=10))
    assert streamed == together[1]


def test_hidden_keys_follow_their_rows_when_rows_leave(tiny_model_dir):
    """The server's batch drops finished rows: what a head-wise press hid stays with its row,
    and nothing stays on the layers for an unpressed read."""
    model = fresh_model(tiny_model_dir, k=1, press="adakv:knorm", press_ratio=0.5)
    prompts = [[Segment(TEXT), Segment(" Q:", compress=False)], [Segment(LONG * 2)], PROMPT]
    rt = model.runtime

    def steps(state, n=6):
        out = []
        for _ in range(n):
            tok = state.logits.argmax(-1)
            out.append(tok)
            rt.advance(state, tok)
        return torch.stack(out, 1)

    state = rt.prefill([model.compress(p) for p in prompts])
    assert state.hidden is not None and set(state.hidden[:, 0].tolist()) == {0, 1, 2}
    rt.keep(state, [0, 2])
    alone = rt.prefill([model.compress(p) for p in (prompts[0], prompts[2])])
    assert torch.equal(steps(state), steps(alone))
    assert all(getattr(m, "masked_key_indices", None) is None
               for m in model.peft.get_base_model().model.layers[0].modules())
    model.use_press(None)
    plain = model.generate(prompts, max_new_tokens=6)
    assert plain == [model.generate(p, max_new_tokens=6) for p in prompts]


def test_stacked_presses_the_merged_rows(tiny_model_dir):
    model = fresh_model(tiny_model_dir, k=4, press="snapkv", press_ratio=0.5)
    cp = model.compress([Segment(LONG * 4), Segment(" Answer:", compress=False)])
    assert cp.pressable < cp.tokens_in / 3  # merged rows
    state = model.runtime.prefill([cp])
    assert state.cache.get_seq_length() == kept_positions(cp, model.runtime.press)


def test_task_rows_count_the_kv_a_press_keeps(tiny_model_dir):
    from ktm.evaluation.evaluate import evaluate_classification, evaluate_perplexity
    from ktm.tasks.base import Example

    examples = [Example(tuple(PROMPT), " true", label="true"),
                Example((Segment(LONG * 2), Segment(" Q:", compress=False)), " false",
                        label="false")]
    model = fresh_model(tiny_model_dir, k=2)
    plain = [evaluate_perplexity(model, examples, batch_size=1),
             evaluate_classification(model, examples, ["true", "false"], max_new_tokens=2),
             evaluate_classification(model, examples, ["true", "false"], scoring="likelihood")]
    assert [r["kv_after"] for r in plain] == [r["tokens_after"] for r in plain]
    model.use_press("knorm", 0.5)
    want = sum(kept_positions(model.compress(list(e.segments)), model.runtime.press)
               for e in examples) / len(examples)
    pressed = [evaluate_perplexity(model, examples, batch_size=1),
               evaluate_classification(model, examples, ["true", "false"], max_new_tokens=2),
               evaluate_classification(model, examples, ["true", "false"], scoring="likelihood")]
    assert [r["kv_after"] for r in pressed] == [want] * 3
    assert want < plain[0]["tokens_after"] == pressed[0]["tokens_after"]


def test_a_prompt_too_short_for_a_press_is_read_whole_and_counted_so(tiny_model_dir):
    """SnapKV presses more rows than its 64-row window, StreamingLLM more than its sinks: a
    shorter prompt is read unpressed (said once), and its KV is counted as kept."""
    model = fresh_model(tiny_model_dir, k=1, press="snapkv", press_ratio=0.5)
    prompt = [Segment("short text"), Segment("Q:", compress=False)]
    with pytest.warns(UserWarning, match="snapkv leaves prompts of fewer than 65"):
        pressed = model.generate(prompt, max_new_tokens=4)
    cp = model.compress(prompt)
    assert kept_positions(cp, model.runtime.press) == cp.tokens_out
    model.use_press(None)
    assert pressed == model.generate(prompt, max_new_tokens=4)
    assert PressConfig("streaming_llm").fewest() == 5 and PressConfig("knorm").fewest() == 1


def test_use_cache_off_is_refused_under_a_press(tiny_model_dir):
    model = fresh_model(tiny_model_dir, k=4, press="knorm")
    with pytest.raises(KTMError, match="use_cache"):
        model.generate(PROMPT, use_cache=False)


def test_other_backends_refuse_a_press_in_one_line(tiny_model_dir):
    model = fresh_model(tiny_model_dir, k=4, press="knorm")
    for backend in ("llamacpp", "vllm"):
        with pytest.raises(KTMError, match=f"torch runtime only: the {backend} backend") as e:
            model.use_backend(backend)
        assert "\n" not in str(e.value)
    assert model.runtime.name == "torch" and model.runtime.press.name == "knorm"
    model.use_press(None)
    assert model.runtime.press is None


def pipeline_parity(model, context: str, question: str, names, n_new: int = 10) -> None:
    """For each press: kvpress's own pipeline (its prefill under the press, then the question
    at its true positions, then greedy decoding) and ktm's press keep the same KV of the
    context (the same values at the positions kept; the same keys hidden per layer and head),
    something dropped, and give the same tokens, on the ids the pipeline itself prepares."""
    import kvpress
    from kvpress import KVPressTextGenerationPipeline
    from transformers import DynamicCache

    from ktm.decode.hidden import hidden_keys

    lm, tok = model.peft.get_base_model(), model.tokenizer
    pipe = KVPressTextGenerationPipeline(model=lm, tokenizer=tok, device=str(model.device))
    ids = pipe.preprocess(context, [question], "", 10**9)
    prompt = [Segment("", ids=ids["context_ids"][0].tolist()),
              Segment("", ids=ids["questions_ids"][0][0].tolist(), compress=False)]
    n_context, n_question = ids["context_ids"].shape[1], ids["questions_ids"][0].shape[1]
    for name in names:
        cfg = PressConfig(name, 0.75)
        # a query-agnostic press, as kvpress offers it, reads the ids its pipeline prefills
        press = getattr(kvpress, REPLAYS[name])(compression_ratio=0.75) if cfg.replays else (
            cfg.make())
        cache = DynamicCache()
        with kvpress_compatible(lm):
            want = pipe(context, question=question, press=press, cache=cache,
                        max_new_tokens=n_new)["answer"]
        # the pipeline leaves the context's KV in ``cache`` and what it hid on the layers,
        # taken off here (a view ktm makes of the LM would copy them)
        want_hidden = hidden_keys(lm)
        kept = cache.get_seq_length()
        assert kept < n_context or want_hidden is not None, f"{name}: nothing pressed"
        model.use_press(cfg)
        state = model.runtime.prefill([model.compress(prompt)])
        assert state.cache.get_seq_length() == kept + n_question, name
        for ours, theirs in zip(state.cache.layers, cache.layers, strict=True):
            close(ours.values[..., :kept, :], theirs.values)
        assert (want_hidden is None) == (state.hidden is None), name
        if want_hidden is not None:
            ours, theirs = (sorted(map(tuple, h.tolist())) for h in (state.hidden, want_hidden))
            if cfg.replays and tok.chat_template is not None:
                # kvpress's KVzip leaves the chat template's opening of the context unscored,
                # so hidden first; ktm re-reads every row (a ktm context holds no template)
                assert len(ours) == len(theirs), name
            else:
                assert ours == theirs, name
        got = generate_ids(model, [prompt], max_new_tokens=n_new)[0]
        assert tok.decode(got, skip_special_tokens=True) == want, name


PIPELINE_PRESSES = ("expected_attention", "snapkv", "knorm", "tova", "keydiff",
                    "streaming_llm", "adakv:expected_attention", "kvzip")


def test_greedy_equals_kvpress_pipeline(tiny_bos_model_dir):
    model = fresh_model(tiny_bos_model_dir, k=1)  # kvpress puts the BOS before a context
    pipeline_parity(model, LONG, " Who jumps?", PIPELINE_PRESSES)


@pytest.mark.slow
def test_greedy_equals_kvpress_pipeline_on_the_embedded_model():
    from ktm.model import KTMModel

    model = KTMModel.from_base("smollm2-135m", k=1).requires_grad_(False)
    context = ("def add(a, b):\n    return a + b\n\n" * 4 + "class Stack:\n    def __init__"
               "(self):\n        self.items = []\n\n    def push(self, x):\n        self."
               "items.append(x)\n\n    def pop(self):\n        return self.items.pop()\n") * 2
    # the presses that read the model's attention or its queries (the tiny model reads all)
    pipeline_parity(model, context, "What does Stack.pop return?",
                    ("expected_attention", "snapkv", "tova", "adakv:expected_attention", "kvzip"),
                    16)


# tiny models of these families read a press (the rest refuse it by name)
PRESSED_FAMILIES = {"llama", "qwen2", "qwen3", "gemma", "mixtral", "phi3", "olmo2", "cohere",
                    "granite", "smollm3", "olmo", "starcoder2", "qwen2_moe", "qwen3_moe",
                    "phimoe"}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_press_reads_a_family_or_refuses_it_by_name(tmp_path, family):
    save_tiny(family, tmp_path)
    model = fresh_model(str(tmp_path), k=2, press="expected_attention", press_ratio=0.5)
    prompt = [Segment(TEXT * 3), Segment(" Q:", compress=False)]
    if family in PRESSED_FAMILIES:
        cp = model.compress(prompt)
        state = model.runtime.prefill([cp])
        assert state.cache.get_seq_length() == kept_positions(cp, model.runtime.press)
        assert isinstance(model.generate(prompt, max_new_tokens=3), str)
    else:
        with pytest.raises(KTMError, match="press expected_attention|a KV press needs"):
            model.generate(prompt, max_new_tokens=3)
