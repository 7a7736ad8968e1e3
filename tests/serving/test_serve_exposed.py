"""``ktm serve`` as an attacker and an operator meet it: keys, request limits, ``/metrics`` and a
clean stop, on the tiny in-process model (the SIGTERM test starts ``ktm serve`` itself).

No test times a request: the 4xx latencies and the memory an attack costs are measured by
``results/serving/attack.py``."""

import contextlib
import hmac
import http.client
import json
import os
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from helpers import perturb
from prometheus_client.parser import text_string_to_metric_families
from test_serve import DOC, _slow_decoding, _wait_until, get

from ktm.errors import KTMError
from ktm.model import KTMModel
from ktm.serving.app import BackgroundServer, create_app
from ktm.serving.config import ServeConfig
from ktm.serving.gate import MAX_DEPTH, nesting

KEYS = ("key-one", "key-two")


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    torch.manual_seed(0)
    m = KTMModel.from_base(tiny_model_dir, k=4)
    perturb(m)
    return m


@contextlib.contextmanager
def serving(model, model_dir, **options):
    cfg = ServeConfig(**{"model": model_dir, "served_name": "tiny", "max_tokens_limit": 448,
                         "batch_window_ms": 50, "log_level": "warning", **options})
    app = create_app(model, cfg)
    with BackgroundServer(app) as srv:
        srv.engine, srv.app = app.state.engine, app
        yield srv


@pytest.fixture(scope="module")
def keyed(model, tiny_model_dir):
    with serving(model, tiny_model_dir, api_key=KEYS) as srv:
        yield srv


@pytest.fixture(scope="module")
def server(model, tiny_model_dir):
    with serving(model, tiny_model_dir) as srv:
        yield srv


def client(srv, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60)


def raw(srv, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict, dict]:
    """POST ``body`` as is: (status, headers, JSON answer)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("POST", path, body, {"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    out = r.status, dict(r.getheaders()), json.loads(r.read())
    conn.close()
    return out


def metrics(srv) -> dict[tuple[str, tuple], float]:
    """Every sample of ``/metrics``: (name, sorted labels) -> value."""
    with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# ---------------------------------------------------------------- keys
def test_the_openai_client_is_served_with_a_key_and_refused_without(keyed, monkeypatch):
    compared = []
    compare = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append(1) or compare(a, b))
    kw = dict(model="tiny", prompt=DOC, max_tokens=6, temperature=0)
    want = client(keyed, KEYS[0]).completions.create(**kw).choices[0].text
    assert client(keyed, KEYS[1]).completions.create(**kw).choices[0].text == want
    assert len(compared) >= 4  # each request compared with both keys, in constant time
    for key in ("wrong", KEYS[0] + "x", KEYS[0][:-1], KEYS[0].upper()):
        c = client(keyed, key)
        for call in (lambda c=c: c.completions.create(**kw), lambda c=c: c.models.list(),
                     lambda c=c: c.chat.completions.create(
                         model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])):
            with pytest.raises(openai.AuthenticationError) as e:
                call()
            assert e.value.status_code == 401
            assert e.value.body == {"message": "a valid API key is required: send it as the "
                                               "header 'Authorization: Bearer KEY'",
                                    "type": "invalid_request_error", "param": None,
                                    "code": "invalid_api_key"}
    body = json.dumps({**kw, "prompt": "hi"}).encode()
    for headers in ({}, {"Authorization": f"Basic {KEYS[0]}"}, {"Authorization": KEYS[0]}):
        status, head, answer = raw(keyed, "/v1/completions", body, headers)
        assert status == 401 and head["www-authenticate"] == "Bearer"
        assert KEYS[0] not in json.dumps(answer)  # the key is never echoed
    assert raw(keyed, "/v1/completions", body, {"Authorization": f"bearer {KEYS[1]}"})[0] == 200
    # what is open: the health check and the metrics
    assert get(keyed, "/health")["status"] == "ok"
    assert metrics(keyed)[("ktm:http_requests_total",
                           (("route", "/v1/completions"), ("status", "401")))] >= 7


def test_keys_come_from_flags_or_the_environment_and_are_never_written_out(monkeypatch,
                                                                           tiny_model_dir):
    import argparse

    from ktm.cli.args import from_args
    from ktm.cli.serve import serve_parser

    def parsed(*argv: str) -> ServeConfig:
        parser = argparse.ArgumentParser()
        serve_parser(parser)
        return from_args(ServeConfig, parser.parse_args(argv))

    monkeypatch.delenv("KTM_API_KEY", raising=False)
    cfg = parsed("--api-key", "a-key", "--api-key", "b-key")
    assert cfg.api_key == ("a-key", "b-key") and "a-key" not in repr(cfg)
    assert parsed().api_key == () and parsed("--api-key", "c").api_key == ("c",)
    monkeypatch.setenv("KTM_API_KEY", "env-key")
    assert ServeConfig().api_key == ("env-key",)
    assert ServeConfig(api_key=("flag-key",)).api_key == ("flag-key",)  # the flag wins
    for bad in ("", " padded", "new\nline", "caf\u00e9"):
        with pytest.raises(KTMError, match="api key #2 is empty or holds") as e:
            ServeConfig(api_key=("fine", bad))
        assert bad.strip() == "" or bad.strip() not in str(e.value)


@pytest.mark.parametrize("host,keys,warned", [("0.0.0.0", (), True), ("0.0.0.0", KEYS, False),
                                              ("127.0.0.1", (), False), ("::1", (), False)])
def test_a_server_others_can_reach_without_a_key_says_so_once(model, tiny_model_dir, caplog,
                                                              host, keys, warned):
    import logging

    caplog.set_level(logging.WARNING, logger="ktm.serving")
    with serving(model, tiny_model_dir, host=host, api_key=keys):
        pass
    said = [r for r in caplog.records if "without an API key" in r.getMessage()]
    assert len(said) == warned
    assert all("\n" not in r.getMessage() and r.levelno == logging.WARNING for r in said)


# ---------------------------------------------------------------- limits
def _answer(sock: socket.socket) -> tuple[int, dict]:
    r = http.client.HTTPResponse(sock)
    r.begin()
    return r.status, json.loads(r.read())


def test_a_200_mb_body_is_refused_by_its_length_without_being_read(server):
    limit = server.app.state.engine.cfg.max_request_mb  # None: the default, 1 MiB here
    assert limit is None
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % (200 * 2**20))
        status, body = _answer(sock)  # not one byte of the body sent
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert "209715200 bytes is over this server's limit of 1048576 bytes" in \
        body["error"]["message"]


def test_a_chunked_body_is_refused_once_it_passes_the_limit(server):
    """A body without a length, sent as fast as the socket takes it: the answer comes while it
    is still being sent, long before 200 MB."""
    import select

    chunk = b"%x\r\n%s\r\n" % (2**16, b"a" * 2**16)
    sent, got = 0, b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        sock.setblocking(False)
        while b"\r\n\r\n" not in got and sent < 200 * 2**20:
            readable, writable, _ = select.select([sock], [sock], [], 30)
            if readable:
                got += sock.recv(2**16)
            elif writable:
                sent += sock.send(chunk)
        sock.setblocking(True)
        head, _, rest = got.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        while len(rest) < length:
            rest += sock.recv(2**16)
    assert head.startswith(b"HTTP/1.1 413") and sent < 200 * 2**20
    assert json.loads(rest)["error"]["code"] == "request_too_large"
    assert get(server, "/health")["status"] == "ok"


ATTACKS = [  # (name, JSON body, param named, what the message says)
    ("nested 100,000 deep", b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000
     + b"}", "prompt", f"nests more than {MAX_DEPTH} levels deep (under 'prompt')"),
    ("nested objects in a message", b'{"model": "tiny", "messages": [{"role": "user", '
     b'"content": "hi", "ktm": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}]}",
     "messages", "nests more than"),
    ("10,000 stop strings", {"prompt": "hi", "stop": [f"s{i}" for i in range(10_000)]}, "stop",
     "Invalid 'stop': 10000 stop sequences, expected at most 4"),
    ("10,000 messages", {"messages": [{"role": "user", "content": "hi"}] * 10_000}, "messages",
     "messages: List should have at most 2048 items"),
    ("a logit_bias of 50,000 entries", {"prompt": "hi", "logit_bias": {
        str(i): 1 for i in range(50_000)}}, "logit_bias",
     "logit_bias=<an object of 50000 entries> is not supported"),
    ("a million choices", {"prompt": "hi", "n": 10**6}, "n", "n: Input should be less than or "
     "equal to 128"),
    ("100,000 prompts", {"prompt": ["hi"] * 100_000}, "n",
     "100000 prompt(s) with n=1 make 100000 choices, over this server's max_queue of 256"),
]


@pytest.mark.parametrize("name,body,param,message", ATTACKS, ids=[a[0] for a in ATTACKS])
def test_an_abusive_request_gets_a_400_naming_its_field(server, name, body, param, message):
    path = "/v1/chat/completions" if b"messages" in (
        body if isinstance(body, bytes) else json.dumps(body).encode()) else "/v1/completions"
    data = body if isinstance(body, bytes) else json.dumps({"model": "tiny", **body}).encode()
    status, _, answer = raw(server, path, data)
    error = answer["error"]
    assert status == 400 and error["param"] == param and message in error["message"], error
    assert len(error["message"]) < 400  # nothing the client sent is echoed back whole
    assert raw(server, "/v1/completions", json.dumps(
        {"model": "tiny", "prompt": "Hello", "max_tokens": 2}).encode())[0] == 200


def test_a_chat_longer_than_the_model_reads_is_refused_before_it_is_built(server):
    """Counted (bytes, then one batch tokenization) before the chat template, the merging or the
    queue: the engine never sees it."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "word " * 60}] * 200}
    before = dict(server.engine.counts)
    status, _, answer = raw(server, "/v1/chat/completions", json.dumps(chat).encode())
    error = answer["error"]
    assert status == 400 and error["param"] == "messages", error
    assert error["code"] == "context_length_exceeded"
    assert "more than this model reads within its context of 512 positions" in error["message"]
    assert server.engine.counts == before


def test_token_ids_past_what_the_model_reads_are_a_400_naming_the_prompt(server):
    status, _, answer = raw(server, "/v1/completions", json.dumps(
        {"model": "tiny", "prompt": [5] * 20_000}).encode())
    assert status == 400 and answer["error"]["param"] == "prompt", answer
    assert answer["error"]["code"] == "context_length_exceeded"


def test_nesting_is_counted_outside_strings_only():
    assert nesting(b'{"a": "[[[[[[", "b": [[1]]}', 2) == (3, "b")
    assert nesting(b'{"a": "\\"[[[[[[[", "b": [1]}', 2) is None  # an escaped quote
    assert nesting(b"[" * 3, 2) == (3, None)
    assert nesting(b'{"x": {"y": {"z": 1}}}', 3) is None


EDGES = [  # (name, body, headers, status, code, what the message says)
    ("an empty body", b"", {}, 400, None, "the request body is empty: expected a JSON object"),
    ("JSON sent as text/plain", b'{"model": "tiny", "prompt": "Hi"}',
     {"Content-Type": "text/plain"}, 415, "unsupported_media_type",
     "Content-Type 'text/plain' is not JSON: expected 'application/json'"),
    ("invalid UTF-8", b'{"model": "tiny", "prompt": "Hi \xff there"}', {}, 400,
     "invalid_encoding", "not valid UTF-8: byte 0xff at offset 32"),
    ("a UTF-16 body nesting 900 deep", ('{"model": "tiny", "prompt": ' + "[" * 900 + "]" * 900
                                        + "}").encode("utf-16-le"), {}, 400,
     "invalid_encoding", "the request body is UTF-16-LE: expected JSON in UTF-8"),
]


@pytest.mark.parametrize("name,body,headers,status,code,message", EDGES,
                         ids=[e[0] for e in EDGES])
def test_a_body_that_is_not_json_in_utf_8_gets_a_clear_4xx(server, name, body, headers, status,
                                                             code, message):
    got, _, answer = raw(server, "/v1/completions", body, headers)
    assert got == status and answer["error"]["code"] == code, answer
    assert message in answer["error"]["message"], answer


def test_a_405_says_which_methods_the_path_takes(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/v1/completions")
    r = conn.getresponse()
    assert r.status == 405 and r.getheader("Allow") == "POST"
    assert json.loads(r.read())["error"]["type"] == "invalid_request_error"
    conn.close()


def test_health_shows_no_other_clients_error_when_the_server_has_a_key(keyed, server):
    assert "last_error" not in get(keyed, "/health")
    assert "last_error" in get(server, "/health")  # open: the operator's own machine


def test_a_completion_without_max_tokens_fits_a_limit_under_16(model, tiny_model_dir):
    with serving(model, tiny_model_dir, max_tokens_limit=3) as srv:
        status, _, answer = raw(srv, "/v1/completions", json.dumps(
            {"model": "tiny", "prompt": "Hello", "temperature": 0,
             "ktm": {"ignore_eos": True}}).encode())
    assert status == 200 and answer["usage"]["completion_tokens"] == 3, answer


def test_the_openapi_document_states_what_the_server_answers(keyed):
    doc = get(keyed, "/openapi.json")
    for path, ops in doc["paths"].items():
        for op in ops.values():
            assert "422" not in op["responses"], path
            assert ("401" in op["responses"]) == path.startswith("/v1/"), path
    post = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "413", "415", "503"} <= set(post)
    assert set(post["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    fields = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    seed = fields["seed"]["anyOf"][0]
    assert (seed["minimum"], seed["maximum"]) == (-2**63, 2**63 - 1)  # exact, not a rounded float
    assert fields["max_tokens"]["anyOf"][0]["maximum"] == 448
    assert fields["model"]["enum"] == ["tiny"]


def test_a_client_sending_its_body_a_byte_at_a_time_holds_up_no_one(server):
    """The slow client sends half its body a byte at a time, then waits until the others are
    answered before sending the rest: their answers (greedy) are those of a quiet server, and
    its own is the same as when sent at once."""
    asks = [dict(model="tiny", prompt=f"{DOC[:30 + 7 * i]} #{i}", max_tokens=8, temperature=0)
            for i in range(4)]
    quiet = [client(server).completions.create(**kw).choices[0].text for kw in asks]
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 4,
                       "temperature": 0}).encode()
    alone = raw(server, "/v1/completions", body)[2]["choices"][0]["text"]
    others_done, halfway = threading.Event(), threading.Event()

    def slow() -> dict:
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
            for i in range(len(body) // 2):
                sock.sendall(body[i:i + 1])
                time.sleep(0.01)
            halfway.set()
            assert others_done.wait(60)
            for i in range(len(body) // 2, len(body)):
                sock.sendall(body[i:i + 1])
            return _answer(sock)[1]

    with ThreadPoolExecutor(1) as pool:
        slowed = pool.submit(slow)
        assert halfway.wait(60)
        busy = [client(server).completions.create(**kw).choices[0].text for kw in asks]
        others_done.set()
        assert slowed.result(timeout=60)["choices"][0]["text"] == alone
    assert busy == quiet


# ---------------------------------------------------------------- /metrics
def _stream_asks(n: int) -> list[dict]:
    words = DOC.split()
    asks = []
    for i in range(n):
        text = " ".join(words[i % 5:][:5 + 2 * i])
        kw = dict(model="tiny", max_tokens=4 + (i * 5) % 23, temperature=0 if i % 2 else 0.8,
                  seed=i, stream=True, stream_options={"include_usage": True})
        if i % 3 == 0:
            kw["messages"] = [{"role": "user", "content": text}]
        else:  # merged whole (short, it would be read plain as its own question)
            kw.update(prompt=text, extra_body={"ktm": {"question": ""}})
        asks.append(kw)
    return asks


def test_metrics_under_16_concurrent_streams_equal_what_the_clients_saw(model, tiny_model_dir):
    with serving(model, tiny_model_dir) as srv:
        before = metrics(srv)
        start = threading.Barrier(16)
        scraped = []

        def one(kw):
            c = client(srv)
            start.wait()
            create = c.chat.completions.create if "messages" in kw else c.completions.create
            chunks = list(create(**kw))
            scraped.append(metrics(srv))  # a scrape while others still stream
            return chunks[-1].usage, [ch.choices[0].finish_reason for ch in chunks
                                      if ch.choices and ch.choices[0].finish_reason]

        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(one, _stream_asks(16)))
        after = metrics(srv)
        assert srv.engine.counts["peak_running"] >= 8  # they were decoded together

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    usages = [u for u, _ in got]
    reasons = [r for _, rs in got for r in rs]
    assert delta("ktm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("ktm:prompt_positions_total") == sum(u.prompt_tokens_merged for u in usages)
    assert delta("ktm:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("ktm:prefix_cache_hits_total") == sum(
        u.prompt_tokens_details.cached_tokens for u in usages)
    assert delta("ktm:prefix_cache_queries_total") == sum(u.prompt_tokens_merged for u in usages)
    assert delta("ktm:http_requests_total", route="/v1/completions", status="200") == 10
    assert delta("ktm:http_requests_total", route="/v1/chat/completions", status="200") == 6
    assert delta("ktm:time_to_first_token_seconds_count") == 16
    assert delta("ktm:e2e_request_latency_seconds_count") == 16
    for reason in ("stop", "length"):
        assert delta("ktm:request_success_total", finished_reason=reason) == reasons.count(reason)
    assert len(reasons) == 16 and sum(u.prompt_tokens for u in usages) > \
        sum(u.prompt_tokens_merged for u in usages)  # merged: fewer positions than tokens
    assert after[("ktm:num_requests_running", ())] == 0
    assert after[("ktm:num_requests_waiting", ())] == 0
    assert len(scraped) == 16  # /metrics answered under load


# ---------------------------------------------------------------- a clean stop
def _sse(port: int, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    return conn, r


def _rest_of(conn, r, lines: list[bytes]) -> tuple[str, dict | None]:
    """A stream read to its end: ("answer", None) where it ended with a finish reason then
    [DONE], ("error", the error) where with an error event then [DONE]; a connection cut
    mid-stream raises (``IncompleteRead``)."""
    while line := r.readline():
        lines.append(line)
    conn.close()
    events = [json.loads(x[6:]) if x != b"data: [DONE]\n" else "[DONE]"
              for x in lines if x.startswith(b"data: ")]
    assert events[-1] == "[DONE]", lines[-3:]
    last = events[-2]
    if "error" in last:
        return "error", last["error"]
    assert last["choices"][0]["finish_reason"] in ("stop", "length"), last
    return "answer", None


def test_a_stop_finishes_or_ends_each_of_16_streams_cleanly(model, tiny_model_dir, monkeypatch):
    """Draining (what SIGTERM starts): short streams finish within the grace time, long ones
    end with an error event then [DONE], a new request meanwhile gets 503 and the health check
    says so; then the server stops."""
    with serving(model, tiny_model_dir, shutdown_timeout=1.0) as srv:
        _slow_decoding(srv, monkeypatch, 0.02)  # a long stream's 448 steps take 9 s or more
        streams = []
        for i in range(16):
            long = i % 2 == 0
            body = {"model": "tiny", "prompt": f"{DOC[:20 + 5 * i]} #{i}", "stream": True,
                    "max_tokens": 448 if long else 3, "ktm": {"ignore_eos": True}}
            conn, r = _sse(srv.port, body)
            streams.append((long, conn, r, [r.readline()]))  # decoding: its first chunk came
        srv.app.state.drain()  # as SIGTERM does, before uvicorn closes its socket
        assert _wait_until(lambda: get_status(srv) == 503, 10)
        refused = raw(srv, "/v1/completions", json.dumps({"model": "tiny", "prompt": "hi"}
                                                         ).encode())
        ends = [(long, *_rest_of(conn, r, lines)) for long, conn, r, lines in streams]
        srv.stop()
        srv.thread.join(timeout=30)
        assert not srv.thread.is_alive()
    assert refused[0] == 503 and refused[2]["error"]["code"] == "server_shutdown"
    assert [how for long, how, _ in ends if not long] == ["answer"] * 8
    assert [how for long, how, _ in ends if long] == ["error"] * 8
    assert all(e["code"] == "server_shutdown" and "--shutdown-timeout of 1 s" in e["message"]
               for _, how, e in ends if how == "error")
    assert srv.engine.counts["aborted"] == 8


def get_status(srv) -> int:
    try:
        with urllib.request.urlopen(srv.url + "/health", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.slow  # starts a Python process
def test_sigterm_during_16_streams_ends_each_cleanly_and_exits_0(tiny_model_dir):
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = "a-key-no-log-may-show"
    cmd = [sys.executable, "-m", "ktm.cli", "serve", "--model", tiny_model_dir, "--k", "4",
           "--port", str(port), "--served-name", "tiny", "--log-level", "debug",
           "--shutdown-timeout", "2", "--max-tokens-limit", "448"]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "KTM_API_KEY": key},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    srv = type("S", (), {"url": f"http://127.0.0.1:{port}", "port": port})
    try:
        assert _wait_until(lambda: proc.poll() is not None or _up(srv), 120), proc.poll()
        assert proc.poll() is None
        headers = {"Authorization": f"Bearer {key}"}
        assert raw(srv, "/v1/completions", b'{"model": "tiny", "prompt": "hi"}')[0] == 401
        streams = []
        for i in range(16):
            body = {"model": "tiny", "prompt": f"{DOC[:20 + 5 * i]} #{i}", "stream": True,
                    "max_tokens": 448 if i % 2 == 0 else 4, "ktm": {"ignore_eos": True}}
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            conn.request("POST", "/v1/completions", json.dumps(body),
                         {"Content-Type": "application/json", **headers})
            r = conn.getresponse()
            assert r.status == 200
            streams.append((conn, r, [r.readline()]))
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        ends = [_rest_of(conn, r, lines) for conn, r, lines in streams]
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert took < 2 + 10  # the grace time and uvicorn's margin after it
    assert {how for how, _ in ends} <= {"answer", "error"} and len(ends) == 16
    assert all(e["code"] == "server_shutdown" for how, e in ends if how == "error")
    assert "Traceback" not in err and key not in out + err
    assert "shutting down: the requests in flight get 2 s to finish" in err


def _up(srv) -> bool:
    try:
        return get(srv, "/health")["status"] == "ok"
    except OSError:
        return False


@pytest.mark.slow  # starts ktm serve and the vLLM server it starts (a minute or more)
@pytest.mark.vllm
@pytest.mark.xdist_group("vllm-server")  # with tests/vllm/test_vllm_started_server.py's
def test_sigterm_on_a_started_vllm_server_ends_the_streams_and_stops_it():
    """``--backend vllm --vllm-server``: the streams in flight end with their answer or an error
    event, ktm serve exits 0, and the vLLM server it started is gone with it."""
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "ktm.cli", "serve", "--model", "smollm2-135m-k4-seq",
           "--port", str(port), "--served-name", "k4", "--backend", "vllm", "--vllm-server",
           "--vllm-kv-cache-gb", "1", "--shutdown-timeout", "3", "--max-batch", "4"]
    # the run's $KTM_CACHE: the reader's vLLM export is made once (atomically) for every test
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    srv = type("S", (), {"url": f"http://127.0.0.1:{port}", "port": port})
    try:
        assert _wait_until(lambda: proc.poll() is not None or _up(srv), 900), proc.poll()
        assert proc.poll() is None
        children = _children(proc.pid)
        assert children  # the vLLM server
        streams = []
        for i in range(4):
            body = {"model": "k4", "prompt": f"{DOC} #{i}", "stream": True,
                    "max_tokens": 400 if i % 2 == 0 else 4, "ktm": {"ignore_eos": True}}
            conn, r = _sse(port, body)
            streams.append((conn, r, [r.readline()]))
        proc.send_signal(signal.SIGTERM)
        ends = [_rest_of(conn, r, lines) for conn, r, lines in streams]
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert {how for how, _ in ends} <= {"answer", "error"} and len(ends) == 4
    assert all(not os.path.exists(f"/proc/{pid}") or _zombie(pid) for pid in children)
    assert "Traceback" not in err


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
