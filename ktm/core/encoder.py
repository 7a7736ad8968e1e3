"""The K-token merging encoder: every block of K token embeddings becomes one embedding.

    C_i = pool(e_1..e_K) + gate * MLP(concat(e_1..e_K))

``pool`` is the masked mean, or (``slot_weights``) a per-slot, per-dimension weighted sum whose
weights start at 1/K: it begins as the mean but can tell 'QF' from 'FQ' from the first step,
which the mean never can. The MLP's contribution starts at exactly zero, either through a zero
last layer (the paper) or through a zero gate (``mlp_gate``, ReZero-style: the gate is a D-vector
with fan-in 1, so one Adam step moves it by about the learning rate, whereas a zero last layer
with a K*D-wide fan-in moves the output by far more than an embedding's norm). Either way an
untrained encoder is exactly mean pooling.

``context_blocks`` W > 0 makes the merge contextual (a causal convolution over blocks): the MLP's
first layer also reads the raw embeddings of the W blocks before this one in its segment,
through weights that start at zero, so an encoder with them untrained is exactly the block
encoder (and a block reader gains them without changing what it computes). A block's vector
depends only on its own tokens and the W blocks before it: appending tokens to a segment never
changes an earlier complete block's vector, so merged prefixes stay cacheable by their ids.

The other contextual options keep that property: ``context_layers`` (the LM's own first layers,
``ktm.core.context_states``) and ``context_transformer`` (small causal layers of the encoder's
own over the token embeddings, ``ktm.core.context_mixer``).
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import asdict, dataclass, fields, replace

import torch
from torch import nn

from ktm.core.config import check_encoder_fields, inner_chain, normal_inner_k
from ktm.core.context_mixer import TokenMixer
from ktm.core.context_states import StatesContext
from ktm.errors import KTMError


@dataclass(frozen=True)
class EncoderConfig:
    """The merging encoder's shape: ``hidden_size`` D of the LM, K, the MLP's width and the
    optional order-aware parts. ``KTMModel`` builds it from ``KTMConfig``; raises ``KTMError``
    on construction for an invalid field (e.g. K < 1, ``inner_k`` not dividing K)."""

    hidden_size: int
    k: int = 4
    mlp_ratio: float = 2.0  # MLP width = mlp_ratio * k * hidden_size (the paper uses ~1.5-2)
    use_mlp: bool = True  # False gives the mean-pooling ablation (with slot_weights off)
    slot_weights: bool = False  # order-aware pooling: per-slot weights initialised to 1/K
    mlp_gate: bool = False  # ReZero gate on the MLP output (zero-initialised D-vector)
    # recursive merging: blocks of inner_k tokens are merged first, then k // inner_k of those
    # (K=4 as a K=2 merge of two K=2 merges, whose inner level can start from the K=2 reader);
    # a tuple nests, outermost first (k=8, inner_k=(4, 2))
    inner_k: int | tuple[int, ...] = 1
    # contextual merging: the MLP also reads the W blocks before each block (0: the paper's)
    context_blocks: int = 0
    # contextual merging from the LM's own first L layers (ktm.core.context_states; 0: off)
    context_layers: int = 0
    # contextual merging: N small causal transformer layers over the token embeddings first
    # (ktm.core.context_mixer; 0: off)
    context_transformer: int = 0
    # how context_layers pools a block's states: mean, or query (ARC-Encoder's pooled queries)
    context_pool: str = "mean"

    def __post_init__(self) -> None:
        object.__setattr__(self, "inner_k", normal_inner_k(self.inner_k))
        check_encoder_fields(self.k, self.mlp_ratio, self.use_mlp, self.mlp_gate, self.inner_k,
                             self.context_blocks, self.context_layers, self.context_transformer,
                             self.context_pool)
        if self.hidden_size < 1:
            raise KTMError(f"hidden_size must be >= 1, got {self.hidden_size!r}")

    @property
    def mlp_hidden(self) -> int:
        return max(1, round(self.mlp_ratio * self.k * self.hidden_size))

    def levels(self) -> tuple[EncoderConfig, EncoderConfig] | None:
        """(inner, outer) configs of a recursive encoder; None for one level. The outer level is
        a single-level encoder; the inner one is recursive itself where ``inner_k`` nests."""
        chain = inner_chain(self.inner_k)
        if not chain:
            return None
        # the layer-state context is the whole encoder's, added once to its K-token merges; the
        # token mixer is too, run once before the inner level
        whole = {"context_layers": 0, "context_transformer": 0, "context_pool": "mean"}
        inner = replace(self, k=chain[0], inner_k=normal_inner_k(chain[1:]), **whole)
        return inner, replace(self, k=self.k // chain[0], inner_k=1, **whole)

    @property
    def is_identity(self) -> bool:
        """K=1 with nothing learnable: merging changes nothing and is skipped."""
        return self.k == 1 and not self.use_mlp and not self.slot_weights

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> EncoderConfig:
        """Read a saved config; fields added after a checkpoint was written keep their
        defaults-off value, so older checkpoints load unchanged."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise KTMError(f"encoder config has unknown fields {unknown}: expected {sorted(known)}")
        return cls(**d)


class KTokenEncoder(nn.Module):
    """Merges contiguous blocks of K embeddings.

    forward: (B, T, D) embeddings + (B, T) mask -> (B, ceil(T/K), D) merged + (B, ceil(T/K)) mask.
    Padding must be on the right of each row: block i of a row covers tokens [iK, iK + K).
    """

    def __init__(self, hidden_size: int, k: int = 4, mlp_ratio: float = 2.0, use_mlp: bool = True,
                 slot_weights: bool = False, mlp_gate: bool = False, context_blocks: int = 0,
                 context_layers: int = 0, context_transformer: int = 0,
                 context_pool: str = "mean"):
        super().__init__()
        self.config = EncoderConfig(hidden_size, k, mlp_ratio, use_mlp, slot_weights, mlp_gate,
                                    context_blocks=context_blocks, context_layers=context_layers,
                                    context_transformer=context_transformer,
                                    context_pool=context_pool)
        d, h = hidden_size, self.config.mlp_hidden
        # fp32 whatever torch's default dtype: trainable weights stay fp32 (an Adam step of
        # 5e-5 rounds to nothing in bf16), and the LM's dtype is reached by autocast
        f32 = {"dtype": torch.float32}
        self.slots: nn.Parameter | None = None
        if slot_weights:
            self.slots = nn.Parameter(torch.full((k, d), 1.0 / k, **f32))
        self.mlp: nn.Sequential | None = None
        self.gate: nn.Parameter | None = None
        if use_mlp:
            self.mlp = nn.Sequential(
                nn.Linear(k * d, h, **f32), nn.GELU(), nn.Linear(h, h, **f32), nn.GELU(),
                nn.Linear(h, d, **f32)
            )
            if mlp_gate:
                self.gate = nn.Parameter(torch.zeros(d, **f32))
            else:
                nn.init.zeros_(self.mlp[-1].weight)
                nn.init.zeros_(self.mlp[-1].bias)
        self.context: nn.Linear | None = None
        if context_blocks:
            # the earlier blocks' raw embeddings into the MLP's first layer, from zero: the
            # untrained encoder is the block encoder exactly
            self.context = nn.Linear(context_blocks * k * d, h, bias=False, **f32)
            nn.init.zeros_(self.context.weight)
        self.states = StatesContext(d, k, d, context_pool) if context_layers else None
        self.mixer = TokenMixer(d, context_transformer) if context_transformer else None

    @classmethod
    def from_config(cls, config: EncoderConfig) -> KTokenEncoder | RecursiveEncoder:
        if config.levels() is not None:
            return RecursiveEncoder(config)
        return cls(config.hidden_size, config.k, config.mlp_ratio, config.use_mlp,
                   config.slot_weights, config.mlp_gate, config.context_blocks,
                   config.context_layers, config.context_transformer, config.context_pool)

    @property
    def k(self) -> int:
        return self.config.k

    def wide_parameters(self) -> list[nn.Parameter]:
        """Weights with a wide fan-in (the MLP's linear layers): they want a smaller Adam step."""
        return [] if self.mlp is None else list(self.mlp.parameters())

    def context_parameters(self) -> list[nn.Parameter]:
        """The weights that read context (``context_blocks``, ``context_layers``,
        ``context_transformer``): new to a block reader continued with them, so training may
        give them a rate of their own."""
        own = [] if self.context is None else [self.context.weight]
        return own + [p for m in (self.states, self.mixer) if m is not None
                      for p in m.parameters()]

    def bind_lm(self, source) -> None:
        """Give a ``context_layers`` encoder the LM states it reads (``LayerStates``)."""
        if self.states is not None:
            self.states.bind(source)

    def order_parameters(self) -> list[nn.Parameter]:
        """The slot weights and the gate: fan-in 1, what tells a block's order apart first."""
        return [p for p in (self.slots, self.gate) if p is not None]

    def forward(
        self, embeds: torch.Tensor, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, D) embeddings + optional (B, T) mask (None: all real) -> (B, ceil(T/K), D)
        merged + (B, ceil(T/K)) mask of blocks holding a real token. Raises ``KTMError`` for
        another shape or D."""
        if embeds.dim() != 3 or embeds.shape[-1] != self.config.hidden_size:
            raise KTMError(
                f"embeds must have shape (B, T, {self.config.hidden_size}), "
                f"got {tuple(embeds.shape)}"
            )
        b, t, d = embeds.shape
        k = self.config.k
        if mask is None:
            mask = torch.ones(b, t, dtype=torch.bool, device=embeds.device)
        given, given_mask = embeds, mask
        if self.mixer is not None:
            embeds = self.mixer(embeds)
        n = -(-t // k)
        pad = n * k - t
        m = mask.to(embeds.dtype)
        if pad:
            embeds = nn.functional.pad(embeds, (0, 0, 0, pad))
            m = nn.functional.pad(m, (0, pad))
        m = m.view(b, n, k, 1)
        blocks = embeds.view(b, n, k, d) * m  # pads zeroed so they never leak into the MLP
        count = m.sum(dim=2)  # (B, N, 1)
        if self.slots is None:
            merged = blocks.sum(dim=2) / count.clamp(min=1.0)
        else:
            # K/count rescales a partial last block so that 1/K weights still give its mean
            weights = self.slots.to(blocks.dtype)
            merged = (blocks * weights).sum(dim=2) * (k / count.clamp(min=1.0))
        if self.mlp is not None:
            flat = blocks.reshape(b, n, k * d)
            if self.context is None:
                extra = self.mlp(flat)
            else:
                extra = self.mlp[1:](self.mlp[0](flat) + self.context(self._earlier(flat)))
            merged = merged + (extra if self.gate is None else self.gate.to(extra.dtype) * extra)
        if self.states is not None:
            merged = merged + self.states(given, given_mask).to(merged.dtype)
        out_mask = count.squeeze(-1) > 0
        # a block of padding only carries no information; keep its output at exactly zero
        merged = merged * out_mask.unsqueeze(-1).to(merged.dtype)
        return merged, out_mask

    def _earlier(self, flat: torch.Tensor) -> torch.Tensor:
        """(B, N, KD) blocks -> (B, N, W*KD): for each block the W blocks before it, nearest
        first, zeros before the segment's start (a causal convolution's window)."""
        w = self.config.context_blocks
        padded = nn.functional.pad(flat, (0, 0, w, 0))  # W zero blocks before the first
        n = flat.shape[1]
        return torch.cat([padded[:, w - j: w - j + n] for j in range(1, w + 1)], dim=-1)


# an encoder's weights cast for inference, by encoder: (dtype and its weights' identity, copy)
_CAST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cast_for_inference(encoder: nn.Module, dtype: torch.dtype) -> nn.Module | None:
    """``encoder`` with its weights in ``dtype`` (an LM's bf16), for a model that does not train
    it; None where it trains (its weights stay fp32: a bf16 Adam step of 5e-5 rounds to nothing;
    the caller autocasts) or where it is in ``dtype`` already. Autocast casts every weight on
    every call (on a GPU, about a fifth of a merged prefill); the copy is made once, and again
    after the weights change (replaced or written in place)."""
    params = list(encoder.parameters())
    if not params or any(p.requires_grad for p in params) or all(p.dtype == dtype
                                                                 for p in params):
        return None
    key = (dtype, tuple((p.data_ptr(), p._version) for p in params))
    got = _CAST.get(encoder)
    if got is None or got[0] != key:
        cast = copy.deepcopy(encoder).to(dtype)
        _CAST[encoder] = got = (key, cast.train(False))
    return got[1]


def level_encoder(encoder: nn.Module, k: int) -> nn.Module:
    """The part of ``encoder`` that merges ``k`` tokens: itself, or a recursive one's inner
    level at that K (each a whole encoder). Raises ``KTMError`` for a K it does not merge at."""
    level = encoder
    while level.k != k and isinstance(level, RecursiveEncoder):
        level = level.inner
    if level.k != k:
        raise KTMError(f"K={k} is not one of this encoder's merge levels: expected one of "
                       f"{[encoder.k, *inner_chain(encoder.config.inner_k)]}")
    return level


def deeper_level(encoder: nn.Module) -> tuple[int, nn.Module] | None:
    """The level past ``encoder``'s K that merging its own merges again reaches, and the module
    that merges them: a recursive encoder's outer level once more (K=4 over inner K=2: two K=4
    merges -> one of K=8), else the encoder itself over K of its merges (K*K). Recursive merging
    of what the encoder has, untrained at that level: a chat's oldest messages read deeper
    before they are left out (``ktm serve --history-budget``). None where merges cannot be
    merged again: K=1, or an encoder that reads its tokens' context (``context_layers``,
    ``context_transformer``), which merged vectors do not have."""
    if isinstance(encoder, RecursiveEncoder):
        return encoder.k * encoder.outer.k, encoder.outer
    if encoder.k == 1 or encoder.states is not None or encoder.mixer is not None:
        return None
    return encoder.k * encoder.k, encoder


def reads_blocks_alone(encoder: nn.Module) -> bool:
    """Whether each merge of ``encoder`` depends on its own block's tokens only (no earlier
    blocks, LM states or token mixer): then pieces laid end to end, each starting on a block,
    merge exactly as each alone."""
    if isinstance(encoder, RecursiveEncoder):
        return (encoder.states is None and encoder.mixer is None
                and reads_blocks_alone(encoder.inner) and reads_blocks_alone(encoder.outer))
    return (isinstance(encoder, KTokenEncoder) and encoder.context is None
            and encoder.states is None and encoder.mixer is None)


class RecursiveEncoder(nn.Module):
    """K = inner_k * outer_k: merge blocks of inner_k tokens, then blocks of outer_k merges.

    forward: (B, T, D) + mask -> (B, ceil(T/K), D) + mask, like ``KTokenEncoder``. Untrained, both
    levels are means, so the whole is the mean of means (the plain mean for full blocks).
    """

    def __init__(self, config: EncoderConfig):
        super().__init__()
        levels = config.levels()
        if levels is None:
            raise KTMError("RecursiveEncoder needs inner_k > 1")
        self.config = config
        self.inner = KTokenEncoder.from_config(levels[0])
        self.outer = KTokenEncoder.from_config(levels[1])
        d = config.hidden_size
        self.states = (StatesContext(d, config.k, d, config.context_pool)
                       if config.context_layers else None)
        self.mixer = (TokenMixer(d, config.context_transformer) if config.context_transformer
                      else None)

    @property
    def k(self) -> int:
        return self.config.k

    def wide_parameters(self) -> list[nn.Parameter]:
        return self.inner.wide_parameters() + self.outer.wide_parameters()

    def context_parameters(self) -> list[nn.Parameter]:
        own = [p for m in (self.states, self.mixer) if m is not None for p in m.parameters()]
        return self.inner.context_parameters() + self.outer.context_parameters() + own

    def bind_lm(self, source) -> None:
        if self.states is not None:
            self.states.bind(source)

    def order_parameters(self) -> list[nn.Parameter]:
        return self.inner.order_parameters() + self.outer.order_parameters()

    def forward(self, embeds: torch.Tensor, mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        mixed = embeds if self.mixer is None else self.mixer(embeds)
        merged, m = self.inner(mixed, mask)
        merged, m = self.outer(merged, m)
        if self.states is not None:
            if mask is None:
                mask = torch.ones(embeds.shape[:2], dtype=torch.bool, device=embeds.device)
            extra = self.states(embeds, mask).to(merged.dtype)
            merged = merged + extra * m.unsqueeze(-1).to(merged.dtype)
        return merged, m


# (MLP layer index, parameter) -> for each axis, whether it counts hidden units
_HIDDEN_AXES = {("0", "weight"): (True, False), ("0", "bias"): (True,),
                ("2", "weight"): (True, True), ("2", "bias"): (True,),
                ("4", "weight"): (False, True), ("4", "bias"): (False,)}


def grow_encoder(saved: dict[str, torch.Tensor], current: dict[str, torch.Tensor]
                 ) -> dict[str, torch.Tensor]:
    """A narrower encoder's weights inside a wider one (a larger ``mlp_ratio``), computing
    exactly the same function; the analogue for the MLP of ``ktm.core.checkpoint.grow_lora``.

    The MLP is ``Linear(KD, h) -> GELU -> Linear(h, h) -> GELU -> Linear(h, D)``. The saved units
    fill the first h of the new H hidden units of each layer. The new units of the first layer
    keep their fresh init; the weights from them into the saved units of the second layer are
    zero, so the saved units compute what they did; the new units of the second layer keep their
    fresh init, and the last layer's weights from them are zero, so they add nothing to the
    output until training moves those weights. The weights reading context (``context_blocks``,
    ``context_layers``, ``context_transformer``), absent from a block encoder, keep their fresh
    init, whose output is zero (the identity, for the token mixer). Slot weights, gates and
    anything outside an MLP are copied as saved; they must have the same shape.
    """
    out = {}
    for key, new in current.items():
        if key not in saved and (key.rsplit(".", 2)[-2:] == ["context", "weight"]
                                 or any(key.startswith(f"{m}.") or f".{m}." in key
                                        for m in ("states", "mixer"))):
            # a block encoder gaining context (context_blocks / _layers / _transformer): the new
            # weights' fresh init, whose output starts at zero
            out[key] = new
            continue
        if key not in saved:
            raise KTMError(f"encoder weight {key!r} is missing from the saved encoder: expected "
                           "the same encoder layout with a narrower MLP")
        value = saved[key].to(new.dtype)
        layer, param = key.rsplit(".", 2)[-2:] if ".mlp." in f".{key}" else (None, None)
        # the axes that count hidden units may grow; every other axis must match exactly
        grows = _HIDDEN_AXES.get((layer, param), (False,) * new.dim())
        if value.dim() != new.dim() or any(a > b if g else a != b
                                           for a, b, g in zip(value.shape, new.shape, grows)):
            raise KTMError(f"encoder weight {key!r} has shape {tuple(value.shape)}, which does "
                           f"not fit {tuple(new.shape)}: expected a wider MLP only")
        if value.shape == new.shape:
            out[key] = value
            continue
        grown = new.detach().clone()
        if (layer, param) == ("2", "weight"):
            grown[: value.shape[0], value.shape[1]:] = 0  # new units in, saved units out: none
        if (layer, param) == ("4", "weight"):
            grown[:, value.shape[1]:] = 0  # the new units reach the output only through training
        grown[tuple(slice(0, n) for n in value.shape)] = value
        out[key] = grown
    unknown = sorted(set(saved) - set(current))
    if unknown:
        raise KTMError(f"saved encoder weights {unknown[:3]} do not exist in this encoder: "
                       "expected the same encoder layout with a narrower MLP")
    return out
