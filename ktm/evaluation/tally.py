"""What every evaluation loop counts of the prompts it reads: tokens before and after merging,
the KV positions kept, the ratio read and the seconds spent encoding, and the row fields they
make (the same keys and meaning in every kind's result row)."""

from __future__ import annotations

from dataclasses import dataclass

from ktm.core.batch import ratio_of, squeezed_sum
from ktm.core.fit import encode_fitted
from ktm.decode.press import kv_kept
from ktm.evaluation.metrics import length_reduction
from ktm.util.timing import timed


@dataclass
class Tally:
    tokens_in: int = 0
    tokens_out: int = 0
    kept: int = 0  # positions whose KV the reading keeps (less what a KV press drops)
    squeezed: tuple[int, int] = (0, 0)  # the compressed segments' (tokens, positions)
    compress_s: float = 0.0

    def encode(self, model, prompts, merge: bool = True, room: int | None = None) -> list:
        """``model.encode_prompts(prompts, merge)``, timed (the encoder's kernels, not only
        their launch, on CUDA) and counted. ``room``: positions to leave after each prompt (the
        new tokens it reads): a prompt past the window is read at the ratio that fits it
        (``ktm.core.fit``)."""
        if room is None:
            prefixes, seconds = timed(model.device, model.encode_prompts, prompts, merge)
        else:
            (_, prefixes), seconds = timed(model.device, encode_fitted, model, prompts, merge,
                                           [room] * len(prompts))
        self.compress_s += seconds
        self.tokens_in += sum(cp.tokens_in for cp in prefixes)
        self.tokens_out += sum(cp.tokens_out for cp in prefixes)
        self.kept += kv_kept(model, prefixes)
        self.squeezed = squeezed_sum(prefixes, self.squeezed)
        return prefixes

    def fields(self, n: int) -> dict:
        """The row's fields of ``n`` examples: per-example tokens and KV, totals of time."""
        return {
            "tokens_before": self.tokens_in / n,
            "tokens_after": self.tokens_out / n,
            "length_reduction": length_reduction(self.tokens_in, self.tokens_out),
            # positions whose KV the reading keeps: tokens_after less what a KV press drops
            "kv_after": self.kept / n,
            # the compressed segments' tokens per position (a ratio's target, or about K)
            "ratio_read": ratio_of(self.squeezed),
            "compression_s": self.compress_s,
            "compression_ms_per_1k_tokens": 1e6 * self.compress_s / self.tokens_in,
        }
