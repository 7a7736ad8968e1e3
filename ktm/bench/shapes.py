"""Models of a given architecture with random weights, for timing at scales no machine here holds.

Speed does not depend on weight values, so ``ktm bench --shape qwen2.5-coder-7b`` times the
paper's 7B model from its configuration alone: the LM is built in-process on the benchmark's
device and dtype with random weights, and a synthetic tokenizer (random words, one token each)
writes its prompts. Nothing is downloaded and nothing is read from disk but a config.

A shape is a name of ``SHAPES`` (the published configurations of the models the paper times), or
the path of any HF ``config.json`` (or of a folder holding one): its weights, if any, are not read.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerFast

from ktm.errors import KTMError

# Published architecture fields (each model's config.json); the rest are transformers' defaults.
SHAPES: dict[str, dict] = {
    # the paper's efficiency table (Table 5)
    "qwen2.5-coder-7b": dict(
        model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        hidden_act="silu", tie_word_embeddings=False),
    # the training-throughput shape
    "qwen2.5-0.5b": dict(
        model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        hidden_act="silu", tie_word_embeddings=True),
}

# the synthetic tokenizer's words: enough that a prompt of 16k tokens rarely repeats a pattern
WORDS = 2000


def shape_config(shape: str) -> PretrainedConfig:
    """The architecture of ``shape``: a ``SHAPES`` name, or an HF config.json (or its folder)."""
    if shape in SHAPES:
        fields = dict(SHAPES[shape])
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    path = Path(shape).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise KTMError(f"shape {shape!r} is neither a known shape ({', '.join(SHAPES)}) nor an "
                       "HF config.json (or a folder holding one)")
    try:
        fields = json.loads(path.read_text())
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    except (OSError, ValueError, KeyError) as e:
        raise KTMError(f"shape {shape!r}: {path} is not an HF model config with a "
                       f"model_type ({e})") from e


def synthetic_tokenizer(seed: int = 0, words: int = WORDS) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer whose vocabulary holds ``words`` random lowercase words as
    single tokens (' word'), trained in-process on a text of them in well under a second."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    vocab = sorted({"".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 7)))
                    for _ in range(words)})
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # every word is seen often enough for all of its merges to win over any cross-word pair
    text = [" " + " ".join(vocab)] * 8
    trainer = trainers.BpeTrainer(vocab_size=258 + 8 * len(vocab),
                                  special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def random_model(shape: str, device: torch.device | str, dtype: torch.dtype, seed: int = 0,
                 tokenizer=None):
    """(LM with random weights built directly on ``device`` in ``dtype``, its tokenizer): the
    synthetic one, or ``tokenizer`` (a real one, for what needs its chat template).

    The tokenizer's ids are the first rows of the LM's vocabulary, so every id it writes is one
    the LM embeds; a vocabulary smaller than the tokenizer's is refused."""
    config = shape_config(shape)
    tok = synthetic_tokenizer(seed) if tokenizer is None else tokenizer
    if config.vocab_size < len(tok):
        which = "synthetic tokenizer's" if tokenizer is None else "tokenizer's"
        raise KTMError(f"shape {shape!r} has a vocabulary of {config.vocab_size} tokens, fewer "
                       f"than the {which} {len(tok)}: expected at least that many")
    config.pad_token_id, config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    config.bos_token_id = tok.bos_token_id  # the synthetic tokenizer has none
    torch.manual_seed(seed)
    # built on the device itself: a 7B model's random init then takes seconds, not minutes
    with torch.device(device):
        lm = AutoModelForCausalLM.from_config(config, dtype=dtype)
    lm.name_or_path = f"shape:{shape}"
    return lm.eval(), tok
