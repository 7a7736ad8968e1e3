"""Growing a checkpoint through the library (no CLI): the saved function at the start, the new
units from the seed, and every other change refused by name."""

from dataclasses import replace

import pytest
import torch
from helpers import fresh_model

from ktm import KTMError
from ktm.core.checkpoint import model_config
from ktm.core.levels import merging_at
from ktm.core.prompt import Segment
from ktm.model import prompt_logits
from ktm.training.growth import changed, grow

TEXT = "The quick brown fox jumps over the lazy dog. Hello world, my name is"


def saved(tiny_model_dir, path, **kw):
    model = fresh_model(tiny_model_dir, slot_weights=True, **kw)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.peft.named_parameters():
            if "lora_B" in name:  # a non-zero adapter, so that it shows in the logits
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for p in model.encoder.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    model.save(path)
    return model.eval()


def logits(model):
    with torch.no_grad():
        return prompt_logits(model, [Segment(TEXT), Segment(" and", compress=False)])


def test_capacity_growth_keeps_the_function_and_takes_its_new_units_from_the_seed(
        tiny_model_dir, tmp_path):
    reader = saved(tiny_model_dir, tmp_path / "ck", k=2)
    own = model_config(tmp_path / "ck")
    want = replace(own, base_model=tiny_model_dir, mlp_ratio=own.mlp_ratio * 2,
                   lora=replace(own.lora, r=own.lora.r * 2, alpha=own.lora.alpha * 4))
    assert sorted(changed(own, want)) == ["lora_alpha", "lora_r", "mlp_ratio"]
    before = torch.get_rng_state()
    grown = grow(tmp_path / "ck", want, seed=3)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's RNG is left as it was
    assert grown.training and grown.config.mlp_ratio == want.mlp_ratio
    torch.testing.assert_close(logits(grown.eval()), logits(reader), atol=1e-5, rtol=1e-5)
    again, other = grow(tmp_path / "ck", want, seed=3), grow(tmp_path / "ck", want, seed=4)
    a, b, c = (dict(m.peft.named_parameters()) for m in (grown, again, other))
    name = next(n for n in a if "lora_A" in n)
    assert torch.equal(a[name], b[name]) and not torch.equal(a[name], c[name])


def test_an_outer_level_reads_the_saved_levels_as_before(tiny_model_dir, tmp_path):
    reader = saved(tiny_model_dir, tmp_path / "k4", k=4, inner_k=2)
    own = model_config(tmp_path / "k4")
    grown = grow(tmp_path / "k4", replace(own, base_model=tiny_model_dir, k=8, inner_k=(4, 2)))
    assert grown.config.levels == (8, 4, 2)
    grown.eval()
    with torch.no_grad():
        for k in (4, 2):
            with merging_at(grown, k), merging_at(reader, k):
                torch.testing.assert_close(grown.compress(TEXT).embeds,
                                           reader.compress(TEXT).embeds)


@pytest.mark.parametrize("change,message", [
    (dict(k=1), "needs its own K=2, not K=1"),
    (dict(use_mlp=False), "changes only lora_r, .*got use_mlp=False \\(saved True\\)"),
    (dict(mlp_ratio=0.5), "mlp_ratio 0.5 \\(--mlp-ratio\\) is below checkpoint"),
    (dict(k=8, inner_k=(4,)), "needs inner_k \\(2,\\) \\(--inner-k 2\\)"),
    (dict(k=4, inner_k=2, use_mlp=False), "expected only k and inner K to change, got use_mlp"),
])
def test_a_change_growth_cannot_make_is_refused_by_name(tiny_model_dir, tmp_path, change,
                                                        message):
    saved(tiny_model_dir, tmp_path / "ck", k=2, mlp_ratio=1.0)
    want = replace(model_config(tmp_path / "ck"), base_model=tiny_model_dir, **change)
    with pytest.raises(KTMError, match=message):
        grow(tmp_path / "ck", want)
