"""What runs the LM while decoding and scoring: the ``Runtime`` contract, and ``TorchRuntime``,
the model's own LM in torch.

A model always has one runtime (``KTMModel.runtime``; ``KTMModel.use_backend`` is the one place
that picks it). The decode loop (``ktm.decode.generate.decode_steps``), the serving engine, the
benchmark and eval-mode scoring call it and never ask which it is:

    prefill(prefixes, sampling, contexts, joinable)  the prompts' rows read -> a batch state whose
                                       ``logits`` (B, V) give each row's next token; ``reused``:
                                       leading rows each found cached
    advance(state, tokens)             one (B,) token per row read; ``state.logits`` updated
    join(a, b) / keep(state, rows)     continuous batching: rows join, rows leave
    release(state)                     a batch done, failed or abandoned: its rows are let go
    score(prefixes, targets)           per prompt, the (T,) log-probs of its target tokens

Implementations: ``TorchRuntime`` here, ``ktm.llamacpp.runtime.LlamaCppRuntime``,
``ktm.vllm.runtime.VLLMRuntime``. What differs between them is said by attributes, not by
names, and every caller reads them as they are, never probing for one: ``gives_logits`` (False:
the logits only single out the engine's own choice, as vLLM samples inside its step),
``context`` (KV cells every running row shares, which the serving engine admits requests by;
None: no such bound), ``joinable`` (rows can join a running batch), ``rereads``
(``use_cache=False``, the whole sequence re-read each step, is possible), ``prefix_kv`` (the
prompts' leading contexts it keeps itself; None: its engine's cache does), ``presses`` (a KV
press can read with it: ``press``, ``use_press``), ``merges`` (``merge_window`` can merge the
answer into its cache: ``merge_due``, ``merge_generated``), ``compile`` and ``compiles`` (ktm's
compiled step), ``weights`` (how the LM's linear layers are read). A runtime whose engine keeps
its own cache, graphs and weights holds those at none, off and native
(``ktm.util.own_engine.OwnEngine``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ktm.core.int8 import check_weights
from ktm.core.loss import target_logits
from ktm.decode import compiled
from ktm.decode.batched import can_rebatch, join, keep_rows, prefill_from_kv, row_kv
from ktm.decode.generate import DecodeState, advance, eval_mode, prefill
from ktm.decode.merge_generated import check_window, due, merge_generated
from ktm.decode.press import PressConfig, pressed_row, pressed_targets
from ktm.errors import KTMError
from ktm.util.lru import LRUCache


class Runtime(Protocol):
    name: str
    gives_logits: bool
    context: int | None
    joinable: bool
    rereads: bool
    # the KV of prompts' leading contexts kept here (``keep_prefixes``: the server's prefix
    # cache); None: the engine's own cache keeps them
    prefix_kv: LRUCache | None
    # a KV press (``ktm.decode.press``) can read with this runtime; False: ``press`` stays None
    # and a caller refuses a press by name (``press_refusal``)
    presses: bool
    press: PressConfig | None  # the press every prefill and score applies; None: none
    # the answer can be merged into the KV cache as it grows (``merge_window``)
    merges: bool
    compile: str  # ktm's compiled step (``ktm.decode.compiled``): "on", "off" or "auto"
    compiles: int  # graphs that step has compiled (0: it never ran)
    weights: str  # the LM's linear layers as read: "native" or "int8" (``ktm.core.int8``)

    def prefill(self, prefixes, sampling=None, contexts=None, joinable: bool = False): ...

    def advance(self, state, tokens: torch.Tensor) -> None: ...

    def join(self, a, b): ...

    def keep(self, state, rows: list[int]) -> None: ...

    def release(self, state) -> None: ...

    def score(self, prefixes, targets: list[list[int]]) -> list[torch.Tensor]: ...

    def use_press(self, press: PressConfig | None) -> None: ...

    def merge_due(self, window: int, plain: int) -> int: ...

    def merge_generated(self, state, ids: torch.Tensor, plain: int) -> None: ...

    def keep_prefixes(self, max_bytes: int) -> None: ...

    def clear(self) -> None: ...

    def kv_bytes(self, state) -> int: ...

    def record(self) -> dict: ...

    def close(self) -> None: ...


def shared_rows(cp, embeds: torch.Tensor, positions: torch.Tensor | None,
                merged: torch.Tensor | None = None) -> int:
    """Leading rows the prefix ``cp`` shares with a stored one (``embeds`` (L, D) at
    ``positions``, None: 0 .. L-1; ``merged``: its merged rows, None: none): equal embeddings
    at equal positions, merged alike (a LoRA of scope "merged" reads a merged row otherwise
    than a plain one of the same embedding)."""
    n = min(cp.tokens_out, embeds.shape[0])
    if (n == 0 or embeds.dtype != cp.embeds.dtype or embeds.device != cp.embeds.device
            or not torch.equal(cp.embeds[0], embeds[0])):  # most stored contexts: one row read
        return 0
    same = (cp.embeds[:n] == embeds[:n]).all(-1)
    if positions is not None or cp.positions is not None:
        mine = cp.row_positions(0)
        mine = torch.arange(n, device=same.device) if mine is None else mine[:n]
        theirs = torch.arange(n, device=same.device) if positions is None else positions[:n]
        same &= mine == theirs
    if merged is not None or cp.merged_rows is not None:
        same &= _flags(cp.merged_rows, n, same) == _flags(merged, n, same)
    differ = (~same).nonzero()
    return int(differ[0, 0]) if len(differ) else n


def _flags(merged: torch.Tensor | None, n: int, like: torch.Tensor) -> torch.Tensor:
    """The first ``n`` merged flags (None: all false)."""
    return torch.zeros_like(like) if merged is None else merged[:n]


class TorchRuntime:
    """The model's own LM in torch (``KTMModel.lm``, its LoRA folded for decoding): the eager
    path. It keeps the KV of prompts' leading contexts when asked (``keep_prefixes``: the
    server's prefix cache), so a repeated long document is read once."""

    name = "torch"
    gives_logits = True
    context = None
    rereads = True  # use_cache=False re-reads the whole sequence each step (the test reference)
    presses = True
    merges = True

    def __init__(self, model, press: PressConfig | None = None, compile: str = "auto",
                 weights: str = "native"):
        self.model = model
        self.prefix_kv = LRUCache(0)
        # a KV press (``ktm.decode.press``) every prefill and score applies; None: none
        self.press = press
        self.compile = compile
        self.weights = weights
        self._step: compiled.CompiledStep | None = None

    @property
    def weights(self) -> str:
        """What the LM's linear layers are read as while decoding and scoring: "native" (the
        model's dtype) or "int8" (``ktm.core.int8``: a quarter of fp32's bytes a step, logits
        within the bound its module states)."""
        return self._weights

    @weights.setter
    def weights(self, weights: str) -> None:
        self._weights = check_weights(weights)
        self.prefix_kv.clear()  # kept KV was read with the other weights

    @property
    def compile(self) -> str:
        """Whether the prefill and decoding steps run compiled (``ktm.decode.compiled``): "on",
        "off" or "auto" (where measured to pay). Batches rows join and leave (the server's) and
        batches decoded without a cache stay eager; so do pressed prefills."""
        return self._compile

    @compile.setter
    def compile(self, mode: str) -> None:
        self._compile = compiled.check_mode(mode)

    @property
    def compiles(self) -> int:
        """Graphs the compiled prefill and decode step have compiled (0: they never ran)."""
        return 0 if self._step is None else self._step.compiles

    def _compiles(self, new_tokens: int | None, rows: int, filled: int) -> bool:
        """Whether a batch of ``rows`` rows of ``filled`` positions, each adding up to
        ``new_tokens`` (None: it stays eager), moves onto the compiled step: ``compile``
        resolves on for this device and size."""
        return new_tokens is not None and compiled.resolve(
            self._compile, self.model.device, compiled.positions(rows, filled, new_tokens))

    def _go_static(self, state: DecodeState, rebatched: bool = False) -> None:
        """Move a prefilled batch onto the compiled step's static cache where ``compile``
        says so (``_compiles``): "on" always (a batch it cannot take is refused by name),
        "auto" where the batch allows. ``rebatched``: a batch rows join and leave (the
        server's), its rows padded to a power of two; one the static cache cannot take stays
        eager under "on" too, so that a server never fails a request for it; under "auto" it
        stays eager (rebatching onto static caches has not been measured on a GPU yet)."""
        if rebatched and self._compile != "on":
            return
        if (self._compile == "auto" or rebatched) and compiled.refusal(state) is not None:
            return
        rows, filled = state.mask.shape  # the mask has a column per cache position
        if not self._compiles(state.new_tokens,
                              compiled.padded_rows(rows) if rebatched else rows, filled):
            return
        self._compiled().start(state, state.new_tokens, pad_rows=rebatched)

    def _prefill_step(self, positions: int) -> compiled.CompiledStep | None:
        """The compiled step whose prefill reads a batch of ``positions`` (rows x longest),
        where ``compile`` resolves on for it on this device (``compiled.resolve_prefill``);
        None: eager."""
        if (self.model.config.lora.scope == "merged"  # its merged rows read through PEFT's layers
                or not compiled.resolve_prefill(self._compile, self.model.device, positions)
                # "on" with layers a static cache cannot hold: the step is refused (or, rebatched,
                # stays eager) after this prefill; compiling it would be time spent for nothing
                or (self._compile == "on" and not self.joinable)):
            return None
        return self._compiled()

    def _compiled(self) -> compiled.CompiledStep:
        if self._step is None:
            self._step = compiled.CompiledStep(self.model.lm_config, self.model.device)
        return self._step

    def _go_dynamic(self, state: DecodeState) -> None:
        """Back from the static cache (``CompiledStep.back``), to be joined or cut."""
        if state.static_mask is not None:
            self._step.back(state)

    @property
    def joinable(self) -> bool:
        """Rows can join and leave a running batch (full-attention cache layers only)."""
        return can_rebatch(self.model)

    def keep_prefixes(self, max_bytes: int) -> None:
        # a pressed prefix's KV is not the prefix's rows: a press reads every prompt whole
        keep = self.joinable and self.press is None
        self.prefix_kv = LRUCache(max_bytes if keep else 0)

    def use_press(self, press: PressConfig | None) -> None:
        """Press every prompt read from now on (None: none)."""
        self.press = press
        self.keep_prefixes(self.prefix_kv.max_bytes)

    def prefill(self, prefixes, sampling=None, contexts=None, joinable: bool = False
                ) -> DecodeState:
        """``sampling``: the rows' ``GenerationConfig``s (their cache setting and how many
        tokens follow, for which the cache keeps room); ``joinable``: a batch rows will join and
        leave (the server's): plain cache layers, and rows whose leading context
        (``contexts[i]``: its key and merged row count, or None) is cached read only the rest."""
        for cfg in sampling or ():
            if cfg.merge_window:
                check_window(self.model, cfg.merge_window)
                if not cfg.use_cache:
                    raise KTMError(f"merge_window={cfg.merge_window} merges the answer in the "
                                   "KV cache: expected use_cache on")
        # how many tokens the rows add, for a static cache's room; a merged answer changes the
        # cache's length, so such a batch stays eager
        new = (max(cfg.max_new_tokens for cfg in sampling)
               if sampling and not any(cfg.merge_window for cfg in sampling) else None)
        if self.press is not None:
            state = self._pressed(prefixes, sampling)
        elif not joinable:
            use_cache = all(cfg.use_cache for cfg in sampling) if sampling else True
            longest = max((cp.tokens_out for cp in prefixes), default=0)
            static = use_cache and self._compiles(new, len(prefixes), longest)
            step = self._prefill_step(len(prefixes) * longest)
            # no room kept in a batch that goes static (copied once), nor in one the compiled
            # prefill reads (it fills plain ``DynamicLayer``s, which it was checked against)
            room = (max(cfg.max_new_tokens for cfg in sampling) - 1
                    if sampling and not static and step is None else 0)
            state = prefill(self.model, prefixes, use_cache, room=room, compiled=step)
            state.reused = [0] * len(prefixes)
            if not use_cache:
                return state
        else:
            state = self._joinable(prefixes, contexts)
        state.new_tokens, state.joinable = new, joinable
        if not joinable:  # a joinable batch goes static at its first step (``advance``)
            self._go_static(state)
        return state

    def _joinable(self, prefixes, contexts) -> DecodeState:
        """A batch rows can join and leave: plain cache layers, and rows whose leading context
        (``contexts[i]``: its key and merged row count, or None) is cached read only the
        rest."""
        contexts = contexts or [None] * len(prefixes)
        parts, order, reused, misses = [], [], [0] * len(prefixes), []
        for i, (cp, ctx) in enumerate(zip(prefixes, contexts)):
            stored, n = self._reusable(cp, ctx)
            n = min(n, cp.tokens_out - 1)
            if n < 1:
                misses.append(i)
                continue
            past = [(k[:, :, :n], v[:, :, :n]) for k, v in stored]
            rest = None if cp.positions is None else cp.positions[n:]
            gate = None if cp.merged_rows is None else cp.merged_rows[n:]
            parts.append(prefill_from_kv(self.model, past, cp.embeds[n:], rest, gate))
            if ctx[0] not in self.prefix_kv:  # started from another's rows: keep its own
                self._keep_context(cp, ctx, parts[-1], 0)
            order.append(i)
            reused[i] = n
        if misses:
            batch = prefill(self.model, [prefixes[i] for i in misses])
            for j, i in enumerate(misses):
                ctx = contexts[i]
                if ctx is not None and ctx[0] not in self.prefix_kv:
                    self._keep_context(prefixes[i], ctx, batch, j)
            parts.append(batch)
            order += misses
        state = parts[0]
        for part in parts[1:]:
            state = join(state, part)
        if order != sorted(order):  # back to the prefixes' order
            keep_rows(state, [order.index(i) for i in range(len(order))])
        state.reused = reused
        return state

    def _keep_context(self, cp, ctx, state: DecodeState, row: int) -> None:
        """Keep the KV of ``cp``'s leading context (``ctx``: key, rows), read as ``row`` of
        ``state``, with its embeddings and positions (what ``_reusable`` compares)."""
        if not self.prefix_kv.max_bytes:
            return
        n = ctx[1]
        pos = None if cp.positions is None else cp.positions[:n].clone()
        merged = None if cp.merged_rows is None else cp.merged_rows[:n].clone()
        self.prefix_kv[ctx[0]] = (row_kv(state, row, n), cp.embeds[:n].clone(), pos, merged)

    def _reusable(self, cp, ctx) -> tuple[list | None, int]:
        """Stored KV the prefix ``cp`` can start from, and how many of its leading rows: its
        context's own (``ctx``: key, rows), else the stored context sharing the most leading
        rows with it, the same embeddings at the same positions (a chat's merged history read
        at an earlier turn: the KV of a row depends on those rows alone); either way only the
        rows equal to the stored ones. (None, 0): none."""
        if ctx is None or not self.prefix_kv.max_bytes:
            return None, 0
        if ctx[0] in self.prefix_kv:
            # the key names the context's text; its rows as read are compared too: a reading
            # that depends on what follows the context (the question allocator's) starts from
            # the rows it shares with the stored one only, so a cached prefix never changes an
            # answer
            kv, embeds, positions, merged = self.prefix_kv[ctx[0]]
            return kv, min(ctx[1], shared_rows(cp, embeds, positions, merged))
        best, most = None, 0
        for key in list(self.prefix_kv):
            _, embeds, positions, merged = self.prefix_kv.peek(key)
            n = shared_rows(cp, embeds, positions, merged)
            if n > most:
                best, most = key, n
        return (None, 0) if best is None else (self.prefix_kv[best][0], most)

    def _pressed(self, prefixes, sampling) -> DecodeState:
        """Each prefix prefilled alone under the press (``pressed_row``), then batched."""
        if sampling and not all(cfg.use_cache for cfg in sampling):
            raise KTMError(f"press {self.press.name} compresses the KV cache: expected "
                           "use_cache on")
        state = None
        for cp in prefixes:
            r = pressed_row(self.model, cp, self.press)
            mask = torch.ones(1, r.length, dtype=torch.long, device=r.logits.device)
            row = DecodeState(cp.embeds[None, -1:], mask, r.positions[:, -1:], r.cache,
                              r.logits[:, -1], r.via, hidden=r.hidden)
            state = row if state is None else join(state, row)
        state.reused = [0] * len(prefixes)
        return state

    def merge_due(self, window: int, plain: int) -> int:
        """Generated tokens to merge now, of ``plain`` held plain (``merge_window``)."""
        return due(window, plain, self.model.k)

    def merge_generated(self, state: DecodeState, ids: torch.Tensor, plain: int) -> None:
        """Merge the oldest generated tokens ``ids`` (B, m) of the ``plain`` at the cache's
        tail (``ktm.decode.merge_generated``)."""
        with torch.no_grad(), eval_mode(self.model):
            merge_generated(self.model, state, ids, plain)

    def advance(self, state: DecodeState, tokens: torch.Tensor) -> None:
        if state.joinable and state.static_mask is None:
            self._go_static(state, rebatched=True)
        advance(self.model, state, tokens, self._step)

    def join(self, a: DecodeState, b: DecodeState) -> DecodeState:
        for state in (a, b):
            self._go_dynamic(state)
        out = join(a, b)
        out.reused = a.reused + b.reused
        out.new_tokens = (None if a.new_tokens is None or b.new_tokens is None
                          else max(a.new_tokens, b.new_tokens))
        out.joinable = True
        return out

    def keep(self, state: DecodeState, rows: list[int]) -> None:
        if rows:
            self._go_dynamic(state)  # static again at its next step
            keep_rows(state, rows)
            state.reused = [state.reused[j] for j in rows]

    def release(self, state) -> None:
        """Nothing to let go: the batch's cache goes with its state."""

    def score(self, prefixes, targets: list[list[int]]) -> list[torch.Tensor]:
        if self.press is not None:
            with torch.no_grad(), eval_mode(self.model):
                t = pressed_targets(self.model, prefixes, targets, self.press,
                                    via=self.model.decode_lm())
        else:
            t = target_logits(self.model, [None] * len(prefixes), targets, prefixes=prefixes)
        lp = torch.log_softmax(t.logits, -1).gather(1, t.labels[:, None])[:, 0]
        return list(lp.split(t.lengths))

    def clear(self) -> None:
        self.prefix_kv.clear()

    def kv_bytes(self, state: DecodeState) -> int:
        """Bytes of every layer's cached keys and values (a ``RoomyLayer``'s free room, the
        same for every method, not counted)."""
        return sum(t.nbytes for layer in state.cache.layers for t in (layer.keys, layer.values)
                   if t is not None)

    def record(self) -> dict:
        rec = {} if self.press is None else {"press": self.press.to_dict()}
        if self._compile == "on" or self.compiles:
            rec["compiled"] = {"mode": self._compile, "compiles": self.compiles}
        return rec

    def close(self) -> None:
        self.prefix_kv.clear()
