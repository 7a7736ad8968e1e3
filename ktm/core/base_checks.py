"""The base model as ktm reads it: the ids that end a generation or a target, and the one gate
(``check_base``) a base model passes through before ``KTMModel`` wraps it, whether it comes from
``from_base`` or a checkpoint's ``load``."""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ktm.core.base_model import check_decoder_with_cache, check_inputs_embeds, check_reads_positions
from ktm.core.config import KTMConfig
from ktm.core.input_lookup import check_ids_equal_embeds
from ktm.errors import KTMError


def _eos_lists(lm: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """The EOS ids of the tokenizer, the model config and its generation config, in that order."""
    sources = (tokenizer.eos_token_id, getattr(lm.config, "eos_token_id", None),
               getattr(getattr(lm, "generation_config", None), "eos_token_id", None))
    return [[int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]
            for ids in sources if ids is not None]


def eos_ids(lm: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every id that ends a generation: the tokenizer's EOS plus the model's (generation) config
    EOS lists (Llama-3 ``<|eot_id|>``, Qwen ``<|im_end|>``)."""
    return frozenset(i for ids in _eos_lists(lm, tokenizer) for i in ids)


def target_eos(lm: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The EOS a target ends with (``add_eos``): the tokenizer's, else the first the model's
    (generation) config names, so a model whose tokenizer lacks one still learns to stop."""
    return next((ids[0] for ids in _eos_lists(lm, tokenizer) if ids), None)


def check_base(lm: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: KTMConfig,
               name: str) -> None:
    """Refuse a base model ktm cannot run as ``config`` asks (``ktm.core.base_model``' family
    checks; no EOS to end targets with): the one gate both ``from_base`` and ``load`` pass a
    base through, so a checkpoint read on another base (``base=``, ``--model``) is held to the
    same rules."""
    check_inputs_embeds(lm)
    check_decoder_with_cache(lm)
    check_ids_equal_embeds(lm)
    if config.spread_positions:
        check_reads_positions(lm)
    if config.add_eos and target_eos(lm, tokenizer) is None:
        raise KTMError(f"base model {name!r} has no EOS token (neither its tokenizer nor its "
                       "model or generation config names one): training targets could not "
                       "end with one and the model would never learn to stop; expected an "
                       "eos_token_id, or add_eos=False (--no-add-eos) to train without")
