"""The readability metric R against NLLs computed by hand through the plain HF forward."""

import pytest
import torch

from ktm.corpus import Window
from ktm.model import KTMModel
from ktm.readability import context_ratio, readability


def hand_nll(lm, embeds, n_prefix, target):
    """Summed NLL of ``target`` after ``n_prefix`` prefix rows of ``embeds`` (1, L, D)."""
    logits = lm(inputs_embeds=embeds).logits[0, n_prefix - 1:n_prefix - 1 + len(target)]
    return float(torch.nn.functional.cross_entropy(logits, torch.tensor(target), reduction="sum"))


def test_r_matches_hand_computed_nlls(tiny_model_dir):
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
    got = readability(model, windows)

    lm = model.peft  # the same model (adapter on) through the plain HF forward
    emb = model.embed_ids
    sums = {"merged": 0.0, "plain": 0.0, "none": 0.0}
    n = 0
    with torch.no_grad():
        for w in windows:
            ctx, tgt = torch.tensor(w.context), torch.tensor(w.target)
            merged, _ = model.encoder(emb(ctx[1:])[None])  # plain_prefix=1 keeps token 0 plain
            prefix = torch.cat([emb(ctx[:1])[None], merged], dim=1)
            sums["merged"] += hand_nll(lm, torch.cat([prefix, emb(tgt)[None]], 1),
                                       prefix.shape[1], w.target)
            sums["plain"] += hand_nll(lm, emb(torch.cat([ctx, tgt]))[None], len(ctx), w.target)
            none = torch.tensor([model.tokenizer.eos_token_id])  # the tiny tokenizer has no BOS
            sums["none"] += hand_nll(lm, emb(torch.cat([none, tgt]))[None], 1, w.target)
            n += len(w.target)
    want = {k: v / n for k, v in sums.items()}
    assert got["nll_merged"] == pytest.approx(want["merged"], rel=1e-4)
    assert got["nll_plain"] == pytest.approx(want["plain"], rel=1e-4)
    assert got["nll_none"] == pytest.approx(want["none"], rel=1e-4)
    r = context_ratio(want["none"], want["merged"], want["plain"])
    assert (got["R"] is None and r is None) or got["R"] == pytest.approx(r, rel=1e-4)
    assert got["tokens_in"] == (9 + 5) / 2
    assert got["tokens_out"] == (1 + 4 + 1 + 2) / 2  # 1 plain + ceil(8/2); 1 plain + ceil(4/2)


def test_context_ratio_edges():
    assert context_ratio(3.0, 2.0, 1.0) == 0.5
    assert context_ratio(3.0, 1.0, 1.0) == 1.0
    assert context_ratio(3.0, 4.0, 1.0) == -0.5  # the merged context misleads
    assert context_ratio(1.0, 1.0, 2.0) is None  # the plain context does not help at all
