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

from ktm.core.allocate import RATIO_TOLERANCE, RatioWarning, Units, allocate
from ktm.core.batch import CompressedPrompt
from ktm.core.config import inner_chain
from ktm.core.encoder import cast_for_inference, deeper_level, level_encoder
from ktm.core.prompt import Segment
from ktm.errors import KTMError

# merged embeddings of a compressed segment, keyed by its token ids (the server's prefix cache)
MergeCache = MutableMapping[tuple[int, ...], torch.Tensor]


@dataclass(frozen=True)
class LineBreaks:
    """The tokens that end a line, read from a vocabulary (``line_break_ids``). ``ids``: every
    token whose text holds a line break, "\\n" or "\\r" (``"\\n"``, ``"\\r\\n"``, ``"\\n    "``,
    a classic Mac "\\r"). Of these, one that holds no "\\n" and ends in "\\r" (``cr_end``) ends
    no line when the next token starts with "\\n" (``lf_start``): a "\\r\\n" written as two
    tokens is one line break, after its "\\n"."""

    ids: frozenset[int]
    cr_end: frozenset[int] = frozenset()
    lf_start: frozenset[int] = frozenset()

    def ends_line(self, ids: list[int], i: int) -> bool:
        """Whether a line ends after ``ids[i]``."""
        return ids[i] in self.ids and not (
            ids[i] in self.cr_end and i + 1 < len(ids) and ids[i + 1] in self.lf_start)


def line_break_ids(tokenizer) -> LineBreaks:
    """The tokenizer's line-break tokens (``LineBreaks``), read from its own decoding, so any
    family's vocabulary works (about 0.5 s for 50k ids). A tokenizer without one (its line
    breaks normalized to spaces or unknown) is an error: a model asked to align lines would
    silently merge across them."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    ids = frozenset(i for i, text in enumerate(texts) if "\n" in text or "\r" in text)
    if not ids:  # its line breaks become spaces or unknown tokens: there are no lines to align
        raise KTMError(f"align_lines: no token of this tokenizer ({type(tokenizer).__name__}, "
                       f"{len(texts)} tokens) holds a line break, so it cannot find a prompt's "
                       "lines; expected a tokenizer that writes '\\n', or align_lines off")
    cr_end = frozenset(i for i in ids if texts[i].endswith("\r") and "\n" not in texts[i])
    return LineBreaks(ids, cr_end, frozenset(i for i in ids if texts[i].startswith("\n")))


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
    # per-token scores for a signal that reads tokens, as scores(signal, ids) (None: none)
    allocator: str = "even"
    scores: Callable[[str, list[int]], list[float] | None] | None = None
    ratio: float | None = None  # the ratio of a compressed segment without its own (None: K)

    def encode(self, prompts: list[tuple[Segment, ...]], merge: bool = True,
               cache: MergeCache | None = None) -> list[CompressedPrompt]:
        """Normalised prompts -> their LM input embeddings, the encoder run once for all.

        ``merge=False`` feeds every segment as plain tokens (the uncompressed baseline);
        ``cache`` reuses segments merged before and merges repeats once.
        """
        pieces = self.layout(prompts, merge)
        to_merge = [(ids, level) for row in pieces for ids, level, _ in row
                    if merge and level and ids]
        merged = iter(self.merge_segments(to_merge, cache))
        device = self.embed.weight.device
        results = []
        for row in pieces:
            parts = [next(merged) if merge and level else
                     self.embed(torch.tensor(ids, dtype=torch.long, device=device))
                     for ids, level, _ in row if ids]
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
            n_out = sum(-(-len(ids) // level) if merge and level else len(ids)
                        for ids, level, _ in row)
            out.append(self._prompt(row, torch.empty(n_out, 0, device="meta"), merge))
        return out

    def layout(self, prompts: list[tuple[Segment, ...]], merge: bool = True
               ) -> list[list[tuple[list[int], int, bool]]]:
        """Each prompt's pieces as (token ids, level, from a compressed segment?); level 0 for
        plain tokens, else the K they are merged at. Its segments are tokenized, cut by
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
        deep = deeper_level(self.encoder)
        for seg, s in enumerate(segs if allocate else ()):
            if s.compress and s.ratio is None and s.levels is None and self.ratio is not None:
                s = replace(s, ratio=self.ratio)
            if s.ratio is None and s.levels is None:
                continue
            merged = [ids for ids, c, i in row if i == seg and c and ids]
            if deep is not None and s.ratio == deep[0]:  # read whole a level past the largest
                runs[seg] = [[(len(ids), deep[0])] for ids in merged]
                continue
            plain = sum(len(ids) for ids, c, i in row if i == seg and not c)
            runs[seg] = self._segment_runs(s, merged, plain)
        out = []
        for ids, c, seg in row:
            if not c:
                out.append((ids, 0, segs[seg].compress))
            elif seg not in runs:
                out.append((ids, self.encoder.k, True))
            elif ids:
                start = 0
                for n, level in runs[seg].pop(0):
                    out.append((ids[start:start + n], 0 if level == 1 else level, True))
                    start += n
        return out

    def _segment_runs(self, seg: Segment, merged: list[list[int]], plain: int
                      ) -> list[list[tuple[int, int]]]:
        """Per merged piece of a segment, its (tokens, level) runs (level 1: plain)."""
        levels, unit = self.merge_levels, self.encoder.k
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
        scores = self.scores(self.allocator, ids) if self.scores is not None else None
        seed = zlib.crc32(bytes(str(ids), "ascii"))  # the random signal: fixed per text
        runs = allocate(merged, plain, seg.ratio, levels, self.allocator, scores, seed)
        total = len(ids) + plain
        got = total / max(1, plain + sum(-(-n // lv) for piece in runs for n, lv in piece))
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
        mergeable = tuple(len(ids) for ids, level, _ in row if level and ids)
        # the compressed segments' tokens and positions: the ratio they were read at
        squeezed = (sum(len(ids) for ids, _, c in row if c),
                    sum(-(-len(ids) // level) if merge and level else len(ids)
                        for ids, level, c in row if c))
        sources = self._positions(row, merge)
        pos = sources if merge and self.spread_positions else None
        rows = [-(-len(ids) // level) if merge and level else len(ids) for ids, level, _ in row]
        pressable = max((sum(rows[:i + 1]) for i, (_, _, c) in enumerate(row) if c), default=0)
        flags = [bool(merge and level) for ids, level, _ in row for _ in range(
            -(-len(ids) // level) if merge and level else len(ids))]
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
            if level and merge:
                out += [start + min(j + level, n) - 1 for j in range(0, n, level)]
            else:
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
        device = self.embed.weight.device
        deep = deeper_level(self.encoder)
        # the level past the largest: the encoder's merges merged again (``deeper_level``)
        again = deep[1] if deep is not None and level == deep[0] else None
        encoder = self.encoder if again is not None else level_encoder(self.encoder, level)
        longest = max(len(s) for s in segments)
        ids = torch.tensor([list(s) + [self.pad_id] * (longest - len(s)) for s in segments],
                           device=device)
        mask = torch.tensor([[1] * len(s) + [0] * (longest - len(s)) for s in segments],
                            device=device, dtype=torch.bool)
        merged, mask = _run(encoder, self.embed(ids), mask)
        if again is not None:
            merged, _ = _run(again, merged, mask)
        return [merged[i, : -(-len(s) // level)] for i, s in enumerate(segments)]


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
