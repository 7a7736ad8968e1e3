"""``KTMConfig``: everything that defines a ktm model, validated on construction.

It is saved as the checkpoint's config and read back, and the CLI's model flags are built from
it, so a result row records exactly what was used. A leaf module: no torch, no model.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ktm.core.signals import SIGNALS, signal_of
from ktm.errors import KTMError
from ktm.util.field_types import check_field_types
from ktm.util.flags import flag_fields, from_flags

DEFAULT_MODEL = "smollm2-135m"
# every accepted spelling -> the canonical torch dtype name
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# where a question allocator's plain lines are read (``KTMConfig.quote``; ktm.core.prefix)
QUOTE_MODES = ("far", "all")
# the rows a LoRA adapts (``LoraSettings.scope``; ktm.core.lora_scope)
LORA_SCOPES = ("all", "merged")
# how ``context_layers`` pools a block's states (ktm.core.context_states)
CONTEXT_POOLS = ("mean", "query")


def check_ratio(ratio: float, what: str = "ratio") -> float:
    """A ratio is a finite number >= 1 (1: every token plain)."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not (
            1.0 <= ratio < math.inf):
        raise KTMError(f"{what} must be a finite number >= 1 (tokens in per position read; 1 "
                       f"reads every token plain), got {ratio!r}")
    return float(ratio)



def inner_chain(inner_k: int | tuple[int, ...]) -> tuple[int, ...]:
    """The inner levels of a recursive encoder, outermost first: ``inner_k`` 1 -> (), 2 -> (2,),
    (4, 2) -> (4, 2) (K=8 merges two K=4 merges, each of two K=2 merges)."""
    return (inner_k,) if _is_int(inner_k) and inner_k > 1 else (
        () if _is_int(inner_k) else tuple(inner_k))


def normal_inner_k(inner_k: Any) -> Any:
    """``inner_k`` in its one spelling: an int for one inner level (or none: 1), a tuple of two
    or more; a list (read from JSON) becomes a tuple. Anything else is left for the check."""
    if isinstance(inner_k, (list, tuple)):
        chain = tuple(inner_k)
        return chain[0] if len(chain) == 1 else (1 if not chain else chain)
    return inner_k


def check_encoder_fields(k: Any, mlp_ratio: Any, use_mlp: bool, mlp_gate: bool,
                         inner_k: Any, context_blocks: Any = 0, context_layers: Any = 0,
                         context_transformer: Any = 0, context_pool: Any = "mean") -> None:
    """The encoder settings' rules, shared by ``KTMConfig`` and ``EncoderConfig``."""
    if not _is_int(k) or k < 1:
        raise KTMError(f"k must be an integer >= 1, got {k!r}")
    if isinstance(mlp_ratio, bool) or not isinstance(mlp_ratio, (int, float)) or not (
            0 < mlp_ratio < float("inf")):
        raise KTMError(f"mlp_ratio must be > 0 and finite, got {mlp_ratio!r}")
    if mlp_gate and not use_mlp:
        raise KTMError("mlp_gate=True needs use_mlp=True: there is no MLP output to gate")
    chain = inner_k if isinstance(inner_k, tuple) else (inner_k,)
    outer = k
    for i in chain:
        if not _is_int(i) or i < 1 or outer % i or (1 < i == outer) or (
                i == 1 and len(chain) > 1):
            raise KTMError(f"inner_k={inner_k!r} must divide k={k} and be smaller, each inner "
                           "level dividing the one above it (1: no recursion; e.g. k=8 with "
                           "inner_k=(4, 2))")
        outer = i
    if not _is_int(context_blocks) or context_blocks < 0:
        raise KTMError(f"context_blocks must be an integer >= 0, got {context_blocks!r}")
    if not _is_int(context_layers) or context_layers < 0:
        raise KTMError(f"context_layers must be an integer >= 0, got {context_layers!r}")
    if not _is_int(context_transformer) or context_transformer < 0:
        raise KTMError(f"context_transformer must be an integer >= 0, got "
                       f"{context_transformer!r}")
    if context_pool not in CONTEXT_POOLS:
        raise KTMError(f"context_pool must be {' or '.join(CONTEXT_POOLS)}, got {context_pool!r}")
    if context_pool != "mean" and not context_layers:
        raise KTMError(f"context_pool={context_pool!r} pools the LM's layer states: it needs "
                       "context_layers >= 1")
    if context_blocks and not use_mlp:
        raise KTMError(f"context_blocks={context_blocks} needs use_mlp=True: the earlier blocks "
                       "are read by the MLP")


@dataclass
class LoraSettings:
    """The PEFT LoRA adapter of ``KTMConfig.lora`` (the ``--lora-*`` flags). Raises ``KTMError``
    on construction for ``r`` < 1, ``alpha`` <= 0, ``dropout`` outside [0, 1) or empty module
    names."""

    r: int = field(default=4, metadata={"help": "LoRA rank"})
    alpha: int = field(default=16, metadata={"help": "LoRA alpha"})
    dropout: float = field(default=0.05, metadata={"help": "LoRA dropout"})
    target_modules: tuple[str, ...] | None = field(default=None, metadata={
        "help": "module names to adapt (None: the family's attention and MLP projections, "
                "see ktm.core.lora)"})
    scope: str = field(default="all", metadata={
        "help": "the rows the LoRA adapts: all (every position the LM reads), or merged (only "
                "the merged blocks: every plain token, a question, a part of a document read "
                "plain, an answer, is read by the base LM as it is; ktm.core.lora_scope)"})

    def __post_init__(self) -> None:
        check_field_types(self)
        if not _is_int(self.r) or self.r < 1:
            raise KTMError(f"LoRA r must be an integer >= 1, got {self.r!r}")
        if self.alpha <= 0:
            raise KTMError(f"LoRA alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise KTMError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        if self.scope not in LORA_SCOPES:
            raise KTMError(f"LoRA scope must be one of {', '.join(LORA_SCOPES)}, got "
                           f"{self.scope!r}")
        if self.target_modules is not None:
            if isinstance(self.target_modules, str):
                self.target_modules = (self.target_modules,)
            try:
                self.target_modules = tuple(self.target_modules)
            except TypeError:
                raise KTMError("LoRA target_modules must be module names, got "
                               f"{self.target_modules!r}") from None
            if not self.target_modules or not all(isinstance(t, str) and t
                                                  for t in self.target_modules):
                raise KTMError("LoRA target_modules must be non-empty module names, got "
                               f"{list(self.target_modules)!r}")


@dataclass
class KTMConfig:
    """The model: base LM, the merging encoder, LoRA, and how targets end."""

    base_model: str = field(default=DEFAULT_MODEL, metadata={
        "flag": "model", "help": "embedded name or HF folder"})
    k: int = field(default=4, metadata={"help": "tokens merged per block"})
    mlp_ratio: float = field(default=2.0, metadata={"help": "encoder MLP width / (K * hidden)"})
    use_mlp: bool = field(default=True, metadata={
        "flag": "mlp", "help": "use the MLP (off: mean pooling)"})
    slot_weights: bool = field(default=False, metadata={
        "help": "order-aware pooling: learnable per-slot weights starting at 1/K"})
    mlp_gate: bool = field(default=False, metadata={
        "help": "ReZero gate on the MLP output instead of a zero last layer"})
    inner_k: int | tuple[int, ...] = field(default=1, metadata={
        "help": "recursive merging: merge blocks of inner_k tokens first (1: off); several "
                "values nest, outermost first (--k 8 --inner-k 4 2: merges of 2, 4 and 8 "
                "tokens, each level a whole encoder)"})
    context_blocks: int = field(default=0, metadata={
        "help": "contextual merging: the encoder MLP also reads the W blocks before each block "
                "of its segment, through weights starting at zero (0: the paper's block encoder)"})
    context_layers: int = field(default=0, metadata={
        "help": "contextual merging: add to each merged vector an MLP (starting at zero) of its "
                "block's states after the base LM's first L layers (0: off)"})
    context_pool: str = field(default="mean", metadata={
        "help": "how context_layers pools a block's states: mean, or query (ARC-Encoder's "
                "pooled queries: the block's mean attends to every state up to its end)"})
    context_transformer: int = field(default=0, metadata={
        "help": "contextual merging: N small causal transformer layers of the encoder's own "
                "(starting as the identity) read each segment's token embeddings before the "
                "block merge (0: off)"})
    plain_prefix: int = field(default=0, metadata={
        "help": "first prompt tokens kept plain (the LM's attention sink)"})
    plain_suffix: int = field(default=0, metadata={
        "help": "last tokens of the last compressed segment kept plain: the recent tokens, "
                "which the continuation reads most closely (a prompt layout: a checkpoint can be "
                "read with another)"})
    align_lines: bool = field(default=False, metadata={
        "help": "merged blocks never span a line break: each line of a compressed segment is "
                "merged on its own, its last block holding fewer than K tokens if need be (a "
                "prompt layout: a checkpoint can be read with or without it)"})
    spread_positions: bool = field(default=False, metadata={
        "help": "a merged block takes its last token's position id, so relative distances are "
                "the plain prompt's (off: consecutive ids, K times more context fits, and the only "
                "layout llama.cpp and vLLM accept; a prompt layout: a checkpoint can be read with "
                "the other)"})
    ratio: float | None = field(default=None, metadata={
        "help": "adaptive merging: read every compressed segment without a ratio of its own at "
                "this many tokens per position (>= 1), each block at its own level, the "
                "positions spent by --allocator (None: uniform K; a prompt layout: a checkpoint "
                "can be read with another)"})
    allocator: str = field(default="rules", metadata={
        "help": "how a segment read at a ratio (--ratio, Segment(ratio=...)) spends its "
                f"positions: the signal it reads ({', '.join(SIGNALS)}; each one class in "
                "ktm.core.signals, which says what it reads) (a prompt layout: a checkpoint can "
                "be read with another)"})
    quote: str = field(default="far", metadata={
        "help": "with a question allocator, where the lines the question asks about are read "
                "plain: far (in place, those more than 512 positions before the question "
                "quoted after the document) or all (the document read as without a question, "
                "every line the question picks quoted after it: the document's reading, and its "
                "cached KV, the same whatever is asked) (a prompt layout: a checkpoint can be "
                "read with the other)"})
    lora: LoraSettings = field(default_factory=LoraSettings, metadata={"prefix": "lora"})
    add_eos: bool = field(default=True, metadata={"help": "training targets end with EOS"})
    dtype: str = field(default="float32", metadata={
        "help": "base LM weights: float32 | bfloat16 | float16 (trainable weights stay fp32)"})

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):
            try:
                self.lora = LoraSettings(**self.lora)
            except TypeError as e:
                raise KTMError(f"KTMConfig.lora {self.lora!r} is malformed: {e}") from e
        if not isinstance(self.lora, LoraSettings):
            raise KTMError(f"KTMConfig.lora must be a LoraSettings (or a dict of its fields), got "
                           f"{self.lora!r}")
        self.inner_k = normal_inner_k(self.inner_k)
        check_encoder_fields(self.k, self.mlp_ratio, self.use_mlp, self.mlp_gate, self.inner_k,
                             self.context_blocks, self.context_layers, self.context_transformer,
                             self.context_pool)
        if not _is_int(self.plain_prefix) or self.plain_prefix < 0:
            raise KTMError(f"plain_prefix must be an integer >= 0, got {self.plain_prefix!r}")
        if not _is_int(self.plain_suffix) or self.plain_suffix < 0:
            raise KTMError(f"plain_suffix must be an integer >= 0, got {self.plain_suffix!r}")
        check_field_types(self)  # the other fields (a wrong type fails no rule above)
        if self.ratio is not None:
            check_ratio(self.ratio)  # None: uniform K
        signal_of(self.allocator)  # the signals that spend a ratio's positions, by name
        if self.quote not in QUOTE_MODES:
            raise KTMError(f"quote must be one of {', '.join(QUOTE_MODES)}, got {self.quote!r}")
        if self.dtype not in DTYPES:
            raise KTMError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        self.dtype = DTYPES[self.dtype]
        if not self.base_model:
            raise KTMError("base_model is empty: expected an embedded model name or a folder")

    # the encoder's part of the config (EncoderConfig adds the base model's hidden size)
    ENCODER_FIELDS = ("k", "mlp_ratio", "use_mlp", "slot_weights", "mlp_gate", "inner_k",
                      "context_blocks", "context_layers", "context_transformer", "context_pool")

    def encoder_kwargs(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.ENCODER_FIELDS}

    @property
    def levels(self) -> tuple[int, ...]:
        """The K this model merges at, largest first: its own and, if recursive, each inner K
        (every inner level is a whole encoder of its K)."""
        return (self.k, *inner_chain(self.inner_k))

    def at_level(self, k: int) -> KTMConfig:
        """This model read at K=``k``, one of ``levels``: itself, or an inner level."""
        if k not in self.levels:
            raise KTMError(f"K={k} is not one of this model's merge levels {sorted(self.levels)}")
        below = self.levels[self.levels.index(k) + 1:]
        return self if k == self.k else replace(self, k=k, inner_k=normal_inner_k(below))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.lora.target_modules is not None:
            d["lora"]["target_modules"] = list(self.lora.target_modules)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KTMConfig:
        """Read a saved config; fields added later keep their defaults."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise KTMError(f"model config has unknown fields {unknown}: expected some of "
                           f"{sorted(known)}")
        try:
            return cls(**d)
        except TypeError as e:
            raise KTMError(f"model config {d!r} is malformed: {e}") from e

    @classmethod
    def from_checkpoint(cls, saved: dict[str, Any]) -> KTMConfig:
        """The config of a ``ktm_config.json``: format 2 holds it under ``config``; format 1
        (before KTMConfig) spread it over ``encoder``, ``lora`` and a few top-level keys."""
        if "config" in saved:
            return cls.from_dict(saved["config"])
        enc = {k: v for k, v in (saved.get("encoder") or {}).items() if k != "hidden_size"}
        unknown = sorted(set(enc) - set(cls.ENCODER_FIELDS))
        if unknown:
            raise KTMError(f"encoder config has unknown fields {unknown}: expected some of "
                           f"{sorted(cls.ENCODER_FIELDS)}")
        lora = dict(saved.get("lora") or {})
        try:
            return cls(base_model=saved["base_model"], **enc, lora=LoraSettings(**lora),
                       add_eos=saved.get("add_eos", True),
                       plain_prefix=saved.get("plain_prefix", 0))
        except (KeyError, TypeError) as e:
            raise KTMError(f"checkpoint config is incomplete: {e}") from e


@dataclass(frozen=True)
class Layout:
    """How a saved model's prompts are laid out when it is read, where that may differ from how
    it was saved (``KTMModel.load(..., layout=Layout(ratio=4))``); each None keeps the
    checkpoint's own. E.g. a spread-position reader continued with consecutive positions, which
    llama.cpp and vLLM accept, or a reader of several levels read at a ratio."""

    plain_suffix: int | None = None
    align_lines: bool | None = None
    spread_positions: bool | None = None
    ratio: float | None = None
    allocator: str | None = None
    quote: str | None = None

    def apply(self, config: KTMConfig) -> KTMConfig:
        """``config`` with this layout's given fields."""
        given = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(config, **{n: v for n, v in given.items() if v is not None})


# set per run, not weights: a checkpoint read with these given need not have saved the same
READ_WITH = ("model", "dtype", "k", *(f.name for f in fields(Layout)))


@dataclass(frozen=True)
class ModelSpec:
    """Which model a command reads: ``checkpoint`` (a folder, a shipped reader's name or an
    opened ``Checkpoint``; None: a fresh model from the base) and ``KTMConfig``'s settings given
    by their flag names (``k``, ``model``, ``lora_r``, ``ratio``, ...). For a fresh model they
    are its config (the rest take ``KTMConfig``'s defaults); for a checkpoint each must agree
    with its own config, except the base folder, dtype, K level and layout, which are how this
    run reads it (``ktm.model.open_model``)."""

    checkpoint: str | os.PathLike | None = field(default=None, metadata={
        "help": "a ktm checkpoint folder or reader (its config is used; model flags given must "
                "agree with it)"})
    settings: dict[str, Any] = field(default_factory=dict, metadata={"flag": None})
    device: str = field(default="cpu", metadata={"help": "torch device: cpu, cuda, cuda:N"})

    def __post_init__(self) -> None:
        if not self.settings:
            return
        known = {name for name, *_ in flag_fields(KTMConfig)}
        unknown = sorted(set(self.settings) - known)
        if unknown:
            raise KTMError(f"unknown model settings {unknown}: expected KTMConfig's, by their "
                           f"flag names ({', '.join(sorted(known))})")

    @property
    def dtype(self) -> str:
        """The dtype of this run (default float32), not the one a checkpoint trained in."""
        return self.settings.get("dtype", "float32")

    @property
    def layout(self) -> Layout:
        return Layout(**{f.name: self.settings.get(f.name) for f in fields(Layout)})

    def fresh_config(self) -> KTMConfig:
        return from_flags(KTMConfig, self.settings)

    def against(self, own: KTMConfig) -> tuple[KTMConfig, list[str]]:
        """A checkpoint of config ``own`` read with these settings: the config wanted (at the
        given K level), and the given settings that contradict ``own``."""
        saved = self._level(own)
        if not self.settings:
            return saved, []
        want = from_flags(KTMConfig, self.settings, base=saved)
        return want, [n for n in self.settings if n not in READ_WITH
                      and setting(want, n) != setting(saved, n)]

    def _level(self, own: KTMConfig) -> KTMConfig:
        return own.at_level(self.settings["k"]) if "k" in self.settings else own

    def contradiction(self, name: str, own: KTMConfig, clash: list[str]) -> KTMError:
        """The error for settings ``clash`` contradicting checkpoint ``name`` of config
        ``own``."""
        ours = ", ".join(f"--{n.replace('_', '-')} {self.settings[n]!r}" for n in clash)
        theirs = ", ".join(f"{n}={setting(self._level(own), n)!r}" for n in clash)
        return KTMError(f"{ours} contradicts checkpoint {name!r}, which has {theirs}: drop the "
                        "flag or pick a matching checkpoint")


def setting(config: KTMConfig, name: str) -> Any:
    """``config``'s value of the setting of flag name ``name``."""
    if name.startswith("lora_"):
        return getattr(config.lora, name.removeprefix("lora_"))
    return getattr(config, {"model": "base_model", "mlp": "use_mlp"}.get(name, name))
