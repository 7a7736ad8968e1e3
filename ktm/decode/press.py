"""KV-cache presses on the torch runtime: NVIDIA's ``kvpress`` behind ktm's prefill and scoring.

A press (``kvpress``, the ``[kvpress]`` extra) prefills a prompt, then keeps a fraction
(``1 - ratio``) of its KV cache, chosen by a training-free score. In ktm a press is a setting
of the torch runtime (``PressConfig``; ``KTMModel.use_press``, ``--press NAME --press-ratio R``):

    prompt rows:  [pressable: what a merge would merge, merged or plain][plain: question, cue]
    prefill:      read the pressable rows under the press -> their KV cut to keep (1 - ratio)
                  then the plain rows, at their true positions, unpressed
    then:         decode (or the targets scored) over that cache, at true positions

so a press stacks on merging: a merged prompt's merged positions are pressed like a plain
prompt's tokens. When no plain row follows the pressable ones, the last of them is read after
the press (it is what the first new token is predicted from, so it reads the pressed cache like
every later token). Presses are picked by name from ``PRESSES``; every kvpress press that needs
no extra model or download is there, the wrapping ones as ``wrapper:inner``
(``adakv:snapkv``).

What this wrapper papers over (kvpress 0.5.5, which declares ``transformers<5.3``; ktm pins
a newer transformers and installs kvpress beside it with ``--no-deps``, as vLLM's wheel):

* kvpress's hook tells the prefill by ``kwargs["cache_position"]``, which attention layers no
  longer get: a forward pre-hook on each attention layer puts it back, rebuilt from the cache's
  length (``_cache_position``). kvpress's own code then runs unchanged: no press is written
  here.
* kvpress presses a whole batch at once and knows no padding: ktm presses row by row, then
  batches the pressed rows (left-padded, as the server joins rows).
* kvpress presses everything its context manager's forward reads: ktm opens it around the
  pressable rows alone.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ktm.core.batch import TargetLogits
from ktm.decode.hidden import attention_layers, hidden_keys, hiding
from ktm.errors import KTMError

# ktm name -> kvpress class. Scorers keep a share of positions by a score of their own; each
# takes ``compression_ratio`` (the share dropped).
SCORERS = {
    "expected_attention": "ExpectedAttentionPress",
    "keydiff": "KeyDiffPress",
    "snapkv": "SnapKVPress",
    "streaming_llm": "StreamingLLMPress",
    "tova": "TOVAPress",
    "knorm": "KnormPress",
    "random": "RandomPress",
    "lagkv": "LagKVPress",
    "leverage": "LeverageScorePress",
    "cur": "CURPress",
    "compactor": "CompactorPress",
    "non_causal_attention": "NonCausalAttnPress",
}
# wrapping presses, named ``wrapper:inner`` with a scorer inside: each takes the inner press
# as ``press`` (AdaKV: head-wise budgets; CriticalKV: values weigh in; CriticalAdaKV: both;
# Block and Chunk: the scorer run per block or chunk of the context)
WRAPPERS = {
    "adakv": "AdaKVPress",
    "criticalkv": "CriticalKVPress",
    "criticaladakv": "CriticalAdaKVPress",
    "block": "BlockPress",
    "chunk": "ChunkPress",
}
# query-agnostic presses: each scores the KV by what the LM needs of it to re-read the
# context after it (KVzip's reconstruction), from the context's token ids, which ktm gives it
# (``Replay``); they hide keys per head (``ktm.decode.hidden``)
REPLAYS = {
    "kvzip": "KVzipPress",
}
# kvpress presses ktm does not offer, and why (``press_names`` lists the rest)
LEFT_OUT = {
    "DuoAttentionPress": "downloads attention patterns",
    "ExpectedAttentionStatsPress": "downloads query statistics",
    "QFilterPress": "downloads its filters",
    "KVzapPress": "needs a trained scoring model",
    "FastKVzipPress": "downloads its gates",
    "RestoreKVPress": "downloads its weights",
    "LUKVPress": "downloads its tables",
    "DMSPress": "needs a model trained for it",
    "ObservedAttentionPress": "needs eager attention weights returned by every layer",
    "PyramidKVPress": "keeps a different length per layer, which rows cannot share a mask with",
    "ThinKPress": "cuts key channels, not positions",
    "DecodingPress": "presses while decoding, not the prompt",
    "PrefillDecodingPress": "presses while decoding, not the prompt",
    "CompressionRatioDecodingPress": "presses while decoding, not the prompt",
    "CAMPress": "presses while decoding, not the prompt",
    "FinchPress": "needs a delimiter token between context and question in the prompt ids",
    "SimLayerKVPress": "keeps a different length per layer",
    "PerLayerCompressionPress": "keeps a different length per layer",
    "ComposedPress": "composes presses given as objects; ktm names one",
    "KVComposePress": "keeps a different length per head",
    "KVgradPress": "needs gradients through the LM at prefill",
    "MergingPress": "a wrapper whose merged keys ktm does not batch",
    "KeyRerotationPress": "moves the kept keys to new positions; ktm reads every later token at "
                          "its true position",
    "ChunkKVPress": "keeps a different length per layer with most scorers inside",
    "EntropyGatedChunkKVPress": "a ChunkKV variant: a different length per layer",
    "CapPress": "caps an absolute length, not a ratio",
}
INSTALL = 'pip install -e ".[kvpress]" && pip install --no-deps kvpress==0.5.5'


def press_names() -> list[str]:
    """Every press name ``PressConfig`` takes: the scorers, the query-agnostic ones, then each
    wrapper around each scorer."""
    return [*SCORERS, *REPLAYS, *(f"{w}:{s}" for w in WRAPPERS for s in SCORERS)]


@dataclass(frozen=True)
class PressConfig:
    """A KV press: ``name`` (``press_names``) and ``ratio``, the share of the pressable
    positions' KV it drops, in [0, 1). Raises ``KTMError`` on construction for an unknown
    name or a ratio outside [0, 1)."""

    name: str
    ratio: float = 0.5

    def __post_init__(self) -> None:
        wrapper, _, inner = self.name.rpartition(":")
        if self.name not in REPLAYS and (inner not in SCORERS
                                         or (wrapper and wrapper not in WRAPPERS)):
            raise KTMError(f"unknown press {self.name!r}: expected one of "
                           f"{', '.join([*SCORERS, *REPLAYS])}, or WRAPPER:PRESS with a "
                           f"wrapper of {', '.join(WRAPPERS)} around one of the first "
                           f"{len(SCORERS)}")
        if (isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float))
                or not 0 <= self.ratio < 1):  # NaN fails it too
            raise KTMError(f"press ratio must be a number in [0, 1) (the share of the KV "
                           f"dropped), got {self.ratio!r}")

    @classmethod
    def parse(cls, spec: str) -> PressConfig:
        """A press written NAME=RATIO (``snapkv=0.75``)."""
        name, sep, ratio = spec.rpartition("=")
        try:
            value = float(ratio)
        except ValueError:
            value = None
        if not sep or value is None:
            raise KTMError(f"press {spec!r}: expected NAME=RATIO, e.g. snapkv=0.75")
        return cls(name, value)

    def to_dict(self) -> dict:
        return {"name": self.name, "ratio": self.ratio}

    def fewest(self) -> int:
        """The fewest pressable positions the press presses (more than SnapKV's window or
        than the sinks StreamingLLM and ExpectedAttention keep, kvpress's own checks); a
        prompt with fewer is read unpressed."""
        return _fewest(self.name)

    def kept(self, n: int) -> int:
        """Positions of ``n`` pressable ones a press keeps (kvpress's own rounding)."""
        return int(n * (1 - self.ratio))

    @property
    def replays(self) -> bool:
        """Whether the press re-reads the context's tokens (``Replay``)."""
        return self.name in REPLAYS

    def make(self, replay: Replay | None = None):
        """The kvpress object (a query-agnostic press: reading ``replay``'s context)."""
        kvpress = import_kvpress()
        if self.replays:
            if replay is None:
                raise KTMError(f"press {self.name} re-reads the context's tokens: expected "
                               "them (ktm.decode.press.Replay)")
            return replay_press(kvpress, REPLAYS[self.name], float(self.ratio), replay)
        wrapper, _, inner = self.name.rpartition(":")
        press = getattr(kvpress, SCORERS[inner])(compression_ratio=float(self.ratio))
        if wrapper:
            press = getattr(kvpress, WRAPPERS[wrapper])(press=press)
        return press


@functools.cache
def _fewest(name: str) -> int:
    if name in REPLAYS:
        return 1
    press = PressConfig(name).make()
    inner = getattr(press, "press", press)  # a wrapper's own press
    return 1 + max(int(getattr(inner, "window_size", 0) or 0),
                   int(getattr(inner, "n_sink", 0) or 0))


class Replay(NamedTuple):
    """What a query-agnostic press re-reads after the pressed rows: per chunk of the context,
    its rows (start, end) and the token ids that re-read it (a cue, then the chunk's tokens),
    and ``read``, which reads (T,) ids after the cache at the next true positions."""
    chunks: list[tuple[int, int, list[int]]]
    read: Callable[[list[int]], None]


# KVzip's cues (the paper's wording, as kvpress words them) and its chunk of re-read tokens
REPLAY_CUE = "\n\nRepeat the previous context exactly."
REPLAY_CUE_NEXT = "\n\nRepeat the part of the previous context exactly, starting with"
REPLAY_CHUNK = 2048  # context tokens per re-read (kvpress's default)
REPLAY_OVERLAP = 8  # tokens of the chunk before that the next cue quotes


def replay_chunks(tokenizer, ids: list[int], sources: list[int]
                  ) -> list[tuple[int, int, list[int]]]:
    """The ``Replay`` chunks of a context of token ``ids`` read as rows, row r standing for
    the tokens up to ``sources[r]``: every ``REPLAY_CHUNK`` tokens re-read after a cue and
    the chat template's turn change (a newline without one), each scoring the rows whose
    last token it holds. With one row per token these are kvpress's KVzip chunks."""
    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False)) if text else []

    turn = "\n"
    if getattr(tokenizer, "chat_template", None):
        mark = "\u2063KTM-CONTEXT\u2063"
        text = tokenizer.apply_chat_template([{"role": "user", "content": mark}],
                                             add_generation_prompt=True, tokenize=False,
                                             enable_thinking=False)
        turn = text.split(mark, 1)[1]
    suffix = encode(turn)
    chunks, row = [], 0
    for c, start in enumerate(range(0, len(ids), REPLAY_CHUNK)):
        piece = ids[start:start + REPLAY_CHUNK]
        end = row
        while end < len(sources) and sources[end] < start + REPLAY_CHUNK:
            end += 1
        cue = (encode(REPLAY_CUE) if c == 0 else
               encode(REPLAY_CUE_NEXT) + ids[max(0, start - REPLAY_OVERLAP):start])
        if end > row:
            chunks.append((row, end, cue + suffix + piece))
        row = end
    return chunks


def replay_press(kvpress, cls_name: str, ratio: float, replay: Replay):
    """kvpress's query-agnostic press ``cls_name`` (KVzip) reading ktm's context: kvpress
    takes the context's ids from the forward it wraps and a tokenizer loaded by the model's
    path, and re-reads with ids at implicit positions; ktm prefills embeddings (merged rows
    among them) at its own positions, so ``replay`` gives the ids, rows and the read. The
    scoring (the re-read's attention over the pressed rows), the choice of what to hide and
    the hiding are kvpress's own methods."""
    base = getattr(kvpress, cls_name)

    class ReplayPress(base):
        @contextmanager
        def __call__(self, lm):
            self.post_init_from_model(lm)
            try:
                yield  # ktm's prefill of the pressed rows
                if self.compression_ratio > 0:
                    self._replay(lm)
            finally:
                self._reset_internal_parameters()

        def _replay(self, lm):
            cfg = lm.config
            rows = replay.chunks[-1][1]
            self.context_length = rows
            self.score_val = torch.zeros((cfg.num_hidden_layers, 1, cfg.num_key_value_heads,
                                          rows), dtype=lm.dtype, device=lm.device)
            hooks = [m.register_forward_hook(self.forward_hook, with_kwargs=True)
                     for m in attention_layers(lm)]
            try:
                for self.start_idx, self.end_idx, ids in replay.chunks:
                    replay.read(ids)
            finally:
                for h in hooks:
                    h.remove()
            self.compress_post(lm)

    logger = logging.getLogger(base.__module__)
    level = logger.level
    logger.setLevel(logging.ERROR)  # its warning that re-reading costs 2-3 prefills, per row
    try:
        return ReplayPress(compression_ratio=ratio)
    finally:
        logger.setLevel(level)


def press_refusal(backend: str, name: str) -> str:
    """Why a press cannot run on ``backend`` (an engine with a KV cache of its own)."""
    return (f"press {name!r} runs on the torch runtime only: the {backend} backend keeps the KV "
            "cache inside its engine, where kvpress cannot reach; expected backend='torch' "
            "(--backend torch), or no press")


@contextmanager
def pressed_as(runtime, press: PressConfig | None) -> Iterator[None]:
    """``runtime`` reads with ``press`` (None: no press) inside, then as before; its prefix
    cache is left as it is. A runtime without presses takes None only."""
    before = runtime.press
    if press == before:
        yield
        return
    if not runtime.presses:
        raise KTMError(press_refusal(runtime.name, press.name))
    runtime.press = press
    try:
        yield
    finally:
        runtime.press = before


def import_kvpress():
    try:
        import kvpress
    except ImportError as e:
        raise KTMError(f"a KV press needs kvpress ({e}): install it with {INSTALL}") from None
    return kvpress


def _cache_position(module, args, kwargs):
    """Forward pre-hook: the ``cache_position`` kvpress's hook reads, from the cache's length
    before this layer's keys are added (none given: the attention layer got none)."""
    if kwargs.get("cache_position") is not None:
        return None
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    cache = kwargs.get("past_key_values")
    past = 0 if cache is None else cache.get_seq_length(module.layer_idx)
    kwargs["cache_position"] = torch.arange(past, past + hidden.shape[1], device=hidden.device)
    return args, kwargs


@contextmanager
def kvpress_compatible(lm) -> Iterator[None]:
    """kvpress's hooks run on ``lm`` (a transformers causal LM) inside, on this transformers
    too: each attention layer gets the ``cache_position`` kvpress reads (``_cache_position``).
    ``pressing`` opens it; kvpress's own pipeline runs inside it as it is."""
    hooks = [m.register_forward_pre_hook(_cache_position, with_kwargs=True)
             for m in attention_layers(lm)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


@contextmanager
def pressing(lm, press: PressConfig, rows: int, replay: Replay | None = None
             ) -> Iterator[None]:
    """The prefill of ``rows`` positions from an empty cache inside compresses its KV with
    ``press`` on ``lm`` (a query-agnostic one re-reading ``replay``). kvpress's refusals (a
    prompt shorter than a press's window) become ``KTMError``s naming the press and the
    prompt."""
    try:
        with kvpress_compatible(lm), press.make(replay)(lm):
            yield
    except AssertionError as e:  # kvpress checks its inputs with assert
        raise KTMError(f"press {press.name} cannot press {rows} positions: {e}; expected a "
                       "longer compressed segment, or another press") from None
    except (RuntimeError, TypeError, AttributeError, ValueError, IndexError) as e:
        # the LM reads this prompt unpressed: what failed is kvpress's reading of its layers
        raise KTMError(f"press {press.name} failed on this {lm.config.model_type} model "
                       f"({type(e).__name__}: {e}): kvpress reads Llama-style attention with "
                       "every layer attending to the whole context (it is tested on Llama, "
                       "Mistral, Phi-3, Qwen2/3 and Gemma 3); expected such a model, or no "
                       "press") from e


def _row_positions(cp, extra: int) -> torch.Tensor:
    """(L + extra,) position ids of a prefix followed by ``extra`` tokens."""
    pos = cp.row_positions(extra)
    if pos is None:
        pos = torch.arange(cp.tokens_out + extra, device=cp.embeds.device)
    return pos


class PressedRow(NamedTuple):
    cache: DynamicCache  # the pressed KV, then the rows read after the press
    logits: torch.Tensor  # (1, keep, V) at the last positions read
    length: int  # positions in the cache
    positions: torch.Tensor  # (1, S) position ids of the rows read after the press
    via: torch.nn.Module | None  # the LM it was read with (``KTMModel.decode_lm``)
    hidden: torch.Tensor | None  # keys a head-wise press hid (``hidden_keys``)


def read_pressed(model, cp, press: PressConfig, after: torch.Tensor | None = None,
                 keep: int = 1, via: torch.nn.Module | None = None) -> PressedRow:
    """Read one prefix (a ``CompressedPrompt``) with its pressable rows pressed, then its other
    rows and ``after`` ((A, D) embeddings that follow it: targets), unpressed, at their true
    positions, through ``via`` (None: the PEFT model, whose LoRA trains). In the caller's
    mode and grad setting: training reads this way too (``pressed_targets``)."""
    extra = 0 if after is None else after.shape[0]
    embeds = cp.embeds if after is None else torch.cat([cp.embeds, after.to(cp.embeds.dtype)])
    pos = _row_positions(cp, extra)
    gate = None
    if cp.merged_rows is not None:
        gate = torch.cat([cp.merged_rows, cp.merged_rows.new_zeros(extra)])
        if model.config.lora.scope == "merged":
            # its merged rows read through the PEFT model, whose layers the press hooks
            via = None
    # the last prefix row is read after the press when nothing plain follows it
    split = min(cp.pressable, cp.tokens_out - 1)
    lm = via if via is not None else model.peft.get_base_model()
    cache = DynamicCache(config=model.lm_config)
    windowed = sorted({type(x).__name__ for x in cache.layers if type(x) is not DynamicLayer})
    if windowed:
        raise KTMError(f"press {press.name} on this {lm.config.model_type} model: its cache has "
                       f"{', '.join(windowed)} layers (sliding-window attention), and kvpress "
                       "presses full-attention caches; expected a model whose every layer "
                       "attends to the whole context, or no press")
    hidden = None
    if 0 < split < press.fewest():
        # too few rows for the press (an evaluation's shortest contexts, a server's short
        # request): read whole, their KV kept (``kept_positions`` counts them so), said once
        warnings.warn(f"press {press.name} leaves prompts of fewer than {press.fewest()} "
                      "pressable positions unpressed (read whole, their KV kept)", UserWarning,
                      stacklevel=2)
        split = 0
    if split > 0:
        one = torch.ones(1, split, dtype=torch.long, device=embeds.device)
        replay = _replay(model, cp, split, cache, int(pos[split - 1]) + 1, via) if (
            press.replays) else None
        try:
            with pressing(lm, press, split, replay):
                model.lm(embeds[None, :split], one, pos[None, :split], cache, keep=1, via=via,
                         gate=None if gate is None else gate[None, :split])
        finally:
            hidden = hidden_keys(lm)
    kv = cache.get_seq_length()
    lengths = {layer.keys.shape[-2] for layer in cache.layers if layer.keys is not None}
    if len(lengths) > 1:
        raise KTMError(f"press {press.name} kept {sorted(lengths)} positions in different "
                       "layers: expected one length for every layer")
    rest = embeds[split:]
    mask = torch.ones(1, kv + rest.shape[0], dtype=torch.long, device=embeds.device)
    with hiding(lm, hidden):
        logits = model.lm(rest[None], mask, pos[None, split:], cache, keep=keep, via=via,
                          gate=None if gate is None else gate[None, split:])
    return PressedRow(cache, logits, kv + rest.shape[0], pos[None, split:], via, hidden)


def _replay(model, cp, split: int, cache: DynamicCache, start: int, via) -> Replay:
    """The ``Replay`` of a prefix's first ``split`` rows: their tokens, re-read after the cache
    from position ``start``, without gradients and leaving the pressed keys and values as they
    were (the tensors training reads through)."""
    if not cp.ids or cp.sources is None:
        raise KTMError("a query-agnostic press re-reads the prompt's token ids: expected a "
                       "prefix made by KTMModel.compress")
    sources = [int(x) for x in cp.sources[:split]]
    chunks = replay_chunks(model.tokenizer, list(cp.ids[:sources[-1] + 1]), sources)

    def read(ids: list[int]) -> None:
        kept = [(layer.keys, layer.values) for layer in cache.layers]
        n = cache.get_seq_length()
        t = torch.tensor(ids, dtype=torch.long, device=cp.embeds.device)
        mask = torch.ones(1, n + len(ids), dtype=torch.long, device=t.device)
        with torch.no_grad():
            model.lm(model.input_embedding(t)[None].to(cp.embeds.dtype), mask,
                     torch.arange(start, start + len(ids), device=t.device)[None], cache,
                     keep=1, via=via)
        for layer, (k, v) in zip(cache.layers, kept):  # the re-read's keys trimmed off
            layer.keys, layer.values = k, v

    return Replay(chunks, read)


@torch.no_grad()
def pressed_row(model, cp, press: PressConfig, after: torch.Tensor | None = None,
                keep: int = 1) -> PressedRow:
    """``read_pressed`` for decoding and scoring: no grad, eval mode, the LM decoding reads
    (``KTMModel.decode_lm``)."""
    from ktm.decode.generate import eval_mode

    with eval_mode(model):
        return read_pressed(model, cp, press, after, keep, model.decode_lm())


def pressed_targets(model, prefixes, targets: list[list[int]], press: PressConfig,
                    via: torch.nn.Module | None = None) -> TargetLogits:
    """fp32 logits (N, V) predicting each target token after its prefix read pressed, row by
    row, as ``ktm.core.loss.target_logits`` gives them unpressed; in the caller's mode and
    grad setting (with the autograd graph: a reader trained to be read stacked, ``ktm
    pretrain --press``; scored by the runtime through ``via``, ``read_pressed``'s)."""
    device = model.device
    logits, labels, rows = [], [], []
    for i, (cp, t) in enumerate(zip(prefixes, targets)):
        ids = torch.tensor(t, dtype=torch.long, device=device)
        after = model.input_embedding(ids[:-1]) if len(t) > 1 else None
        logits.append(read_pressed(model, cp, press, after, keep=len(t), via=via).logits[0])
        labels.append(ids)
        rows += [i] * len(t)
    return TargetLogits(torch.cat(logits).float(), torch.cat(labels),
                        torch.tensor(rows, device=device), [len(t) for t in targets],
                        sum(cp.tokens_in for cp in prefixes),
                        sum(cp.tokens_out for cp in prefixes))


def kept_positions(cp, press: PressConfig | None) -> int:
    """Positions of a prefix (``CompressedPrompt``) whose KV a press leaves in the cache."""
    split = min(cp.pressable, cp.tokens_out - 1)
    if press is None or split <= 0 or split < press.fewest():
        return cp.tokens_out
    return cp.tokens_out - split + press.kept(split)


def kv_kept(model, prefixes) -> int:
    """Positions of ``prefixes`` whose KV ``model``'s reading keeps: every position read, less
    what its runtime's press drops (the torch runtime's; other runtimes keep them all)."""
    press = model.runtime.press
    return sum(kept_positions(cp, press) for cp in prefixes)
