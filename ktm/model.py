"""KTMModel: a LoRA-adapted causal LM that reads K-merged prompt embeddings.

The LM always runs through its own Hugging Face forward (``inputs_embeds`` + ``logits_to_keep``),
so every family's post-head transform applies (Gemma-2 soft-capping, Cohere ``logit_scale``,
Granite ``logits_scaling``), while the LM head still runs only at the positions that need logits.
Sequence layout and the batch types: ``ktm.core.batch``.

Building one: ``from_base`` (around a base model: an embedded name, an HF folder or a model
object) and ``load`` (a saved checkpoint or a shipped reader), both bound to ``KTMModel`` as
classmethods, ``cls`` being the class; ``load_any`` takes a name that is either.
"""


from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import field, replace
from functools import partial
from pathlib import Path

import torch
from peft import PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ktm.core import checkpoint
from ktm.core.base_checks import check_base, eos_ids, target_eos
from ktm.core.base_identity import base_identity, check_same_base
from ktm.core.base_model import check_device, dtype_name, load_base, model_location, parse_dtype
from ktm.core.batch import CompressedPrompt, LossOutput, pack
from ktm.core.config import DEFAULT_MODEL, KTMConfig, Layout, LoraSettings, ModelSpec
from ktm.core.encoder import EncoderConfig, KTokenEncoder, level_encoder
from ktm.core.input_lookup import input_lookup
from ktm.core.int8 import WEIGHTS, check_weights
from ktm.core.levels import merges
from ktm.core.lora import lora_config, peft_wrapping, resolve_targets
from ktm.core.lora_fold import FoldedLM
from ktm.core.lora_scope import gate_lora, gated
from ktm.core.loss import check_fits, ids_tensor, loss
from ktm.core.prefix import MergeCache, PromptEncoder
from ktm.core.prompt import PromptLike, as_segments, split_prompts
from ktm.core.signals import ATTENTION_WINDOW, Scorer, signal_of
from ktm.core.tokens import LineBreaks, SegmentTokenizer, line_break_ids
from ktm.decode.compiled import COMPILE_MODES, check_mode
from ktm.decode.press import (
    SCORERS,
    WRAPPERS,
    PressConfig,
    import_kvpress,
    press_names,
    press_refusal,
)
from ktm.decode.runtime import TorchRuntime
from ktm.errors import KTMError
from ktm.llamacpp.backend import attach
from ktm.llamacpp.runtime import RuntimeConfig
from ktm.vllm.runtime import VLLMConfig

# what runs the LM while decoding and scoring: chosen here, and only here (``use_backend``)
BACKENDS = ("torch", "llamacpp", "vllm")


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise KTMError(f"backend must be one of {BACKENDS}, got {backend!r}")

# -- building: KTMModel.from_base and KTMModel.load ----------------------------------------------

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
    press: str | None = None,
    press_ratio: float = 0.5,
    runtime: RuntimeSpec | None = None,
    **fields,
) -> KTMModel:
    """Wrap a base model (embedded name, local HF folder, or a loaded model + tokenizer).

    ``config`` gives everything at once; otherwise it is built from ``k``, ``lora``,
    ``dtype`` and any other ``KTMConfig`` field given by keyword (``mlp_ratio=0.5``,
    ``slot_weights=True``, ``spread_positions=True``, ...). ``runtime`` (``RuntimeSpec``, or its
    fields by keyword: ``backend="llamacpp"``, ``press="snapkv"``, ...): where it runs, as
    ``load``'s; ``press`` / ``press_ratio``: a KV press, the same.

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
    where = {n: fields.pop(n) for n in list(fields) if n in RUNTIME_FIELDS}
    if press is not None:
        where.update(press=press, press_ratio=press_ratio)
    runtime = replace(runtime or RuntimeSpec(), **where)  # checked before the model loads
    config = _base_config(base, name, config, k=k, lora=lora, dtype=dtype, fields=fields)
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
    return runtime.apply(cls(peft_model, tok, encoder, config).eval())


def _base_config(base: str | PreTrainedModel, name: str, config: KTMConfig | None, *, k: int,
                 lora: LoraSettings | None, dtype: str | torch.dtype, fields: dict) -> KTMConfig:
    """``from_base``'s config: ``config`` as given (its base the one named beside it), else one
    built from ``k``, ``lora``, ``dtype`` and the other ``KTMConfig`` fields by keyword."""
    if config is None:
        known = {f.name for f in dataclasses.fields(KTMConfig)} - {"base_model", "k", "lora",
                                                                   "dtype"}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise KTMError(f"from_base got unknown options {unknown}: expected KTMConfig "
                           f"fields such as {sorted(known)}, or RuntimeSpec fields "
                           f"{sorted(RUNTIME_FIELDS)}")
        return KTMConfig(base_model=name, k=k, lora=lora or LoraSettings(),
                         dtype=dtype_name(dtype), **fields)
    if fields:
        raise KTMError(f"give config= or options {sorted(fields)}, not both")
    if isinstance(base, str) and base != DEFAULT_MODEL:
        # a base named beside a config: the config's own base must be that one (or the
        # default, i.e. not set), never silently another
        if config.base_model not in (DEFAULT_MODEL, base):
            raise KTMError(f"from_base got base {base!r} and a config whose base_model is "
                           f"{config.base_model!r}: expected one base model (name it in "
                           "one place, or give the same in both)")
        return replace(config, base_model=base)
    return config


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


@dataclasses.dataclass(frozen=True)
class RuntimeSpec:
    """Where a model runs while decoding and scoring, declared once: ``backend`` (``BACKENDS``),
    the llama.cpp GGUF export and context settings (``gguf``, ``llamacpp``), where vLLM runs
    (``vllm``), and the torch runtime's options: a KV press at ``press_ratio``, ``compile``
    and ``weights`` (``ktm.decode.runtime.TorchRuntime``). Checked when built, before any
    engine starts; ``apply`` puts it on a model."""

    # the metadata makes each command's flags (``ktm.cli.args.add_dataclass_args``); the
    # llama.cpp and vLLM settings' flags are their configs' own, prefixed --llamacpp-, --vllm-
    backend: str = field(default="torch", metadata={
        "choices": BACKENDS,
        "help": "what prefills and decodes: torch; llama.cpp (the [llamacpp] extra; the model "
                "is exported to GGUF once, into the cache, unless --gguf names an export); or "
                "vLLM (installed as docs/serving.md says; exported once into the cache)"})
    gguf: str | Path | None = field(default=None, metadata={
        "metavar": "DIR",
        "help": "a GGUF export of this model (ktm export --format gguf) for --backend llamacpp"})
    llamacpp: RuntimeConfig | None = None
    vllm: VLLMConfig | None = None
    press: str | None = field(default=None, metadata={
        "choices": press_names(), "metavar": "NAME",
        "help": "press the KV cache of the prompt's compressed segments after prefill (merged "
                "or plain; the plain segments after them never) with a kvpress press (the "
                "[kvpress] extra; torch backend only): " + ", ".join(SCORERS) + ", or "
                "WRAPPER:PRESS with a wrapper of " + ", ".join(WRAPPERS)})
    press_ratio: float = field(default=0.5, metadata={
        "metavar": "R", "help": "--press: the share of the pressed segments' KV dropped, in "
                                "[0, 1)"})
    compile: str = field(default="auto", metadata={
        "choices": COMPILE_MODES,
        "help": "--backend torch: decode steps on a static KV cache, compiled (torch.compile; "
                "CUDA graphs on CUDA), and the prefill compiled for every length: on, off, or "
                "auto, where measured to pay (on CUDA, decode batches of up to 64k cache "
                "positions and prefills of up to 1,024: docs/guide.md)"})
    weights: str = field(default="native", metadata={
        "choices": WEIGHTS,
        "help": "--backend torch: the LM's linear layers as loaded (native) or in int8, one "
                "scale per output row (a quarter of fp32's bytes read a decode step; logits "
                "within the bound docs/guide.md states)"})

    def __post_init__(self) -> None:
        check_backend(self.backend)
        check_mode(self.compile)
        check_weights(self.weights)
        if self.press is not None:
            PressConfig(self.press, self.press_ratio)  # an unknown name or a bad ratio
            if self.backend != "torch":
                raise KTMError(press_refusal(self.backend, self.press))
        for name, default in (("compile", "auto"), ("weights", "native")):
            value = getattr(self, name)
            if value != default and self.backend != "torch":
                raise KTMError(f"--{name} {value} is an option of the torch backend, not "
                               f"--backend {self.backend} (llama.cpp and vLLM run their own "
                               f"{'graphs' if name == 'compile' else 'weight types'})")

    def build(self, model: KTMModel, source: str | Path | None = None):
        """A runtime (``ktm.decode.runtime.Runtime``) that runs ``model`` as this spec says;
        ``model`` is left as it is (``apply`` makes the runtime its own). ``source``: the
        checkpoint folder it was loaded from, which a llama.cpp GGUF export is read from."""
        if self.backend == "llamacpp":
            return attach(model, source=source, gguf=self.gguf, config=self.llamacpp)
        if self.backend == "vllm":
            from ktm.vllm.backend import make_runtime

            return make_runtime(model, self.vllm)
        press = None
        if self.press is not None:
            import_kvpress()
            press = PressConfig(self.press, self.press_ratio)
        return TorchRuntime(model, press, compile=self.compile, weights=self.weights)

    def apply(self, model: KTMModel, source: str | Path | None = None) -> KTMModel:
        """``model``, running as this spec says from now on (the runtime it had is closed)."""
        if self != RuntimeSpec():  # the one every model starts with
            model._run_on(self.build(model, source))
        return model


LAYOUT_FIELDS = frozenset(f.name for f in dataclasses.fields(Layout))
RUNTIME_FIELDS = frozenset(f.name for f in dataclasses.fields(RuntimeSpec))


def layout_and_runtime(layout: Layout | None, runtime: RuntimeSpec | None,
                       options: dict) -> tuple[Layout, RuntimeSpec]:
    """``layout`` and ``runtime`` with ``options``, their fields given by keyword
    (``ratio=4``, ``backend="vllm"``, ``press="snapkv"``, ...), filled in."""
    unknown = sorted(set(options) - LAYOUT_FIELDS - RUNTIME_FIELDS)
    if unknown:
        raise KTMError(f"unknown options {unknown}: expected Layout fields "
                       f"{sorted(LAYOUT_FIELDS)} or RuntimeSpec fields {sorted(RUNTIME_FIELDS)}")
    layout, runtime = layout or Layout(), runtime or RuntimeSpec()
    given = {n: v for n, v in options.items() if n in LAYOUT_FIELDS}
    layout = replace(layout, **given) if given else layout
    given = {n: v for n, v in options.items() if n in RUNTIME_FIELDS}
    return layout, replace(runtime, **given) if given else runtime


def load(
    cls: type[KTMModel],
    directory: str | Path | checkpoint.Checkpoint,
    *,
    base: str | None = None,
    k: int | None = None,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = torch.float32,
    trainable: bool = False,
    layout: Layout | None = None,
    runtime: RuntimeSpec | None = None,
    **options,
) -> KTMModel:
    """Load a checkpoint folder, a shipped reader's name (e.g. ``"smollm2-135m-k4"``) or an
    opened ``Checkpoint`` (``ktm.readers.open_checkpoint``).

    ``base``: another folder of the checkpoint's base model (same sizes and tokenizer; None: the
    saved one). ``k``: None for the saved K, or a recursive checkpoint's inner K. ``trainable``:
    False freezes everything (inference); True lets ``train`` continue the encoder and LoRA.
    ``layout`` (``ktm.core.config.Layout``: ``plain_suffix``, ``align_lines``,
    ``spread_positions``, ``ratio``, ``allocator``, ``quote``) reads it with another prompt
    layout than it was saved with. ``runtime`` (``RuntimeSpec``) says where it runs:
    ``backend="llamacpp"`` prefills and decodes through llama.cpp (``ktm.llamacpp``; the
    ``[llamacpp]`` extra), from the GGUF export ``gguf`` (None: the checkpoint folder if it is
    one, else an export written once into the cache) with the ``llamacpp`` context settings;
    ``backend="vllm"`` through vLLM (``ktm.vllm``; its install step in docs/serving.md), where
    ``vllm`` says; ``press``: a KV press (``ktm.decode.press``, the ``[kvpress]`` extra) on the
    torch runtime at ``press_ratio`` (the share of the pressable KV dropped), as ``use_press``.
    The fields of either are also taken by keyword (``ratio=4``, ``backend="vllm"``). Raises
    ``KTMError`` for a folder that is not a checkpoint, a K it cannot merge at, or a base model
    whose sizes or tokenizer disagree with the saved ones."""
    from ktm.readers import open_checkpoint

    if not isinstance(directory, (str, Path, checkpoint.Checkpoint)):
        raise KTMError(f"load needs a checkpoint folder or a reader name, got "
                       f"{type(directory).__name__} {directory!r:.60}")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
        raise KTMError(f"k must be an integer (or None: the checkpoint's own), got {k!r}")
    if not isinstance(trainable, bool):
        raise KTMError(f"trainable must be a bool (True or False), got {trainable!r}")
    layout, runtime = layout_and_runtime(layout, runtime, options)
    ckpt = open_checkpoint(directory)
    ckpt.check_level(k)  # a recursive one also reads at inner K
    config = layout.apply(replace(ckpt.config, base_model=base or ckpt.config.base_model,
                                  dtype=dtype_name(dtype)))
    device = check_device(device)
    lm, tok, config = _checkpoint_base(ckpt, config, device, base)
    enc_cfg = encoder_config(config, lm)
    encoder = KTokenEncoder.from_config(enc_cfg)
    encoder.load_state_dict(ckpt.encoder_state(enc_cfg))
    if k is not None and k != config.k:
        encoder, config = level_encoder(encoder, k), config.at_level(k)
    encoder.to(device).requires_grad_(trainable)
    peft_model = ckpt.load_peft(lm, trainable)
    config = replace(config, lora=replace(config.lora,
                                          target_modules=ckpt.adapter_targets or None))
    model = cls(peft_model, tok, encoder, config)
    model.compressor_record = ckpt.compressor
    model.scorer.table = ckpt.surprisal
    model = model.train(trainable) if trainable else model.eval()
    return runtime.apply(model, source=ckpt.path)


def _checkpoint_base(ckpt: checkpoint.Checkpoint, config: KTMConfig, device: torch.device,
                     base: str | None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase,
                                                KTMConfig]:
    """The base LM and tokenizer a checkpoint reads with (``config.base_model``), checked to be
    the one it was trained on or a copy of it; ``config`` with its location."""
    directory, saved = ckpt.path, ckpt.saved
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
    return lm, tok, config


def valid_pad(pad: int | None, rows: int) -> int:
    """The id pads are written with. Pads never reach the LM (masked), but they are looked up
    in the embedding table, so any row of it will do: the tokenizer's pad, else (none, or one
    added past the table, as ``add_special_tokens({"pad_token": ...})`` does) 0."""
    return int(pad) if pad is not None and 0 <= pad < rows else 0


@torch.no_grad()
def lm_surprisal(model: KTMModel, ids: list[int]) -> list[float]:
    """Each token's surprisal (nats) under the base LM (adapter off) reading ``ids`` plain;
    the first token's is the mean of the rest (nothing predicts it). The ``lm`` allocator's
    signal (``KTMModel.scorer``)."""
    if len(ids) < 2:
        return [1.0] * len(ids)
    p = pack([model.input_embedding(ids_tensor(ids, model.device))])
    was = model.training
    model.eval()
    try:
        with model.peft.disable_adapter():
            logits = model.lm(p.embeds, p.mask, p.position_ids)[0, :-1].float()
    finally:
        model.train(was)
    nll = nn.functional.cross_entropy(logits, ids_tensor(ids[1:], model.device),
                                      reduction="none")
    return [float(nll.mean())] + nll.tolist()


@torch.no_grad()
def lm_attention(model: KTMModel, ids: list[int]) -> list[float]:
    """Each token's attention from the last ``ATTENTION_WINDOW`` tokens under the base LM
    (adapter off) reading ``ids`` plain, averaged over layers, heads and those queries (a query
    before a token pays it none). The ``attention`` allocator's signal (``KTMModel.scorer``).

    Attention weights need the LM's eager attention, switched to for this forward; a hook on
    each layer's attention keeps only the last queries' rows of its weights, so no more than
    one layer's (heads, L, L) weights are held at a time."""
    if len(ids) < 2:
        return [1.0] * len(ids)
    p = pack([model.input_embedding(ids_tensor(list(ids), model.device))])
    lm = model.peft.get_base_model()
    window = min(ATTENTION_WINDOW, len(ids))
    rows: list[torch.Tensor] = []

    def keep(module, args, output):
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if weights is not None:
            rows.append(weights[0, :, -window:, :len(ids)].float().mean(dim=(0, 1)))

    hooks = [m.register_forward_hook(keep) for name, m in lm.named_modules()
             if name.rsplit(".", 1)[-1] == "self_attn"]
    was, implementation = model.training, lm.config._attn_implementation
    model.eval()
    lm.set_attn_implementation("eager")
    try:
        with model.peft.disable_adapter():
            model.peft(inputs_embeds=p.embeds, attention_mask=p.mask,
                       position_ids=p.position_ids, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
        lm.set_attn_implementation(implementation)
        model.train(was)
    if not rows:
        raise KTMError(f"{type(lm).__name__} gave no attention weights to read (no self_attn "
                       "module returning them): the attention allocator needs them; expected "
                       "another allocator")
    return torch.stack(rows).mean(dim=0).tolist()


def warn_unapplied_compressor(model: KTMModel) -> None:
    """Once: a baseline checkpoint whose method rewrites prompts, read with prompts as given,
    answers as another model would."""
    rec = model.compressor_record
    if (rec is None or rec["name"] in checkpoint.SETTING_ONLY
            or model.applied_compressor == rec["name"] or model._compressor_warned):
        return
    warnings.warn(f"this checkpoint was trained with --compressor {rec['name']} "
                  f"({checkpoint.COMPRESSOR_RECORD}), but generate reads prompts as given: "
                  f"rewrite them with {rec['name']} first (ktm.compressors.apply."
                  "apply_compressor, as ktm generate does), or load a checkpoint trained "
                  "without a baseline", UserWarning, stacklevel=3)
    model._compressor_warned = True


class KTMModel(nn.Module):
    """Base causal LM + PEFT LoRA + K-token merging encoder, described by one ``KTMConfig``."""

    def __init__(self, peft_model: PeftModel, tokenizer: PreTrainedTokenizerBase,
                 encoder: KTokenEncoder, config: KTMConfig):
        super().__init__()
        self.peft = peft_model
        self.encoder = encoder
        self.tokenizer = tokenizer
        self._config = config
        lm: PreTrainedModel = peft_model.get_base_model()
        # a view into the PEFT-wrapped LM, kept out of nn.Module registration (no duplicate
        # params); an extension (LTSC's meta rows) replaces it (``extend_input_embedding``);
        # scaled as the LM's forward scales looked-up ids (Falcon-H1's embedding_multiplier)
        object.__setattr__(self, "_embed", input_lookup(lm))
        self.eos_ids = eos_ids(lm, tokenizer)
        self.eos_id = target_eos(lm, tokenizer)
        self._segment_ids = SegmentTokenizer(tokenizer)
        self.lead_ids = self._segment_ids.lead_ids  # the BOS the first segment opens with, if any
        self.pad_id = valid_pad(tokenizer.pad_token_id, self._embed.weight.shape[0])
        self.max_positions: int | None = getattr(lm.config, "max_position_embeddings", None)
        self._line_breaks: LineBreaks | None = None  # read from the tokenizer on first use
        # a baseline checkpoint's compressor.json ({"name", "options"}; None: plain), and the
        # method ktm.compressors.apply.apply_compressor set this model up for
        self.compressor_record: dict | None = None
        self.applied_compressor: str | None = None
        self._compressor_warned = False
        # per-token scores for a segment read at a ratio (ktm.core.allocate); its surprisal
        # table is the reader's own (saved beside it), if it has one
        self.scorer = Scorer(tokenizer, lm=partial(lm_surprisal, self),
                             attention=partial(lm_attention, self))
        # what the decode loop prefills and decodes through, and eval-mode scoring reads
        # (ktm.decode.runtime: torch, llama.cpp or vLLM; picked by use_backend)
        self.runtime = TorchRuntime(self)
        # decoding reads the LM with its LoRA folded into a separate copy of the adapted weights
        # (``ktm.core.lora_fold``, which says what that costs): True always, False never, None
        # when no LoRA weight trains (a model loaded with trainable=False)
        self.fold_lora: bool | None = None
        object.__setattr__(self, "_folded", FoldedLM())  # not a module: never saved or trained
        if config.lora.scope == "merged":
            gate_lora(peft_model)
        layers = getattr(getattr(encoder, "config", None), "context_layers", 0)
        if layers:  # the encoder reads the base LM's first layers, by reference
            from ktm.core.context_states import LayerStates

            sink = next((i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id)
                         if i is not None), self.pad_id)
            encoder.bind_lm(LayerStates(peft_model.get_base_model(), layers, int(sink),
                                        peft_model.disable_adapter))

    # ---------------------------------------------------------------- construction
    # around a base model or from a checkpoint (defined above)
    from_base = classmethod(from_base)
    load = classmethod(load)

    def save(self, directory: str | Path) -> None:
        """Write a checkpoint (config, encoder, LoRA; never the base weights) that ``load``
        reads. Atomic: a crash leaves any earlier checkpoint there intact. Raises ``KTMError``
        if ``directory`` holds something other than a checkpoint (it would be replaced)."""
        checkpoint.save_model(self, directory)

    # ---------------------------------------------------------------- properties
    @property
    def config(self) -> KTMConfig:
        """What this model is; the encoder part always follows the encoder in use (baselines and
        the benchmark swap encoders)."""
        enc = self.encoder.config
        return replace(self._config, **{f: getattr(enc, f) for f in KTMConfig.ENCODER_FIELDS})

    @property
    def k(self) -> int:
        """Tokens merged per block by the encoder in use."""
        return self.encoder.k

    @property
    def device(self) -> torch.device:
        return self._embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The base LM's dtype (trainable weights are fp32 whatever it is)."""
        return self._embed.weight.dtype

    @property
    def lm_config(self):
        return self.peft.get_base_model().config

    # ---------------------------------------------------------------- prompts
    def tokenize(self, text: str, first: bool = False) -> list[int]:
        """Token ids of one segment; only the first segment gets the special tokens the tokenizer
        puts before a text, the others continue it (``ktm.core.tokens``)."""
        return self._segment_ids(text, first)

    def compress(
        self, prompt: PromptLike | Sequence[PromptLike], merge: bool = True
    ) -> CompressedPrompt | list[CompressedPrompt]:
        """Prefix embeddings of one prompt or a list of prompts (``merge=False``: all plain).

        A prompt is a string (merged whole) or a list of ``Segment``s. Returns one
        ``CompressedPrompt`` (``embeds`` (L, D), ``tokens_in``, ``tokens_out``) per prompt, or
        the single one for a single prompt."""
        prompts, single = split_prompts(prompt)
        out = self.encode_prompts(prompts, merge)
        return out[0] if single else out

    def encode_prompts(
        self, prompts: Sequence[PromptLike], merge: bool = True, cache: MergeCache | None = None,
        embed: bool = True, layout: Layout | None = None,
    ) -> list[CompressedPrompt]:
        """Prompts -> their LM input embeddings, the encoder run once for all.

        This is the one prompt-encoding step (``ktm.core.prefix``) that training, evaluation,
        generation, the benchmark and the server share; ``cache`` reuses merged segments.
        ``embed=False``: the same from tokenizing alone (``PromptEncoder.measure``): counts and
        positions, no embeddings; enough to check that prompts fit. ``layout``
        (``ktm.core.config.Layout``: ratio, allocator, quote, ...): this call's reading plan,
        its given fields over the model's own; the model is left as it is.
        """
        segments, merge = [as_segments(p) for p in prompts], merge and merges(self)
        if not embed:
            return self._prompt_encoder(layout).measure(segments, merge)
        return self._prompt_encoder(layout).encode(segments, merge, cache)

    def _prompt_encoder(self, layout: Layout | None = None) -> PromptEncoder:
        c = self._config if layout is None else layout.apply(self._config)
        return PromptEncoder(self.tokenize, self._embed, self.encoder, self.pad_id,
                             c.plain_prefix, c.spread_positions, c.plain_suffix,
                             self._breaks(c.align_lines), c.allocator, self.scorer, c.ratio,
                             c.quote)

    def _breaks(self, align_lines: bool) -> LineBreaks | None:
        """The tokenizer's line-break tokens if prompts merge line by line (``align_lines``)."""
        if not align_lines:
            return None
        if self._line_breaks is None:
            self._line_breaks = line_break_ids(self.tokenizer)
        return self._line_breaks

    @property
    def input_embedding(self) -> nn.Module:
        """The id -> (..., D) lookup every prompt, target and generated token goes through
        (``extend_input_embedding`` replaces it)."""
        return self._embed

    # ---------------------------------------------------------------- the LM
    def lm(self, embeds: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor,
           cache=None, keep: int | torch.Tensor = 0, hidden: bool = False,
           via: nn.Module | None = None, gate: torch.Tensor | None = None):
        """The causal LM's own forward on (B, L, D) embeddings; extends ``cache`` if given.

        ``keep``: an int keeps logits at the last positions (0: all) -> (B, keep, V); a (B, L)
        bool mask keeps exactly those positions, flattened row by row -> (N, V).
        ``hidden``: also return every layer's hidden states (B, L, D), as (logits, states).
        ``via``: the LM to run (``decode_lm``'s view); None: the PEFT-wrapped LM.
        ``gate``: (B, L) bool, the merged rows (``Packed.gate``; None: none). A LoRA of scope
        "merged" adapts those rows only (``ktm.core.lora_scope``): a forward with a merged row
        runs, when decoding (``via`` given), the LM switched by row (``_rows_lm``), else the PEFT
        model; one without reads through ``via``, the base LM's view.
        """
        run, rows = via or self.peft, nullcontext()
        if self._config.lora.scope == "merged":
            if gate is not None and bool(gate.any()):
                run = (via is not None and self._rows_lm()) or self.peft
            if run is not via:
                rows = gated(gate if gate is not None else torch.zeros(
                    embeds.shape[:2], dtype=torch.bool, device=embeds.device),
                    by_row=run is not self.peft)
        with rows:
            out = run(
                inputs_embeds=embeds, attention_mask=mask, position_ids=position_ids,
                past_key_values=cache, use_cache=cache is not None, logits_to_keep=keep,
                output_hidden_states=hidden)
        return (out.logits, out.hidden_states) if hidden else out.logits

    def _rows_lm(self) -> nn.Module | None:
        """What a LoRA of scope "merged" reads a decoding forward with merged rows through: the
        LM folded at those rows, base at the rest (``ktm.core.lora_fold.rows_view``), when
        ``fold_lora`` says so (None: when the LoRA does not train); else None, the PEFT model
        with the gate's hook. Native weights either way."""
        lm = self.peft.get_base_model()
        fold = self.fold_lora
        if fold is None:
            fold = not self._folded.lora_trains(lm)
        return self._folded.get(lm, mode="rows") if fold else None

    def decode_lm(self) -> nn.Module | None:
        """What decoding passes ``lm`` as ``via``: the LM with its LoRA folded into separate
        weights (``ktm.core.lora_fold``) when ``fold_lora`` says so, else None (the PEFT model);
        its linear layers in int8 where the runtime's ``weights`` says so (``ktm.core.int8``).
        Made on first use and again after the weights change; freed when folding is off."""
        fold = self.fold_lora
        lm = self.peft.get_base_model()
        weights = self.runtime.weights
        if self._config.lora.scope == "merged":  # decoding reads plain rows: the base LM, unfolded
            return self._folded.get(lm, weights, mode="base")
        if fold is None:
            fold = not self._folded.lora_trains(lm)
        if not fold:
            if weights != "native":
                raise KTMError(f"weights={weights!r} reads the LM with its LoRA folded in, and "
                               "this model's LoRA trains (or fold_lora is False): load it with "
                               "trainable=False, or use weights='native'")
            self._folded.clear()
            return None
        return self._folded.get(lm, weights)

    def train(self, mode: bool = True) -> KTMModel:
        if mode:  # a model that trains changes its LoRA: a fold would be stale memory
            self._folded.clear()
        return super().train(mode)

    # ---------------------------------------------------------------- the loss
    def forward(
        self, prompts: Sequence[PromptLike], targets: Sequence[str | Sequence[int]],
        merge: bool = True, prefixes: list[CompressedPrompt] | None = None,
    ) -> LossOutput:
        """Loss on target tokens only (``ktm.core.loss``: ``target_ids``, ``target_logits``);
        in eval mode read from the runtime. ``prefixes``: the prompts' ``CompressedPrompt``s
        when the caller already has them."""
        return loss(self, prompts, targets, merge, prefixes)

    # ---------------------------------------------------------------- generation
    def use_backend(self, backend: str, source: str | Path | None = None,
                    gguf: str | Path | None = None,
                    config: RuntimeConfig | VLLMConfig | None = None) -> None:
        """Decode through ``backend``: ``"torch"``, ``"llamacpp"`` or ``"vllm"`` (see ``load``;
        ``source``: the checkpoint folder this model was loaded from; ``config``: the backend's
        settings). Generation and, in eval mode, scoring (``forward``: R, likelihoods,
        perplexity) run there; training, ``target_logits`` and hidden states stay on torch."""
        press = self.runtime.press
        if press is not None and backend != "torch":  # before an engine starts
            raise KTMError(press_refusal(backend, press.name))
        spec = RuntimeSpec(backend, gguf=gguf,
                           llamacpp=config if backend == "llamacpp" else None,
                           vllm=config if backend == "vllm" else None,
                           press=None if press is None else press.name,
                           press_ratio=0.5 if press is None else press.ratio)
        self._run_on(spec.build(self, source))

    def _run_on(self, runtime) -> None:
        """``runtime`` runs this model from now on (``RuntimeSpec.build`` made it for this
        model); the one before (a llama.cpp context, a vLLM engine) is freed."""
        self.runtime.close()
        self.runtime = runtime

    def use_press(self, press: str | PressConfig | None, ratio: float = 0.5) -> None:
        """Compress the KV cache of every prompt's pressable rows (its compressed segments,
        merged or plain) after prefill with a kvpress press (``ktm.decode.press``: names in
        ``press_names()``), dropping ``ratio`` of it; for generation, streaming, serving and
        eval-mode scoring alike. None: no press. The torch runtime only: llama.cpp and vLLM
        keep their own KV cache (a ``KTMError`` there)."""
        cfg = (press if isinstance(press, PressConfig) or press is None
               else PressConfig(press, ratio))
        if cfg is not None:
            import_kvpress()
        if cfg is not None and not self.runtime.presses:
            raise KTMError(press_refusal(self.runtime.name, cfg.name))
        self.runtime.use_press(cfg)

    def generate(self, prompts, **kwargs):
        """Text continuation of one prompt (returns str) or of a list of prompts (list[str]).

        ``kwargs`` are ``ktm.decode.generate.GenerationConfig``'s fields (``max_new_tokens``,
        ``do_sample``, ``temperature``, ``top_p``, ``seed``, ``stop_at_eos``, ``use_cache``,
        ``merge``); greedy by default. Raises ``KTMError`` for a bad option or a prompt too long
        for the LM's positions."""
        from ktm.decode.generate import generate

        warn_unapplied_compressor(self)
        return generate(self, prompts, **kwargs)

    def stream(self, prompt: PromptLike, **kwargs):
        """Yield text pieces of one prompt's continuation as they are decoded (options as
        ``generate``); a list of prompts raises ``KTMError`` at the first piece."""
        from ktm.decode.generate import stream

        warn_unapplied_compressor(self)
        return stream(self, prompt, **kwargs)


# -- what the layers ask of a model, beside the class (it keeps to what a user calls) ------------

def extend_input_embedding(model: KTMModel, module: nn.Module) -> None:
    """Route every id -> embedding lookup of ``model`` through ``module`` (registered, so its
    weights train and move with the model); LTSC's meta-token rows extend the table this way."""
    model.input_extension = module
    object.__setattr__(model, "_embed", module)


def prompt_logits(model: KTMModel, prompt: PromptLike, merge: bool = True) -> torch.Tensor:
    """(L, V) logits at every prefix position of one prompt."""
    cp = model.encode_prompts([prompt], merge)[0]
    check_fits(model, [cp], [0], "more tokens")
    p = pack([cp.embeds], [cp.positions], [cp.merged_rows])
    return model.lm(p.embeds, p.mask, p.position_ids, gate=p.gate)[0]


def ratio_refusal(model: KTMModel, ratio: float) -> str | None:
    """Why ``model`` cannot read a compressed segment at ``ratio`` (None: it can), checked
    before any text is read: the server refuses such a request when it parses it."""
    if not merges(model):
        return None
    return model._prompt_encoder().ratio_refusal(ratio)


def may_leave_out(model: KTMModel) -> bool:
    """Whether ``model`` may leave part of a merged segment unread (an allocator of
    ``ktm.core.signals.Signal.drops``): a segment of it may then take no position at all."""
    return merges(model) and signal_of(model._prompt_encoder().allocator).drops


def tokens_readable(model: KTMModel, ratio: float | None = None) -> float | None:
    """The most tokens a prompt of ``model`` can hold within its context: every position at
    its densest (``PromptEncoder.densest``; ``ratio``: a ratio asked for). None: no bound (a
    model without a known context). A prompt longer than this is refused before it is read."""
    if model.max_positions is None:
        return None
    most = model._prompt_encoder().densest(ratio) if merges(model) else 1
    return model.max_positions * most


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of the weights that train (``requires_grad``): a model's encoder's and
    LoRA's; none for one loaded for inference (``load(..., trainable=False)``)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def open_model(spec: ModelSpec, *, runtime: RuntimeSpec | None = None,
               trainable: bool = False) -> KTMModel:
    """The model ``spec`` names (``ktm.core.config.ModelSpec``), on ``runtime`` (None: torch):
    its checkpoint read at the K level, layout, base folder and dtype given, or a fresh model of
    its settings. Raises ``KTMError`` for a setting that contradicts the checkpoint's config."""
    runtime = runtime or RuntimeSpec()
    if spec.checkpoint is None:
        return runtime.apply(KTMModel.from_base(config=spec.fresh_config(), device=spec.device))
    from ktm.readers import open_checkpoint

    ckpt = open_checkpoint(spec.checkpoint)  # read once: the name or folder, or already opened
    # K first, as ``load`` checks it: a recursive checkpoint also reads at its inner K
    ckpt.check_level(spec.settings.get("k"))
    _, clash = spec.against(ckpt.config)
    if clash:
        raise spec.contradiction(ckpt.name, ckpt.config, clash)
    return KTMModel.load(ckpt, base=spec.settings.get("model"), k=spec.settings.get("k"),
                         device=spec.device, dtype=spec.dtype, trainable=trainable,
                         layout=spec.layout, runtime=runtime)


# -- one name, either kind -----------------------------------------------------------------------

DEFAULT_K = 4


def load_any(model: str, k: int | None = None, device: str = "cpu",
             dtype: str | torch.dtype = "float32", runtime: RuntimeSpec | None = None,
             layout: Layout | None = None, **options):
    """``k``: a base model's K (default 4); for a checkpoint, if given, it must match.
    ``runtime`` (or its fields by keyword: ``backend``, ``press``, ...): where it runs, as
    ``KTMModel.load``'s; ``layout``: how its prompts are laid out, as there."""
    from ktm.readers import READERS

    unknown = sorted(set(options) - RUNTIME_FIELDS)
    if unknown:
        raise KTMError(f"unknown options {unknown}: expected RuntimeSpec fields "
                       f"{sorted(RUNTIME_FIELDS)}")
    runtime = replace(runtime or RuntimeSpec(), **options)
    dt = parse_dtype(dtype)
    if (Path(model) / "ktm_config.json").is_file() or model in READERS:
        return KTMModel.load(model, k=k, device=device, dtype=dt, runtime=runtime,
                             layout=layout)
    k = DEFAULT_K if k is None else k  # not ``k or``: K=0 is an error, not the default
    # frozen like a loaded checkpoint: served or exported, never trained (decoding then folds
    # the LoRA, ``KTMModel.fold_lora``)
    given = {} if layout is None else {f.name: getattr(layout, f.name)
                                       for f in dataclasses.fields(layout)}
    out = KTMModel.from_base(model, k=k, use_mlp=False, device=device, dtype=dt,
                             **{n: v for n, v in given.items() if v is not None}
                             ).requires_grad_(False)
    return runtime.apply(out)
