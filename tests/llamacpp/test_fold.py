"""Folding the LoRA into the base GGUF: every adapted weight becomes W + (alpha / r) B A in its
own number type, everything else (metadata, other tensors) is copied unchanged, and what cannot
be folded is refused. Runs without llama.cpp (only the ``gguf`` package)."""

import numpy as np
import pytest
from helpers import fresh_model, perturb

from ktm.errors import KTMError
from ktm.llamacpp.fold import fold_adapter
from ktm.llamacpp.gguf_files import gguf_arch, gguf_module, lora_tensors, write_base


@pytest.fixture
def files(tiny_model_dir, tmp_path):
    model = fresh_model(tiny_model_dir, k=2)
    perturb(model)
    with model.peft.disable_adapter():
        write_base(tmp_path / "base.gguf", model.peft.get_base_model(), model.tokenizer, "f32")
    adapter, alpha = lora_tensors(model.peft, model.lm_config, gguf_arch(model.lm_config))
    return tmp_path / "base.gguf", adapter, alpha


def _tensors(path) -> dict[str, np.ndarray]:
    r = gguf_module().GGUFReader(str(path))
    return {t.name: np.array(t.data).reshape([int(n) for n in reversed(t.shape)])
            for t in r.tensors}


def test_each_adapted_weight_becomes_w_plus_the_scaled_lora_product(files, tmp_path):
    base, adapter, alpha = files
    folded = fold_adapter(base, tmp_path / "model.gguf", adapter, alpha)
    before, after = _tensors(base), _tensors(tmp_path / "model.gguf")
    assert set(after) == set(before)
    assert len(folded) == len(adapter) // 2 and set(folded.values()) == {"F32"}
    for name, w in before.items():
        if name in folded:
            a, b = adapter[f"{name}.lora_a"], adapter[f"{name}.lora_b"]
            want = w + (alpha / a.shape[0]) * (b @ a)
            assert not np.array_equal(after[name], w)  # perturb() made the LoRA non-zero
            np.testing.assert_allclose(after[name], want, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(after[name], w)


def test_the_metadata_is_copied_unchanged(files, tmp_path):
    base, adapter, alpha = files
    fold_adapter(base, tmp_path / "model.gguf", adapter, alpha)
    gguf = gguf_module()
    a, b = gguf.GGUFReader(str(base)), gguf.GGUFReader(str(tmp_path / "model.gguf"))
    assert list(a.fields) == list(b.fields)
    for key, field in a.fields.items():
        assert b.fields[key].contents() == field.contents(), key


def test_an_adapter_for_another_base_is_refused_and_writes_nothing(files, tmp_path):
    base, adapter, alpha = files
    other = {k.replace("blk.0.", "blk.99."): v for k, v in adapter.items()}
    with pytest.raises(KTMError, match=r"lacks the adapted weights \['blk\.99\."):
        fold_adapter(base, tmp_path / "model.gguf", other, alpha)
    assert not (tmp_path / "model.gguf").exists()
    name = next(k for k in adapter if k.endswith(".lora_a"))
    wrong = dict(adapter, **{name: adapter[name][:, :-1]})
    with pytest.raises(KTMError, match="do not fit the base weight"):
        fold_adapter(base, tmp_path / "model.gguf", wrong, alpha)
    assert not (tmp_path / "model.gguf").exists()


def test_fold_types_keep_eight_bits_or_more_and_fold_fewer_into_q8_0():
    from ktm.llamacpp.fold import fold_type

    assert [fold_type(k) for k in ("F32", "F16", "BF16", "Q8_0")] == ["F32", "F16", "BF16", "Q8_0"]
    assert [fold_type(k) for k in ("Q4_0", "Q4_1", "Q5_0", "Q5_1")] == ["Q8_0"] * 4
    assert fold_type("Q4_1", "same") == "Q4_1" and fold_type("Q4_1", "F16") == "F16"
    with pytest.raises(KTMError, match="fold type must be auto, same or one of .*got 'Q3_K'"):
        fold_type("F32", "Q3_K")


def test_a_weight_folded_into_another_type_is_stored_in_it(files, tmp_path):
    base, adapter, alpha = files
    folded = fold_adapter(base, tmp_path / "model.gguf", adapter, alpha, "F16")
    assert set(folded.values()) == {"F16"}
    gguf = gguf_module()
    types = {t.name: t.tensor_type.name
             for t in gguf.GGUFReader(str(tmp_path / "model.gguf")).tensors}
    assert {types[n] for n in folded} == {"F16"}
    assert {types[n] for n in types if n not in folded} == {"F32"}


def test_a_weight_folded_into_q8_0_is_within_one_quantisation_step_of_w_plus_ba(files,
                                                                                 tmp_path):
    """Q8_0 (the default fold of a Q4_1 base) stores each block of 32 numbers as 8-bit steps of
    max |block| / 127: every folded number lies within one step of W + (alpha / r) B A."""
    gguf = gguf_module()
    base, adapter, alpha = files
    folded = fold_adapter(base, tmp_path / "model.gguf", adapter, alpha, "Q8_0")
    before = _tensors(base)
    stored = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "model.gguf")).tensors}
    for name in folded:
        t = stored[name]
        assert t.tensor_type.name == "Q8_0"
        a, b = adapter[f"{name}.lora_a"], adapter[f"{name}.lora_b"]
        want = before[name] + (alpha / a.shape[0]) * (b @ a)
        got = gguf.quants.dequantize(np.array(t.data), t.tensor_type).reshape(want.shape)
        blocks = want.reshape(-1, 32)
        step = np.abs(blocks).max(axis=1, keepdims=True) / 127
        assert np.all(np.abs(got.reshape(-1, 32) - blocks) <= step * (1 + 1e-3))
        assert not np.array_equal(got, want)  # really quantised
