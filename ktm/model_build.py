"""Building a ``KTMModel``: around a base model (``from_base``) or from a saved checkpoint or
shipped reader (``load``). ``KTMModel`` binds both as its classmethods; ``cls`` is the class."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from peft import get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ktm import checkpoint
from ktm.base_checks import check_base
from ktm.base_identity import base_identity, check_same_base
from ktm.config import DEFAULT_MODEL, KTMConfig, LoraSettings
from ktm.encoder import EncoderConfig, KTokenEncoder
from ktm.errors import KTMError
from ktm.lora import lora_config, peft_wrapping, resolve_targets
from ktm.models import check_device, dtype_name, load_base, model_location, parse_dtype

if TYPE_CHECKING:
    from ktm.model import KTMModel


def from_base(
    cls: type[KTMModel],
    base: str | PreTrainedModel = DEFAULT_MODEL,
    k: int = 4,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    lora: LoraSettings | None = None,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = torch.float32,
    config: KTMConfig | None = None,
    **fields,
) -> KTMModel:
    """Wrap a base model (embedded name, local HF folder, or a loaded model + tokenizer).

    ``config`` gives everything at once; otherwise it is built from ``k``, ``lora``,
    ``dtype`` and any other ``KTMConfig`` field given by keyword (``mlp_ratio=0.5``,
    ``slot_weights=True``, ``spread_positions=True``, ...).

    A model object is adapted in place (PEFT injects the LoRA layers into it), so it then
    belongs to the returned model; from_base refuses it a second time.
    """
    if not isinstance(base, (str, nn.Module)):  # a PeftModel is refused below, clearly
        raise KTMError(f"base must be a model name, a folder or a transformers model, got "
                       f"{type(base).__name__} {base!r:.60}")
    if config is not None and not isinstance(config, KTMConfig):
        raise KTMError(f"config must be a KTMConfig, got {type(config).__name__}")
    if isinstance(base, str) and tokenizer is not None:
        raise KTMError(f"tokenizer= goes with a model object; base {base!r} is loaded with "
                       "its own tokenizer: expected no tokenizer, or base as a loaded model")
    name = base if isinstance(base, str) else (base.name_or_path or type(base).__name__)
    if config is None:
        known = {f.name for f in dataclasses.fields(KTMConfig)} - {"base_model", "k", "lora",
                                                                   "dtype"}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise KTMError(f"from_base got unknown options {unknown}: expected KTMConfig "
                           f"fields such as {sorted(known)}")
        config = KTMConfig(base_model=name, k=k, lora=lora or LoraSettings(),
                           dtype=dtype_name(dtype), **fields)
    elif fields:
        raise KTMError(f"give config= or options {sorted(fields)}, not both")
    elif isinstance(base, str) and base != DEFAULT_MODEL:
        # a base named beside a config: the config's own base must be that one (or the
        # default, i.e. not set), never silently another
        if config.base_model not in (DEFAULT_MODEL, base):
            raise KTMError(f"from_base got base {base!r} and a config whose base_model is "
                           f"{config.base_model!r}: expected one base model (name it in "
                           "one place, or give the same in both)")
        config = replace(config, base_model=base)
    torch_dtype = parse_dtype(config.dtype)
    device = check_device(device)
    if isinstance(base, str):
        lm, tok = load_base(config.base_model, device, torch_dtype)
        config = replace(config, base_model=model_location(config.base_model))
        name = config.base_model  # config= (the CLI's --model) names it, not base
    else:
        if tokenizer is None:
            raise KTMError("from_base with a model object needs tokenizer=...")
        # adapting it again would re-initialise the LoRA of the KTMModel that owns it
        if any(isinstance(m, BaseTunerLayer) for m in base.modules()):
            raise KTMError(f"model {name!r} already carries PEFT (LoRA) adapter layers: "
                           "from_base adapts a model object in place, so one given to it "
                           "before belongs to that KTMModel; expected a model without "
                           "adapters (load a fresh copy, or merge_and_unload() this one)")
        lm, tok = base, tokenizer
    check_base(lm, tok, config, name)
    # a model object moves only once it is accepted: a refused one is left as it was given
    if not isinstance(base, str):
        lm = cast_as_loaded(lm, device, torch_dtype)
    config = replace(config, lora=replace(config.lora,
                                          target_modules=resolve_targets(lm, config.lora)))
    # trainable weights stay fp32 whatever the LM's dtype: the encoder here, LoRA by PEFT
    encoder = KTokenEncoder.from_config(encoder_config(config, lm)).to(device)
    with peft_wrapping():
        peft_model = get_peft_model(lm, lora_config(lm, config.lora),
                                    autocast_adapter_dtype=True)
    return cls(peft_model, tok, encoder, config).eval()


def cast_as_loaded(lm: PreTrainedModel, device: torch.device, dtype: torch.dtype
                   ) -> PreTrainedModel:
    """``lm`` on ``device`` in ``dtype`` as ``from_pretrained(dtype=...)`` (so ``load``) gives
    it. ``lm.to(dtype)`` also casts the buffers computed at construction, some of which
    from_pretrained keeps fp32 (rotary ``inv_freq``): the model then read positions otherwise
    than its own checkpoint loaded back or exported. Those buffers get the dtype a weightless
    copy built on the meta device gives them; a model already in ``dtype`` is only moved."""
    if lm.dtype == dtype:
        return lm.to(device)
    saved = set(lm.state_dict())
    computed = {n: b for n, b in lm.named_buffers() if n not in saved and b.is_floating_point()}
    try:
        with torch.device("meta"):
            loaded = dict(type(lm)._from_config(lm.config, dtype=dtype).named_buffers())
    except Exception:  # noqa: BLE001 - a model that cannot be built so is cast whole, as before
        loaded = {}
    lm = lm.to(device=device, dtype=dtype)
    for name, b in computed.items():
        if name in loaded:
            owner, _, leaf = name.rpartition(".")
            setattr(lm.get_submodule(owner), leaf, b.to(device=device, dtype=loaded[name].dtype))
    return lm


def encoder_config(config: KTMConfig, lm: PreTrainedModel) -> EncoderConfig:
    # as wide as the input embeddings it merges, which OPT-350m projects up to its hidden
    # size inside the model (512 -> 1024)
    width = lm.get_input_embeddings().weight.shape[1]
    return EncoderConfig(width, **config.encoder_kwargs())


def load(
    cls: type[KTMModel],
    directory: str | Path,
    *,
    base: str | None = None,
    k: int | None = None,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = torch.float32,
    trainable: bool = False,
    plain_suffix: int | None = None,
    align_lines: bool | None = None,
) -> KTMModel:
    """Load a checkpoint folder or a shipped reader's name (e.g. ``"smollm2-135m-k4"``).

    ``base``: another folder of the checkpoint's base model (same sizes and tokenizer; None: the
    saved one). ``k``: None for the saved K, or a recursive checkpoint's inner K. ``trainable``:
    False freezes everything (inference); True lets ``train`` continue the encoder and LoRA.
    ``plain_suffix`` / ``align_lines`` read it with another prompt layout than it was saved with
    (None: its own). Raises ``KTMError`` for a folder that is not a checkpoint, a K it cannot
    merge at, or a base model whose sizes or tokenizer disagree with the saved ones."""
    from ktm.readers import resolve_checkpoint

    if not isinstance(directory, (str, Path)):
        raise KTMError(f"load needs a checkpoint folder or a reader name, got "
                       f"{type(directory).__name__} {directory!r:.60}")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
        raise KTMError(f"k must be an integer (or None: the checkpoint's own), got {k!r}")
    if not isinstance(trainable, bool):
        raise KTMError(f"trainable must be a bool (True or False), got {trainable!r}")
    directory = resolve_checkpoint(directory)
    saved = checkpoint.read_config(directory)
    config = checkpoint.model_config(directory)
    checkpoint.check_level(config, k, directory)  # a recursive one also reads at inner K
    config = replace(config, base_model=base or config.base_model, dtype=dtype_name(dtype),
                     plain_suffix=config.plain_suffix if plain_suffix is None else plain_suffix,
                     align_lines=config.align_lines if align_lines is None else align_lines)
    device = check_device(device)
    try:
        lm, tok = load_base(config.base_model, device, parse_dtype(config.dtype))
    except KTMError as e:
        if base:  # the caller's own choice: its error is the whole story
            raise
        # the checkpoint names a model that is not here (moved, another machine): say whose
        # it is and how to point at a copy
        raise KTMError(f"checkpoint {str(directory)!r} was trained on base model "
                       f"{config.base_model!r}, which cannot be loaded here ({e}); expected "
                       "that model, or base= (--model) naming a local copy of it") from e
    config = replace(config, base_model=model_location(config.base_model))
    check_base(lm, tok, config, config.base_model)  # the family first: the deeper reason
    recorded = (saved.get("config") or saved).get("base_model")
    hidden, vocab = lm.config.hidden_size, lm.get_input_embeddings().weight.shape[0]
    if (hidden, vocab) != (saved.get("hidden_size"), saved.get("vocab_size")):
        raise KTMError(
            f"checkpoint {str(directory)!r} expects hidden_size={saved.get('hidden_size')}, "
            f"vocab_size={saved.get('vocab_size')}, but base model {config.base_model!r} "
            f"has hidden_size={hidden}, vocab_size={vocab}: expected the checkpoint's base "
            f"model {recorded!r} or a local copy of it")
    check_same_base(directory, saved, config.base_model, lambda: base_identity(lm.config, tok))
    enc_cfg = encoder_config(config, lm)
    encoder = KTokenEncoder.from_config(enc_cfg)
    encoder.load_state_dict(checkpoint.encoder_state(directory, enc_cfg))
    if k is not None and k != config.k:
        encoder, config = encoder.inner, config.at_level(k)
    encoder.to(device).requires_grad_(trainable)
    peft_model = checkpoint.load_peft(lm, directory, trainable)
    targets = tuple(sorted(checkpoint.adapter_targets(directory) or ())) or None
    config = replace(config, lora=replace(config.lora, target_modules=targets))
    model = cls(peft_model, tok, encoder, config)
    model.compressor_record = checkpoint.read_compressor_record(directory)
    return model.train(trainable) if trainable else model.eval()
