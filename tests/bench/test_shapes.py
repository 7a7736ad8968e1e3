"""``ktm bench --shape``: random weights of an architecture, and the FLOPs / MFU of train rows."""

import json

import pytest
import torch

from ktm.bench import flops
from ktm.bench.bench import run_bench
from ktm.bench.config import BenchConfig
from ktm.bench.measure import word_pool
from ktm.bench.shapes import SHAPES, random_model, shape_config, synthetic_tokenizer
from ktm.core.encoder import KTokenEncoder
from ktm.errors import KTMError

TINY = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 20000, "max_position_embeddings": 2048}


@pytest.fixture
def tiny_shape(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def test_the_known_shapes_are_the_published_configurations():
    seven = shape_config("qwen2.5-coder-7b")
    assert (seven.model_type, seven.hidden_size, seven.num_hidden_layers,
            seven.num_key_value_heads, seven.vocab_size) == ("qwen2", 3584, 28, 4, 152064)
    half = shape_config("qwen2.5-0.5b")
    assert (half.hidden_size, half.num_hidden_layers, half.tie_word_embeddings) == (896, 24, True)
    assert set(SHAPES) == {"qwen2.5-coder-7b", "qwen2.5-0.5b"}


def test_a_config_file_or_its_folder_is_a_shape(tiny_shape, tmp_path):
    assert shape_config(tiny_shape).hidden_size == 32
    assert shape_config(str(tmp_path)).hidden_size == 32
    with pytest.raises(KTMError, match="'nope'.*known shape"):
        shape_config("nope")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"hidden_size": 3}')
    with pytest.raises(KTMError, match="model_type"):
        shape_config(str(bad))


def test_the_synthetic_tokenizer_reads_each_word_as_one_token():
    tok = synthetic_tokenizer(seed=3)
    pool = word_pool(tok, size=1500)
    assert len(pool) == 1500
    text = "".join(pool[:50])
    assert len(tok(text, add_special_tokens=False)["input_ids"]) == 50
    assert synthetic_tokenizer(seed=3).get_vocab() == tok.get_vocab()  # deterministic


def test_a_random_model_is_built_on_the_device_in_the_dtype(tiny_shape, tmp_path):
    lm, tok = random_model(tiny_shape, "cpu", torch.bfloat16)
    assert lm.dtype == torch.bfloat16 and lm.config.eos_token_id == tok.eos_token_id
    small = tmp_path / "small.json"
    small.write_text(json.dumps({**TINY, "vocab_size": 100}))
    with pytest.raises(KTMError, match="vocabulary of 100"):
        random_model(str(small), "cpu", torch.float32)


def test_a_random_model_reads_a_given_tokenizer(tiny_shape, tmp_path):
    words = synthetic_tokenizer(seed=3, words=50)
    words.bos_token = "<pad>"  # a tokenizer that names a first token: the LM's config takes it
    lm, tok = random_model(tiny_shape, "cpu", torch.float32, tokenizer=words)
    assert tok is words
    assert (lm.config.eos_token_id, lm.config.bos_token_id) == (words.eos_token_id,
                                                                words.bos_token_id)
    small = tmp_path / "small.json"
    small.write_text(json.dumps({**TINY, "vocab_size": len(words) - 1}))
    with pytest.raises(KTMError, match=f"fewer than the tokenizer's {len(words)}"):
        random_model(str(small), "cpu", torch.float32, tokenizer=words)


def test_shape_options_are_checked_before_anything_runs(tiny_shape):
    with pytest.raises(KTMError, match="--shape .* and --model"):
        BenchConfig(shape=tiny_shape, model="some/folder")
    with pytest.raises(KTMError, match="infer and train"):
        BenchConfig(shape=tiny_shape, mode="serve")
    with pytest.raises(KTMError, match="known shape"):
        BenchConfig(shape="no-such-shape")


def test_train_rows_count_model_flops(tiny_shape):
    cfg = BenchConfig(mode="train", shape=tiny_shape, ks=(4,), lengths=(64,), batch_sizes=(2,),
                      target_tokens=4, repeats=1, warmup=0, progress=False)
    rows = {r["method"]: r for r in run_bench(cfg)}
    plain, merged = rows["uncompressed"], rows["ktm"]
    assert plain["shape"] == tiny_shape and plain["random_weights"] is True
    # the body: per layer q and o (32x32, q with a bias), k and v (16 wide, with biases), the
    # MLP's three 32x64 and two norms; then the final norm (not the embedding table or the head)
    body = 2 * (32 * 32 + 32 + 2 * (32 * 16 + 16) + 32 * 32 + 3 * 32 * 64 + 2 * 32) + 32
    targets = 4 + 1  # and EOS

    def step(positions: int, blocks: int) -> int:
        return 2 * (6 * body * positions + 6 * 2 * 32 * positions ** 2
                    + 6 * 20000 * 32 * targets + 6 * encoder * blocks)

    encoder = 0
    assert plain["model_flops_per_step"] == step(64 + targets, 0)
    encoder = sum(p.numel() for p in KTokenEncoder(32, 4, 2.0).parameters())
    assert merged["model_flops_per_step"] == step(16 + targets, 16)
    assert plain["mfu"] is None and plain["peak_tflops"] is None  # no peak known on a CPU
    assert plain["model_tflops_per_s"] == pytest.approx(
        plain["model_flops_per_step"] / plain["step_s"] / 1e12)


def test_the_peak_is_read_from_the_device_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda", 0)
    assert flops.peak_tflops(cuda, torch.bfloat16) == (989.4, "NVIDIA H100 80GB HBM3")
    assert flops.peak_tflops(cuda, torch.float32)[0] is None  # no fp32 peak claimed
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Some GPU")
    assert flops.peak_tflops(cuda, torch.bfloat16) == (None, "Some GPU")
    assert flops.peak_tflops(torch.device("cpu"), torch.bfloat16) == (None, None)
