"""Contextual merging from the LM's own first layers (``context_layers`` L > 0).

The base LM's first L decoder layers read a compressed segment as plain tokens (adapter off, no
gradient: the base's own weights, referenced, never copied or saved). Each token's state is
RMS-normalised (the states are 20-300 times the embeddings' scale, with a massive activation at
the first position, which a sink row placed before the segment takes and which is then dropped),
pooled per block of K tokens, and passed through an MLP whose last layer starts at zero. Its
output is added to the block encoder's merged vector, so an untrained one is exactly the block
encoder, and a block reader continued with it starts where the reader is.

Pooling (``context_pool``): ``mean`` averages a block's states; ``query`` is ARC-Encoder's pooled
queries (Pilchen et al. 2025): the block's mean state is one query of an attention over every
state of the segment up to the block's end, so a block's vector reads the context before it, not
only its own tokens. ARC pools the queries inside the LM's last encoder layer; here the attention
is one of the encoder's own (any family's layers work the same way, and the LM's weights stay
shared, never trained), added to the mean as a residual before the MLP.

Causal: the LM's layers are causal and the states are read within the segment, so a block's
vector depends only on its segment's tokens up to the block's end; appending tokens never
changes an earlier complete block's vector, and merged prefixes stay cacheable by their ids.
Cost: a plain prefill of L of the model's layers over the compressed tokens (under a no-grad
pass), on top of the merged prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from ktm.errors import KTMError


def decoder_layers(lm: nn.Module) -> nn.ModuleList:
    """The LM's stack of decoder layers: the module list as long as ``num_hidden_layers`` (any
    family's: ``model.layers``, ``transformer.h``, ``gpt_neox.layers`` ...)."""
    n = getattr(lm.config, "num_hidden_layers", None)
    found = [m for m in lm.modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    if n is None or not found:
        raise KTMError(f"cannot find the decoder layers of this {type(lm).__name__} (a module "
                       f"list of num_hidden_layers={n} layers): context_layers needs them")
    return found[0]


class StopForward(Exception):
    """Raised by a hook on layer L: the rest of the LM need not run."""


class LayerStates:
    """The base LM's hidden states after its first ``layers`` layers, without gradient; a
    callable the encoder holds (not a module: never saved or trained).

    ``lm``: the causal LM whose layers are read (a ``KTMModel``'s base under its PEFT wrapper,
    or the export's copy of the first layers, ``ktm.vllm.export``); ``adapter_off``: a
    context manager under which ``lm`` computes as the base model (PEFT's ``disable_adapter``;
    none for a plain LM)."""

    def __init__(self, lm: nn.Module, layers: int, sink_id: int,
                 adapter_off: Callable[[], AbstractContextManager] = nullcontext):
        self.lm, self.layers, self.sink_id, self.adapter_off = lm, layers, sink_id, adapter_off
        stack = decoder_layers(lm)
        if layers > len(stack):
            raise KTMError(f"context_layers={layers} is more than the base model's "
                           f"{len(stack)} layers: expected 1 to {len(stack)}")
        self.layer = stack[layers - 1]  # found once: the hook goes on it at every call

    def __call__(self, embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, T, D) input embeddings + (B, T) mask -> (B, T, D) states after layer L."""
        got: dict[str, torch.Tensor] = {}

        def stop(_module, _args, out):
            got["h"] = out[0] if isinstance(out, tuple) else out
            raise StopForward

        b = embeds.shape[0]
        table = self.lm.get_input_embeddings()
        sink = table(torch.full((b, 1), self.sink_id, dtype=torch.long, device=embeds.device))
        x = torch.cat([sink.to(embeds.dtype), embeds], dim=1)
        m = torch.cat([torch.ones(b, 1, dtype=torch.long, device=mask.device), mask.long()], 1)
        hook = self.layer.register_forward_hook(stop)
        try:
            with torch.no_grad(), self.adapter_off():
                self.lm(inputs_embeds=x, attention_mask=m, use_cache=False)
        except StopForward:
            pass
        finally:
            hook.remove()
        if "h" not in got:
            raise KTMError(f"the base model's forward never reached layer {self.layers}")
        return got["h"][:, 1:].detach()


class PooledQueries(nn.Module):
    """Attention whose queries are the blocks' mean states (ARC-Encoder's pooled queries): block
    i's query reads every real state up to the block's end, never after it.

    (B, N, D) block means + (B, T, D) states + (B, T) mask -> (B, N, D). Heads about 64 wide;
    no position encoding of its own: the LM's layers have put positions into the states."""

    def __init__(self, hidden_size: int, k: int):
        super().__init__()
        f32 = {"dtype": torch.float32}
        self.k = k
        self.heads = max(1, round(hidden_size / 64))
        while hidden_size % self.heads:
            self.heads -= 1
        self.q = nn.Linear(hidden_size, hidden_size, bias=False, **f32)
        self.kv = nn.Linear(hidden_size, 2 * hidden_size, bias=False, **f32)
        self.o = nn.Linear(hidden_size, hidden_size, bias=False, **f32)

    def forward(self, pooled: torch.Tensor, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, d = pooled.shape
        t, heads = h.shape[1], self.heads
        q = self.q(pooled).view(b, n, heads, d // heads).transpose(1, 2)
        key, value = self.kv(h).view(b, t, 2, heads, d // heads).permute(2, 0, 3, 1, 4)
        ends = (torch.arange(n, device=h.device) + 1) * self.k  # block i reads tokens < its end
        allowed = torch.arange(t, device=h.device)[None, :] < ends[:, None]  # (N, T)
        allowed = allowed[None] & mask.bool()[:, None, :]  # (B, N, T): real tokens only
        # a block of padding only reads nothing: let it read the first token (its output is
        # zeroed by the encoder anyway) rather than make the softmax 0/0
        allowed[..., 0] |= ~allowed.any(-1)
        out = nn.functional.scaled_dot_product_attention(q, key, value,
                                                         attn_mask=allowed[:, None])
        return self.o(out.transpose(1, 2).reshape(b, n, d))


class StatesContext(nn.Module):
    """RMS-normalised layer-L states pooled per block of K (``pool``: the mean, or the mean
    plus ARC's pooled-query attention), then an MLP from zero: (B, N, D) added to the merged
    vectors. ``source`` (a ``LayerStates``) is bound by the model; ``pool`` is checked with the
    rest of the encoder's config (``ktm.core.config.check_encoder_fields``)."""

    def __init__(self, hidden_size: int, k: int, width: int, pool: str = "mean"):
        super().__init__()
        f32 = {"dtype": torch.float32}
        self.k = k
        self.attend = PooledQueries(hidden_size, k) if pool == "query" else None
        self.mlp = nn.Sequential(nn.Linear(hidden_size, width, **f32), nn.GELU(),
                                 nn.Linear(width, hidden_size, **f32))
        nn.init.zeros_(self.mlp[-1].weight)
        nn.init.zeros_(self.mlp[-1].bias)
        object.__setattr__(self, "source", None)

    def bind(self, source: LayerStates | None) -> None:
        object.__setattr__(self, "source", source)

    def forward(self, embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.source is None:
            raise KTMError("this encoder reads the LM's first layers (context_layers), but no "
                           "LM is bound to it: use it inside a KTMModel")
        h = self.source(embeds, mask).to(self.mlp[0].weight.dtype)  # states in the LM dtype
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        b, t, d = h.shape
        k = self.k
        n = -(-t // k)
        m = nn.functional.pad(mask.to(h.dtype), (0, n * k - t)).view(b, n, k, 1)
        h = nn.functional.pad(h, (0, 0, 0, n * k - t)).view(b, n, k, d) * m
        pooled = h.sum(2) / m.sum(2).clamp(min=1.0)
        if self.attend is not None:
            # contiguous: on a strided input, matmul runs one mm if the weight requires grad and
            # a bmm if not (torch's should_fold), which on CUDA round differently, so a frozen
            # (loaded) encoder merged vectors a last bit off the trainable one it was saved from
            states = h.view(b, n * k, d)[:, :t].contiguous()
            pooled = pooled + self.attend(pooled, states, mask)
        return self.mlp(pooled)
