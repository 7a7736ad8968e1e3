"""The llama.cpp runtime: a merged prefix prefilled and its answer decoded by llama.cpp.

ktm's one decode loop (``ktm.decode.generate.decode_steps``) asks a model's runtime for two
things: ``prefill(prefixes)`` (the ``CompressedPrompt``s a batch starts from) and
``advance(state, tokens)`` (one token per row). This runtime answers both through
llama-cpp-python's low-level API, so sampling, stop strings and streaming stay ktm's own:

- a prefix goes in as input embeddings (``llama_batch.embd``): merged vectors and plain tokens'
  table rows alike, since a llama.cpp batch holds either embeddings or token ids, never both;
  decoded tokens go in as ids;
- each prompt of a batch is a sequence of its own (ids 0..B-1) in one unified KV cache, each at
  consecutive positions: llama.cpp accepts no others, so a spread-position model is refused;
- the cache is kept between calls: a prefix whose first rows equal what a sequence already holds
  (the same merged document, the earlier turns of a chat) is prefilled from the first row that
  differs; when the cells run out, the idle sequence prefilled longest ago is dropped first.

The llama.cpp library is imported on first use, so ktm works without the ``[llamacpp]`` extra
until this runtime is asked for.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ktm.errors import KTMError
from ktm.util.own_engine import OwnEngine

INSTALL = "pip install 'ktm[llamacpp]'  (builds llama.cpp from source: about 12 minutes on 2 cores)"


def import_llama_cpp():
    """The llama_cpp module, or a one-line error saying how to install it."""
    try:
        import llama_cpp
    except ImportError as e:
        raise KTMError(f"the llama.cpp backend needs llama-cpp-python, which is not installed "
                       f"({e}); install it with: {INSTALL}") from None
    return llama_cpp


KV_TYPES = {"f32": 0, "f16": 1}  # ggml type ids
DEFAULT_CONTEXT = 16384


@dataclass(frozen=True)
class RuntimeConfig:
    """How the llama.cpp context is made. ``context``: KV-cache cells shared by all sequences
    (one per prompt or generated token held; None: the model's trained context, at most
    ``DEFAULT_CONTEXT``); ``sequences``: prompts one batch may hold;
    ``kv_type``: the cache's number type (f32 for exact parity with the torch path);
    ``threads``: None for torch's thread count; ``gpu_layers``: layers offloaded where
    llama.cpp was built for a GPU (0 on a CPU build). ``deterministic``: greedy output that
    depends on nothing but the prompt: each sequence gets its own cells (``context /
    sequences`` each, instead of sharing all), every prompt is read from its first row (no rows
    reused from an earlier request), and each row is decoded in a llama.cpp batch of its own;
    it costs the batched decode's throughput (docs/llamacpp.md)."""

    # ("flag": None: a setting of the library only, no command-line flag)
    context: int | None = field(default=None, metadata={
        "metavar": "N", "help": "llama.cpp KV-cache cells, shared by all prompts decoding at "
                                "once (None: the model's trained context, at most 16384)"})
    sequences: int = field(default=16, metadata={
        "metavar": "N", "help": "prompts llama.cpp decodes at once at most"})
    batch: int = field(default=512, metadata={"flag": None})
    threads: int | None = field(default=None, metadata={
        "metavar": "N", "help": "llama.cpp CPU threads (None: torch's thread count)"})
    gpu_layers: int = field(default=0, metadata={"flag": None})
    # the KV cache's type: f16 (llama.cpp's default, half the memory) | f32
    kv_type: str = field(default="f16", metadata={
        "choices": sorted(KV_TYPES), "help": "llama.cpp KV-cache type: f16 (its default) or f32 "
                                             "(the torch path's precision exactly, no flash "
                                             "attention)"})
    deterministic: bool = field(default=False, metadata={
        "help": "llama.cpp: greedy output independent of other requests and of what ran before "
                "(cells per sequence, no reused rows, a decode batch per row; slower under "
                "load)"})
    # llama.cpp's weight layouts repacked for this CPU (its "extra buffer types"): off, as on a
    # Xeon with AMX and AVX-512 llama-cpp-python 0.3.36's decode of the Q4_1 GGUF crashes with
    # them (a segmentation fault at the first llama_decode)
    extra_buffers: bool = field(default=False, metadata={"flag": None})

    def __post_init__(self) -> None:
        if self.kv_type not in KV_TYPES:
            raise KTMError(f"llama.cpp kv_type must be one of {sorted(KV_TYPES)}, got "
                           f"{self.kv_type!r}")
        for name in ("context", "sequences", "batch"):
            v = getattr(self, name)
            if v is None and name == "context":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise KTMError(f"llama.cpp {name} must be an integer >= 1, got {v!r}")
        if self.sequences > self.batch:  # a decode step feeds one token per sequence at once
            raise KTMError(f"llama.cpp sequences ({self.sequences}) must not exceed its batch "
                           f"({self.batch})")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise KTMError(f"llama.cpp threads must be an integer >= 1 or None, got "
                           f"{self.threads!r}")


@dataclass
class Held:
    """What one sequence of the cache holds: its prefix rows (embeddings, positions) and the
    number of decoded tokens after them."""

    embeds: torch.Tensor | None = None  # (L, D) float32, on the CPU
    positions: torch.Tensor | None = None  # (L,)
    decoded: int = 0
    merged: torch.Tensor | None = None  # (L,) bool: the rows read with the adapter (gated)


@dataclass
class LlamaState:
    """A batch being decoded by llama.cpp: its rows' sequences, next positions and logits."""

    seqs: list[int]
    next_pos: list[int]
    logits: torch.Tensor  # (B, V)
    reused: list[int] = field(default_factory=list)  # prefix rows found in the cache, per row


def _silence(llama_cpp):
    """Route llama.cpp's log lines to nothing (it writes every load's details to stderr); the
    callback object is kept alive as long as the module is."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


_LOG_CALLBACK = None


class LlamaCppRuntime(OwnEngine):
    """A llama.cpp model (base GGUF + LoRA adapter GGUF) and one context over it. Its KV cache,
    graphs and weight types are llama.cpp's (``OwnEngine``: no press, nothing of ktm's
    compiled)."""

    name = "llamacpp"
    gives_logits = True
    joinable = True  # each row is a sequence of its own
    rereads = False  # no use_cache=False: the cache is always kept
    prefix_kv = None  # cached prefixes live in its own KV cache

    def __init__(self, base_gguf: str | Path, adapter_gguf: str | Path | None,
                 config: RuntimeConfig = RuntimeConfig(), gated: bool = False):
        """``gated``: the adapter reads the merged rows only (a LoRA of scope "merged",
        ``ktm.core.lora_scope``): a prefix is decoded in runs of merged and plain rows, the
        adapter set for the first and cleared for the second, and every token without it."""
        self.lib = lib = import_llama_cpp()
        self.gated = gated and adapter_gguf is not None
        self._adapting: bool | None = None  # whether the adapter is set now (None: unknown)
        self.files = {"model_gguf": str(base_gguf),
                      "adapter_gguf": None if adapter_gguf is None else str(adapter_gguf)}
        _silence(lib)
        lib.llama_backend_init()
        self.config = config
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = config.gpu_layers
        mparams.use_extra_bufts = config.extra_buffers
        self.model = lib.llama_model_load_from_file(str(base_gguf).encode(), mparams)
        if not self.model:
            raise KTMError(f"llama.cpp could not load the GGUF model {str(base_gguf)!r}: "
                           "expected a GGUF file of a causal LM llama.cpp runs")
        self.adapter = None
        if adapter_gguf is not None:
            self.adapter = lib.llama_adapter_lora_init(self.model, str(adapter_gguf).encode())
            if not self.adapter:
                self.close()
                raise KTMError(f"llama.cpp could not load the LoRA adapter {str(adapter_gguf)!r} "
                               f"onto {str(base_gguf)!r}: expected an adapter exported for "
                               "this base model (ktm export --format gguf)")
        threads = config.threads or torch.get_num_threads()
        cparams = lib.llama_context_default_params()
        self.context = config.context or min(lib.llama_model_n_ctx_train(self.model),
                                             DEFAULT_CONTEXT)
        cparams.n_ctx = self.context
        cparams.n_batch = config.batch
        cparams.n_ubatch = config.batch
        cparams.n_seq_max = config.sequences
        # sequences share the cells (one long prompt may use them all), unless each must read
        # its cache laid out the same whatever the others hold
        cparams.kv_unified = not config.deterministic
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.no_perf = True
        cparams.type_k = cparams.type_v = KV_TYPES[config.kv_type]
        if config.kv_type == "f32":
            # llama.cpp's CPU flash attention rounds queries to F16; off keeps F32 throughout
            cparams.flash_attn_type = 0
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            self.close()
            raise KTMError(f"llama.cpp could not make a context of {self.context} cells for "
                           f"{str(base_gguf)!r} (out of memory?): expected a smaller context")
        if self.adapter is not None:
            try:
                self._adapt(not self.gated)
            except KTMError:
                self.close()
                raise
        self.memory = lib.llama_get_memory(self.ctx)
        self.width = lib.llama_model_n_embd_inp(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.held = [Held() for _ in range(config.sequences)]
        self.busy: set[int] = set()  # sequences a running batch decodes
        self.used = [0] * config.sequences  # when each sequence was last prefilled (eviction)
        self._clock = 0

    def _adapt(self, on: bool) -> None:
        """Set the adapter (at scale 1) or clear it, unless it is so already."""
        if self.adapter is None or on == self._adapting:
            return
        lib = self.lib
        if on:
            adapters = (lib.llama_adapter_lora_p_ctypes * 1)(self.adapter)
            rc = lib.llama_set_adapters_lora(self.ctx, adapters, 1, (ctypes.c_float * 1)(1.0))
        else:
            rc = lib.llama_set_adapters_lora(self.ctx, None, 0, None)
        if rc != 0:
            raise KTMError(f"llama.cpp refused to {'set' if on else 'clear'} the LoRA adapter "
                           f"{self.files['adapter_gguf']!r} (llama_set_adapters_lora returned "
                           f"{rc})")
        self._adapting = on

    # ---- the two calls of ktm's decode loop --------------------------------------------------

    def prefill(self, prefixes, sampling=None, contexts=None, joinable: bool = False
                ) -> LlamaState:
        """Read the prefixes (``CompressedPrompt``s), each into a free sequence of its own (the
        one whose cached rows it shares most), from the first row that sequence lacks.
        Sampling stays the decode loop's; cached rows are found by comparing them, so
        ``contexts`` is not needed, and every batch can be joined."""
        free = [s for s in range(self.config.sequences) if s not in self.busy]
        if len(prefixes) > len(free):
            raise KTMError(f"{len(prefixes)} prompts, but this llama.cpp context has "
                           f"{len(free)} of its {self.config.sequences} sequences free: expected "
                           f"at most {self.config.sequences} prompts decoding at once "
                           "(--llamacpp-sequences)")
        seqs, logits, next_pos, reused = [], [], [], []
        own = self.context // self.config.sequences  # a sequence's cells when not shared
        try:
            for cp, cfg in zip(prefixes, sampling or [None] * len(prefixes)):
                embeds, positions, merged = self._rows(cp)
                need = embeds.shape[0] + (cfg.max_new_tokens if cfg is not None else 1)
                if self.config.deterministic and need > own:
                    raise KTMError(f"a prompt of {embeds.shape[0]} rows and its answer need "
                                   f"{need} KV cells, but a deterministic llama.cpp context "
                                   f"gives each of its {self.config.sequences} sequences "
                                   f"{own}: expected a larger --llamacpp-context")
                seq = max(free, key=lambda s: self._shared(s, embeds, positions, merged))
                free.remove(seq)
                self.busy.add(seq)
                self._clock += 1
                self.used[seq] = self._clock
                seqs.append(seq)
                start = self._cut(seq, embeds, positions, merged)
                self.held[seq] = Held()  # unknown until the rows are in
                logits.append(self._feed_embeds(seq, embeds, start, merged))
                self.held[seq] = Held(embeds.clone(), positions.clone(), merged=merged.clone())
                next_pos.append(embeds.shape[0])
                reused.append(start)
        except BaseException:
            self.busy.difference_update(seqs)
            raise
        return LlamaState(seqs, next_pos, torch.stack(logits), reused)

    def advance(self, state: LlamaState, tokens: torch.Tensor) -> None:
        """Feed one token per row, all rows in one llama.cpp batch (deterministic: a batch per
        row, the shape a request decoded alone has); updates ``state``."""
        if self.config.deterministic and len(state.seqs) > 1:
            rows = [LlamaState([seq], [pos], state.logits[j:j + 1])
                    for j, (seq, pos) in enumerate(zip(state.seqs, state.next_pos))]
            for j, row in enumerate(rows):
                self.advance(row, tokens[j:j + 1])
            state.logits = torch.cat([row.logits for row in rows])
            state.next_pos = [row.next_pos[0] for row in rows]
            return
        lib = self.lib
        ids = tokens.tolist()
        self._adapt(not self.gated)  # a decoded token is plain
        batch = lib.llama_batch_init(len(ids), 0, 1)
        try:
            batch.n_tokens = len(ids)
            for j, (seq, tok) in enumerate(zip(state.seqs, ids)):
                batch.token[j] = int(tok)
                batch.pos[j] = state.next_pos[j]
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = seq
                batch.logits[j] = 1
            self._decode(batch, "a decoded token")
        finally:
            lib.llama_batch_free(batch)
        state.logits = torch.stack([self._logits(j) for j in range(len(ids))]).to(
            state.logits.device)
        for j, seq in enumerate(state.seqs):
            state.next_pos[j] += 1
            self.held[seq].decoded += 1

    def target_logits(self, prefixes, targets: list[list[int]]) -> list[torch.Tensor]:
        """Per prompt, the (T, V) logits predicting each of its target tokens: the prefix read
        (reusing cached rows), then the target fed as ids (scoring: R, likelihoods, perplexity)."""
        out = []
        for cp, target in zip(prefixes, targets):
            state = self.prefill([cp])
            try:
                rows = [state.logits[0]]
                if len(target) > 1:
                    rows += list(self._feed_tokens(state.seqs[0], target[:-1],
                                                   state.next_pos[0]))
                    self.held[state.seqs[0]].decoded += len(target) - 1
            finally:
                self.release(state)
            out.append(torch.stack(rows))
        return out

    def score(self, prefixes, targets: list[list[int]]) -> list[torch.Tensor]:
        """Per prompt, the (T,) log-probabilities of its target tokens (from ``target_logits``)."""
        return [torch.log_softmax(lg.float(), -1)[torch.arange(len(t)), torch.tensor(t)]
                for lg, t in zip(self.target_logits(prefixes, targets), targets)]

    def _feed_tokens(self, seq: int, ids: list[int], start: int) -> torch.Tensor:
        """Token ids at positions ``start..`` of one sequence, in batches; (len, V) logits."""
        lib, size, out = self.lib, self.config.batch, []
        self._adapt(not self.gated)  # target tokens are plain
        for lo in range(0, len(ids), size):
            chunk = ids[lo:lo + size]
            batch = lib.llama_batch_init(len(chunk), 0, 1)
            try:
                batch.n_tokens = len(chunk)
                for j, t in enumerate(chunk):
                    batch.token[j] = int(t)
                    batch.pos[j] = start + lo + j
                    batch.n_seq_id[j] = 1
                    batch.seq_id[j][0] = seq
                    batch.logits[j] = 1
                self._decode(batch, "the target")
                out += [self._logits(j) for j in range(len(chunk))]
            finally:
                lib.llama_batch_free(batch)
        return torch.stack(out)

    # ---- continuous batching (the server) ----------------------------------------------------

    def join(self, a: LlamaState, b: LlamaState) -> LlamaState:
        """``a``'s rows then ``b``'s (each keeps its own sequence)."""
        return LlamaState(a.seqs + b.seqs, a.next_pos + b.next_pos,
                          torch.cat([a.logits, b.logits]), a.reused + b.reused)

    def keep(self, state: LlamaState, rows: list[int]) -> None:
        """Drop every row not in ``rows``: its sequence is free again (its KV stays cached)."""
        self.busy.difference_update(s for j, s in enumerate(state.seqs) if j not in rows)
        state.seqs = [state.seqs[j] for j in rows]
        state.next_pos = [state.next_pos[j] for j in rows]
        state.reused = [state.reused[j] for j in rows] if state.reused else []
        state.logits = state.logits[rows]

    def release(self, state: LlamaState | None) -> None:
        """A finished batch: its sequences are free again (their KV stays cached)."""
        if state is not None:
            self.busy.difference_update(state.seqs)

    # ---- the cache ---------------------------------------------------------------------------

    def _rows(self, cp) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A prefix's rows (float32, CPU), positions and merged flags, checked for what
        llama.cpp reads."""
        embeds = cp.embeds.detach().to(device="cpu", dtype=torch.float32)
        if embeds.shape[1] != self.width:
            raise KTMError(f"prefix rows are {embeds.shape[1]} wide, but the llama.cpp model "
                           f"reads {self.width}-wide input embeddings: expected the GGUF of "
                           "this model's base")
        consecutive = torch.arange(embeds.shape[0])
        positions = consecutive if cp.positions is None else cp.positions.detach().cpu()
        if not torch.equal(positions, consecutive):
            raise KTMError("llama.cpp reads a sequence only at consecutive positions, but this "
                           "prompt's are spread (a spread-position model): expected a model "
                           "with consecutive positions (e.g. the reader smollm2-135m-k4-seq)")
        merged = (torch.zeros(embeds.shape[0], dtype=torch.bool) if cp.merged_rows is None
                  else cp.merged_rows.detach().cpu())
        return embeds, positions, merged

    def _shared(self, seq: int, embeds: torch.Tensor, positions: torch.Tensor,
                merged: torch.Tensor) -> int:
        """Leading rows of a prefix that sequence ``seq`` already holds (the same rows at the
        same positions, merged alike), at most all but the last (whose logits the decode starts
        from)."""
        held = self.held[seq]
        if held.embeds is None or self.config.deterministic:
            return 0
        m = min(held.embeds.shape[0], embeds.shape[0] - 1)
        same = ((held.embeds[:m] == embeds[:m]).all(-1) & (held.positions[:m] == positions[:m])
                & (held.merged[:m] == merged[:m]))
        return m if bool(same.all()) else int((~same).int().argmax())

    def _cut(self, seq: int, embeds: torch.Tensor, positions: torch.Tensor,
             merged: torch.Tensor) -> int:
        """Keep the rows of ``seq`` this prefix shares, drop the rest; returns how many stay."""
        n = self._shared(seq, embeds, positions, merged)
        if not self.lib.llama_memory_seq_rm(self.memory, seq, n, -1):
            self.lib.llama_memory_seq_rm(self.memory, seq, -1, -1)  # a whole sequence always goes
            n = 0
        return n

    def _evict(self) -> bool:
        """Free the cached rows of the idle sequence used longest ago; False if none holds any."""
        idle = [s for s in range(self.config.sequences)
                if s not in self.busy and self.held[s].embeds is not None]
        if not idle:
            return False
        seq = min(idle, key=lambda s: self.used[s])
        self.lib.llama_memory_seq_rm(self.memory, seq, -1, -1)
        self.held[seq] = Held()
        return True

    def clear(self) -> None:
        """Forget every cached sequence."""
        self.lib.llama_memory_clear(self.memory, True)
        self.held = [Held() for _ in range(self.config.sequences)]
        self.busy.clear()

    # ---- llama.cpp calls ---------------------------------------------------------------------

    def _feed_embeds(self, seq: int, embeds: torch.Tensor, start: int,
                     merged: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``start:`` of one sequence's prefix, in batches (gated: in runs of merged and
        plain rows, ``merged`` (L,), each with the adapter set or cleared); the last row's
        logits."""
        lib, total = self.lib, embeds.shape[0]
        for lo, hi, adapted in self._chunks(start, total, merged):
            self._adapt(adapted)
            chunk = embeds[lo:hi].contiguous()
            batch = lib.llama_batch_init(hi - lo, self.width, 1)
            try:
                batch.n_tokens = hi - lo
                ctypes.memmove(batch.embd, chunk.data_ptr(), chunk.numel() * 4)
                for j in range(hi - lo):
                    batch.pos[j] = lo + j
                    batch.n_seq_id[j] = 1
                    batch.seq_id[j][0] = seq
                    batch.logits[j] = int(lo + j == total - 1)
                self._decode(batch, "the prompt")
            finally:
                lib.llama_batch_free(batch)
        return self._logits(-1)

    def _chunks(self, start: int, total: int, merged: torch.Tensor | None
                ) -> list[tuple[int, int, bool]]:
        """(lo, hi, adapter on?) of the batches rows ``start:total`` are decoded in: at most
        ``config.batch`` rows each, and, gated, none mixing merged and plain rows."""
        cuts = [start, total]
        if self.gated and merged is not None and total > start:
            flags = merged[start:total]
            cuts += [start + int(i) + 1 for i in (flags[1:] != flags[:-1]).nonzero()]
        cuts = sorted(set(cuts) | set(range(start, total, self.config.batch)))
        return [(lo, hi, bool(merged[lo]) if self.gated and merged is not None
                 else not self.gated) for lo, hi in zip(cuts, cuts[1:])]

    def _decode(self, batch, what: str) -> None:
        rc = self.lib.llama_decode(self.ctx, batch)
        while rc == 1 and self._evict():  # the cache is full: drop an idle sequence's rows
            rc = self.lib.llama_decode(self.ctx, batch)
        if rc == 1:
            raise KTMError(f"llama.cpp has no room in its KV cache for {what}: the context "
                           f"holds {self.context} cells for all sequences; expected a "
                           "larger context (--llamacpp-context) or shorter prompts")
        if rc != 0:
            raise KTMError(f"llama.cpp could not decode {what} (llama_decode returned {rc})")

    def _logits(self, i: int) -> torch.Tensor:
        ptr = self.lib.llama_get_logits_ith(self.ctx, i)
        if not ptr:
            raise KTMError(f"llama.cpp returned no logits for output {i}")
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())

    def row_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """(L, V) logits at every row of one prompt given as (L, D) input embeddings, read
        afresh at positions 0..L-1 (the parity checks' reference; sequence 0 is cleared)."""
        embeds = rows.detach().to(device="cpu", dtype=torch.float32).contiguous()
        return self._fresh(embeds.shape[0], lambda batch: ctypes.memmove(
            batch.embd, embeds.data_ptr(), embeds.numel() * 4), self.width)

    def token_logits(self, ids: list[int]) -> torch.Tensor:
        """(L, V) logits at every position of a prompt given as token ids, read afresh."""
        def fill(batch):
            for j, t in enumerate(ids):
                batch.token[j] = int(t)
        return self._fresh(len(ids), fill, 0)

    def _fresh(self, n: int, fill, width: int) -> torch.Tensor:
        """Rows read afresh, every one plain (gated: without the adapter)."""
        lib = self.lib
        self._adapt(not self.gated)
        if not 0 < n <= self.config.batch:
            raise KTMError(f"a fresh read takes 1 to {self.config.batch} rows, got {n}")
        seq = next((s for s in range(self.config.sequences) if s not in self.busy), None)
        if seq is None:
            raise KTMError("every llama.cpp sequence is decoding: a fresh read needs a free one")
        lib.llama_memory_seq_rm(self.memory, seq, -1, -1)
        self.held[seq] = Held()
        batch = lib.llama_batch_init(n, width, 1)
        try:
            batch.n_tokens = n
            fill(batch)
            for j in range(n):
                batch.pos[j] = j
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = seq
                batch.logits[j] = 1
            self._decode(batch, "the prompt")
            return torch.stack([self._logits(j) for j in range(n)])
        finally:
            lib.llama_batch_free(batch)
            lib.llama_memory_seq_rm(self.memory, seq, -1, -1)

    def keep_prefixes(self, max_bytes: int) -> None:
        """The cells keep what sequences held until they are needed: no budget of its own."""

    def kv_bytes(self, state: LlamaState) -> int:
        """Bytes the KV cache holds for the batch's rows (keys and values of every layer)."""
        cells = sum(state.next_pos)
        lib = self.lib
        per = (lib.llama_model_n_layer(self.model) * 2 * lib.llama_model_n_head_kv(self.model)
               * (lib.llama_model_n_embd(self.model) // lib.llama_model_n_head(self.model)))
        return cells * per * (4 if self.config.kv_type == "f32" else 2)

    def record(self) -> dict:
        """What a result row records of this runtime: its files and context settings."""
        from dataclasses import asdict

        # a file by its folder and name (an export's folder is its fingerprint, the embedded
        # GGUF's its package): never a path of this machine
        files = {k: v if not isinstance(v, str) else "/".join(Path(v).parts[-2:])
                 for k, v in self.files.items()}
        return {**files, **asdict(self.config), "context": self.context,
                "llama_cpp_python": getattr(self.lib, "__version__", None)}

    def close(self) -> None:
        lib = self.lib
        if getattr(self, "ctx", None):
            lib.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "adapter", None):
            lib.llama_adapter_lora_free(self.adapter)
            self.adapter = None
        if getattr(self, "model", None):
            lib.llama_model_free(self.model)
            self.model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass
