"""Generation: prefill the compressed prefix once, then decode token by token with the KV cache.

``prefill`` and ``advance`` (compiled or not) are the only places the LM is called while
decoding, besides a merge window's re-read (``ktm.decode.merge_generated``), and ``Decoding`` is
the one step loop: ``decode_steps``, which every entry point uses (generate, stream, the demo's
and the benchmark's timings), and the server's continuous batching step through it, one token
per row and step, so streaming, batching and merging generated tokens hook in at one place.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ktm.core.batch import pack
from ktm.core.fit import encode_fitted
from ktm.core.loss import check_fits
from ktm.core.prompt import PromptLike, Segment, split_prompts
from ktm.decode.hidden import hiding
from ktm.decode.text_stream import TextStream, anchor_ids, decode_continuation
from ktm.errors import KTMError
from ktm.util.field_types import check_field_types
from ktm.util.timing import timed


@dataclass(frozen=True)
class GenerationConfig:
    """How ``KTMModel.generate`` / ``stream`` decode (the ``ktm generate`` flags).

    Greedy unless ``do_sample``; ``seed`` makes sampling repeatable per prompt. Raises
    ``KTMError`` on construction for ``max_new_tokens`` < 1, ``temperature`` <= 0 or not finite,
    or ``top_p`` outside (0, 1].
    """

    max_new_tokens: int = field(default=32, metadata={"help": "tokens to generate at most"})
    do_sample: bool = field(default=False, metadata={
        "flag": "sample", "help": "sample (temperature, top-p) instead of greedy"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass"})
    # each prompt of a batch draws from a generator of its own seeded with it, so a batch gives
    # each prompt the samples it gets alone (one prompt twice: the same sample twice)
    seed: int | None = field(default=None, metadata={"help": "sampling seed (per prompt)"})
    stop_at_eos: bool = field(default=True, metadata={
        "help": "stop at the tokenizer's or the model's end-of-sequence ids"})
    use_cache: bool = field(default=True, metadata={
        "help": "KV cache (off re-runs the whole sequence each step: the test reference)"})
    merge: bool = field(default=True, metadata={
        "help": "merge the compressed segments (off: the uncompressed baseline)"})
    merge_window: int = field(default=0, metadata={
        "help": "merge the answer as it grows (torch): past this many generated tokens held "
                "plain, the oldest are merged K to a position and read again, so a long "
                "answer's KV grows K times slower (0: off; at least 2K)"})

    def to_dict(self) -> dict:
        return asdict(self)

    def ends_at(self, token: int, eos: frozenset[int]) -> bool:
        """Whether ``token`` ends the generation by itself: an end-of-sequence id (``eos``, the
        model's ``eos_ids``) while ``stop_at_eos``. The one rule the decode loop, ``generate``,
        ``stream`` and the server apply (the loop on tensors: ``stop_ids``)."""
        return self.stop_at_eos and token in eos

    def stop_ids(self, eos: frozenset[int], device) -> torch.Tensor:
        """``ends_at`` as the ids a row of tokens is checked against (none: never ends)."""
        return torch.tensor(sorted(eos) if self.stop_at_eos else [], dtype=torch.long,
                            device=device)

    def __post_init__(self) -> None:
        if (not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool)
                or self.max_new_tokens < 1):
            raise KTMError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        check_field_types(self)
        if not 0 < self.temperature < math.inf:  # NaN fails it too
            raise KTMError(f"temperature must be a finite number > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise KTMError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.merge_window < 0:
            raise KTMError(f"merge_window must be 0 (off) or a number of generated tokens, got "
                           f"{self.merge_window}")


def sampling_probs(logits: torch.Tensor, cfg: GenerationConfig) -> torch.Tensor:
    """(B, V) logits -> (B, V) the weights sampling draws from: softmax at ``temperature``, then
    only the smallest set of most likely tokens whose mass reaches ``top_p`` (unnormalised:
    ``torch.multinomial`` normalises)."""
    # in float64, each row less its largest logit first: any temperature > 0 an API passes
    # (5e-324 too, which float32 reads as 0) gives a finite distribution, its limit towards 0
    # the most likely tokens; float32's exp at a tiny temperature would give inf / inf = NaN
    scaled = logits.double()
    scaled = (scaled - scaled.amax(-1, keepdim=True)) / cfg.temperature
    probs = torch.softmax(scaled, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p; the first token always survives
        # (a top_p of 1e-300 is 0 in float32, and 0 >= 0 would drop every token)
        drop = sorted_p.cumsum(-1) - sorted_p >= cfg.top_p
        drop[..., 0] = False
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return probs.float()


def select_next(logits: torch.Tensor, cfg: GenerationConfig, gen: torch.Generator | None):
    """(B, V) logits -> (B,) next tokens, greedy or temperature/top-p sampling."""
    if not cfg.do_sample:
        return logits.argmax(-1)
    return torch.multinomial(sampling_probs(logits, cfg), 1, generator=gen).squeeze(-1)


def pick(logits: torch.Tensor, cfgs: Sequence[GenerationConfig],
         gens: Sequence[torch.Generator | None]) -> tuple[torch.Tensor, dict[int, Exception]]:
    """(B, V) -> (B,) next tokens, row i by ``cfgs[i]`` drawing from ``gens[i]`` (None: torch's
    global generator): the greedy rows at once, unseeded sampled rows of the same settings at
    once, each seeded row alone, so its draws do not depend on its batch-mates. A row whose
    choice fails (NaN logits cannot be sampled) is returned in the dict with its error, the
    others unaffected."""
    groups: dict = {}
    for i, (cfg, gen) in enumerate(zip(cfgs, gens, strict=True)):
        key = ("greedy" if not cfg.do_sample else i if gen is not None
               else (cfg.temperature, cfg.top_p))
        groups.setdefault(key, []).append(i)
    out = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    failed: dict[int, Exception] = {}
    queue = deque(groups.values())
    while queue:
        rows = queue.popleft()
        try:
            if len(rows) == logits.shape[0]:  # one group: every row, in order
                out = select_next(logits, cfgs[rows[0]], gens[rows[0]])
            else:
                idx = torch.tensor(rows, device=logits.device)
                out[idx] = select_next(logits[idx], cfgs[rows[0]], gens[rows[0]])
        except Exception as e:  # noqa: BLE001 - one row's failure, found and returned
            if len(rows) > 1:  # which row was it: each alone
                queue.extend([i] for i in rows)
            else:
                failed[rows[0]] = e
    return out, failed


class Decoding:
    """A batch decoding on a runtime (``ktm.decode.runtime``), each row with its own
    ``GenerationConfig`` and generator: the one step loop. ``decode_steps`` steps one batch
    through it to the end; the serving engine steps its running batch, rows joining and leaving
    between steps."""

    def __init__(self, runtime, state, cfgs: Sequence[GenerationConfig],
                 gens: Sequence[torch.Generator | None]):
        self.runtime, self.state = runtime, state
        self.cfgs, self.gens = list(cfgs), list(gens)
        # merging the answer as it grows (``merge_window``, ``ktm.decode.merge_generated``):
        # the generated tokens held plain at the cache's tail, oldest first
        self.window = max((cfg.merge_window for cfg in self.cfgs), default=0)
        self.plain: list[torch.Tensor] = []
        if self.window and len({cfg.merge_window for cfg in self.cfgs}) > 1:
            raise KTMError("rows merging their answers at different windows cannot decode "
                           "together: expected one merge_window for the batch")
        if self.window and not runtime.merges:
            raise KTMError(f"merge_window={self.window} merges the answer in the KV cache of "
                           f"the torch runtime; the {runtime.name} backend keeps its own")

    @property
    def logits(self) -> torch.Tensor:
        """(B, V) the rows' next-token logits."""
        return self.state.logits

    def pick(self) -> tuple[torch.Tensor, dict[int, Exception]]:
        """Each row's next token by its own settings (``pick``), and the rows that failed."""
        return pick(self.state.logits, self.cfgs, self.gens)

    def advance(self, tokens: torch.Tensor) -> None:
        """Read one (B,) token per row; ``logits`` become the next step's. With a merge
        window, the oldest plain answer tokens are merged once the window is passed."""
        self.runtime.advance(self.state, tokens)
        if not self.window:
            return
        self.plain.append(tokens)
        n = self.runtime.merge_due(self.window, len(self.plain))
        if n:
            self.runtime.merge_generated(self.state, torch.stack(self.plain[:n], 1),
                                         len(self.plain))
            del self.plain[:n]

    def join(self, other: Decoding) -> None:
        """``other``'s rows join after these (continuous batching)."""
        if self.window or other.window:
            raise KTMError("rows merging their answers (merge_window) decode alone: none join")
        self.state = self.runtime.join(self.state, other.state)
        self.cfgs += other.cfgs
        self.gens += other.gens

    def keep(self, rows: list[int]) -> None:
        """Only ``rows`` go on, in that order; the others are let go."""
        self.runtime.keep(self.state, rows)
        self.cfgs = [self.cfgs[i] for i in rows]
        self.gens = [self.gens[i] for i in rows]

    def release(self) -> None:
        """Done, failed or abandoned: every row is let go."""
        self.runtime.release(self.state)


@contextmanager
def eval_mode(model) -> Iterator[None]:
    """Eval mode (no dropout) for the calls inside, then the caller's mode back.

    Held only around model calls, never across a ``yield``: a stream left unfinished must not
    leave the model in eval mode.
    """
    if not model.training:
        # already in eval mode (``eval()`` sets every submodule): switching walks every module
        # and sets each flag again, a third of a decode step of SmolLM2-135M on a CPU
        yield
        return
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


class RoomyLayer(DynamicLayer):
    """A full-attention KV cache layer that keeps room for the next positions.

    ``DynamicLayer`` concatenates every step, copying the whole cache (94 MB a step for
    SmolLM2-135M at 2,048 positions, in fp32): decoding there is 3 to 10% faster on a CPU
    without it. This layer writes each step into spare room at the end of its buffer and hands
    out views of the filled part, copying only when the room runs out (then making ``room``
    more), so it holds at most ``room`` unused positions; or when the keys were replaced
    (``DynamicLayer``'s batch selection). Keys and values read exactly as ``DynamicLayer``'s."""

    def __init__(self, room: int):
        super().__init__()
        self.room = room
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, m = self.get_seq_length(), key_states.shape[-2]
        buf = self._buffers[0] if self._buffers is not None else None
        if (buf is None or n + m > buf.shape[-2] or self.keys.shape[:-2] != buf.shape[:-2]
                or (n and self.keys.data_ptr() != buf.data_ptr())):
            # keys and values may differ in width (DeepSeek-V3's latent attention)
            grown = tuple(t.new_empty(*t.shape[:-2], n + m + self.room, t.shape[-1])
                          for t in (key_states, value_states))
            if n:
                grown[0][..., :n, :], grown[1][..., :n, :] = self.keys, self.values
            self._buffers = grown
        k, v = self._buffers
        k[..., n:n + m, :], v[..., n:n + m, :] = key_states, value_states
        self.keys, self.values = k[..., :n + m, :], v[..., :n + m, :]
        return self.keys, self.values


# room a decode reserves at most: a long max_new_tokens that ends early at EOS must not hold
# its whole length of cache, and a copy every 256 steps costs nothing measurable
MAX_ROOM = 256


def kv_cache(model, room: int = 0) -> DynamicCache:
    """An empty KV cache for ``model``; ``room`` > 0 makes its full-attention layers
    ``RoomyLayer``s keeping that many positions (at most ``MAX_ROOM``) for what follows."""
    cache = DynamicCache(config=model.lm_config)
    if room > 0:
        cache.layers = [RoomyLayer(min(room, MAX_ROOM)) if type(layer) is DynamicLayer else layer
                        for layer in cache.layers]
    return cache


def windowed_layers(cache) -> list[str]:
    """The kinds of ``cache``'s layers that do not hold every position read (sliding-window
    and the like), by name; empty: full attention throughout, what a cache that changes
    length or moves (a static copy, a merged answer) needs."""
    return sorted({type(layer).__name__ for layer in cache.layers
                   if not isinstance(layer, DynamicLayer)
                   or getattr(layer, "sliding_window", None)})


@dataclass
class DecodeState:
    """A batch being decoded: what the LM has read so far and its next-token logits (B, V)."""

    embeds: torch.Tensor  # (B, L, D); with a cache only the last step is needed
    mask: torch.Tensor  # (B, L) over everything read, prefix padding included
    pos: torch.Tensor  # (B, L) position ids (B, 1 with a cache: the last step's)
    cache: DynamicCache | None
    logits: torch.Tensor  # (B, V) next-token logits
    # the LM prefill read with (``KTMModel.decode_lm``: the LoRA-folded view, or None for the
    # PEFT model): every later step of the batch reads with the same weights as its cache
    via: torch.nn.Module | None = None
    reused: list[int] = field(default_factory=list)  # leading rows each row found cached
    # (N, 4) [row, layer, head, position] of cached keys a head-wise KV press hid from
    # attention (``ktm.decode.press.hidden_keys``: kept in the cache, never attended); None: none
    hidden: torch.Tensor | None = None
    # (B', C) the mask of a batch moved onto a static cache of C positions, B' >= B rows (a
    # rebatched one is padded to a power of two; ``ktm.decode.compiled``): its steps run
    # compiled; None: eager
    static_mask: torch.Tensor | None = None
    # (B, L) the merged rows of what the batch read (``Packed.gate``), for the reference path
    # that re-reads everything; None: none (or a cache holds them)
    gate: torch.Tensor | None = None
    # the most tokens a row adds after its prefill (a static cache keeps room for them); None:
    # the batch decodes eager (no settings given, or an answer merged as it grows)
    new_tokens: int | None = None
    # rows join and leave this batch (the server's): it goes onto the compiled step, if at all,
    # at its next step, never while it waits to join another
    joinable: bool = False


@torch.no_grad()
def prefill(model, prefixes, use_cache: bool = True, room: int = 0,
            compiled=None) -> DecodeState:
    """Read the prefixes (``CompressedPrompt``s) once; the cache then holds their keys/values.

    ``room``: positions the cache keeps free for the tokens decoded next (``kv_cache``), as
    ``decode_steps`` asks; 0 gives plain ``DynamicLayer``s, which rows can join or leave
    (``ktm.decode.batched``). ``compiled``: the runtime's ``ktm.decode.compiled.CompiledStep``,
    whose compiled prefill reads a cached batch; None: eager."""
    p = pack([cp.embeds for cp in prefixes], [cp.positions for cp in prefixes],
             [cp.merged_rows for cp in prefixes])
    cache = kv_cache(model, room) if use_cache else None
    via = model.decode_lm()
    with eval_mode(model):
        if compiled is not None and cache is not None:
            logits = compiled.prefill(via if via is not None else model.peft, p.embeds, p.mask,
                                      p.position_ids, cache)
        else:
            logits = model.lm(p.embeds, p.mask, p.position_ids, cache, keep=1, via=via,
                              gate=p.gate)[:, -1]
    return DecodeState(p.embeds, p.mask, p.position_ids, cache, logits, via, gate=p.gate)


@torch.no_grad()
def advance(model, state: DecodeState, tokens: torch.Tensor, compiled=None) -> None:
    """Feed one (B,) token per row; updates ``state`` in place (cached: one position each).
    ``compiled``: the runtime's ``ktm.decode.compiled.CompiledStep``, which steps a batch moved
    onto its static cache (``state.static_mask``; that mask already spans every later step)."""
    step = model.input_embedding(tokens)[:, None]
    last = state.pos[:, -1:] + 1
    with eval_mode(model):
        if state.static_mask is not None:
            state.pos = last
            state.logits = compiled.step(state.via if state.via is not None else model.peft,
                                         state, step, last)
            return
        state.mask = torch.cat([state.mask, state.mask.new_ones(state.mask.shape[0], 1)], dim=1)
        if state.cache is not None:
            state.pos = last
            with hiding(state.via if state.via is not None else model.peft.get_base_model(),
                        state.hidden):
                state.logits = model.lm(step, state.mask, last, state.cache, keep=1,
                                        via=state.via)[:, -1]
        else:  # the reference path: re-read everything
            state.embeds = torch.cat([state.embeds, step], dim=1)
            state.pos = torch.cat([state.pos, last], dim=1)
            if state.gate is not None:  # a generated token is plain
                state.gate = torch.cat([state.gate, torch.zeros_like(state.gate[:, :1])], 1)
            state.logits = model.lm(state.embeds, state.mask, state.pos, keep=1,
                                    via=state.via, gate=state.gate)[:, -1]


def decode_steps(model, prompts: list[tuple[Segment, ...]] | None, cfg: GenerationConfig,
                 prefixes=None, state: DecodeState | None = None,
                 timing: dict | None = None, runtime=None, layout=None
                 ) -> Iterator[torch.Tensor]:
    """Yield (B,) token ids per step; rows that have finished repeat the pad id.

    ``prefixes``: the prompts' ``CompressedPrompt``s when the caller already has them, else
    they are read with ``layout`` (``ktm.core.config.Layout``: this call's reading plan; None:
    the model's own);
    ``state``: a batch the runtime has already prefilled (the benchmark times the prefill apart).
    ``timing``: a dict that gets ``prefill_s``, the seconds of this call's prefill.
    The model's runtime (``ktm.decode.runtime``: torch, llama.cpp or vLLM; ``runtime``: another
    one built for this model, ``RuntimeSpec.build``) prefills and advances.
    """
    runtime = runtime or model.runtime
    if state is None:
        if prefixes is None:  # a prompt past the window is read at the ratio that fits it
            with torch.no_grad(), eval_mode(model):
                prompts, prefixes = encode_fitted(model, prompts, cfg.merge,
                                                  [max(cfg.max_new_tokens - 1, 0)] * len(prompts),
                                                  layout=layout)
        elif len(prefixes) != len(prompts):
            raise KTMError(f"{len(prefixes)} prefixes for {len(prompts)} prompts: "
                           "expected one each")
        # the last new token is returned, never read back: it takes no position
        check_fits(model, prefixes, [cfg.max_new_tokens] * len(prefixes), "new tokens", unread=1)
        if not (cfg.use_cache or runtime.rereads):
            raise KTMError(f"use_cache=False re-runs the whole sequence on the torch path (the "
                           f"test reference); the {runtime.name} backend always keeps its KV "
                           "cache")
        if timing is None:
            state = runtime.prefill(prefixes, [cfg] * len(prefixes))
        else:
            state, timing["prefill_s"] = timed(model.device, runtime.prefill, prefixes,
                                               [cfg] * len(prefixes))
    rows = state.logits.shape[0]
    gens = [None] * rows
    if cfg.do_sample and cfg.seed is not None:
        gens = [torch.Generator(device=model.device).manual_seed(cfg.seed) for _ in range(rows)]
    decoding = Decoding(runtime, state, [cfg] * rows, gens)
    try:  # done, failed or abandoned: its rows are let go
        yield from _steps(model, decoding, cfg)
    finally:
        decoding.release()


def _steps(model, decoding: Decoding, cfg: GenerationConfig) -> Iterator[torch.Tensor]:
    eos = cfg.stop_ids(model.eos_ids, model.device)
    finished = torch.zeros(decoding.logits.shape[0], dtype=torch.bool, device=model.device)
    for i in range(cfg.max_new_tokens):
        nxt, failed = decoding.pick()
        if failed:
            raise next(iter(failed.values()))
        nxt = nxt.masked_fill(finished, model.pad_id)
        yield nxt
        if len(eos):
            finished |= torch.isin(nxt, eos)
            if bool(finished.all()):
                return
        if i + 1 < cfg.max_new_tokens:
            decoding.advance(nxt)


def _trim(ids: list[int], eos: frozenset[int], cfg: GenerationConfig) -> list[int]:
    return next((ids[:i] for i, t in enumerate(ids) if cfg.ends_at(t, eos)), ids)


def generate_ids(model, prompts, prefixes=None, timing: dict | None = None, layout=None,
                 **kwargs) -> list[list[int]]:
    """Generated token ids per prompt, EOS and anything after it removed (``timing`` and
    ``layout``: as ``decode_steps``'s)."""
    cfg = GenerationConfig(**kwargs)
    segs, _ = split_prompts(prompts)
    with eval_mode(model):  # once for the whole loop, not twice a step (nothing is yielded)
        steps = list(decode_steps(model, segs, cfg, prefixes, timing=timing, layout=layout))
    if not steps:
        return [[] for _ in segs]
    ids = torch.stack(steps, dim=1).tolist()
    return [_trim(row, model.eos_ids, cfg) for row in ids]


def generate(model, prompts: PromptLike | Sequence[PromptLike], prefixes=None,
             timing: dict | None = None, layout=None, **kwargs) -> str | list[str]:
    """Text for one prompt (returns str) or a list of prompts (returns list[str]);
    ``prefixes``, ``timing`` and ``layout`` as ``decode_steps``'s."""
    segs, single = split_prompts(prompts)  # read once: an iterator of prompts is spent after
    rows = generate_ids(model, segs, prefixes, timing, layout, **kwargs)
    anchor = anchor_ids(model.tokenizer)
    texts = [decode_continuation(model.tokenizer, r, anchor) for r in rows]
    return texts[0] if single else texts


def stream(model, prompt: PromptLike, layout=None, **kwargs) -> Iterator[str]:
    """Yield text pieces of one prompt's continuation as tokens are decoded (``layout``: as
    ``decode_steps``'s)."""
    cfg = GenerationConfig(**kwargs)
    segs, single = split_prompts(prompt)
    if not single:
        raise KTMError("stream takes one prompt; use generate for a list")
    text = TextStream(model.tokenizer)
    for nxt in decode_steps(model, segs, cfg, layout=layout):
        tok = int(nxt[0])
        if cfg.ends_at(tok, model.eos_ids):
            break
        if piece := text.push(tok):
            yield piece
    if tail := text.flush():  # a last character left unfinished
        yield tail
