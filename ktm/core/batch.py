"""What flows between prompt encoding, the LM and the losses: prefixes, packed batches, outputs.

Layout of every sequence the LM sees (rows left-padded to a common length):

    [pad ...][prefix: merged blocks and plain-token embeddings][targets or generated tokens]

Position ids count only real positions, so a row's result does not depend on its batch-mates.
By default they are consecutive (a merged block is one position); with ``spread_positions`` a
merged block takes the position of the last token it stands for, so relative distances in the
LM's rotary or learned positions are those of the plain prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ktm.errors import KTMError


@dataclass
class CompressedPrompt:
    """A prompt's prefix embeddings (L, D) with exact token counts before and after merging.

    ``mergeable``: token counts of the segments the encoder merges (or would, with merging on),
    so the K at which a too-long prompt would fit can be worked out.
    """

    embeds: torch.Tensor
    tokens_in: int
    tokens_out: int
    mergeable: tuple[int, ...] = ()
    positions: torch.Tensor | None = None  # (L,) spread position ids; None: 0 .. L-1
    # (L,) index in the plain prompt of the last token each position stands for (a plain token:
    # its own; a merged block: its last token's); the plain reading's state to compare with
    sources: torch.Tensor | None = None
    merged: bool = True  # False: read with merging off (every segment plain)
    # (tokens, positions) of the compressed segments alone: the ratio they were read at
    squeezed: tuple[int, int] = (0, 0)
    # leading rows up to the end of the last compressed segment (merged or, with merging off,
    # read plain): what a KV press compresses (``ktm.decode.press``); the rows after it (a
    # question, a cue) are never pressed
    pressable: int = 0
    # the plain prompt's token ids (what a query-agnostic press re-reads: ``ktm.decode.press``)
    ids: tuple[int, ...] = ()
    # (L,) bool: the rows the encoder wrote (merged blocks), the rest plain token embeddings;
    # where a LoRA of scope "merged" adapts (``ktm.core.lora_scope``). None: no row merged
    merged_rows: torch.Tensor | None = None

    @property
    def length_reduction(self) -> float:
        return 1.0 - self.tokens_out / self.tokens_in

    @property
    def ratio_read(self) -> float | None:
        """Tokens per position of the compressed segments (None: the prompt has none)."""
        return ratio_of(self.squeezed)

    @property
    def next_position(self) -> int:
        """The position id of whatever follows the prefix (a target or generated token)."""
        return self.tokens_out if self.positions is None else int(self.positions[-1]) + 1

    def row_positions(self, extra: int) -> torch.Tensor | None:
        """Position ids of the prefix followed by ``extra`` more tokens; None when compact."""
        if self.positions is None:
            return None
        after = torch.arange(extra, device=self.positions.device) + self.next_position
        return torch.cat([self.positions, after])

    def positions_at(self, k: int) -> int:
        """Prefix positions if the mergeable segments were merged at ``k``."""
        plain = self.tokens_in - sum(self.mergeable)
        return plain + sum(-(-n // k) for n in self.mergeable)


@dataclass
class LossOutput:
    loss: torch.Tensor  # mean NLL over all target tokens of the batch
    nll: torch.Tensor  # (B,) summed NLL per sample
    n_tokens: torch.Tensor  # (B,) target tokens per sample
    tokens_in: int = 0  # prompt tokens before merging, summed over the batch
    tokens_out: int = 0  # prompt positions the LM actually read
    parts: dict[str, tuple[float, int]] = field(default_factory=dict)  # objective: (sum, tokens)


@dataclass
class TargetLogits:
    """Logits at the target positions of a batch, flattened over samples."""

    logits: torch.Tensor  # (N, V) fp32, N = total target tokens
    labels: torch.Tensor  # (N,) target token ids
    rows: torch.Tensor  # (N,) sample index of each target token
    lengths: list[int]  # target tokens per sample
    tokens_in: int
    tokens_out: int
    hidden: tuple[torch.Tensor, ...] | None = None  # per layer (N, D), when asked for
    # per layer (M, D) at every prefix position, rows in order (M = all tokens_out), when asked
    prompt_hidden: tuple[torch.Tensor, ...] | None = None


@dataclass
class Packed:
    """Left-padded batch: embeds (B, L, D), mask (B, L), position_ids (B, L); gate (B, L) bool
    the merged rows (``CompressedPrompt.merged_rows``; None: none)."""

    embeds: torch.Tensor
    mask: torch.Tensor
    position_ids: torch.Tensor
    lengths: list[int] = field(default_factory=list)
    gate: torch.Tensor | None = None


def pack(seqs: list[torch.Tensor], positions: list[torch.Tensor | None] | None = None,
         merged: list[torch.Tensor | None] | None = None) -> Packed:
    """Left-pad a list of (L_i, D) sequences into one batch; ``positions[i]`` (L_i,) gives row
    i's position ids (None: consecutive from 0); ``merged[i]`` (M_i,) bool its first M_i rows'
    merged flags (``CompressedPrompt.merged_rows``; the rows after them, and a None, plain)."""
    lengths = [s.shape[0] for s in seqs]
    longest = max(lengths)
    b, d = len(seqs), seqs[0].shape[-1]
    embeds = seqs[0].new_zeros(b, longest, d)
    mask = torch.zeros(b, longest, dtype=torch.long, device=seqs[0].device)
    for i, s in enumerate(seqs):
        embeds[i, longest - s.shape[0]:] = s
        mask[i, longest - s.shape[0]:] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    for i, pos in enumerate(positions or []):
        if pos is not None:
            position_ids[i, longest - lengths[i]:] = pos
    gate = None
    if merged and any(m is not None for m in merged):
        gate = torch.zeros(b, longest, dtype=torch.bool, device=mask.device)
        for i, m in enumerate(merged):
            if m is not None:
                start = longest - lengths[i]
                gate[i, start:start + m.shape[0]] = m
    return Packed(embeds, mask, position_ids, lengths, gate)


def check_positions(prefixes: list[CompressedPrompt], extra: list[int], limit: int | None,
                    k: int, what: str, unread: int = 0) -> None:
    """Refuse a sequence longer than the model's positions, saying which K would make it fit.

    ``extra[i]``: tokens after prefix i (its target tokens, or the tokens to generate), of which
    the last ``unread`` are never read by the LM and take no position (the last generated token
    is returned, not fed back: a prompt exactly at the limit still yields one new token).
    """
    if not limit:
        return
    for cp, more in zip(prefixes, extra):
        read = max(more - unread, 0)
        if cp.next_position + read <= limit:
            continue
        if read >= limit:  # the prompt takes at least one position: no K or layout helps
            raise KTMError(f"{more} {what} alone reach the model's limit of {limit} positions, "
                           f"leaving none for the prompt ({cp.tokens_in} tokens): expected fewer "
                           f"than {limit + min(unread, more)} {what}")
        if cp.positions is not None:
            raise KTMError(f"prompt spans {cp.next_position} positions ({cp.tokens_in} tokens; "
                           f"spread positions keep the original token positions) + {more} "
                           f"{what}, over the model's limit of {limit} positions; no K fits "
                           "with spread_positions on")
        fits = next((kk for kk in range(1, max(cp.mergeable, default=1) + 1)
                     if cp.positions_at(kk) + read <= limit), None)
        least = cp.positions_at(max(cp.mergeable, default=1))  # each merged segment one block
        if fits:
            hint = f"K={fits} would fit" if cp.merged else f"merging at K={fits} would fit"
        elif least >= limit:
            hint = "no K fits: shorten the plain segments"
        else:
            hint = (f"no K fits: the prompt takes at least {least} positions, leaving "
                    f"{limit - least} for the {more} {what}; shorten the plain segments or the "
                    f"{what}")
        how = (f"after merging (K={k}, {cp.tokens_in} tokens before)" if cp.merged
               else "with merging off")
        raise KTMError(f"prompt is {cp.tokens_out} positions {how} + {more} {what}, over the "
                       f"model's limit of {limit} positions; {hint}")


def squeezed_sum(prefixes, total: tuple[int, int] = (0, 0)) -> tuple[int, int]:
    """``total`` plus the compressed segments' (tokens, positions) of ``prefixes``
    (``CompressedPrompt.squeezed``): what a result row's ``ratio_read`` pools."""
    return (total[0] + sum(cp.squeezed[0] for cp in prefixes),
            total[1] + sum(cp.squeezed[1] for cp in prefixes))


def ratio_of(squeezed: tuple[int, int]) -> float | None:
    """Tokens per position of (tokens, positions) (None: no compressed segment)."""
    return squeezed[0] / squeezed[1] if squeezed[1] else None
