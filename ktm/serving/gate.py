"""What every HTTP request passes before a route: its key, its size, its nesting, and a server
that is shutting down; each refusal in OpenAI's error shape, and every answer counted by route
and status (``ktm.serving.metrics``).

    /v1/...   a key, when the server has one (``--api-key``, ``KTM_API_KEY``): 401 without
              ``Authorization: Bearer KEY``, compared in constant time (``hmac.compare_digest``);
              the key is never written to a log line or an answer
    a body    413 once it is over ``max_bytes``: at once where its Content-Length says so, else
              as it arrives (a chunked body), never read whole first; 415 for a Content-Type
              other than JSON's; 400 for a body not in UTF-8 (UTF-16 and UTF-32 included) and
              where its JSON nests deeper than ``MAX_DEPTH``, naming the top-level field it
              nests under

After a 413 the connection lingers a little (``LINGER_S``, at most ``max_bytes`` more read and
dropped) before it closes, as nginx's lingering close does: closed with a body still arriving,
the kernel would reset it, and a client reading its answer as it sends could lose the 413.
    stopping  503 for a new /v1 request while the server finishes those in flight (SIGTERM),
              and for one whose body is still arriving

A pure ASGI middleware rather than FastAPI's ``BaseHTTPMiddleware`` or a dependency: it sees the
body as the server receives it, chunk by chunk, so a large body costs the server at most
``max_bytes`` (uvicorn stops reading a connection's socket while 64 KiB of it wait unread), and
a client sending its body slowly holds only its own connection's coroutine. The body read here
is handed on to the routes unchanged; after it, the routes' ``receive`` is the server's own, so
they still hear a client that goes away.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ktm.serving.protocol import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# JSON nesting a request may have: a chat message's content parts or ktm segments sit at depth 5
MAX_DEPTH = 32
# what a JSON scan stops at: brackets, and quotes and backslashes, which say where strings are
# seconds a connection refused with 413 reads (and drops) what its client still sends
LINGER_S = 1.0
_STRUCTURE = re.compile(rb'[\[\]{}"\\]')


def nesting(body: bytes, limit: int = MAX_DEPTH) -> tuple[int, str | None] | None:
    """Where ``body``'s JSON first nests deeper than ``limit`` levels (objects and arrays): the
    depth reached and the top-level field it is under (None: under no field, or not an object);
    None where it never does. Reads brackets outside strings only, so it costs little for a
    body of text, and stops at the first level too deep; malformed JSON is left to the parser."""
    depth, key, last = 0, None, None  # last: the latest string at depth 1 (a field's name)
    in_string, start, skip = False, 0, -1
    for m in _STRUCTURE.finditer(body):
        i = m.start()
        if i < skip:  # the character a backslash escapes
            continue
        c = body[i]
        if in_string:
            if c == 0x5C:  # backslash
                skip = i + 2
            elif c == 0x22:  # quote
                in_string = False
                if depth == 1:
                    last = body[start:i]
        elif c == 0x22:
            in_string, start = True, i + 1
        elif c in (0x5B, 0x7B):  # [ {
            if depth == 1:
                key = last
            depth += 1
            if depth > limit:
                return depth, _name(key)
        elif c in (0x5D, 0x7D):  # ] }
            depth -= 1
    return None


def unreadable(scope: Scope, body: bytes) -> tuple[int, str, str] | None:
    """Why a request body is not JSON this server reads, as (status, message, code), before
    any parser sees it; None: it may be. A Content-Type other than JSON's (none: read as JSON,
    as FastAPI does), a body in UTF-16 or UTF-32 (which Python's JSON parser would take, and
    which the nesting scan, reading bytes, would not see as JSON), or one not valid UTF-8."""
    given = next((v for k, v in scope["headers"] if k == b"content-type"), None)
    if given is not None:
        kind = given.split(b";")[0].strip().lower()
        if kind != b"application/json" and not (kind.startswith(b"application/")
                                                and kind.endswith(b"+json")):
            shown = given.decode("latin-1")[:80]
            return (415, f"Content-Type {shown!r} is not JSON: expected 'application/json' "
                    "(the body is a JSON object)", "unsupported_media_type")
    if not body:
        return None
    encoding = json.detect_encoding(body)
    if encoding not in ("utf-8", "utf-8-sig"):
        return (400, f"the request body is {encoding.upper()}: expected JSON in UTF-8 "
                "(RFC 8259)", "invalid_encoding")
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        return (400, f"the request body is not valid UTF-8: byte {body[e.start]:#04x} at "
                f"offset {e.start} ({e.reason}); expected JSON in UTF-8", "invalid_encoding")
    return None


def _name(raw: bytes | None) -> str | None:
    if raw is None:
        return None
    try:
        name = json.loads(b'"' + raw + b'"')
    except ValueError:
        return None
    return name if len(name) <= 64 else None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address ``ktm serve`` listens on) takes connections from this
    machine only."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Gate:
    """The ASGI middleware in front of ``app`` (the module docstring). ``keys``: the keys a /v1
    request may carry (none: no key asked); ``max_bytes``: the largest body; ``stopping``: set
    once the server stops taking requests; ``count(route, status)``: called as each answer
    starts."""

    def __init__(self, app, keys: tuple[str, ...], max_bytes: int, stopping: asyncio.Event,
                 count: Callable[[str, int], None], routes: tuple[str, ...]):
        self.app, self.max_bytes, self.stopping, self.count = app, max_bytes, stopping, count
        self.keys = tuple(k.encode() for k in keys)
        self.routes = routes  # the paths counted by name; any other is counted as "other"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = (path if path in self.routes else
                 "/v1/models/{model_id}" if path.startswith("/v1/models/") else "other")
        counted = False

        async def send_counted(message: Message) -> None:
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True
                self.count(route, message["status"])
            await send(message)

        v1 = path == "/v1" or path.startswith("/v1/")
        if v1 and self.keys and not self._authorized(scope):
            await refuse(send_counted, 401, "a valid API key is required: send it as the "
                         "header 'Authorization: Bearer KEY'", code="invalid_api_key",
                         headers=[(b"www-authenticate", b"Bearer")])
            return
        if v1 and self.stopping.is_set():
            await _shutting_down(send_counted)
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send_counted)
            return
        body = await self._body(scope, receive, send_counted)
        if body is None:
            return
        refusal = unreadable(scope, body)
        if refusal is not None:
            status, message, code = refusal
            await refuse(send_counted, status, message, code=code)
            return
        deep = nesting(body)
        if deep is not None:
            depth, field = deep
            where = f" (under {field!r})" if field else ""
            await refuse(send_counted, 400, f"the JSON body nests more than {MAX_DEPTH} levels "
                         f"deep{where}: expected at most {MAX_DEPTH}", param=field,
                         code="json_too_deep")
            return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # the server's own: a client that goes away is heard

        await self.app(scope, replay, send_counted)

    def _authorized(self, scope: Scope) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = given.partition(b" ")
        token = token.strip()
        # every key compared, whatever the first gives: the time taken says nothing of which
        ok = [hmac.compare_digest(token, key) for key in self.keys]
        return scheme.lower() == b"bearer" and any(ok)

    async def _body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The request's body, or None once a refusal is sent (too large, or the client went
        away before it ended)."""
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(send, receive, int(length))
            return None
        chunks, size = [], 0
        while True:
            message = await self._receive(receive)
            if message is None:  # the server is stopping: a body still arriving is not awaited
                await _shutting_down(send)
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(send, receive, None)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _receive(self, receive: Receive) -> Message | None:
        """The next message, or None once the server is stopping."""
        if self.stopping.is_set():
            return None
        got, stop = asyncio.ensure_future(receive()), asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait((got, stop), return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if got.done():
            return got.result()
        got.cancel()
        return None

    async def _too_large(self, send: Send, receive: Receive, length: int | None) -> None:
        """The 413; then, lingering, what the client still sends read and dropped."""
        mib = self.max_bytes / 2**20
        said = f"of {length} bytes " if length is not None else ""
        await refuse(send, 413, f"the request body {said}is over this server's limit of "
                     f"{self.max_bytes} bytes ({mib:.3g} MiB, ktm serve --max-request-mb)",
                     code="request_too_large", done=False)
        loop = asyncio.get_running_loop()
        deadline, dropped = loop.time() + LINGER_S, 0
        try:
            while dropped <= self.max_bytes and (left := deadline - loop.time()) > 0:
                message = await asyncio.wait_for(receive(), left)
                dropped += len(message.get("body", b""))
                if message["type"] != "http.request" or not message.get("more_body", False):
                    break
        except TimeoutError:
            pass
        await send({"type": "http.response.body", "body": b""})


async def _shutting_down(send: Send) -> None:
    await refuse(send, 503, "the server is shutting down: it finishes the requests in flight "
                 "and takes no new ones", kind="server_error", code="server_shutdown")


async def refuse(send: Send, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None, done: bool = True) -> None:
    """Answer ``status`` with OpenAI's error object, closing the connection: a body the client
    may still be sending is never read. ``done`` False: the answer is whole, but the connection
    stays until an empty last body message."""
    body = json.dumps(error_body(message, kind, param, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *(headers or [])]})
    await send({"type": "http.response.body", "body": body, "more_body": not done})
