"""Shared fixtures: a tiny Llama-family model and tokenizer built in-process (offline, seconds)."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CORPUS = [
    "Tree: AB\n+CD\n++EF, Task: Parent/Child Relationship, Parent: AB, Child: CD, Answer: true",
    "Review: These shoes fit well and look great, Label: positive negative false",
    "def add(a, b):\n    return a + b\n# Update the old python code content",
    "The quick brown fox jumps over the lazy dog. Hello world, my name is ktm.",
]


def build_tokenizer(bos: bool = False, eos: bool = False) -> PreTrainedTokenizerFast:
    """``bos``: the tokenizer puts <bos> before every text, as Llama 3's or Gemma's does;
    ``eos``: it puts <eos> after every text, as Llama 2's with ``add_eos_token`` does."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<eos>"] + ["<bos>"] * bos,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    if bos or eos:
        single = "<bos> " * bos + "$A" + " <eos>" * eos
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=f"{single} {single.replace('$A', '$B')}",
            special_tokens=[(t, tok.token_to_id(t)) for t in ("<bos>", "<eos>") if t in single])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   model_max_length=512, **({"bos_token": "<bos>"} if bos else {}))


def sentencepiece_like_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer that puts a space before every text it is given (SentencePiece's dummy prefix,
    a ``Metaspace`` pre-tokenizer in the fast tokenizers of Llama 2 and Mistral)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def legacy_sentencepiece_tokenizers() -> dict:
    """Tokenizers that put the dummy space before a text even after a special token, so none can
    anchor a later segment: a ``legacy=True`` Llama tokenizer (Metaspace ``prepend_scheme=
    "always"``) and a Llama-2 ``tokenizer.json`` (a ``Prepend("▁")`` normalizer)."""
    import json

    from tokenizers import Tokenizer, normalizers
    from transformers import LlamaTokenizer, PreTrainedTokenizerFast

    sp = sentencepiece_like_tokenizer()
    state = json.loads(sp.backend_tokenizer.to_str())["model"]
    legacy = LlamaTokenizer(vocab=state["vocab"], merges=[tuple(m) for m in state["merges"]],
                            legacy=True)
    backend = Tokenizer.from_str(sp.backend_tokenizer.to_str())
    backend.pre_tokenizer = None
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                               normalizers.Replace(" ", "\u2581")])
    prepend = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>",
                                      eos_token="</s>", unk_token="<unk>")
    return {"legacy": legacy, "prepend": prepend}


def save_tiny_llama(path, bos: bool = False, eos: bool = False) -> str:
    tok = build_tokenizer(bos, eos)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg)
    # random init is tiny; scale up so logits differ enough for generation tests to be meaningful
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A saved tiny HF causal-LM folder (2 layers, width 64), the same for every test."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_bos_model_dir(tmp_path_factory) -> str:
    """The same, with a tokenizer that puts a BOS before every text (Llama 3, Gemma)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-bos"), bos=True)


def fresh_model(model_dir: str, k: int = 4, **kw):
    """A new KTMModel on ``model_dir``, its fresh weights drawn at seed 0."""
    from ktm.model import KTMModel

    torch.manual_seed(0)
    return KTMModel.from_base(model_dir, k=k, **kw)


@pytest.fixture
def ktm_model(tiny_model_dir):
    return fresh_model(tiny_model_dir)


@pytest.fixture
def checkpoint_swaps(monkeypatch) -> list[list[str]]:
    """The file names in each checkpoint's temp folder at the moment it is swapped in."""
    import ktm.checkpoint as checkpoint

    seen: list[list[str]] = []
    real = checkpoint.replace_dir

    def watched(tmp, dest):
        seen.append(sorted(p.name for p in tmp.iterdir()))
        real(tmp, dest)

    monkeypatch.setattr(checkpoint, "replace_dir", watched)
    return seen


CORPUS_TEXT = ("The quick brown fox jumps over the lazy dog. Hello world, my name is ktm. " * 6
               + "def add(a, b):\n    return a + b\n" * 4)


@pytest.fixture
def corpus(tmp_path) -> str:
    """A folder of three small text files: a user corpus for reader pretraining."""
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(3):
        (folder / f"doc{i}.txt").write_text(CORPUS_TEXT[i * 7:])
    return str(folder)
