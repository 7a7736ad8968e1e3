"""The readability metric R against NLLs computed by hand through the plain HF forward."""

import pytest
import torch

import ktm.evaluation.readability
from ktm.evaluation.readability import context_ratio, r_interval, readability
from ktm.model import KTMModel
from ktm.tasks.corpus import Window


def hand_nll(lm, embeds, n_prefix, target):
    """Summed NLL of ``target`` after ``n_prefix`` prefix rows of ``embeds`` (1, L, D)."""
    logits = lm(inputs_embeds=embeds).logits[0, n_prefix - 1:n_prefix - 1 + len(target)]
    return float(torch.nn.functional.cross_entropy(logits, torch.tensor(target), reduction="sum"))


def test_r_matches_hand_computed_nlls(tiny_model_dir, monkeypatch):
    torch.manual_seed(0)
    model = KTMModel.from_base(tiny_model_dir, k=2, slot_weights=True, plain_prefix=1)
    with torch.no_grad():  # a trained-looking encoder and adapter, so all three NLLs differ
        for name, p in model.named_parameters():
            if "lora_B" in name or "slots" in name or "mlp.4" in name:
                p.add_(torch.randn_like(p) * 0.3)
    ids = model.tokenizer("The quick brown fox jumps over the lazy dog. Hello world, my name",
                          add_special_tokens=False)["input_ids"]
    windows = [Window(tuple(ids[:9]), tuple(ids[9:13]), "t"), Window(tuple(ids[2:7]),
                                                                     tuple(ids[7:10]), "t")]
    seen = []  # what the interval is computed from (R itself is None on the tiny model)
    monkeypatch.setattr(ktm.evaluation.readability, "r_interval",
                        lambda t: seen.append(t) or [0.0, 1.0])
    got = readability(model, windows)

    lm = model.peft  # the same model (adapter on) through the plain HF forward
    emb = model.input_embedding
    sums = {"merged": 0.0, "plain": 0.0, "none": 0.0}
    n = 0
    per_window = []
    with torch.no_grad():
        for w in windows:
            before = dict(sums)
            ctx, tgt = torch.tensor(w.context), torch.tensor(w.target)
            merged, _ = model.encoder(emb(ctx[1:])[None])  # plain_prefix=1 keeps token 0 plain
            prefix = torch.cat([emb(ctx[:1])[None], merged], dim=1)
            sums["merged"] += hand_nll(lm, torch.cat([prefix, emb(tgt)[None]], 1),
                                       prefix.shape[1], w.target)
            sums["plain"] += hand_nll(lm, emb(torch.cat([ctx, tgt]))[None], len(ctx), w.target)
            none = torch.tensor([model.tokenizer.eos_token_id])  # the tiny tokenizer has no BOS
            sums["none"] += hand_nll(lm, emb(torch.cat([none, tgt]))[None], 1, w.target)
            n += len(w.target)
            per_window.append([sums[k] - before[k] for k in ("merged", "plain", "none")]
                              + [len(w.target)])
    want = {k: v / n for k, v in sums.items()}
    assert got["nll_merged"] == pytest.approx(want["merged"], rel=1e-4)
    assert got["nll_plain"] == pytest.approx(want["plain"], rel=1e-4)
    assert got["nll_none"] == pytest.approx(want["none"], rel=1e-4)
    r = context_ratio(want["none"], want["merged"], want["plain"])
    assert (got["R"] is None and r is None) or got["R"] == pytest.approx(r, rel=1e-4)
    # the interval is a bootstrap over these windows' own summed NLLs and token counts
    assert got["R_ci95"] == [0.0, 1.0]
    torch.testing.assert_close(seen[0], torch.tensor(per_window, dtype=torch.float64),
                               rtol=1e-4, atol=1e-4)
    assert got["tokens_in"] == (9 + 5) / 2
    assert got["tokens_out"] == (1 + 4 + 1 + 2) / 2  # 1 plain + ceil(8/2); 1 plain + ceil(4/2)


def test_windows_start_with_the_bos_the_tokenizer_puts_first(tiny_bos_model_dir):
    """A task prompt's first segment gets the tokenizer's BOS; held-out windows, cut from token
    ids, must get it too, and "no context" is then the BOS alone."""
    torch.manual_seed(0)
    model = KTMModel.from_base(tiny_bos_model_dir, k=2, plain_prefix=1)
    bos = model.tokenizer.bos_token_id
    ids = model.tokenizer("The quick brown fox jumps over the lazy dog. Hello world",
                          add_special_tokens=False)["input_ids"]
    assert bos not in ids
    w = Window(tuple(ids[:8]), tuple(ids[8:12]), "t")
    got = readability(model, [w])
    lm, emb = model.peft, model.input_embedding
    ctx, tgt = torch.tensor((bos,) + w.context), torch.tensor(w.target)
    with torch.no_grad():
        merged, _ = model.encoder(emb(ctx[1:])[None])  # the BOS is the plain first token
        prefix = torch.cat([emb(ctx[:1])[None], merged], dim=1)
        want = {"merged": hand_nll(lm, torch.cat([prefix, emb(tgt)[None]], 1), prefix.shape[1],
                                   w.target),
                "plain": hand_nll(lm, emb(torch.cat([ctx, tgt]))[None], len(ctx), w.target),
                "none": hand_nll(lm, emb(torch.cat([ctx[:1], tgt]))[None], 1, w.target)}
        without = hand_nll(lm, emb(torch.cat([ctx[1:], tgt]))[None], len(ctx) - 1, w.target)
    assert abs(without - want["plain"]) > 1e-3  # the test can tell a missing BOS
    for name, v in want.items():
        assert got[f"nll_{name}"] == pytest.approx(v / len(w.target), rel=1e-4), name
    assert got["tokens_in"] == 9 and got["tokens_out"] == 1 + 4


def test_context_ratio_edges():
    assert context_ratio(3.0, 2.0, 1.0) == 0.5
    assert context_ratio(3.0, 1.0, 1.0) == 1.0
    assert context_ratio(3.0, 4.0, 1.0) == -0.5  # the merged context misleads
    assert context_ratio(1.0, 1.0, 2.0) is None  # the plain context does not help at all


def test_r_is_none_when_the_context_gain_is_noise():
    # a gain of 1e-6 nats would make R 1e6 for a merged reading 1 nat better than none
    assert context_ratio(3.0, 2.0, 3.0 - 1e-6) is None
    assert context_ratio(3.0, 2.0, 3.0 - 0.029) is None  # under 1 % of NLL_none
    assert context_ratio(3.0, 2.0, 2.9) == pytest.approx(10.0)  # 3.3 %: defined
    a = [10.0, 10.0, 30.0, 10.0]  # per window: summed NLL merged, plain, none; target tokens
    tiny = [20.0, 30.0 - 1e-5, 30.0, 10.0]  # a context gain of 1e-6 nats per token
    # about a quarter of the resamples draw only `tiny`: no R, far more than the 2.5 % tail
    assert r_interval(torch.tensor([a, tiny])) is None


def test_r_interval_is_a_bootstrap_over_windows():
    # per window: summed NLL merged, plain, none; target tokens. Window a keeps all of its
    # context (merged == plain: R 1), window b none of it (merged == none: R 0)
    a, b = [10.0, 10.0, 30.0, 10.0], [30.0, 10.0, 30.0, 10.0]
    assert r_interval(torch.tensor([a, a, a])) == pytest.approx([1.0, 1.0])  # windows agree
    lo, hi = r_interval(torch.tensor([a, b]))  # resamples aa (1), ab / ba (0.5), bb (0)
    assert (lo, hi) == pytest.approx((0.0, 1.0))
    lo, hi = r_interval(torch.tensor([a, b] * 32))  # more windows: narrower, around 0.5
    assert 0.3 < lo < 0.5 < hi < 0.7
    assert r_interval(torch.tensor([a])) is None  # one window: no interval
    flat = [10.0, 20.0, 20.0, 10.0]  # the plain context does not help: R undefined
    assert r_interval(torch.tensor([flat, flat])) is None


def test_recall_r_asks_for_what_followed_a_copied_question(tiny_model_dir):
    """Recall R: a question copied from a place in the context drawn per context and seed (never
    by the reader), its target the tokens that followed; both kinds of R come back, with the
    ratio the contexts were read at."""
    from helpers import fresh_model

    from ktm.evaluation.readability import readability
    from ktm.tasks.corpus import Window, recall_question

    w = Window(tuple(range(10, 90)), tuple(range(90, 100)), "code")
    q, t = recall_question(w, seed=0)
    assert (len(q), len(t)) == (8, 16) and q + t == w.context[w.context.index(q[0]):][:24]
    assert recall_question(w, seed=0) == (q, t) != recall_question(w, seed=1)
    short = Window((1, 2, 3, 4, 5, 6), (7,), "x")  # a third for the question, the rest after it
    assert [len(x) for x in recall_question(short, 0)] == [2, 4]
    model = fresh_model(tiny_model_dir, k=4, inner_k=2)
    windows = [Window(tuple(model.tokenize("The quick brown fox jumps over the lazy dog. " * 4,
                                           first=True)), (5, 6, 7), "x")] * 2
    out = readability(model, windows, ratio=3.0)
    assert {"R", "R_recall", "R_ci95", "R_recall_ci95", "recall_nll_merged"} <= set(out)
    assert out["ratio"] == 3.0 and abs(out["ratio_read"] / 3.0 - 1) < 0.05
    alone = readability(model, windows, recall=False)
    assert "R_recall" not in alone and alone["ratio_read"] == pytest.approx(
        out["tokens_in"] / -(-out["tokens_in"] // 4), rel=0.05)


def test_the_stdlib_held_out_set_is_text_no_project_file_imports():
    """``stdlib``: Python standard-library modules read from this Python's own sources, needing
    no data folder; none of them is imported anywhere in the project."""
    import re
    from pathlib import Path

    from ktm.tasks.corpus import STDLIB_MODULES, heldout_texts

    texts = heldout_texts("stdlib")
    assert len(texts) > 100 and all(texts)
    repo = Path(__file__).resolve().parents[2]
    used = set()
    for path in [*repo.glob("ktm/**/*.py"), *repo.glob("tests/**/*.py"),
                 *repo.glob("results/**/*.py")]:
        used |= set(re.findall(r"^\s*(?:import|from)\s+(\w+)", path.read_text(), flags=re.M))
    assert used.isdisjoint(STDLIB_MODULES)


def test_a_plain_cache_reads_each_plain_nll_once_and_changes_nothing(tiny_model_dir):
    from helpers import fresh_model

    from ktm.evaluation.readability import readability
    from ktm.tasks.corpus import Window

    model = fresh_model(tiny_model_dir, k=4, inner_k=2)
    text = "The quick brown fox jumps over the lazy dog. Hello world, my name is ktm. " * 3
    windows = [Window(tuple(model.tokenize(text[i:], first=True)), (5, 6, 7), "x")
               for i in (0, 9, 17)]
    cache: dict = {}
    for ratio in (None, 2.0, 3.0):
        want = readability(model, windows, ratio=ratio)
        got = readability(model, windows, ratio=ratio, plain_cache=cache)
        assert {k: got[k] for k in ("R", "R_recall", "nll_plain", "recall_nll_none")} == {
            k: want[k] for k in ("R", "R_recall", "nll_plain", "recall_nll_none")}
    # plain continuation and recall per window, recall's question alone per window, and the
    # one context-free continuation reading all three share (the same target)
    assert len(cache) == 3 * len(windows) + 1
