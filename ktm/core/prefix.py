"""Prompt encoding: segments -> LM input embeddings, compressed segments merged by the encoder.

This is the one prompt-encoding step that training, evaluation, generation, the benchmark, the
server and the vLLM client share. It needs only a tokenizer, the input-embedding table and the
encoder, not the LM, so a client can compute merged prefixes without loading the model.

    [Segment(doc), Segment(question, compress=False)]
        -> ids per segment -> (ceil(len(doc)/K) + len(question), D) embeddings
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, replace

import torch
from torch import nn

from ktm.core.allocate import (
    QUOTE_BEYOND,
    RATIO_TOLERANCE,
    RatioWarning,
    Units,
    allocate,
    positions,
    ratio_refusal,
)
from ktm.core.batch import CompressedPrompt
from ktm.core.config import inner_chain
from ktm.core.encoder import cast_for_inference, deeper_level, level_encoder, reads_blocks_alone
from ktm.core.prompt import Segment
from ktm.core.question import question_segments
from ktm.core.signals import signal_of
from ktm.core.tokens import LineBreaks
from ktm.errors import KTMError

# merged embeddings of a compressed segment, keyed by its token ids (the server's prefix cache)
MergeCache = MutableMapping[tuple[int, ...], torch.Tensor]
# a layout piece's level for tokens left out (``ktm.core.allocate``'s question signal: read
# neither plain nor merged, they take no position)
LEFT_OUT = -1


def rows_of(ids: list[int], level: int, merge: bool = True) -> int:
    """Rows a layout piece takes: plain (level 0) a row a token, merged a row per block of
    ``level`` tokens, none when left out."""
    if level == LEFT_OUT:
        return 0
    return -(-len(ids) // level) if merge and level else len(ids)


def embedding_rows(embed: nn.Module) -> int:
    """Ids an embedding looks up: the LM's table plus any rows an extension adds (LTSC's meta
    tokens)."""
    extra = getattr(embed, "meta", None)
    return embed.weight.shape[0] + (0 if extra is None else extra.shape[0])


@dataclass
class PromptEncoder:
    """What encoding needs: tokenizer (as ``tokenize(text, first)``), input embeddings, encoder.

    ``plain_prefix``: the first tokens of a compressed first segment stay plain (position 0 is
    the LM's attention sink). ``plain_suffix``: the last tokens of the last compressed segment
    stay plain (the recent tokens, which a continuation or an answer reads most closely).
    ``line_breaks``: the tokens that end a line (``line_break_ids``); given, a
    compressed segment is cut after each of them and every line merged on its own, so no block
    spans two lines (a tree's node, a line of code, stays in blocks of its own).
    """

    tokenize: Callable[[str, bool], list[int]]
    embed: nn.Module
    encoder: nn.Module
    pad_id: int
    plain_prefix: int = 0
    spread_positions: bool = False  # merged blocks at their last token's position
    plain_suffix: int = 0
    line_breaks: LineBreaks | None = None
    # a segment read at a ratio: the signal that spends its positions (ktm.core.allocate), and
    # per-token scores for a signal that reads tokens, as scores(signal, ids, question) (None:
    # none), ``question`` the prompt's plain segments after its last compressed one
    allocator: str = "even"
    scores: Callable[[str, list[int], list[int]], list[float] | None] | None = None
    ratio: float | None = None  # the ratio of a compressed segment without its own (None: K)
    # a question allocator's plain lines (``KTMConfig.quote``): "far" read in place, those far
    # from the question quoted after the document; "all" the document read as without a
    # question and every line the question picks quoted after it
    quote: str = "far"

    def encode(self, prompts: list[tuple[Segment, ...]], merge: bool = True,
               cache: MergeCache | None = None) -> list[CompressedPrompt]:
        """Normalised prompts -> their LM input embeddings, the encoder run once for all.

        ``merge=False`` feeds every segment as plain tokens (the uncompressed baseline);
        ``cache`` reuses segments merged before and merges repeats once.
        """
        pieces = self.layout(prompts, merge)
        to_merge = [(ids, level) for row in pieces for ids, level, _ in row
                    if merge and level > 0 and ids]
        merged = iter(self.merge_segments(to_merge, cache))
        device = self.embed.weight.device
        results = []
        for row in pieces:
            parts = [next(merged) if merge and level > 0 else
                     self.embed(torch.tensor(ids, dtype=torch.long, device=device))
                     for ids, level, _ in row if ids and level != LEFT_OUT]
            embeds = torch.cat(parts, dim=0) if parts else None
            results.append(self._prompt(row, embeds, merge))
        return results

    def measure(self, prompts: list[tuple[Segment, ...]], merge: bool = True
                ) -> list[CompressedPrompt]:
        """What ``encode`` gives, from the token ids alone: every count and position as there,
        ``embeds`` an (L, 0) tensor on the meta device. Tokenizing only, no embedding or
        encoder: checking that many prompts fit the model's positions is cheap."""
        out = []
        for row in self.layout(prompts, merge):
            n_out = sum(rows_of(ids, level, merge) for ids, level, _ in row)
            out.append(self._prompt(row, torch.empty(n_out, 0, device="meta"), merge))
        return out

    def layout(self, prompts: list[tuple[Segment, ...]], merge: bool = True
               ) -> list[list[tuple[list[int], int, bool]]]:
        """Each prompt's pieces as (token ids, level, from a compressed segment?); level 0 for
        plain tokens, ``LEFT_OUT`` for tokens not read (the question allocator's), else the K
        they are merged at. Its segments are tokenized, cut by
        ``plain_prefix``, ``plain_suffix`` and ``line_breaks`` (class docstring), and a segment
        with a ratio or levels is cut into runs of units at their levels
        (``ktm.core.allocate``; with ``merge`` off nothing is merged, so nothing allocated)."""
        pieces: list[list[tuple[list[int], int, bool]]] = []
        for segs in prompts:
            # (ids, merged?, index of the segment it comes from)
            row = [(self.tokenize(s.text, i == 0) if s.ids is None else list(s.ids), s.compress,
                    i) for i, s in enumerate(segs)]
            if self.plain_prefix and row and row[0][1]:
                ids, n = row[0][0], self.plain_prefix
                row[:1] = [(ids[:n], False, 0), (ids[n:], True, 0)]
            if self.plain_suffix:
                last = max((i for i, (_, c, _) in enumerate(row) if c), default=None)
                if last is not None:
                    ids, seg = row[last][0], row[last][2]
                    cut = max(len(ids) - self.plain_suffix, 0)
                    row[last:last + 1] = [(ids[:cut], True, seg), (ids[cut:], False, seg)]
            if self.line_breaks is not None:
                row = [(line, c, seg) for ids, c, seg in row
                       for line in (self._lines(ids) if c else [ids])]
            pieces.append(self._levels(row, segs, allocate=merge))
        self._check_ids(prompts)
        return pieces

    def ratio_refusal(self, ratio: float) -> str | None:
        """Why a compressed segment cannot be read at ``ratio`` here (None: it can), before any
        text is read (``ktm.core.allocate.ratio_refusal``)."""
        deep = deeper_level(self.encoder)
        return ratio_refusal(ratio, self.merge_levels, self.allocator,
                             None if deep is None else deep[0])

    def densest(self, ratio: float | None = None) -> float:
        """The most tokens one position can read: the deepest level (merges merged again,
        ``deeper_level``), or past it ``ratio`` (else this encoder's) where the allocator
        leaves text out."""
        deep = deeper_level(self.encoder)
        most = max(self.merge_levels) if deep is None else deep[0]
        ratio = self.ratio if ratio is None else ratio
        if ratio is not None and signal_of(self.allocator).drops:
            most = max(most, ratio)
        return most

    @property
    def merge_levels(self) -> tuple[int, ...]:
        """The K the encoder merges at, largest first (a recursive one's inner levels too)."""
        return (self.encoder.k, *inner_chain(self.encoder.config.inner_k))

    def _levels(self, row: list[tuple[list[int], bool, int]], segs: tuple[Segment, ...],
                allocate: bool = True) -> list[tuple[list[int], int, bool]]:
        """Pieces with their levels: plain 0, merged at the encoder's K, or, for a segment
        with a ratio or levels, its merged pieces cut into runs of one level each (not when
        ``allocate`` is off: a prompt read unmerged needs no plan)."""
        runs: dict[int, list[list[tuple[int, int]]]] = {}
        asked = set(question_segments(segs))  # the prompt's question (``ktm.core.question``)
        question = [t for ids, c, i in row if i in asked and not c for t in ids]
        last = max((i for i, s in enumerate(segs) if s.compress), default=len(segs))
        deep = deeper_level(self.encoder)
        appended: list[list[int]] = []  # quote "all": the question's lines, in order
        for seg, s in enumerate(segs if allocate else ()):
            if s.compress and s.ratio is None and s.levels is None and self.ratio is not None:
                s = replace(s, ratio=self.ratio)
            if s.ratio is None and s.levels is None:
                continue
            merged = [ids for ids, c, i in row if i == seg and c and ids]
            if (deep is not None and s.ratio == deep[0]
                    and not signal_of(self.allocator).drops):  # whole, a level past the largest
                runs[seg] = [[(len(ids), deep[0])] for ids in merged]
                continue
            plain = sum(len(ids) for ids, c, i in row if i == seg and not c)
            if self.quote == "all" and question and signal_of(self.allocator).quotes:
                # the document as without a question; the question's lines copied after it
                picked = self._segment_runs(s, merged, plain, question)
                runs[seg] = self._segment_runs(s, merged, plain, [])
                appended += [ids[sum(n for n, _ in piece[:j]):][:n]
                             for ids, piece in zip(merged, picked)
                             for j, (n, level) in enumerate(piece) if level == 1]
            else:
                runs[seg] = self._segment_runs(s, merged, plain, question)
        out, where, chosen = [], [], []  # pieces, their segments, the plain ones allocated
        for ids, c, seg in row:
            if not c:
                out.append((ids, 0, segs[seg].compress))
                where.append(seg)
            elif seg not in runs:
                out.append((ids, self.encoder.k, True))
                where.append(seg)
            elif ids:
                start = 0
                for n, level in runs[seg].pop(0):
                    if level == 1 and segs[seg].levels is None:
                        chosen.append(len(out))
                    out.append((ids[start:start + n],
                                {1: 0, 0: LEFT_OUT}.get(level, level), True))
                    where.append(seg)
                    start += n
        if chosen and signal_of(self.allocator).quotes:
            out = self._quoted(out, where, chosen, last)
        if appended:  # after the last compressed segment, before the question
            end = max(j for j, seg in enumerate(where) if seg == last) + 1
            out[end:end] = [(ids, 0, True) for ids in appended]
        return out

    @staticmethod
    def _quoted(out: list[tuple[list[int], int, bool]], where: list[int], chosen: list[int],
                last: int) -> list[tuple[list[int], int, bool]]:
        """``out`` with each allocated plain piece that ends more than ``QUOTE_BEYOND`` rows
        before the prompt does moved after the last compressed segment (segment ``last``),
        in its order: a question reads it there, next to it (``ktm.core.allocate``)."""
        after = [0] * (len(out) + 1)  # rows after each piece
        for j in range(len(out) - 1, -1, -1):
            after[j] = after[j + 1] + rows_of(out[j][0], out[j][1])
        far = {j for j in chosen if after[j + 1] > QUOTE_BEYOND}
        if not far:
            return out
        end = max(j for j, seg in enumerate(where) if seg == last)
        kept = [p for j, p in enumerate(out[:end + 1]) if j not in far]
        return kept + [out[j] for j in sorted(far)] + out[end + 1:]

    def _segment_runs(self, seg: Segment, merged: list[list[int]], plain: int,
                      question: list[int]) -> list[list[tuple[int, int]]]:
        """Per merged piece of a segment, its (tokens, level) runs (level 1: plain, 0: left
        out); ``question``: the prompt's question (``_levels``), for the question signal."""
        levels, unit = self.merge_levels, self.encoder.k
        deep = deeper_level(self.encoder)
        if (seg.levels is None and deep is not None and seg.ratio > unit
                and signal_of(self.allocator).drops):
            # past the largest level, units of the deeper level: what the signal needs least
            # is read there, merges merged again, before any unit is left out
            levels, unit = (deep[0], *levels), deep[0]
        if seg.levels is not None:
            units = Units.of(merged, unit)
            if len(seg.levels) != len(units.cuts):
                raise KTMError(f"Segment levels give {len(seg.levels)} levels, but the segment "
                               f"has {len(units.cuts)} units of up to {unit} tokens: expected "
                               "one level per unit")
            bad = next((v for v in seg.levels if v != 1 and v not in levels), None)
            if bad is not None:
                raise KTMError(f"Segment level {bad} is not one this model reads: expected 1 "
                               f"(plain) or one of its merge levels {sorted(levels)}")
            runs: list[list[tuple[int, int]]] = [[] for _ in merged]
            for (p, _, n), level in zip(units.cuts, seg.levels):
                runs[p].append((n, level))
            return runs
        ids = [i for piece in merged for i in piece]
        scores = (self.scores(self.allocator, ids, question) if self.scores is not None
                  else None)
        seed = zlib.crc32(bytes(str(ids), "ascii"))  # the random signal: fixed per text
        runs = allocate(merged, plain, seg.ratio, levels, self.allocator, scores, seed)
        total = len(ids) + plain
        got = total / max(1, plain + sum(positions(n, lv) for piece in runs for n, lv in piece
                                         if lv))
        if abs(got / seg.ratio - 1) > RATIO_TOLERANCE:
            warnings.warn(f"a segment of {total} tokens was read at ratio {got:.2f}, not "
                          f"{seg.ratio:g}: its units of up to {unit} tokens allow no closer "
                          "split", RatioWarning, stacklevel=2)
        return runs

    def _prompt(self, row: list[tuple[list[int], int, bool]], embeds: torch.Tensor | None,
                merge: bool) -> CompressedPrompt:
        """One prompt's ``CompressedPrompt`` from its pieces and its (L, D) prefix embeddings."""
        n_in = sum(len(ids) for ids, _, _ in row)
        if n_in == 0 or embeds is None:
            raise KTMError("prompt tokenizes to no tokens: expected a non-empty prompt")
        mergeable = tuple(len(ids) for ids, level, _ in row if level > 0 and ids)
        rows = [rows_of(ids, level, merge) for ids, level, _ in row]
        # the compressed segments' tokens and positions: the ratio they were read at
        squeezed = (sum(len(ids) for ids, _, c in row if c),
                    sum(n for n, (_, _, c) in zip(rows, row) if c))
        sources = self._positions(row, merge)
        pos = sources if merge and self.spread_positions else None
        pressable = max((sum(rows[:i + 1]) for i, (_, _, c) in enumerate(row) if c), default=0)
        flags = [bool(merge and level > 0) for n, (_, level, _) in zip(rows, row)
                 for _ in range(n)]
        merged_rows = (torch.tensor(flags, dtype=torch.bool, device=embeds.device)
                       if any(flags) else None)
        return CompressedPrompt(embeds, n_in, embeds.shape[0], mergeable, pos, sources,
                                merged=merge, squeezed=squeezed, pressable=pressable,
                                ids=tuple(i for ids, _, _ in row for i in ids),
                                merged_rows=merged_rows)

    def _check_ids(self, prompts: list[tuple[Segment, ...]]) -> None:
        """Ids given directly must be rows of the embedding table (the LM's, plus any extra rows
        an extension such as LTSC's meta tokens adds)."""
        rows = embedding_rows(self.embed)
        for segs in prompts:
            for s in segs:
                bad = next((i for i in s.ids or () if i >= rows), None)
                if bad is not None:
                    raise KTMError(f"Segment token id {bad} is outside the embedding table: "
                                   f"expected ids below {rows}")

    def _lines(self, ids: list[int]) -> list[list[int]]:
        """``ids`` cut after every line-break token: consecutive pieces, none spanning a break."""
        out, start = [], 0
        for i in range(len(ids)):
            if self.line_breaks.ends_line(ids, i):
                out.append(ids[start:i + 1])
                start = i + 1
        if start < len(ids) or not out:
            out.append(ids[start:])
        return out

    def _positions(self, row: list[tuple[list[int], int, bool]], merge: bool = True
                   ) -> torch.Tensor:
        """Each plain token at its own position, each merged block at its last token's."""
        start, out = 0, []
        for ids, level, _ in row:
            n = len(ids)
            if level > 0 and merge:
                out += [start + min(j + level, n) - 1 for j in range(0, n, level)]
            elif level != LEFT_OUT:
                out += range(start, start + n)
            start += n
        return torch.tensor(out, dtype=torch.long, device=self.embed.weight.device)

    def merge_segments(self, segments: list[tuple[list[int], int]],
                       cache: MergeCache | None = None) -> list[torch.Tensor]:
        """Run the encoder once per level over the (token ids, level) pieces: right-padded
        (S, T, D) -> (ceil(T_s/level), D) each; with ``cache`` only over those not merged
        before. A cache key is the ids, led by -level for a level other than the encoder's K
        (ids are >= 0, so no key of one level is another's)."""
        if not segments:
            return []
        k = self.encoder.k
        keys = [tuple(ids) if level == k else (-level, *ids) for ids, level in segments]
        level_of = {key: level for key, (_, level) in zip(keys, segments)}
        todo = keys if cache is None else list(dict.fromkeys(x for x in keys if x not in cache))
        found: dict[tuple[int, ...], torch.Tensor] = {}
        for level in dict.fromkeys(level_of[x] for x in todo):
            group = [x for x in todo if level_of[x] == level]
            ids = [x if level == k else x[1:] for x in group]
            for key, m in zip(group, self._merge(ids, level)):
                found[key] = m if cache is None else m.detach()
                if cache is not None:
                    cache[key] = found[key]
        return [found[x] if x in found else cache[x] for x in keys]

    def _merge(self, segments: list[tuple[int, ...]], level: int) -> list[torch.Tensor]:
        deep = deeper_level(self.encoder)
        # the level past the largest: the encoder's merges merged again (``deeper_level``)
        again = deep[1] if deep is not None and level == deep[0] else None
        encoder = self.encoder if again is not None else level_encoder(self.encoder, level)
        if len(segments) > 1 and reads_blocks_alone(encoder) and (
                again is None or reads_blocks_alone(again)):
            # one row, each piece padded to whole blocks: a long document's runs between its
            # plain lines, right-padded to the longest in a batch, would be mostly padding
            sizes = [-(-len(s) // level) for s in segments]
            ids = [t for s, n in zip(segments, sizes)
                   for t in (*s, *[self.pad_id] * (n * level - len(s)))]
            mask = [m for s, n in zip(segments, sizes)
                    for m in [1] * len(s) + [0] * (n * level - len(s))]
            merged = self._encode_rows(encoder, again, [ids], [mask])[0]
            return list(torch.split(merged, sizes))
        longest = max(len(s) for s in segments)
        rows = [list(s) + [self.pad_id] * (longest - len(s)) for s in segments]
        masks = [[1] * len(s) + [0] * (longest - len(s)) for s in segments]
        merged = self._encode_rows(encoder, again, rows, masks)
        return [merged[i, : -(-len(s) // level)] for i, s in enumerate(segments)]

    def _encode_rows(self, encoder: nn.Module, again: nn.Module | None, rows: list[list[int]],
                     masks: list[list[int]]) -> torch.Tensor:
        """(B, T) ids and masks -> (B, units, D): ``encoder``'s merges, merged ``again``."""
        device = self.embed.weight.device
        ids = torch.tensor(rows, device=device)
        mask = torch.tensor(masks, device=device, dtype=torch.bool)
        merged, mask = _run(encoder, self.embed(ids), mask)
        if again is not None:
            merged, _ = _run(again, merged, mask)
        return merged


def _run(encoder: nn.Module, embeds: torch.Tensor, mask: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``encoder`` over (B, T, D) ``embeds`` in their dtype -> (B, ceil(T/k), D) and its mask."""
    if embeds.dtype == torch.float32:
        merged, out_mask = encoder(embeds, mask)
    elif (cast := cast_for_inference(encoder, embeds.dtype)) is not None:
        merged, out_mask = cast(embeds, mask)  # an encoder that does not train, in the LM's dtype
    else:
        # fp32 weights (a bf16 Adam step of 5e-5 rounds to nothing), matmuls in the LM dtype
        with torch.autocast(embeds.device.type, dtype=embeds.dtype):
            merged, out_mask = encoder(embeds, mask)
    return merged.to(embeds.dtype), out_mask
