"""The serving engine: one thread that decodes all running requests together.

Continuous batching on the model's runtime (``ktm.decode.runtime``: torch, llama.cpp or vLLM),
stepped through ``ktm.decode.generate.Decoding``, the step loop ``decode_steps`` runs on (each
row's token picked by its own settings, one advance per step), with rows joining and leaving
between steps:

    loop: admit waiting requests -> prefill them together -> join them to the running batch
          -> pick one token per row (each row with its own sampling settings and generator)
          -> the logprobs of the rows that asked (``ktm.serving.logprobs``)
          -> send each request its new text -> drop finished or disconnected rows -> advance

An idle engine waits ``batch_window_ms`` after a request so that requests arriving together are
prefilled together; while it is decoding, arrivals join at the next step. Rows never affect each
other (left padding, position ids of real positions only), so batching does not change outputs.

Prefix cache: the merged embeddings of every compressed segment are kept here (LRU,
bytes-bounded), and the runtime keeps the KV of a prompt's leading context (before its question,
or up to its last merged segment: ``context_of``; torch within this budget, llama.cpp and vLLM in
their own caches). A request whose context was seen before prefills only what follows it.

Torch work runs on this thread; the asyncio server only queues requests and relays text.

Its metrics (``ktm.serving.metrics``) are counted here, each before the event that ends a step
is delivered, so a client that has its answer finds it counted in ``/metrics``. ``abort`` ends
every request, waiting or running, with an error: the end of a shutdown's grace time.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ktm.core.allocate import RatioWarning
from ktm.core.batch import CompressedPrompt
from ktm.core.fit import encode_fitted
from ktm.core.prompt import Segment
from ktm.decode.generate import Decoding, GenerationConfig
from ktm.decode.press import PressConfig, pressed_as
from ktm.decode.text_stream import TextStream
from ktm.errors import KTMError
from ktm.serving.config import ServeConfig
from ktm.serving.logprobs import TokenLogprob, Trail, step_logprobs
from ktm.serving.metrics import Metrics
from ktm.serving.prompts import context_of
from ktm.serving.protocol import RequestError
from ktm.util.lru import LRUCache

log = logging.getLogger("ktm.serving")
RETRY_AFTER_S = 1  # a full queue's Retry-After: a decode step frees rows within it


@dataclass
class Event:
    """What a request receives: new text, and at the end a finish reason and usage."""

    text: str = ""
    finish: str | None = None  # "stop" (EOS or a stop string) or "length"
    usage: dict | None = None
    error: RequestError | None = None
    logprobs: list[TokenLogprob] | None = None  # of the tokens whose text starts in ``text``


@dataclass
class Job:
    segments: tuple[Segment, ...]  # token-id segments, merged or plain
    max_tokens: int | None  # None: as many as fit, at most the server's max_tokens_limit
    deliver: Callable[[Event], None]  # thread-safe; called from the engine thread
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # 0: greedy
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # alternatives per token (0: the chosen one's only); None: off
    press: PressConfig | None = None  # the KV press its prompt is read with (None: none)
    # the leading segments whose KV the server keeps for later prompts that begin with them
    # (None: ``context_of``, before its question; a chat: all but its generation prompt)
    context: tuple[Segment, ...] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.monotonic)
    ahead: bool = False  # the server's own read of a chat's next turn (counted apart)
    # the ratio its merged parts were read at when the server fitted it to the window (None:
    # read as sent)
    ratio_read: float | None = None

    @property
    def tokens_in(self) -> int:
        return sum(len(s.ids) for s in self.segments)


def sampling(job: Job, limit: int) -> GenerationConfig:
    """A request's decoding settings: temperature 0 or top_p 0 (a nucleus of the most likely
    token only) is greedy."""
    return GenerationConfig(max_new_tokens=limit, do_sample=job.temperature > 0 and job.top_p > 0,
                            temperature=job.temperature or 1.0, top_p=job.top_p or 1.0,
                            seed=job.seed, stop_at_eos=not job.ignore_eos)


class Row:
    """A running request: its sampling settings, token count and released text."""

    def __init__(self, job: Job, model, cp: CompressedPrompt, cached: int, limit: int):
        self.job, self.limit, self.n = job, limit, 0
        self.cfg = sampling(job, limit)
        self.gen = None
        if self.cfg.do_sample and job.seed is not None:
            self.gen = torch.Generator(device=model.device).manual_seed(job.seed)
        self.text = TextStream(model.tokenizer, job.stop)
        self.trail = None if job.logprobs is None else Trail(model.tokenizer)
        self.eos = model.eos_ids
        self.cells = cp.tokens_out + limit  # KV cells it may come to hold (llama.cpp's budget)
        self.prompt = {"prompt_tokens": cp.tokens_in, "prompt_tokens_merged": cp.tokens_out,
                       "prompt_tokens_details": {"cached_tokens": cached}}
        if job.ratio_read is not None:  # fitted to the window: the ratio it was read at
            self.prompt["prompt_ratio_read"] = job.ratio_read

    def push(self, token: int) -> Event:
        """The row's next token (with a trail, the engine has added its logprob entry)."""
        self.n += 1
        if self.cfg.ends_at(token, self.eos):
            return self._end(self.text.flush(), "stop")
        piece = self.text.push(token)
        if self.text.stopped:
            return self._end(piece, "stop")
        if self.n >= self.limit:  # what was held back may end in a stop string
            piece += self.text.flush()
            return self._end(piece, "stop" if self.text.stopped else "length")
        return Event(piece, logprobs=self._logprobs(final=False))

    def _end(self, text: str, reason: str) -> Event:
        usage = {**self.prompt, "completion_tokens": self.n,
                 "total_tokens": self.prompt["prompt_tokens"] + self.n}
        return Event(text, reason, usage, logprobs=self._logprobs(final=True))

    def _logprobs(self, final: bool) -> list[TokenLogprob] | None:
        if self.trail is None:
            return None
        return self.trail.take(self.text.sent, final, cut=self.text.stopped)


class Engine:
    def __init__(self, model, cfg: ServeConfig):
        self.model, self.cfg = model, cfg
        self.context: int | None = model.max_positions
        budget = int(cfg.prefix_cache_mb * 2**20)
        self.runtime = model.runtime
        # the torch runtime's decode step (--compile) and linear layers (--weights); a runtime
        # with an engine of its own takes their defaults only, which ServeConfig checked
        self.runtime.compile = cfg.runtime.compile
        self.runtime.weights = cfg.runtime.weights
        # vLLM samples inside its own step and hands back tokens, not a distribution
        self.logits = self.runtime.gives_logits
        self.rebatch = self.runtime.joinable  # else: windowed batches
        self.merged = LRUCache(budget // 8)
        self.runtime.keep_prefixes(budget - budget // 8)
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._rows: list[Row] = []
        self._batch: Decoding | None = None  # the running rows, stepped together
        # llama.cpp: requests wait for KV cells while this many rows or more run (None: no wait)
        self._cells_wait: int | None = None
        self._stopping = False
        self._abort: RequestError | None = None  # once set, every request ends with it
        self._thread = threading.Thread(target=self._run, name="ktm-engine", daemon=True)
        self.counts = {"finished": 0, "cancelled": 0, "rejected": 0, "failed": 0, "aborted": 0,
                       "steps": 0, "peak_running": 0, "read_ahead": 0}
        self.last_error: str | None = None
        self.metrics = Metrics(running=lambda: len(self._rows), waiting=lambda: len(self._waiting))

    # ---------------------------------------------------------------- called from the server
    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def kv(self) -> LRUCache | None:
        """The KV of leading contexts, where the runtime keeps it within this server's budget
        (None: in a cache of its own)."""
        return self.runtime.prefix_kv

    def submit(self, *jobs: Job) -> None:
        """Queue ``jobs`` (the choices of one request): all of them, or none if they do not fit."""
        with self._cond:
            if self._abort is not None:
                raise self._abort
            if len(self._waiting) + len(jobs) > self.cfg.max_queue:
                raise RequestError(f"server busy: {len(self._waiting)} requests are waiting "
                                   f"(max_queue={self.cfg.max_queue}); retry later",
                                   code="server_busy", status=503, kind="server_error",
                                   headers={"Retry-After": str(RETRY_AFTER_S)})
            self._waiting.extend(jobs)
            self._cond.notify_all()

    def abort(self, error: RequestError) -> None:
        """End every request, waiting or running, with ``error`` before the next step, and
        refuse later ones with it (a shutdown's grace time is over)."""
        with self._cond:
            self._abort = error
            self._cond.notify_all()

    def cancel(self, job: Job) -> None:
        """The client went away: its row is dropped before the next step."""
        if not job.cancelled.is_set():
            job.cancelled.set()
            with self._cond:
                self._cond.notify_all()

    def stats(self) -> dict:
        return {"running": len(self._rows), "waiting": len(self._waiting),
                "max_batch": self.cfg.max_batch, "continuous_batching": self.rebatch,
                **self.counts, "prefix_cache": {"merged": self.merged.stats(),
                                                "kv": None if self.kv is None else self.kv.stats()},
                "last_error": self.last_error}

    # ---------------------------------------------------------------- the engine thread
    def _run(self) -> None:
        with torch.no_grad():
            while (jobs := self._take()) is not None:
                try:
                    if self._abort is not None:
                        self._end_all(jobs)
                        continue
                    if jobs:
                        self._admit(jobs)
                    if self._rows:
                        self._step()
                except Exception as e:  # noqa: BLE001 - fail the running requests, keep serving
                    # the shared forward pass (or the batch's book-keeping) failed: no request is
                    # to blame and the batch's state is unknown, so every row ends; _admit and
                    # _step answer what they can attribute to one request themselves
                    log.exception("engine step failed: the %d running requests fail",
                                  len(self._rows))
                    self._fail([r.job for r in self._rows], e)

    def _take(self) -> list[Job] | None:
        """Block until there is work; the waiting requests that fit in the batch now."""
        with self._cond:
            while not self._stopping and not self._waiting and not self._rows:
                self._cond.wait()
            if self._stopping:
                return None
            if self._abort is not None:
                return []
            if not self._rows and self._waiting:  # idle: let requests arriving together gather
                deadline = self._waiting[0].arrived + self.cfg.batch_window_ms / 1000
                while (not self._stopping and len(self._waiting) < self.cfg.max_batch
                       and (left := deadline - time.monotonic()) > 0):
                    self._cond.wait(left)
            free = self.cfg.max_batch - len(self._rows) if self.rebatch or not self._rows else 0
            if self._cells_wait is not None:
                if len(self._rows) < self._cells_wait:  # a row ended: its cells are free again
                    self._cells_wait = None
                else:
                    free = 0
            jobs: list[Job] = []
            while self._waiting and len(jobs) < free:
                job = self._waiting.popleft()
                if job.cancelled.is_set():
                    self._ended("cancelled")
                else:
                    jobs.append(job)
            return jobs

    def _fitted(self, job: Job) -> CompressedPrompt:
        """The layout of ``job``'s prompt (no embedding), fitted to the window as the library
        fits one (``ktm.core.fit``: its merged parts read at a higher ratio, the question's lines
        plain) when its reading and the tokens it may generate run past it. The request then
        reads the fitted segments (its kept context too, keyed on the ratio read) and its usage
        says the ratio (``prompt_ratio_read``). One that cannot fit is laid out as sent: its
        refusal (``_limit``) names the positions it spans."""
        if self.context is not None:
            # tokens it may generate: as it asks, else as many as the server allows; the last
            # is never read back
            room = (job.max_tokens or self.cfg.max_tokens_limit) - 1
            try:
                with warnings.catch_warnings(record=True) as told:
                    warnings.simplefilter("always", RatioWarning)
                    (segs,), (cp,) = encode_fitted(self.model, [job.segments], True, [room],
                                                   embed=False)
            except KTMError as e:
                log.info("a prompt could not be fitted to the context: %s", e)
            else:
                if segs != tuple(job.segments):
                    for w in told:
                        log.info("%s", w.message)
                    kept = None if job.context is None else len(job.context)
                    job.segments = segs
                    job.context = None if kept is None else segs[:kept]
                    job.ratio_read = cp.ratio_read
                return cp
        return self.model.encode_prompts([job.segments], embed=False)[0]

    def _limit(self, job: Job, cp: CompressedPrompt) -> int | None:
        """Tokens this request may generate, or None after answering it with an error."""
        # tokens it may generate: the last one is returned, never read back, so it takes no position
        room = None if self.context is None else self.context - cp.next_position + 1
        # the limit is on the positions the prompt spans: with spread positions a merged block
        # takes its last token's position, so that can exceed the number of merged embeddings
        what = (f"the prompt spans {cp.next_position} positions after merging ({cp.tokens_out} "
                f"embeddings from {cp.tokens_in} tokens, K={self.model.k})")
        if cp.tokens_out == cp.tokens_in:  # sent plain ("ktm": {"merge": false}) or K=1
            what = (f"the prompt spans {cp.next_position} positions ({cp.tokens_in} tokens, "
                    "none merged)")
        want = job.max_tokens or min(self.cfg.max_tokens_limit, room or self.cfg.max_tokens_limit)
        err = None
        if room is not None and room < 1:
            err = f"{what}: more than the model's context of {self.context} positions"
        elif room is not None and want > room:
            err = (f"{what}; with max_tokens={want} it needs {cp.next_position + want - 1} "
                   f"positions (the last new token is not read back), more than the model's "
                   f"context of {self.context}")
        if err:
            self._ended("rejected")
            job.deliver(Event(error=RequestError(err, param="max_tokens" if room and room > 0
                                                 else "prompt", code="context_length_exceeded")))
            job.cancelled.set()  # answered: a failure of its batch-mates must not answer it again
            return None
        return want

    def _fit_cells(self, keep: list[tuple[Job, CompressedPrompt, int]]
                   ) -> list[tuple[Job, CompressedPrompt, int]]:
        """The llama.cpp backend's KV cells are shared by all sequences: admit requests, in
        order, while the cells they may come to hold (prompt rows + tokens they may generate)
        fit beside the running rows'; the rest wait, first in line, until a row ends. One that
        cannot fit even alone is answered with an error. A runtime that counts no cells (a
        vLLM server) schedules its cache itself."""
        total = self.runtime.context
        if total is None:
            return keep
        free = total - sum(r.cells for r in self._rows)
        fit, later = [], []
        for job, cp, limit in keep:
            need = cp.tokens_out + limit
            if need > total:
                self._ended("rejected")
                job.deliver(Event(error=RequestError(
                    f"the prompt's {cp.tokens_out} rows after merging and max_tokens={limit} "
                    f"need {need} KV-cache cells, more than the llama.cpp context's {total} "
                    "(ktm serve --llamacpp-context)", param="max_tokens",
                    code="context_length_exceeded")))
                job.cancelled.set()
            elif not later and need <= free:
                fit.append((job, cp, limit))
                free -= need
            else:
                later.append(job)
        if later:
            with self._cond:
                self._waiting.extendleft(reversed(later))
            self._cells_wait = len(self._rows) + len(fit)
        return fit

    def _admit(self, jobs: list[Job]) -> None:
        """Prefill ``jobs`` and join them to the running batch. A failure before the join fails
        these requests only: the running ones never saw them."""
        try:
            parts, rows = self._prefill(jobs)
        except Exception as e:  # noqa: BLE001 - fail the request to blame, keep the others
            jobs = [j for j in jobs if not j.cancelled.is_set()]
            if len(jobs) > 1:  # which request was it: each read alone (rows never affect each
                # other, so alone each gets the answer it would have got in the batch)
                log.warning("admitting %d requests together failed (%s: %s): each is read "
                            "alone", len(jobs), type(e).__name__, e)
                for job in jobs:
                    self._admit([job])
                return
            log.exception("admitting a request failed")
            self._fail(jobs, e, running=False)
            return
        self._rows += rows  # first: a failed join (it grows the batch's cache) fails them too
        for part in parts:
            if self._batch is None:
                self._batch = part
            else:
                self._batch.join(part)
        self.counts["peak_running"] = max(self.counts["peak_running"], len(self._rows))

    def _prefill(self, jobs: list[Job]) -> tuple[list, list[Row]]:
        # a prompt too long is fitted or refused from its counts (``encode_prompts(...,
        # embed=False)``), before the encoder reads it: one many times the context costs its
        # tokens' ids, never their embeddings
        measured = [self._fitted(job) for job in jobs]
        fits = [(job, limit) for job, cp in zip(jobs, measured)
                if (limit := self._limit(job, cp)) is not None]
        cps = self.model.encode_prompts([j.segments for j, _ in fits], cache=self.merged)
        keep = self._fit_cells([(job, cp, limit) for (job, limit), cp in zip(fits, cps)])
        if not keep:
            return [], []
        states: list[Decoding] = []
        try:
            return self._prefill_groups(keep, states)
        except BaseException:
            for state in states:  # the groups read before the failure hold rows: let them go
                state.release()
            raise

    def _prefill_groups(self, keep: list[tuple[Job, CompressedPrompt, int]],
                        states: list[Decoding]) -> tuple[list, list[Row]]:
        """``keep``'s prefill, one per press, each group's state appended to ``states`` as it
        is made."""
        rows = []
        for press in dict.fromkeys(job.press for job, _, _ in keep):  # a prefill per press
            group = [(job, cp, limit) for job, cp, limit in keep if job.press == press]
            with pressed_as(self.runtime, press):
                state = self.runtime.prefill([cp for _, cp, _ in group],
                                             [sampling(job, limit) for job, _, limit in group],
                                             [self._context(job) for job, _, _ in group],
                                             joinable=True)
            mine = [Row(job, self.model, cp, n, limit)
                    for (job, cp, limit), n in zip(group, state.reused)]
            for (job, cp, _), n in zip(group, state.reused):
                if not job.ahead:  # the server's own reads are counted apart
                    m = self.metrics
                    m.prompt_tokens.inc(cp.tokens_in)
                    m.prompt_positions.inc(cp.tokens_out)
                    m.cache_queries.inc(cp.tokens_out)
                    m.cache_hits.inc(n)
            states.append(Decoding(self.runtime, state, [r.cfg for r in mine],
                                   [r.gen for r in mine]))
            rows += mine
        return states, rows

    def _context(self, job: Job) -> tuple[tuple, int] | None:
        """A prompt's leading context (``context_of``: before its question) as the runtime may keep
        its KV: its key and merged row count; None when there is none or nothing is kept."""
        context = context_of(job.segments) if job.context is None else job.context
        if not context or self.kv is None or not self.kv.max_bytes:
            return None
        # counts: no encoder run
        n = self.model.encode_prompts([context], embed=False)[0].tokens_out
        # keyed on how the text is read too: a document read at another ratio is another
        # context (the runtime still compares the rows it reuses)
        return tuple((s.ids, s.compress, s.ratio, s.levels) for s in context), n

    def _step(self) -> None:
        gone = [i for i, r in enumerate(self._rows) if r.job.cancelled.is_set()]
        if gone:
            self._ended("cancelled", len(gone))
            self._keep([i for i in range(len(self._rows)) if i not in gone])
            if not self._rows:
                return
        tokens, failed = self._batch.pick()
        asked = [i for i, r in enumerate(self._rows) if r.trail is not None and i not in failed]
        lps = step_logprobs(self._batch.logits, tokens, asked,
                            [self._rows[i].job.logprobs for i in asked]) if asked else {}
        done, out, generated = [], [], 0
        for i, (row, tok) in enumerate(zip(self._rows, tokens.tolist())):
            generated += i not in failed and not row.job.ahead
            try:
                if i in lps:
                    row.trail.add(tok, *lps[i])
                ev = self._row_failed(row, failed[i]) if i in failed else row.push(tok)
            except Exception as e:  # noqa: BLE001 - its text or stop strings: this request only
                ev = self._row_failed(row, e)
            # the first token is told even when its text is held back (part of a character,
            # or of a stop string): the reply starts when the first token is chosen
            if ev.text or ev.finish or ev.error or ev.logprobs or row.n == 1:
                out.append((row.job, ev))
            if ev.finish or ev.error:
                done.append(i)
        # book-keeping first, then deliver: a client that has its last event never sees its row
        # still running or uncounted in /health
        self.counts["steps"] += 1
        self.counts["finished"] += sum(1 for job, ev in out if ev.finish and not job.ahead)
        self.counts["read_ahead"] += sum(1 for job, ev in out if ev.finish and job.ahead)
        self.metrics.generation_tokens.inc(generated)
        for job, ev in out:
            if ev.finish and job.ahead:
                self.metrics.ahead.inc()
            elif ev.finish:
                self.metrics.success.labels(ev.finish).inc()
        if done:
            keep = [i for i in range(len(self._rows)) if i not in done]
            self._keep(keep)
            tokens = tokens[keep]
        for job, ev in out:
            job.deliver(ev)
        if self._rows:
            self._batch.advance(tokens)

    def _row_failed(self, row: Row, e: Exception) -> Event:
        """One request failed while decoding: a 500 for it, its row dropped, the others go on."""
        log.error("a request failed while decoding (the others go on): %s: %s",
                  type(e).__name__, e, exc_info=e)
        self.last_error = f"{type(e).__name__}: {e}"
        self._ended("failed")
        return Event(error=_internal(e))

    def _keep(self, rows: list[int]) -> None:
        self._batch.keep(rows)  # the dropped rows are let go
        if not rows:
            self._batch, self._rows = None, []
            return
        self._rows = [self._rows[i] for i in rows]

    def _fail(self, jobs: list[Job], e: Exception, running: bool = True) -> None:
        """Answer ``jobs`` with a 500; ``running``: they include the batch, which is dropped.
        Not running: one request read alone failed, a 400 where ktm refuses what it asks
        (a ``KTMError``: the request is to blame, not the server)."""
        if running:
            if self._batch is not None:
                self._batch.release()
            self._batch, self._rows = None, []
        refused = not running and isinstance(e, KTMError)
        error = RequestError(f"this request cannot be read: {e}") if refused else _internal(e)
        if not refused:
            self.last_error = f"{type(e).__name__}: {e}"
        self._ended("rejected" if refused else "failed", len(jobs))
        for job in jobs:
            job.deliver(Event(error=error))

    def _end_all(self, taken: list[Job]) -> None:
        """``abort``: the running rows, the jobs just taken and every waiting one end with its
        error."""
        with self._cond:
            jobs = [r.job for r in self._rows] + taken + list(self._waiting)
            self._waiting.clear()
        if self._batch is not None:
            self._batch.release()
        self._batch, self._rows = None, []
        jobs = [j for j in jobs if not j.cancelled.is_set()]
        self._ended("aborted", len(jobs))
        for job in jobs:
            job.cancelled.set()
            job.deliver(Event(error=self._abort))

    def _ended(self, how: str, n: int = 1) -> None:
        """``n`` requests ended otherwise than by stop or length: cancelled (the client went),
        rejected (too long), failed or aborted (the shutdown)."""
        self.counts[how] += n
        self.metrics.failure.labels("shutdown" if how == "aborted" else how).inc(n)


def _internal(e: Exception) -> RequestError:
    return RequestError(f"internal error while generating: {type(e).__name__}: {e}",
                        status=500, kind="server_error")
