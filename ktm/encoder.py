"""The K-token merging encoder: every block of K token embeddings becomes one embedding.

    C_i = masked_mean(e_1..e_K) + MLP(concat(e_1..e_K))

The MLP's last layer starts at zero, so an untrained encoder is exactly mean pooling and training
starts from a sensible compressed representation rather than noise.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from ktm.errors import KTMError


@dataclass(frozen=True)
class EncoderConfig:
    hidden_size: int
    k: int = 4
    mlp_ratio: float = 2.0  # MLP width = mlp_ratio * k * hidden_size (the paper uses ~1.5-2)
    use_mlp: bool = True  # False gives the mean-pooling ablation

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or self.k < 1:
            raise KTMError(f"k must be an integer >= 1, got {self.k!r}")
        if self.hidden_size < 1:
            raise KTMError(f"hidden_size must be >= 1, got {self.hidden_size!r}")
        if self.mlp_ratio <= 0:
            raise KTMError(f"mlp_ratio must be > 0, got {self.mlp_ratio!r}")

    @property
    def mlp_hidden(self) -> int:
        return max(1, round(self.mlp_ratio * self.k * self.hidden_size))

    def to_dict(self) -> dict:
        return asdict(self)


class KTokenEncoder(nn.Module):
    """Merges contiguous blocks of K embeddings.

    forward: (B, T, D) embeddings + (B, T) mask -> (B, ceil(T/K), D) merged + (B, ceil(T/K)) mask.
    Padding must be on the right of each row: block i of a row covers tokens [iK, iK + K).
    """

    def __init__(self, hidden_size: int, k: int = 4, mlp_ratio: float = 2.0, use_mlp: bool = True):
        super().__init__()
        self.config = EncoderConfig(hidden_size, k, mlp_ratio, use_mlp)
        d, h = hidden_size, self.config.mlp_hidden
        self.mlp: nn.Sequential | None = None
        if use_mlp:
            self.mlp = nn.Sequential(
                nn.Linear(k * d, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, d)
            )
            nn.init.zeros_(self.mlp[-1].weight)
            nn.init.zeros_(self.mlp[-1].bias)

    @classmethod
    def from_config(cls, config: EncoderConfig) -> KTokenEncoder:
        return cls(config.hidden_size, config.k, config.mlp_ratio, config.use_mlp)

    @property
    def k(self) -> int:
        return self.config.k

    def forward(
        self, embeds: torch.Tensor, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if embeds.dim() != 3 or embeds.shape[-1] != self.config.hidden_size:
            raise KTMError(
                f"embeds must have shape (B, T, {self.config.hidden_size}), "
                f"got {tuple(embeds.shape)}"
            )
        b, t, d = embeds.shape
        k = self.config.k
        if mask is None:
            mask = torch.ones(b, t, dtype=torch.bool, device=embeds.device)
        n = -(-t // k)
        pad = n * k - t
        m = mask.to(embeds.dtype)
        if pad:
            embeds = nn.functional.pad(embeds, (0, 0, 0, pad))
            m = nn.functional.pad(m, (0, pad))
        m = m.view(b, n, k, 1)
        blocks = embeds.view(b, n, k, d) * m  # pads zeroed so they never leak into the MLP
        count = m.sum(dim=2)  # (B, N, 1)
        merged = blocks.sum(dim=2) / count.clamp(min=1.0)
        if self.mlp is not None:
            merged = merged + self.mlp(blocks.reshape(b, n, k * d))
        out_mask = count.squeeze(-1) > 0
        # a block of padding only carries no information; keep its output at exactly zero
        merged = merged * out_mask.unsqueeze(-1).to(merged.dtype)
        return merged, out_mask
