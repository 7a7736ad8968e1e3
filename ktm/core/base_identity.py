"""What identifies a base model wherever its files are: the sizes of its architecture and the
vocabulary of its tokenizer, recorded in every checkpoint as ``base_identity``.

A checkpoint's encoder and LoRA are trained on one base model; read on another whose sizes
match (another tokenizer of the same length, another family of the same width) they load
without error and compute nonsense. Names and paths cannot tell: the embedded model is
``smollm2-135m``, a local copy of it is any folder. The identity is cheap to take from a folder
(its ``config.json`` and tokenizer, no weights) and the same for every copy of a model, so it
both refuses a mismatch (``KTMModel.load``, ``--init-adapter``) and finds the shipped reader of
a local copy (``ktm.readers.find_reader``). Weights are not part of it: a fine-tune of a model
(or its base/instruct sibling) has the same identity, and reads that model's readers.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from ktm.errors import KTMError

# getattr reads them through each config's attribute_map (GPT-2's n_embd is hidden_size); a
# field a family lacks is recorded as None. Not norm epsilons or rope settings: the embedded
# model's GGUF conversion rounds them (rms_norm_eps 9.99e-06), so a copy would not match.
ARCHITECTURE = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "vocab_size")


def base_identity(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> dict:
    """``{architecture fields..., "tokenizer": {"tokens": N, "sha256": ...}}``.

    The tokenizer part hashes its (token, id) pairs with ids inside the embedding table: a token
    added past the table (a pad from ``add_special_tokens``) is never read by the model.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    out = {name: getattr(text, name, None) for name in ARCHITECTURE}
    rows = out["vocab_size"] if isinstance(out["vocab_size"], int) else None
    vocab = sorted((tok, i) for tok, i in tokenizer.get_vocab().items()
                   if rows is None or i < rows)
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()
    return {**out, "tokenizer": {"tokens": len(vocab), "sha256": digest}}


def folder_identity(path: str | Path) -> dict:
    """The identity of a local HF model folder, from its config and tokenizer only."""
    try:
        return base_identity(AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path))
    except (OSError, ValueError) as e:
        raise KTMError(f"could not read the config and tokenizer of {str(path)!r}: {e}") from e


def differences(saved: dict, mine: dict) -> list[str]:
    """``name=saved vs mine`` for every part of two identities that differs."""
    out = [f"{name}={saved.get(name)!r} vs {mine.get(name)!r}" for name in ARCHITECTURE
           if saved.get(name) != mine.get(name)]
    theirs, ours = saved.get("tokenizer") or {}, mine.get("tokenizer") or {}
    if theirs != ours:
        out.append(f"tokenizer vocabulary {theirs.get('tokens')} tokens, sha256 "
                   f"{str(theirs.get('sha256'))[:12]} vs {ours.get('tokens')} tokens, sha256 "
                   f"{str(ours.get('sha256'))[:12]}")
    return out


def check_same_base(directory: str | Path, saved: dict, base_model: str,
                    identity: Callable[[], dict]) -> None:
    """Refuse a checkpoint (``saved``: its ``ktm_config.json``) read on a base model other than
    the one it records whose identity (``identity()``, taken only then) differs from the
    recorded one. A checkpoint from before the record only gets a warning: its sizes are
    checked by the caller, its tokenizer cannot be."""
    theirs = (saved.get("config") or saved).get("base_model")
    if base_model == theirs:  # the very model it was trained on
        return
    recorded = saved.get("base_identity")
    if not isinstance(recorded, dict):
        warnings.warn(f"checkpoint {str(directory)!r} predates the record of its base model's "
                      f"identity: that {base_model!r} is a copy of its base model {theirs!r} is "
                      "not checked (only their sizes are)", stacklevel=3)
        return
    diffs = differences(recorded, identity())
    if diffs:
        raise KTMError(f"checkpoint {str(directory)!r} was trained on base model {theirs!r}, "
                       f"but base model {base_model!r} is another model of the same sizes "
                       f"({'; '.join(diffs)}; the checkpoint's first): expected {theirs!r} or a "
                       "local copy of it")
