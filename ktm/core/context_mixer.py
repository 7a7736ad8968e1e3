"""Contextual merging with a small transformer of its own (``context_transformer`` N > 0).

N causal transformer layers read a compressed segment's token embeddings before the block merge,
so each token's vector can carry what the tokens before it in the segment say. Each is a pre-norm
layer as wide as the embeddings (D): LayerNorm, causal multi-head attention (heads of about 64
dimensions, torch's scaled-dot-product attention), LayerNorm, a GELU feed-forward of width D.
Each adds its attention and feed-forward outputs to its input; both output projections start at
zero, so untrained layers return their input exactly: the encoder is then the block encoder, and
a block reader continued with them starts where the reader is.

Scale: the layers work on each token's embedding divided by its RMS and return their change at
that token's own scale (``x + rms(x) * change``). Input embeddings are small (SmolLM2-135M's have
an RMS of about 0.12 per coordinate) while a fresh layer's branches are at unit scale, so
without this the first steps at an ordinary learning rate swamped the embeddings (the loss
rose 0.1-0.4 above the block encoder's, results/LOG.md).

Written out rather than ``nn.TransformerEncoderLayer``: torch's layer switches to fused kernels
when its weights do not require grad, so a loaded (frozen) reader computed what the trainable
model did only to ~2e-7, and save -> load must give identical vectors.

Positions: none are added (causal attention tells order apart by itself), so a segment's vectors
do not depend on where the segment starts in the prompt.

Causal: every layer's attention is causal within the segment, so a token's vector depends only
on the segment's tokens up to it; appending tokens never changes an earlier complete block's
merged vector, and merged prefixes stay cacheable by their ids. Padding must be on the right:
real tokens never attend to it, and the merge zeroes what the pads become.
Cost: 6 D x D matrices per layer (query, key, value, output, feed-forward up and down), about
0.6 of a SmolLM2-135M decoder layer, over the compressed tokens.
"""

from __future__ import annotations

import torch
from torch import nn


def heads_for(width: int, head_dim: int = 64) -> int:
    """The number of attention heads: the divisor of ``width`` whose head size is nearest 64."""
    divisors = [h for h in range(1, width + 1) if width % h == 0]
    return min(divisors, key=lambda h: (abs(width // h - head_dim), h))


class MixerLayer(nn.Module):
    """One pre-norm causal transformer layer whose output projections start at zero."""

    def __init__(self, width: int):
        super().__init__()
        f32 = {"dtype": torch.float32}
        self.heads = heads_for(width)
        self.norm1 = nn.LayerNorm(width, **f32)
        self.qkv = nn.Linear(width, 3 * width, **f32)
        self.out = nn.Linear(width, width, **f32)
        self.norm2 = nn.LayerNorm(width, **f32)
        self.up = nn.Linear(width, width, **f32)
        self.down = nn.Linear(width, width, **f32)
        for zero in (self.out, self.down):
            nn.init.zeros_(zero.weight)
            nn.init.zeros_(zero.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(
            2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class TokenMixer(nn.Module):
    """(B, T, D) token embeddings -> (B, T, D), through ``layers`` causal transformer layers
    that start as the identity."""

    def __init__(self, hidden_size: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(MixerLayer(hidden_size) for _ in range(layers))

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        x = embeds.to(self.layers[0].qkv.weight.dtype)
        rms = x.pow(2).mean(-1, keepdim=True).add(1e-12).sqrt()
        unit = h = x / rms
        for layer in self.layers:
            h = layer(h)
        # untrained, h - unit is exactly zero and so the result is exactly the input
        return (x + rms * (h - unit)).to(embeds.dtype)
