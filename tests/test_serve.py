"""``ktm serve`` over loopback with the official openai client, on the tiny in-process model."""

import bisect
import http.client
import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from test_model import perturb

from ktm import Segment
from ktm.model import KTMModel
from ktm.serve.app import BackgroundServer, create_app
from ktm.serve.config import ServeConfig

DOC = ("Tree: AB\n+CD\n++EF\n+GH\n++IJ\n+++KL. The quick brown fox jumps over the lazy dog. "
       "def add(a, b):\n    return a + b\n")
LIMIT = 448  # max_tokens limit of the test server; the tiny model's context is 512


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    torch.manual_seed(0)
    model = KTMModel.from_base(tiny_model_dir, k=4)
    perturb(model)
    cfg = ServeConfig(model=tiny_model_dir, served_name="tiny", max_tokens_limit=LIMIT,
                      batch_window_ms=100, log_level="warning")
    app = create_app(model, cfg)
    with BackgroundServer(app) as srv:
        srv.model, srv.engine = model, app.state.engine
        yield srv


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def segs_body(doc: str, question: str) -> dict:
    return {"ktm": {"segments": [{"text": doc, "merge": True},
                                 {"text": question, "merge": False}]}}


def get(server, path: str) -> dict:
    with urllib.request.urlopen(server.url + path, timeout=10) as r:
        return json.loads(r.read())


def post(server, body: dict, path: str = "/v1/completions") -> dict:
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_completion_equals_generate_and_reports_merged_usage(server, client):
    prompt = [Segment(DOC), Segment("Question: who? Answer:", compress=False)]
    r = client.completions.create(model="tiny", prompt=None, max_tokens=12, temperature=0,
                                  extra_body=segs_body(DOC, "Question: who? Answer:"))
    assert r.choices[0].text == server.model.generate(prompt, max_new_tokens=12)
    cp = server.model.compress(prompt)
    assert r.usage.prompt_tokens == cp.tokens_in
    assert r.usage.prompt_tokens_merged == cp.tokens_out < cp.tokens_in
    assert r.usage.total_tokens == cp.tokens_in + r.usage.completion_tokens
    plain = client.completions.create(model="tiny", prompt=DOC, max_tokens=12, temperature=0,
                                      extra_body={"ktm": {"merge": False}})
    n_doc = len(server.model.tokenize(DOC, first=True))
    assert plain.usage.prompt_tokens_merged == plain.usage.prompt_tokens == n_doc
    assert plain.choices[0].text == server.model.generate(DOC, max_new_tokens=12, merge=False)


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_joins_to_the_non_streaming_answer(server, client, chat):
    kw = dict(model="tiny", max_tokens=20, temperature=0)
    if chat:
        kw["messages"] = [{"role": "system", "content": DOC},
                          {"role": "user", "content": "Who?", "ktm": {"merge": False}}]
        create = client.chat.completions.create
    else:
        kw["prompt"] = DOC
        create = client.completions.create
    whole = create(**kw)
    chunks = list(create(stream=True, stream_options={"include_usage": True}, **kw))
    pieces = [c.choices[0] for c in chunks if c.choices]
    text = "".join((p.delta.content or "") if chat else p.text for p in pieces)
    reference = whole.choices[0].message.content if chat else whole.choices[0].text
    assert len(pieces) > 2 and text == reference
    assert pieces[-1].finish_reason == whole.choices[0].finish_reason
    assert all(p.finish_reason is None for p in pieces[:-1])
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_merged == whole.usage.prompt_tokens_merged


def _requests() -> list[dict]:
    """16 different requests: completions and chats, greedy and seeded sampling, stops."""
    words = DOC.split()
    out = []
    for i in range(16):
        doc = " ".join(words[i % 5:][: 6 + 2 * i])
        kw = {"model": "tiny", "max_tokens": 4 + (i * 3) % 17,
              "temperature": 0 if i % 3 else 0.9, "top_p": 1.0 if i % 2 else 0.8, "seed": i}
        if i % 4 == 3:
            kw["stop"] = ["e"]
        if i % 2:
            kw["messages"] = [{"role": "user", "content": doc},
                              {"role": "user", "content": f"Q{i}?", "ktm": {"merge": False}}]
        else:
            kw["prompt"] = None
            kw["extra_body"] = segs_body(doc, f" Q{i}:")
        out.append(kw)
    return out


def _ask(url: str, kw: dict) -> tuple[str, str]:
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    if "messages" in kw:
        ch = c.chat.completions.create(**kw).choices[0]
        return ch.message.content, ch.finish_reason
    ch = c.completions.create(**kw).choices[0]
    return ch.text, ch.finish_reason


def test_sixteen_concurrent_requests_equal_one_by_one(server):
    reqs = _requests()
    one_by_one = [_ask(server.url, kw) for kw in reqs]
    assert server.engine.counts["peak_running"] <= 2  # (a stream above may have overlapped)
    start = threading.Barrier(16)

    def together(kw):
        start.wait()
        return _ask(server.url, kw)

    with ThreadPoolExecutor(16) as pool:
        concurrent = list(pool.map(together, reqs))
    assert server.engine.counts["peak_running"] >= 8  # they really were decoded together
    assert concurrent == one_by_one
    assert len({t for t, _ in one_by_one}) > 8 and {"stop", "length"} <= {f for _, f in one_by_one}
    # and the server equals the library: greedy and seeded sampling alike
    for kw, (text, _) in zip(reqs[:8:2], one_by_one[:8:2]):
        doc, q = (s["text"] for s in kw["extra_body"]["ktm"]["segments"])
        want = server.model.generate([Segment(doc), Segment(q, compress=False)],
                                     max_new_tokens=kw["max_tokens"],
                                     do_sample=kw["temperature"] > 0,
                                     temperature=kw["temperature"] or 1.0, top_p=kw["top_p"],
                                     seed=kw["seed"])
        assert text == (want.split("e")[0] if "stop" in kw else want)


def test_a_repeated_context_reuses_its_merged_kv(server, client):
    doc = DOC * 3
    before = server.engine.kv.stats()["hits"]
    first = client.completions.create(model="tiny", prompt=None, max_tokens=8, temperature=0,
                                      extra_body=segs_body(doc, " First?"))
    second = client.completions.create(model="tiny", prompt=None, max_tokens=8, temperature=0,
                                       extra_body=segs_body(doc, " Second?"))
    ctx = server.model.compress(doc).tokens_out
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == ctx
    assert server.engine.kv.stats()["hits"] == before + 1
    want = server.model.generate([Segment(doc), Segment(" Second?", compress=False)],
                                 max_new_tokens=8)
    assert second.choices[0].text == want


BAD = [
    ("malformed JSON", b'{"model": "tiny", "prompt": ', 400, "malformed JSON"),
    ("unknown field", {"prompt": "hi", "tools": []}, 400, "unknown field 'tools'"),
    ("unimplemented option", {"prompt": "hi", "logprobs": 2}, 400,
     "logprobs=2 is not supported by this server: it accepts only false or null"),
    ("a penalty", {"prompt": "hi", "presence_penalty": 0.5}, 400,
     "presence_penalty=0.5 is not supported"),
    ("unknown ktm field", {"prompt": "hi", "ktm": {"merge_all": True}}, 400, "ktm.merge_all"),
    ("empty prompt", {"prompt": ""}, 400, "prompt is empty"),
    ("no prompt", {}, 400, "prompt is empty"),
    ("max_tokens over the limit", {"prompt": "hi", "max_tokens": LIMIT + 1}, 400,
     f"over this server's limit of {LIMIT}"),
    ("too long after merging", {"prompt": "Hello world " * 1200}, 400,
     "more than the model's context of 512"),
    ("too long with max_tokens", {"prompt": "Hello world " * 300, "max_tokens": LIMIT}, 400,
     "more than the model's context of 512"),
    ("bad temperature", {"prompt": "hi", "temperature": 3}, 400,
     "temperature: Input should be less than or equal to 2, got 3"),
    ("n > 1", {"prompt": "hi", "n": 2}, 400, "n:"),
    ("seed over int64", {"prompt": "hi", "temperature": 1, "seed": 2**64}, 400,
     f"seed: Input should be less than or equal to {2**63 - 1}, got {2**64}"),
    ("two prompts", {"prompt": ["hi", "ho"]}, 400, "prompt is a list of 2 prompts"),
    ("token ids", {"prompt": [1, 2, 3]}, 400, "prompt as token ids is not supported"),
    ("token id lists", {"prompt": [[1, 2]]}, 400, "prompt as token ids is not supported"),
    ("empty prompt list", {"prompt": []}, 400, "prompt is empty"),
    ("prompt contradicts segments", {"prompt": "other", **segs_body("a", "b")}, 400,
     "segments' texts joined"),
    ("unknown model", {"model": "gpt-4", "prompt": "hi"}, 404, "not served here"),
]


@pytest.mark.parametrize("name,body,status,message", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, name, body, status,
                                                               message):
    data = body if isinstance(body, bytes) else json.dumps({"model": "tiny", **body}).encode()
    req = urllib.request.Request(server.url + "/v1/completions", data=data,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == status
    err = json.loads(e.value.read())["error"]
    assert message in err["message"], err
    assert set(err) == {"message", "type", "param", "code"}
    assert get(server, "/health")["status"] == "ok"
    ok = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 2}).encode()
    req = urllib.request.Request(server.url + "/v1/completions", data=ok,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200 and json.loads(r.read())["choices"][0]["finish_reason"]


def test_null_fields_mean_their_default_and_neutral_options_are_accepted(client):
    # OpenAI's optional fields are nullable, and some clients always send options this server
    # does not implement, at their neutral values: neither may change the answer or be refused
    kw = dict(model="tiny", prompt=DOC, max_tokens=8, seed=5)
    sampled = client.completions.create(temperature=1.0, top_p=1.0, **kw).choices[0].text
    r = client.completions.create(temperature=None, top_p=None, n=None, stream=None, stop=None,
                                  logprobs=None, suffix=None, user=None, presence_penalty=0,
                                  frequency_penalty=0.0, logit_bias={}, best_of=1, echo=False,
                                  **kw)
    assert r.choices[0].text == sampled
    msgs = [{"role": "user", "content": DOC, "name": None, "ktm": None}]
    chat = dict(model="tiny", messages=msgs, temperature=0)
    want = client.chat.completions.create(max_tokens=6, **chat).choices[0].message.content
    got = client.chat.completions.create(max_tokens=None, max_completion_tokens=6, logprobs=False,
                                         top_logprobs=None, presence_penalty=0,
                                         response_format={"type": "text"}, **chat)
    assert got.choices[0].message.content == want


def test_a_list_of_one_prompt_is_that_prompt(client):
    kw = dict(model="tiny", max_tokens=8, temperature=0)
    want = client.completions.create(prompt=DOC, **kw).choices[0].text
    assert client.completions.create(prompt=[DOC], **kw).choices[0].text == want


def test_an_unexpected_failure_is_a_500_in_openais_shape(server, client, monkeypatch):
    def broken(*_):
        raise RuntimeError("a bug")

    # the globals of the module the server runs (another test may have re-imported ktm)
    monkeypatch.setitem(create_app.__globals__, "completion_segments", broken)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert e.value.status_code == 500
    assert e.value.body == {"message": "internal error: RuntimeError: a bug",
                            "type": "server_error", "param": None, "code": None}


@pytest.mark.parametrize("body,message", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": ""}]}, "messages are empty"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     'messages.0.content.0.type: Input should be \'text\', got "image_url"'),
    ({"messages": [{"role": "user", "content": "hi"}],
      "extra_body": {"ktm": {"segments": [{"text": "a"}]}}},
     "ktm.segments is for /v1/completions"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": LIMIT + 1},
     f"max_completion_tokens={LIMIT + 1} is over this server's limit of {LIMIT}"),
])
def test_bad_chat_requests(client, body, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", **{"max_tokens": 2, **body})
    assert message in e.value.body["message"]


def _wait_until(pred, seconds=20.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_slot(server, stream, monkeypatch):
    import inspect

    # the globals the running engine really uses: another test may have re-imported ktm, so
    # `from ktm.serve import engine` could give a fresh module the server never calls into
    engine_globals = next(f for f in vars(type(server.engine)).values()
                          if inspect.isfunction(f)).__globals__
    advance = engine_globals["advance"]
    # a slow model: LIMIT steps take 20+ s, so a row that ran on to max_tokens would show, even
    # when a loaded machine takes seconds to notice the disconnect
    monkeypatch.setitem(engine_globals, "advance", lambda *a: time.sleep(0.05) or advance(*a))
    # start from an idle server, so the running row seen below is this request's
    assert _wait_until(lambda: get(server, "/health")["running"] == 0)
    before = dict(server.engine.counts)
    body = {"model": "tiny", "prompt": DOC, "max_tokens": LIMIT, "stream": stream,
            "ktm": {"ignore_eos": True}}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    assert _wait_until(lambda: get(server, "/health")["running"] == 1)
    if stream:
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.sock.close()  # the client goes away mid-generation
    conn.close()
    assert _wait_until(lambda: get(server, "/health")["running"] == 0, seconds=40.0)
    counts = server.engine.counts
    assert counts["cancelled"] == before["cancelled"] + 1, (before, counts)
    assert counts["finished"] == before["finished"]  # it did not run to max_tokens
    r = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0).completions.create(
        model="tiny", prompt="Hello", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_a_request_that_fails_to_start_does_not_fail_the_running_ones(server, monkeypatch):
    import inspect

    engine_globals = next(f for f in vars(type(server.engine)).values()
                          if inspect.isfunction(f)).__globals__
    advance, context_of = engine_globals["advance"], engine_globals["context_of"]

    def failing_context_of(segs):
        if any("BOOM" in s.text for s in segs):
            raise RuntimeError("this request cannot start")
        return context_of(segs)

    monkeypatch.setitem(engine_globals, "advance", lambda *a: time.sleep(0.02) or advance(*a))
    monkeypatch.setitem(engine_globals, "context_of", failing_context_of)
    assert _wait_until(lambda: get(server, "/health")["running"] == 0)
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    kw = dict(model="tiny", prompt=DOC, max_tokens=60, temperature=0,
              extra_body={"ktm": {"ignore_eos": True}})
    alone = c.completions.create(**kw).choices[0].text
    stream = c.completions.create(stream=True, **kw)
    pieces = [next(stream).choices[0].text]  # it is decoding
    with pytest.raises(openai.InternalServerError, match="this request cannot start"):
        c.completions.create(model="tiny", prompt="BOOM", max_tokens=2)
    pieces += [ch.choices[0].text for ch in stream]
    assert "".join(pieces) == alone  # it went on, undisturbed


def test_models_and_health(server):
    models = get(server, "/v1/models")["data"]
    assert [(m["id"], m["k"], m["base_model"], m["max_model_len"]) for m in models] == [
        ("tiny", 4, server.model.config.base_model, 512)]
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    assert (c.models.retrieve("tiny").id, c.models.retrieve("tiny").k) == ("tiny", 4)
    with pytest.raises(openai.NotFoundError, match="'gpt-4' is not served here"):
        c.models.retrieve("gpt-4")
    health = get(server, "/health")
    assert health["status"] == "ok" and health["running"] == 0 and health["k"] == 4
    assert health["continuous_batching"] and "kv" in health["prefix_cache"]


def test_ktm_serve_command_serves_and_stops_cleanly(tiny_model_dir):
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "ktm.cli", "serve", "--model", tiny_model_dir, "--k", "2",
           "--port", str(port), "--served-name", "tiny", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def up():
            try:
                return get(type("S", (), {"url": url}), "/health")["status"] == "ok"
            except OSError:
                return proc.poll() is not None
        assert _wait_until(up, 120) and proc.poll() is None, proc.communicate()
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
        assert [m.k for m in c.models.list().data] == [2]
        r = c.completions.create(model="tiny", prompt="Hello world", max_tokens=3)
        assert r.usage.prompt_tokens_merged == -(-r.usage.prompt_tokens // 2)
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    # uvicorn shuts down gracefully, then re-raises the signal it caught
    assert proc.returncode in (0, -signal.SIGTERM) and "Traceback" not in err, err
    assert f"on http://127.0.0.1:{port}/v1" in out


@pytest.mark.parametrize("argv,match", [
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--k", "0"], "k must be an integer >= 1"),
    (["--max-batch", "0"], "max_batch must be >= 1"),
])
def test_serve_flags_are_checked(capsys, argv, match):
    from ktm.cli import main

    assert main(["serve", *argv]) == 2
    assert match in capsys.readouterr().err


def test_too_long_message_counts_the_positions_a_spread_prompt_spans(tiny_model_dir):
    # with spread positions a merged block takes its last token's position, so the prompt spans
    # more positions than it has merged embeddings; the limit is on positions, and so is the
    # number the error gives (it once gave the embeddings' count, which looked under the limit)
    model = KTMModel.from_base(tiny_model_dir, k=4, spread_positions=True)
    cfg = ServeConfig(model=tiny_model_dir, served_name="tiny", max_tokens_limit=LIMIT,
                      log_level="warning")
    prompt = "Hello world " * 50  # fits alone (K=4: ~26 embeddings), not with LIMIT more tokens
    cp = model.compress([Segment(prompt)])
    assert cp.tokens_out + LIMIT <= 512 < cp.next_position + LIMIT - 1
    with BackgroundServer(create_app(model, cfg)) as srv:
        data = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": LIMIT}).encode()
        req = urllib.request.Request(srv.url + "/v1/completions", data=data,
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
    message = json.loads(e.value.read())["error"]["message"]
    assert f"spans {cp.next_position} positions" in message, message
    assert f"needs {cp.next_position + LIMIT - 1} positions" in message, message


def test_a_prompt_exactly_at_the_context_still_gets_one_token(server):
    # the last new token is returned, never read back: a prompt spanning all 512 positions can
    # have max_tokens=1, and with max_tokens=n it needs 511 + n positions
    words = "Hello world, my name is ktm. " * 200
    n = bisect.bisect_left(range(len(words)), 512,
                           key=lambda i: len(server.model.tokenize(words[:i], first=True)))
    text = words[:n]
    assert len(server.model.tokenize(text, first=True)) == 512
    body = {"model": "tiny", "prompt": text, "temperature": 0, "ktm": {"merge": False}}
    r = post(server, {**body, "max_tokens": 1})
    assert r["usage"]["prompt_tokens_merged"] == 512 and r["usage"]["completion_tokens"] == 1
    with torch.no_grad():
        greedy = int(server.model.prompt_logits(text, merge=False)[-1].argmax())
    assert r["choices"][0]["text"] == server.model.tokenizer.decode([greedy],
                                                                   skip_special_tokens=True)
    with pytest.raises(urllib.error.HTTPError) as e:
        post(server, {**body, "max_tokens": 2})
    message = json.loads(e.value.read())["error"]["message"]
    assert "needs 513 positions" in message and "context of 512" in message, message


def test_a_full_queue_answers_503_and_the_waiting_request_is_served_later(tiny_model_dir,
                                                                          monkeypatch):
    # README: 503 when --max-queue is full, in OpenAI's error shape. The engine is held back
    # until the check, so the first request is surely still waiting when the second arrives.
    model = KTMModel.from_base(tiny_model_dir, k=4)
    cfg = ServeConfig(model=tiny_model_dir, served_name="tiny", max_queue=1, max_batch=1,
                      log_level="warning")
    app = create_app(model, cfg)
    engine = app.state.engine
    start = engine.start
    monkeypatch.setattr(engine, "start", lambda: None)
    body = {"model": "tiny", "prompt": DOC, "max_tokens": 2}
    with BackgroundServer(app) as srv, ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, srv, body)
        try:
            assert _wait_until(lambda: len(engine._waiting) == 1)
            req = urllib.request.Request(srv.url + "/v1/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=10)  # a queued request would time out
        finally:
            start()
        assert e.value.code == 503
        error = json.loads(e.value.read())["error"]
        assert error["code"] == "server_busy" and "max_queue=1" in error["message"], error
        assert first.result(timeout=60)["usage"]["completion_tokens"] == 2
