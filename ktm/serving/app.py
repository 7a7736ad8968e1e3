"""The HTTP layer of ``ktm serve``: OpenAI-compatible routes on FastAPI, served by uvicorn.

    POST /v1/completions        prompt (or ktm segments) -> text, SSE with "stream": true
    POST /v1/chat/completions   messages through the chat template -> assistant message
    GET  /v1/models             the served model, its K and base model (/v1/models/{id}: its card)
    GET  /health                engine state: running / waiting requests, cache statistics
    GET  /metrics               Prometheus' text format (``ktm.serving.metrics``)

Each route is a handler of this module (``router``) that reads the engine, the model and the
settings ``create_app`` keeps on ``app.state``. Every request first passes ``ktm.serving.gate``
(its key, its body's size and nesting). On SIGTERM or Ctrl-C the server stops taking requests
and gives those in flight ``--shutdown-timeout`` seconds; the engine then ends the rest with an
error (a stream with an error event, then ``[DONE]``), the model's runtime is closed (a vLLM
server ktm started is stopped), and ``ktm serve`` exits 0.

Why FastAPI + uvicorn: it is the most used and best kept ASGI stack in Python (vLLM's and
SGLang's OpenAI servers run on it); its pydantic models give the request schema, type checks and
the refusal of unknown fields in one place; Starlette's ``StreamingResponse`` writes SSE and
notices a client that went away; uvicorn is the reference ASGI server. A model step is torch
work, so it runs on the engine's own thread and the event loop only relays text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from ktm.core.levels import merges
from ktm.errors import KTMError
from ktm.serving.config import ServeConfig
from ktm.serving.engine import Engine, Event, Job
from ktm.serving.gate import Gate, is_loopback
from ktm.serving.history import next_turn
from ktm.serving.logprobs import chat_logprobs, completion_logprobs
from ktm.serving.metrics import CONTENT_TYPE, Metrics
from ktm.serving.openapi import openapi_document
from ktm.serving.prompts import chat_reading, completion_segments
from ktm.serving.protocol import (
    ChatRequest,
    CompletionRequest,
    KtmOptions,
    RequestError,
    error_body,
    validation_message,
)

log = logging.getLogger("ktm.serving")
# OpenAI's default for /v1/completions (a server whose --max-tokens-limit is lower: its limit)
COMPLETION_DEFAULT_MAX_TOKENS = 16
# the routes /metrics counts by name (any other path: "other")
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
# bytes of request body per prompt token the default --max-request-mb leaves room for (a token
# is a few characters of text, six bytes each where JSON escapes them as \uXXXX)
BYTES_PER_TOKEN = 64


class ClientGone(Exception):
    pass


class Handle:
    """One request's link to the engine: its jobs (one per choice, ``n``) deliver
    ``(choice, event)`` on one asyncio queue."""

    def __init__(self, engine: Engine, jobs: list[dict]):
        self.engine, self.loop = engine, asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Event] | None] = asyncio.Queue()
        self.jobs = [Job(deliver=partial(self._deliver, i), **args)
                     for i, args in enumerate(jobs)]
        self._watcher: asyncio.Task | None = None

    def _deliver(self, choice: int, ev: Event) -> None:  # engine thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (choice, ev))
        except RuntimeError:  # the event loop is gone (shutdown)
            for job in self.jobs:
                job.cancelled.set()

    def cancel(self) -> None:
        """Its rows are dropped before the next step (those still running)."""
        for job in self.jobs:
            self.engine.cancel(job)

    def watch(self, request: Request) -> None:
        """Until ``unwatch``, a disconnect of the client (the ASGI receive channel says
        ``http.disconnect``) makes ``next`` raise ``ClientGone``."""
        async def wait_for_disconnect() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.queue.put_nowait(None)

        self._watcher = asyncio.ensure_future(wait_for_disconnect())

    def unwatch(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()

    async def next(self) -> tuple[int, Event]:
        item = await self.queue.get()
        if item is None:
            raise ClientGone
        return item


def merged_usage(usages: list[dict], n: int) -> dict:
    """The usage of the choices of a request, ``n`` per prompt: each prompt counted once (by its
    first choice), every completion."""
    def total(key: str, of: list[dict]) -> int:
        return sum(u[key] for u in of)

    firsts = usages[::n]
    prompt, completion = total("prompt_tokens", firsts), total("completion_tokens", usages)
    out = {"prompt_tokens": prompt, "prompt_tokens_merged": total("prompt_tokens_merged", firsts),
           "prompt_tokens_details": {"cached_tokens": sum(
               u["prompt_tokens_details"]["cached_tokens"] for u in firsts)},
           "completion_tokens": completion, "total_tokens": prompt + completion}
    fitted = [u["prompt_ratio_read"] for u in firsts if "prompt_ratio_read" in u]
    if fitted:  # a prompt fitted to the window: the highest ratio one was read at
        out["prompt_ratio_read"] = max(fitted)
    return out


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def request_press(runtime, ext: KtmOptions, history=None):
    """The KV press a request is read with: its ``ktm`` field's (``press``, ``press_ratio``;
    ``"none"``: none), else the server's ``--press``; ``history``: the press a chat's history
    is read with to fit its budget (``chat_reading``), which excludes another."""
    from ktm.decode.press import PressConfig

    if history is not None:
        if ext.press is not None or ext.press_ratio is not None:
            raise RequestError(f"ktm.press and the history press {history.name} both press this "
                               "chat's older part: expected one (ktm.history_press \"none\" "
                               "merges the history instead)", param="ktm.press")
        return _pressing(runtime, history.name, history.ratio, "ktm.history_press")
    server = runtime.press
    if ext.press is None and ext.press_ratio is None:
        return server
    name = ext.press or (server.name if server is not None else None)
    if name is None:
        raise RequestError("ktm.press_ratio needs a press: name one in ktm.press (this server "
                           "reads with none)", param="ktm.press_ratio")
    if name == "none":
        return None
    ratio = ext.press_ratio if ext.press_ratio is not None else (
        server.ratio if server is not None else PressConfig.ratio)
    return _pressing(runtime, name, ratio, "ktm.press")


def _pressing(runtime, name: str, ratio: float, param: str):
    """The press ``name`` at ``ratio``, once this server can read with it (a known press, a
    runtime with presses, kvpress installed); a 400 naming ``param`` if not."""
    from ktm.decode.press import PressConfig, import_kvpress, press_refusal

    try:
        cfg = PressConfig(name, ratio)
        if not runtime.presses:
            raise KTMError(press_refusal(runtime.name, cfg.name))
        import_kvpress()
    except KTMError as e:
        raise RequestError(str(e), param=param) from None
    return cfg


def request_bytes(cfg: ServeConfig, model) -> int:
    """The largest request body: ``--max-request-mb``, else room for the longest prompt the
    model reads (its context of positions, each K tokens merged, ``BYTES_PER_TOKEN`` each), at
    least 1 MiB; 16 MiB for a model without a known context."""
    if cfg.max_request_mb is not None:
        return int(cfg.max_request_mb * 2**20)
    context = model.max_positions
    if context is None:
        return 16 * 2**20
    return max(2**20, context * model.k * BYTES_PER_TOKEN)


def create_app(model, cfg: ServeConfig, owns_model: bool = False) -> FastAPI:
    """The server's app: the engine, the model and the settings its routes read on
    ``app.state``, every request through the ``Gate``, the routes of ``router``. ``owns_model``:
    the server's end is the model's (``ktm serve``), so its runtime is closed then: a vLLM
    engine's processes end with the server."""
    engine = Engine(model, cfg)
    app = FastAPI(title="ktm serve", lifespan=lifespan)
    state = app.state
    state.engine, state.model, state.cfg, state.metrics = engine, model, cfg, engine.metrics
    state.owns_model, state.started = owns_model, int(time.time())
    state.stopping = asyncio.Event()  # set once a signal asks the server to stop (``drain``)
    state.loop = None  # the event loop serving the app, once it runs (``lifespan``)
    state.drain, state.shutdown_timeout = partial(drain, app), cfg.shutdown_timeout
    app.add_middleware(Gate, keys=cfg.api_key, max_bytes=request_bytes(cfg, model),
                       stopping=state.stopping, count=engine.metrics.count_http, routes=ROUTES)
    for kind, handler in ERROR_HANDLERS.items():
        app.add_exception_handler(kind, handler)
    app.include_router(router)
    app.openapi = partial(openapi_document, app)  # what the server answers (ktm.serving.openapi)
    return app


@asynccontextmanager
async def lifespan(app: FastAPI):
    """The engine's thread runs while the app is served; after it, the model's runtime is closed
    where the server owns the model."""
    state = app.state
    state.loop = asyncio.get_running_loop()
    if not state.cfg.api_key and not is_loopback(state.cfg.host):
        log.warning("listening on %s without an API key: anyone who reaches this port may "
                    "generate (--api-key or KTM_API_KEY)", state.cfg.host)
    state.engine.start()
    yield
    state.engine.shutdown()
    if state.owns_model:  # here, not after uvicorn.run: on SIGTERM uvicorn re-raises the signal
        state.model.runtime.close()


def drain(app: FastAPI) -> None:
    """Stop taking requests and give those in flight ``shutdown_timeout`` seconds; safe from any
    thread and from a signal handler (``app.state.drain``)."""
    if app.state.loop is not None:
        app.state.loop.call_soon_threadsafe(begin_draining, app.state)


def begin_draining(state) -> None:
    """``drain``'s work, on the event loop: the ``Gate`` refuses new requests from now on, and
    the engine ends those still running once ``shutdown_timeout`` has passed."""
    if state.stopping.is_set():
        return
    state.stopping.set()
    timeout = state.cfg.shutdown_timeout
    log.info("shutting down: the requests in flight get %g s to finish", timeout)
    state.loop.call_later(timeout, state.engine.abort, RequestError(
        f"the server is shutting down: this request did not finish within its "
        f"--shutdown-timeout of {timeout:g} s", status=503, kind="server_error",
        code="server_shutdown"))


# ---- errors, each in OpenAI's shape -----------------------------------------------------------

async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = validation_message(list(exc.errors()))
    return JSONResponse(error_body(message, param=param), status_code=400)


async def refused(_: Request, exc: RequestError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    # its headers kept: a 405's Allow names the methods the path takes
    return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code,
                        headers=exc.headers)


async def crashed(_: Request, exc: Exception) -> JSONResponse:  # a bug: OpenAI's shape too
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}",
                                   "server_error"), status_code=500)


ERROR_HANDLERS = {RequestValidationError: invalid_body, RequestError: refused,
                  HTTPException: http_error, Exception: crashed}


# ---- the routes -------------------------------------------------------------------------------

router = APIRouter()


def not_served(cfg: ServeConfig, name: str) -> RequestError:
    return RequestError(f"model {name!r} is not served here: this server serves "
                        f"{cfg.served_name!r}", param="model", code="model_not_found", status=404)


def model_card(state) -> dict:
    cfg, model = state.cfg, state.model
    return {"id": cfg.served_name, "object": "model", "created": state.started,
            "owned_by": "ktm", "root": cfg.model, "k": model.k, "merges": merges(model),
            "base_model": model.config.base_model, "max_model_len": state.engine.context}


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    state = request.app.state
    stopping = state.stopping.is_set()
    ok = state.engine.alive and not stopping  # a load balancer stops sending requests
    status = "ok" if ok else "shutting down" if stopping else "engine stopped"
    body = {"status": status, "model": state.cfg.served_name, "k": state.model.k,
            "base_model": state.model.config.base_model, **state.engine.stats()}
    if state.cfg.api_key:  # open to all: another client's error text is not shown (the log has it)
        del body["last_error"]
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models")
async def models(request: Request) -> dict:
    return {"object": "list", "data": [model_card(request.app.state)]}


@router.get("/v1/models/{model_id:path}")
async def one_model(model_id: str, request: Request) -> dict:
    if model_id != request.app.state.cfg.served_name:
        raise not_served(request.app.state.cfg, model_id)
    return model_card(request.app.state)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    return await generate(body, request, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request):
    return await generate(body, request, chat=True)


async def generate(body, request: Request, chat: bool):
    """A completion or chat request: checked, its prompts read, a job per choice queued; the
    answer whole once every choice has ended, or streamed once every choice has started."""
    arrived = time.monotonic()
    state = request.app.state
    job = job_settings(state, body, chat)
    prompts, history_press, history = await read_prompts(state, body, chat)
    job["press"] = request_press(state.model.runtime, body.ktm or KtmOptions(), history_press)
    # OpenAI's order: each prompt's n choices in turn; choice i of a prompt samples with
    # seed + i: n different answers, each reproducible alone
    # a chat's next turn begins with this whole prompt but its generation prompt
    handle = Handle(state.engine, [{**job, "segments": segments,
                                    "context": segments[:-1] if chat else None,
                                    "seed": None if body.seed is None else body.seed + i}
                                   for segments in prompts for i in range(body.n)])
    state.engine.submit(*handle.jobs)
    events = await first_events(handle, request, body.stream, state.metrics, arrived)
    if events is None:
        log.info("the client of a %s request went away; its rows are freed",
                 "chat" if chat else "completion")
        return JSONResponse(error_body("client disconnected"), status_code=499)
    answer = Answer.of(state, body, chat, history, arrived)
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(stream(handle, events, answer, usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return whole_answer(answer, events, len(handle.jobs), job["logprobs"])


def job_settings(state, body, chat: bool) -> dict:
    """What every choice of a request decodes with (a ``Job``'s fields but its prompt, seed and
    press), once the request passes this server's checks: its model, its stream options and
    logprobs, its token and choice limits; a ``RequestError`` for the first that fails."""
    cfg = state.cfg
    if body.model != cfg.served_name:
        raise not_served(cfg, body.model)
    body.check_stream_options()
    logprobs = body.logprobs_asked()
    if logprobs is not None and not state.engine.logits:
        raise RequestError(f"logprobs are not available on the {state.model.runtime.name} backend: "
                           "it samples inside its own engine and returns tokens only",
                           param="logprobs")
    max_tokens = ((body.max_completion_tokens or body.max_tokens) if chat
                  else body.max_tokens or min(COMPLETION_DEFAULT_MAX_TOKENS,
                                              cfg.max_tokens_limit))
    if max_tokens is not None and max_tokens > cfg.max_tokens_limit:
        name = "max_completion_tokens" if chat and body.max_completion_tokens else "max_tokens"
        raise RequestError(f"{name}={max_tokens} is over this server's limit of "
                           f"{cfg.max_tokens_limit}", param=name)
    stop = tuple(body.stop_list())
    count = 1 if chat else len(body.prompt_values())  # checked before any is tokenized
    if count * body.n > cfg.max_queue:
        raise RequestError(f"{count} prompt(s) with n={body.n} make {count * body.n} "
                           f"choices, over this server's max_queue of {cfg.max_queue}",
                           param="n")
    ext = body.ktm or KtmOptions()
    return {"max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p,
            "stop": stop, "ignore_eos": ext.ignore_eos, "logprobs": logprobs}


async def read_prompts(state, body, chat: bool) -> tuple[list, object, object]:
    """The request's prompts as segments, read on a worker thread, with the press a chat's
    history is read with and how that history was read (``chat_reading``; None for a
    completion): a chat's one prompt, within ``--history-budget``, or each of a completion's."""
    if not chat:
        return await run_in_threadpool(completion_segments, state.model, body), None, None
    segments, history_press, history = await run_in_threadpool(
        chat_reading, state.model, body, state.cfg.history_budget, state.cfg.history_press)
    if history is not None:
        state.metrics.count_history(history)
    return [segments], history_press, history


async def first_events(handle: Handle, request: Request, streamed: bool, metrics,
                       arrived: float) -> list[tuple[int, Event]] | None:
    """The events that come before the 200: until every choice has started (a prompt too long
    is refused here, before the 200), and for an answer not ``streamed`` until every choice has
    ended. A choice's error is raised, the other choices ended; None if the client went away
    first (its rows are freed)."""
    choices, events = len(handle.jobs), []
    handle.watch(request)
    try:
        started, ends = set(), 0
        while len(started) < choices or (not streamed and ends < choices):
            i, ev = await handle.next()
            if ev.error:
                raise ev.error
            if not events:
                metrics.ttft.observe(time.monotonic() - arrived)
            started.add(i)
            ends += ev.finish is not None
            events.append((i, ev))
    except ClientGone:
        handle.cancel()
        return None
    except BaseException:
        handle.cancel()  # one choice refused or failed: the others end too
        raise
    finally:
        handle.unwatch()  # a stream's disconnects are watched by StreamingResponse
    return events


@dataclass
class Answer:
    """What a request's answer is made of, streamed or whole. ``head``: its id, creation time
    and model; ``per_prompt``: choices per prompt (``n``); ``ext``: the answer's ``ktm`` field
    (how a chat was read within its budget; None: none); ``ahead``: given choice 0's whole text,
    reads the chat's next turn (``read_ahead``; None: nothing)."""

    head: dict
    chat: bool
    per_prompt: int
    arrived: float
    ext: dict | None
    ahead: Callable[[str], None] | None
    metrics: Metrics
    tokenizer: object

    @classmethod
    def of(cls, state, body, chat: bool, history, arrived: float) -> Answer:
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": rid, "created": int(time.time()), "model": state.cfg.served_name}
        # how a chat was read within its budget: merged, read deeper, its oldest left out
        ext = None if history is None else {"ktm": {"history": history.to_dict()}}
        # --history-ahead: given the answer, the chat's next turn is read (one choice only)
        ahead = (partial(read_ahead, state, body)
                 if chat and state.cfg.history_ahead and body.n == 1 else None)
        return cls(head, chat, body.n, arrived, ext, ahead, state.metrics, state.model.tokenizer)

    def logprobs(self, entries: list | None) -> dict | None:
        """A choice's logprobs in the shape of this kind of answer (None: none asked)."""
        if entries is None:
            return None
        return (chat_logprobs if self.chat else completion_logprobs)(self.tokenizer, entries)

    def ended(self) -> None:
        """Every choice has ended: the request's time is observed."""
        self.metrics.e2e.observe(time.monotonic() - self.arrived)


def whole_answer(answer: Answer, events: list[tuple[int, Event]], choices: int,
                 logprobs: int | None) -> dict:
    """The answer not streamed: each choice's text, logprobs and end, and the usage of all."""
    texts, ends_of = [""] * choices, [Event()] * choices
    entries: list[list | None] = [None if logprobs is None else []] * choices
    for i, ev in events:
        texts[i] += ev.text
        if ev.logprobs is not None:
            entries[i] = entries[i] + ev.logprobs
        if ev.finish:
            ends_of[i] = ev
    if answer.ahead is not None and ends_of[0].finish:
        answer.ahead(texts[0])
    answer.ended()
    chat = answer.chat
    return {**answer.head, **(answer.ext or {}),
            "object": "chat.completion" if chat else "text_completion",
            "choices": [{"index": i, **({"message": {"role": "assistant", "content": text}}
                                        if chat else {"text": text}),
                         "logprobs": answer.logprobs(lps), "finish_reason": end.finish}
                        for i, (text, end, lps) in enumerate(zip(texts, ends_of, entries))],
            "usage": merged_usage([e.usage for e in ends_of], answer.per_prompt)}


class Chunks:
    """The SSE chunks of a streamed answer: each carries one choice (its ``index``), the first
    also the answer's ``ktm`` field; with ``usage``, each a null usage and a last one the whole
    request's."""

    def __init__(self, answer: Answer, usage: bool):
        self.answer, self.usage, self.first = answer, usage, True
        self.kind = "chat.completion.chunk" if answer.chat else "text_completion"

    def choice(self, i: int, text: str | None, finish: str | None, role: bool = False,
               logprobs: list | None = None) -> str:
        if self.answer.chat:
            delta = {"role": "assistant", "content": ""} if role else (
                {"content": text} if text else {})
            choice = {"index": i, "delta": delta}
        else:
            choice = {"index": i, "text": text or ""}
        out = {**self.answer.head, "object": self.kind, "choices": [
            {**choice, "logprobs": self.answer.logprobs(logprobs), "finish_reason": finish}]}
        if self.first:
            out.update(self.answer.ext or {})
            self.first = False
        return _sse({**out, "usage": None} if self.usage else out)

    def totals(self, usages: list[dict]) -> str:
        """The usage chunk: every choice's, each prompt counted once."""
        return _sse({**self.answer.head, "object": self.kind, "choices": [],
                     "usage": merged_usage(usages, self.answer.per_prompt)})


async def stream(handle: Handle, events: list[tuple[int, Event]], answer: Answer,
                 usage: bool) -> AsyncIterator[str]:
    """SSE chunks (``Chunks``): the events read before the 200, then the rest as they come; the
    usage chunk and ``[DONE]`` once all ended; ``answer.ahead`` then given choice 0's whole
    text. An error ends it with an error event, then ``[DONE]``."""
    chunks, chat, ahead = Chunks(answer, usage), answer.chat, answer.ahead
    done, n, ends = False, len(handle.jobs), {}
    early, text = iter(events), []
    try:
        if chat:
            for i in range(n):
                yield chunks.choice(i, None, None, role=True)
        while len(ends) < n:
            i, ev = next(early, None) or await handle.next()
            if ev.error:
                yield _sse(ev.error.body())
                break
            if chat and ev.text and ev.finish:
                yield chunks.choice(i, ev.text, None, logprobs=ev.logprobs)
                yield chunks.choice(i, None, ev.finish)
            elif ev.text or ev.finish or ev.logprobs:
                yield chunks.choice(i, ev.text, ev.finish, logprobs=ev.logprobs)
            if i == 0 and ev.text and ahead is not None:
                text.append(ev.text)
            if ev.finish:
                ends[i] = ev.usage
        else:
            answer.ended()
            if ahead is not None:  # before the last chunks: a client may close on them
                ahead("".join(text))
            if usage:
                yield chunks.totals([ends[i] for i in range(n)])
        yield _sse("[DONE]")
        done = True
    except ClientGone:  # the watcher saw it go just as the first event came: no one to tell
        pass
    finally:
        handle.cancel()  # a client gone mid-stream frees its rows at the next step
        if not done:
            log.info("%s: the client went away mid-stream; its rows are freed",
                     answer.head["id"])


def read_ahead(state, body: ChatRequest, answer: str) -> None:
    """``--history-ahead``: the chat's next turn (``next_turn``'s guess) read on a worker thread
    and queued as a job of one token answered to no one (``read_next_turn``). Called only for a
    chat of one choice on a server with ``history_ahead``."""
    asyncio.get_running_loop().run_in_executor(None, read_next_turn, state, body, answer)


def read_next_turn(state, body: ChatRequest, answer: str) -> None:
    """Queue the read of the chat's guessed next turn. Its context's KV stays in the prefix
    cache, and the real next turn starts from the rows it shares with it. A guess that cannot be
    read, or one read with a KV press (its history's or its prompt's: a pressed prompt is read
    whole every turn), reads nothing ahead; a busy server drops it."""
    guess = next_turn(body.messages, answer)
    if guess is None:
        return
    cfg, model = state.cfg, state.model
    try:
        segments, history, _ = chat_reading(model, body.model_copy(update={"messages": guess}),
                                            cfg.history_budget, cfg.history_press)
        press = request_press(model.runtime, body.ktm or KtmOptions(), history)
        if press is None:
            state.engine.submit(Job(segments=segments, max_tokens=1, deliver=lambda ev: None,
                                    context=segments[:-1], ahead=True))
    except (KTMError, RequestError) as e:  # the real turn reads it all itself
        log.debug("nothing read ahead: %s", e)


class Server(uvicorn.Server):
    """uvicorn's server, which tells the app (``app.state.drain``) when a signal asks it to
    stop, so that the requests in flight get ``--shutdown-timeout`` seconds before uvicorn's
    own grace time (a little longer) would cut them."""

    def __init__(self, app: FastAPI, **config):
        grace = app.state.shutdown_timeout + SHUTDOWN_MARGIN_S
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=grace, **config))
        self.drain = app.state.drain

    def handle_exit(self, sig: int, frame) -> None:
        self.drain()
        super().handle_exit(sig, frame)


# how much longer than --shutdown-timeout uvicorn waits for the answers the engine has just
# ended: their last chunks are written within it
SHUTDOWN_MARGIN_S = 10.0


class BackgroundServer:
    """uvicorn serving ``app`` on a loopback socket in a thread (tests and the benchmark).

    The socket is bound before the thread starts, so ``url`` is valid at once (port 0: any free
    port); ``with`` waits until the server accepts requests and stops it afterwards.
    ``stop()`` stops it as SIGTERM stops ``ktm serve`` (``join`` waits for the end).
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning"):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = Server(app, log_level=log_level)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True, name="ktm-serve")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"ktm serve did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.handle_exit(signal.SIGTERM, None)

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def serve(cfg: ServeConfig) -> None:
    """``ktm serve``: load the model and serve it until SIGTERM or Ctrl-C, then stop as the
    module docstring says and return."""
    import torch

    from ktm.serving.config import load_served_model

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model = load_served_model(cfg)
    keyed = f", {len(cfg.api_key)} API key(s) asked" if cfg.api_key else ""
    print(f"ktm serve: {cfg.served_name} (K={model.k}, base {model.config.base_model}) on "
          f"http://{cfg.host}:{cfg.port}/v1{keyed}", flush=True)
    server = Server(create_app(model, cfg, owns_model=True), host=cfg.host, port=cfg.port,
                    log_level=cfg.log_level, log_config=log_config(cfg.log_level))
    # uvicorn handles the signal, then raises it again to the handler it found: here one that
    # does nothing, as the server has stopped cleanly, so the command exits 0
    before = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def log_config(level: str) -> dict:
    """uvicorn's logging, with ktm's own lines (a failed request, a client gone) printed like
    uvicorn's at the same level; without it they would reach stderr only from warning up."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    out = copy.deepcopy(LOGGING_CONFIG)
    out["loggers"]["ktm"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return out
