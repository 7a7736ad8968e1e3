"""``ktm serve`` over loopback with the official openai client, on the tiny in-process model."""

import bisect
import contextlib
import http.client
import json
import re
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from helpers import perturb

from ktm import KTMError, Segment
from ktm.core.allocate import RatioWarning
from ktm.model import KTMModel, RuntimeSpec, prompt_logits
from ktm.serving.app import BackgroundServer, create_app
from ktm.serving.config import ServeConfig

DOC = ("Tree: AB\n+CD\n++EF\n+GH\n++IJ\n+++KL. The quick brown fox jumps over the lazy dog. "
       "def add(a, b):\n    return a + b\n")
LIMIT = 448  # max_tokens limit of the test server; the tiny model's context is 512


@contextlib.contextmanager
def running_server(model_dir: str, max_tokens_limit: int):
    """The tiny model (K=4, perturbed) served in-process over loopback, as ``server`` serves it;
    ``srv.model`` and ``srv.engine`` are the served model and its engine."""
    torch.manual_seed(0)
    model = KTMModel.from_base(model_dir, k=4)
    perturb(model)
    cfg = ServeConfig(model=model_dir, served_name="tiny", max_tokens_limit=max_tokens_limit,
                      batch_window_ms=100, log_level="warning")
    app = create_app(model, cfg)
    with BackgroundServer(app) as srv:
        srv.model, srv.engine = model, app.state.engine
        yield srv


def openai_client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with running_server(tiny_model_dir, LIMIT) as srv:
        yield srv


@pytest.fixture
def client(server):
    return openai_client(server)


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


def _together(url: str, reqs: list[dict]) -> list[tuple[str, str]]:
    """``reqs`` sent at once, one thread each, released together by a barrier."""
    return _together_by(lambda kw: _ask(url, kw), reqs)


def test_sixteen_concurrent_requests_equal_one_by_one(server):
    reqs = _requests()
    one_by_one = [_ask(server.url, kw) for kw in reqs]
    assert server.engine.counts["peak_running"] <= 2  # (a stream above may have overlapped)
    concurrent = _together(server.url, reqs)
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
    doc = "A context no other test sends. " + DOC * 3  # no stored context shares its rows
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
    ("unimplemented option", {"prompt": "hi", "best_of": 2}, 400,
     "best_of=2 is not supported by this server; it accepts only 1 or null"),
    ("a penalty", {"prompt": "hi", "presence_penalty": 0.5}, 400,
     "presence_penalty=0.5 is not supported"),
    ("unknown ktm field", {"prompt": "hi", "ktm": {"merge_all": True}}, 400, "ktm.merge_all"),
    ("empty prompt", {"prompt": ""}, 400, "prompt is empty"),
    ("no prompt", {}, 400, "prompt is empty"),
    ("max_tokens over the limit", {"prompt": "hi", "max_tokens": LIMIT + 1}, 400,
     f"over this server's limit of {LIMIT}"),
    # 4,801 tokens: fitted at ratio 16 with 16 new tokens (the test below), not with 447
    ("too long after merging", {"prompt": "Hello world " * 1200, "max_tokens": LIMIT - 1}, 400,
     "more than the model's context of 512"),
    ("too long, n=2", {"prompt": "Hello world " * 1200, "n": 2, "max_tokens": LIMIT - 1}, 400,
     "more than the model's context of 512"),
    ("too long with max_tokens", {"prompt": "Hello world " * 300, "max_tokens": LIMIT}, 400,
     "more than the model's context of 512"),
    ("bad temperature", {"prompt": "hi", "temperature": 3}, 400,
     "temperature: Input should be less than or equal to 2, got 3"),
    ("n = 0", {"prompt": "hi", "n": 0}, 400, "n: Input should be greater than or equal to 1"),
    ("n over OpenAI's 128", {"prompt": "hi", "n": 129}, 400, "n: Input should be less than"),
    ("seed over int64", {"prompt": "hi", "temperature": 1, "seed": 2**64}, 400,
     f"seed: Input should be less than or equal to {2**63 - 1}, got {2**64}"),
    ("five stop sequences", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400,
     "Invalid 'stop': 5 stop sequences, expected at most 4"),
    ("token id outside the vocabulary", {"prompt": [1, 10**6]}, 400,
     "prompt token id 1000000 is outside this model's vocabulary: expected ids in [0, "),
    ("negative token id", {"prompt": [[1, -1]]}, 400, "prompt token id -1 is outside"),
    ("token id as a string", {"prompt": [1, "2"]}, 400,
     'prompt[1] is "2": expected a token id (an integer)'),
    ("token id as a bool", {"prompt": [[1, True]]}, 400, "prompt[0][1] is true: expected a token"),
    ("token id as a float", {"prompt": [1.0]}, 400, "prompt[0] is 1.0: expected a token id"),
    ("token ids and segments", {"prompt": [1, 2], **segs_body("a", "b")}, 400,
     "ktm.segments gives the one prompt: prompt must be omitted"),
    ("two prompts and segments", {"prompt": ["a", "b"], **segs_body("a", "b")}, 400,
     "not token ids or a list of 2 prompts"),
    ("an empty prompt of two", {"prompt": ["hi", ""]}, 400, "prompt[1] is empty"),
    ("an unknown id in the second prompt", {"prompt": [[1], [10**6]]}, 400,
     "prompt[1] token id 1000000 is outside"),
    ("empty token-id prompt", {"prompt": [[]]}, 400, "prompt is empty"),
    ("empty prompt list", {"prompt": []}, 400, "prompt is empty"),
    ("prompt contradicts segments", {"prompt": "other", **segs_body("a", "b")}, 400,
     "segments' texts joined"),
    ("unknown model", {"model": "gpt-4", "prompt": "hi"}, 404, "not served here"),
    # OpenAI answers 400 here; it was accepted and ignored
    ("stream_options without stream", {"prompt": "hi", "stream_options": {"include_usage": True}},
     400, "The 'stream_options' parameter is only allowed when 'stream' is enabled"),
    ("stream_options with stream false", {"prompt": "hi", "stream": False,
                                          "stream_options": {}}, 400, "'stream_options'"),
    # a boolean is no integer: max_tokens=true was read as 1
    ("max_tokens as a bool", {"prompt": "hi", "max_tokens": True}, 400,
     "max_tokens: Input should be a valid integer, got true"),
    ("n as a bool", {"prompt": "hi", "n": True}, 400, "n: Input should be a valid integer"),
    ("seed as a bool", {"prompt": "hi", "seed": False}, 400, "seed: Input should be a valid"),
    # everything plain: the message said "after merging"
    ("too long, sent plain", {"prompt": "Hello world " * 300, "ktm": {"merge": False}}, 400,
     "tokens, none merged): more than the model's context of 512"),
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


def test_top_p_zero_is_greedy(client):
    # OpenAI takes top_p in [0, 1]; a nucleus of mass 0 keeps only the most likely token
    kw = dict(model="tiny", prompt=DOC, max_tokens=12)
    greedy = client.completions.create(temperature=0, **kw).choices[0].text
    for seed in (1, 2):
        r = client.completions.create(temperature=1.5, top_p=0, seed=seed, **kw)
        assert r.choices[0].text == greedy


@pytest.mark.parametrize("chat", [False, True])
def test_n_choices_are_n_seeded_samples(client, chat):
    # OpenAI's n: n choices of the one prompt; choice i samples with seed + i, so each equals a
    # request of n=1 with that seed, and the usage counts the prompt once
    kw = dict(model="tiny", max_tokens=10, temperature=1.0, seed=7)
    if chat:
        kw["messages"] = [{"role": "user", "content": DOC}]
        create, text = client.chat.completions.create, lambda c: c.message.content
    else:
        kw["prompt"] = DOC
        create, text = client.completions.create, lambda c: c.text
    ones = [create(**{**kw, "seed": 7 + i}) for i in range(3)]
    r = create(n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [text(c) for c in r.choices] == [text(o.choices[0]) for o in ones]
    assert len({text(c) for c in r.choices}) > 1
    assert [c.finish_reason for c in r.choices] == [o.choices[0].finish_reason for o in ones]
    assert r.usage.prompt_tokens == ones[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(o.usage.completion_tokens for o in ones)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(create(n=3, stream=True, stream_options={"include_usage": True}, **kw))
    streamed = ["", "", ""]
    finish = [None] * 3
    for ch in chunks[:-1]:
        (c,) = ch.choices
        streamed[c.index] += (c.delta.content or "") if chat else c.text
        if c.finish_reason:
            assert finish[c.index] is None
            finish[c.index] = c.finish_reason
    assert streamed == [text(c) for c in r.choices]
    assert finish == [c.finish_reason for c in r.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        r.usage.completion_tokens


def test_more_choices_than_the_queue_holds_are_refused(server, client, monkeypatch):
    monkeypatch.setattr(server.engine.cfg, "max_queue", 5)  # the app's config too
    with pytest.raises(openai.BadRequestError, match="2 prompt.s. with n=3 make 6 choices, over "
                                                     "this server's max_queue of 5"):
        client.completions.create(model="tiny", prompt=["hi", "ho"], max_tokens=2, n=3)


def test_a_list_of_prompts_gets_their_choices_in_order(client):
    # OpenAI's order: each prompt's n choices in turn; the usage counts each prompt once
    prompts = [DOC, "Hello world", DOC[::-1]]
    kw = dict(model="tiny", max_tokens=6, temperature=1.0, seed=3)
    ones = [client.completions.create(prompt=p, **{**kw, "seed": 3 + i})
            for p in prompts for i in range(2)]
    ids = [client.completions.create(prompt=p, max_tokens=1, model="tiny").usage.prompt_tokens
           for p in prompts]
    for stream in (False, True):
        r = client.completions.create(prompt=prompts, n=2, stream=stream, **kw)
        if stream:
            chunks = list(r)
            texts = [""] * 6
            for ch in chunks:
                texts[ch.choices[0].index] += ch.choices[0].text
        else:
            assert [c.index for c in r.choices] == list(range(6))
            texts = [c.text for c in r.choices]
            assert r.usage.prompt_tokens == sum(ids)
            assert r.usage.completion_tokens == sum(o.usage.completion_tokens for o in ones)
        assert texts == [o.choices[0].text for o in ones]
    r = client.completions.create(model="tiny", prompt=[[5, 6, 7, 8], [10, 11, 12]],
                                  max_tokens=3)
    assert len(r.choices) == 2 and r.usage.prompt_tokens == 7


def test_a_list_of_one_prompt_is_that_prompt(client):
    kw = dict(model="tiny", max_tokens=8, temperature=0)
    want = client.completions.create(prompt=DOC, **kw).choices[0].text
    assert client.completions.create(prompt=[DOC], **kw).choices[0].text == want


@pytest.mark.parametrize("merge", [True, False])
def test_a_prompt_of_token_ids_is_those_tokens(server, client, merge):
    # as OpenAI (and vLLM) take it: a list of ints, or a list of one such list, is the prompt's
    # tokens as given, merged like a text prompt unless "ktm": {"merge": false}
    ids = server.model.tokenize(DOC, first=True)
    kw = dict(model="tiny", max_tokens=8, temperature=0,
              extra_body={"ktm": {"merge": merge, "question": ""}})
    want = client.completions.create(prompt=DOC, **kw)
    for prompt in (ids, [ids]):
        got = client.completions.create(prompt=prompt, **kw)
        assert got.choices[0].text == want.choices[0].text
        assert got.usage.prompt_tokens == len(ids)
        assert got.usage.prompt_tokens_merged == want.usage.prompt_tokens_merged


def test_four_stop_sequences_are_accepted(client):
    r = client.completions.create(model="tiny", prompt=DOC, max_tokens=4, temperature=0,
                                  stop=["\x00a", "\x00b", "\x00c", "\x00d"])
    assert r.choices[0].finish_reason in ("length", "stop")


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
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": True},
     "max_completion_tokens: Input should be a valid integer, got true"),
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


def _engine_globals(server) -> dict:
    """The globals the running engine really uses: another test may have re-imported ktm, so
    `from ktm.serving import engine` could give a fresh module the server never calls into."""
    import inspect

    return next(f for f in vars(type(server.engine)).values()
                if inspect.isfunction(f)).__globals__


def _slow_decoding(server, monkeypatch, seconds: float) -> dict:
    """Each decode step of the running engine's runtime takes ``seconds`` more; the engine's
    globals, to patch more."""
    runtime = server.engine.runtime
    advance = runtime.advance
    monkeypatch.setattr(runtime, "advance", lambda *a: time.sleep(seconds) or advance(*a))
    return _engine_globals(server)


def _post_long(server, stream: bool) -> http.client.HTTPConnection:
    """Start a LIMIT-token completion of DOC that ignores EOS, on a raw connection."""
    body = {"model": "tiny", "prompt": DOC, "max_tokens": LIMIT, "stream": stream,
            "ktm": {"ignore_eos": True}}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    return conn


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_slot(server, stream, monkeypatch):
    # a slow model: LIMIT steps take 20+ s, so a row that ran on to max_tokens would show, even
    # when a loaded machine takes seconds to notice the disconnect
    _slow_decoding(server, monkeypatch, 0.05)
    # start from an idle server, so the running row seen below is this request's
    assert _wait_until(lambda: get(server, "/health")["running"] == 0)
    before = dict(server.engine.counts)
    conn = _post_long(server, stream)
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


def test_a_disconnect_seen_with_the_first_token_is_one_quiet_log_line(server, monkeypatch,
                                                                      caplog):
    # the race: the disconnect watcher sees the client go in the same loop turn as the first
    # token arrives; its "gone" mark then waits behind that token and is read by the stream,
    # which once let it escape as a traceback ("Exception in ASGI application")
    import logging

    _slow_decoding(server, monkeypatch, 0.05)
    handle_cls = create_app.__globals__["Handle"]
    deliver, gone = handle_cls._deliver, []

    def deliver_then_go(self, choice, ev):
        deliver(self, choice, ev)
        if not gone:  # what the watcher does when the client goes at this moment
            gone.append(ev)
            self.loop.call_soon_threadsafe(self.queue.put_nowait, None)

    monkeypatch.setattr(handle_cls, "_deliver", deliver_then_go)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("uvicorn.error").addHandler(handler)
    caplog.set_level(logging.INFO, logger="ktm.serving")
    try:
        assert _wait_until(lambda: get(server, "/health")["running"] == 0)
        before = dict(server.engine.counts)
        conn = _post_long(server, True)
        resp = conn.getresponse()
        assert resp.status == 200
        with contextlib.suppress(http.client.IncompleteRead):  # (it broke off, once)
            resp.read()  # the stream ends at once: its client is gone
        conn.close()
        assert _wait_until(lambda: get(server, "/health")["running"] == 0)
        assert server.engine.counts["cancelled"] == before["cancelled"] + 1
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
    assert not [r for r in records if r.exc_info], [r.getMessage() for r in records]
    gone = [r for r in caplog.records if "went away" in r.getMessage()]
    assert len(gone) == 1 and gone[0].levelno == logging.INFO and not gone[0].exc_info
    assert "\n" not in gone[0].getMessage()


def _one_decoding(server):
    """A client; DOC's greedy 60-token completion alone; then the same completion streamed, with
    its first piece read (it is decoding): (client, alone, stream, [first piece])."""
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    kw = dict(model="tiny", prompt=DOC, max_tokens=60, temperature=0,
              extra_body={"ktm": {"ignore_eos": True}})
    alone = c.completions.create(**kw).choices[0].text
    stream = c.completions.create(stream=True, **kw)
    return c, alone, stream, [next(stream).choices[0].text]


def _fail_to_start_on_boom(g: dict, monkeypatch) -> None:
    """A request whose prompt holds "BOOM" fails as it starts (its context cannot be built)."""
    context_of = g["context_of"]

    def failing_context_of(segs):
        if any("BOOM" in s.text for s in segs):
            raise RuntimeError("this request cannot start")
        return context_of(segs)

    monkeypatch.setitem(g, "context_of", failing_context_of)


def test_a_request_that_fails_to_start_does_not_fail_the_running_ones(server, monkeypatch):
    _fail_to_start_on_boom(_slow_decoding(server, monkeypatch, 0.02), monkeypatch)
    assert _wait_until(lambda: get(server, "/health")["running"] == 0)
    c, alone, stream, pieces = _one_decoding(server)
    with pytest.raises(openai.InternalServerError, match="this request cannot start"):
        c.completions.create(model="tiny", prompt="BOOM", max_tokens=2)
    pieces += [ch.choices[0].text for ch in stream]
    assert "".join(pieces) == alone  # it went on, undisturbed


def test_a_refused_request_is_not_failed_again_by_its_batch(server, monkeypatch):
    # a request refused at admission (too long) has its answer; when a later request of the same
    # admission then fails, the refused one is not answered and counted a second time
    _fail_to_start_on_boom(_engine_globals(server), monkeypatch)
    assert _wait_until(lambda: get(server, "/health")["running"] == 0)
    before = dict(server.engine.counts)

    def ask(body):
        with pytest.raises(urllib.error.HTTPError) as e:
            post(server, {"model": "tiny", "max_tokens": 2, **body})
        return e.value.code

    with ThreadPoolExecutor(2) as pool:
        # past the context even read at the densest, with room for its max_tokens
        too_long = pool.submit(ask, {"prompt": "Hello world " * 1200, "max_tokens": LIMIT - 1})
        time.sleep(0.02)  # after it, in the same batch window
        boom = pool.submit(ask, {"prompt": "BOOM"})
        assert (too_long.result(), boom.result()) == (400, 500)
    counts = server.engine.counts
    assert (counts["rejected"], counts["failed"]) == (before["rejected"] + 1,
                                                      before["failed"] + 1)


@pytest.mark.parametrize("where", ["sampling", "text"])
def test_a_decode_failure_of_one_request_fails_only_that_request(server, monkeypatch, where):
    import ktm.decode.generate as generate

    g = _slow_decoding(server, monkeypatch, 0.02)
    select_next, push = generate.select_next, g["Row"].push

    def failing_select(logits, cfg, gen):  # e.g. NaN logits of one row, which cannot be sampled
        if cfg.temperature == 0.625:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return select_next(logits, cfg, gen)

    def failing_push(row, token):  # e.g. a token its detokenizer cannot decode
        if row.job.temperature == 0.625:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return push(row, token)

    if where == "sampling":
        monkeypatch.setattr(generate, "select_next", failing_select)
    else:
        monkeypatch.setattr(g["Row"], "push", failing_push)
    assert _wait_until(lambda: get(server, "/health")["running"] == 0)
    before = dict(server.engine.counts)
    c, alone, stream, pieces = _one_decoding(server)
    with pytest.raises(openai.InternalServerError, match="inf, nan") as e:
        c.completions.create(model="tiny", prompt="Hello", max_tokens=20, temperature=0.625,
                             seed=1)
    assert e.value.body["type"] == "server_error"
    pieces += [ch.choices[0].text for ch in stream]
    assert "".join(pieces) == alone  # it went on, undisturbed
    counts = server.engine.counts
    assert counts["failed"] == before["failed"] + 1
    assert counts["finished"] == before["finished"] + 2


def test_a_failed_forward_step_fails_the_running_requests_and_the_server_goes_on(
        server, monkeypatch):
    runtime = server.engine.runtime
    advance = runtime.advance
    calls = []

    def failing_advance(*a):  # the shared forward pass: no request is to blame
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("out of memory")
        return advance(*a)

    monkeypatch.setattr(runtime, "advance", failing_advance)
    assert _wait_until(lambda: get(server, "/health")["running"] == 0)
    before = dict(server.engine.counts)
    start = threading.Barrier(2)

    def ask(prompt):
        start.wait()
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError, match="out of memory"):
            c.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0,
                                 extra_body={"ktm": {"ignore_eos": True}})

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(ask, [DOC, "Hello there"]))
    health = get(server, "/health")
    assert health["running"] == 0 and health["status"] == "ok"
    assert health["failed"] == before["failed"] + 2
    r = post(server, {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert r["choices"][0]["finish_reason"] in ("length", "stop")


def test_a_failed_join_fails_the_running_and_the_joining_requests(server, monkeypatch):
    # joining grows the running batch's cache in place: a failure there leaves no batch to go
    # on with, and the request that was joining must be answered too, not left waiting
    _slow_decoding(server, monkeypatch, 0.02)

    def failing_join(*_):
        raise RuntimeError("join failed")

    monkeypatch.setattr(server.engine.runtime, "join", failing_join)
    assert _wait_until(lambda: get(server, "/health")["running"] == 0)
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=30)
    stream = c.completions.create(model="tiny", prompt=DOC, max_tokens=200, stream=True,
                                  extra_body={"ktm": {"ignore_eos": True}})
    next(stream)  # it is decoding
    with pytest.raises(openai.InternalServerError, match="join failed"):
        c.completions.create(model="tiny", prompt="Hello", max_tokens=2)
    with pytest.raises(openai.APIError, match="join failed"):
        list(stream)
    assert get(server, "/health")["running"] == 0


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


@pytest.mark.slow  # starts a Python process
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
           "--port", str(port), "--served-name", "tiny", "--log-level", "info"]
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
        r = c.completions.create(model="tiny", prompt="Hello world", max_tokens=3,
                                 extra_body={"ktm": {"question": ""}})  # merged whole
        assert r.usage.prompt_tokens_merged == -(-r.usage.prompt_tokens // 2)
        # a client that goes mid-stream: one line, no traceback
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps(
            {"model": "tiny", "prompt": "Hello", "max_tokens": 500, "stream": True,
             "ktm": {"ignore_eos": True}}), {"Content-Type": "application/json"})
        assert conn.getresponse().readline().startswith(b"data: ")
        conn.sock.close()
        conn.close()
        assert _wait_until(lambda: get(type("S", (), {"url": url}), "/health")["cancelled"] == 1)
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    # uvicorn shuts down gracefully, then re-raises the signal it caught
    assert proc.returncode in (0, -signal.SIGTERM) and "Traceback" not in err, err
    assert len(re.findall(r"INFO: +cmpl-\w+: the client went away mid-stream", err)) == 1, err
    assert f"on http://127.0.0.1:{port}/v1" in out


@pytest.mark.parametrize("argv,match", [
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--k", "0"], "k must be an integer >= 1"),
    (["--max-batch", "0"], "max_batch must be >= 1"),
])
def test_serve_flags_are_checked(capsys, argv, match):
    from ktm.cli.main import main

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


def test_a_prompt_past_the_context_is_fitted_as_the_library_fits_it(server, client):
    """Merged at its K it spans more than the 512 positions: read at a higher ratio instead
    (``ktm.core.fit``), as ``KTMModel.generate`` reads it, and the usage says the ratio."""
    doc, question = "Hello world, my name is ktm. " * 200, " Question: who? Answer:"
    assert len(server.model.tokenize(doc, first=True)) / server.model.k > 512
    r = client.completions.create(model="tiny", prompt=None, max_tokens=8, temperature=0,
                                  extra_body=segs_body(doc, question))
    with pytest.warns(RatioWarning, match="was read at ratio"):
        want = server.model.generate([Segment(doc), Segment(question, compress=False)],
                                     max_new_tokens=8)
    assert r.choices[0].text == want
    usage = r.model_dump()["usage"]
    assert usage["prompt_tokens_merged"] + 7 <= 512
    assert usage["prompt_ratio_read"] > server.model.k
    plain = client.completions.create(model="tiny", prompt="Hello", max_tokens=2)
    assert "prompt_ratio_read" not in plain.model_dump()["usage"]  # read as sent: no ratio


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
        greedy = int(prompt_logits(server.model, text, merge=False)[-1].argmax())
    assert r["choices"][0]["text"] == server.model.tokenizer.decode([greedy],
                                                                   skip_special_tokens=True)
    with pytest.raises(urllib.error.HTTPError) as e:
        post(server, {**body, "max_tokens": 2})
    message = json.loads(e.value.read())["error"]["message"]
    assert "needs 513 positions" in message and "context of 512" in message, message


def test_a_full_queue_answers_503_and_the_waiting_request_is_served_later(tiny_model_dir,
                                                                          monkeypatch):
    # README: 503 when --max-queue is full, in OpenAI's error shape, saying when to retry
    # (Retry-After). The engine is held back
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
        assert e.value.code == 503 and e.value.headers["Retry-After"] == "1"
        error = json.loads(e.value.read())["error"]
        assert error["code"] == "server_busy" and "max_queue=1" in error["message"], error
        assert first.result(timeout=60)["usage"]["completion_tokens"] == 2


def test_int8_weights_serve_what_the_model_generates_with_them(tiny_model_dir):
    """--weights int8: the server decodes through the int8 view (``ktm.core.int8``), and its
    answers are the model's own int8 generation's."""
    torch.manual_seed(0)
    model = KTMModel.from_base(tiny_model_dir, k=4)
    perturb(model)
    model.requires_grad_(False)  # as ktm serve loads a model: its LoRA folded, then in int8
    cfg = ServeConfig(model=tiny_model_dir, served_name="tiny", batch_window_ms=0,
                      log_level="warning", runtime=RuntimeSpec(weights="int8"))
    app = create_app(model, cfg)
    reqs = [{"doc": f"{DOC[:40 + 9 * i]} #{i}", "q": f" Q{i}?", "n": 5} for i in range(3)]
    with BackgroundServer(app) as srv:
        assert model.runtime.weights == "int8"
        got = [_ask(srv.url, {"model": "tiny", "prompt": None, "max_tokens": r["n"],
                              "temperature": 0, "extra_body": segs_body(r["doc"], r["q"])})[0]
               for r in reqs]
    assert type(model.decode_lm().lm_head).__name__ == "Int8Linear"
    for r, text in zip(reqs, got):
        assert text == model.generate([Segment(r["doc"]), Segment(r["q"], compress=False)],
                                      max_new_tokens=r["n"])


@pytest.mark.xdist_group("compile")  # with tests/decode/test_compiled.py's graphs
def test_the_compiled_step_serves_as_eager_and_compiles_nothing_new_per_request(tiny_model_dir,
                                                                                monkeypatch):
    """--compile on: the running batch decodes on a static cache, its rows padded to a power
    of two, so rows leaving as they finish reuse a few compiled shapes. Answers equal eager
    decoding's, and a second round of requests compiles nothing."""
    torch.manual_seed(0)
    model = KTMModel.from_base(tiny_model_dir, k=4)
    perturb(model)
    reqs = [{"doc": f"{DOC[:40 + 7 * i]} #{i}", "q": f" Q{i}?", "n": 4 + i} for i in range(8)]
    # an idle engine waits for a full batch (a minute at most): each round lands as one batch
    # of 8 however its requests arrive, its rows leaving as their answers end, so both rounds
    # step through the same shapes
    cfg = ServeConfig(model=tiny_model_dir, served_name="tiny", max_batch=len(reqs),
                      batch_window_ms=60_000, log_level="warning",
                      runtime=RuntimeSpec(compile="on"))
    app = create_app(model, cfg)
    with BackgroundServer(app) as srv:
        assert model.runtime.compile == "on"

        def ask(r):
            return _ask(srv.url, {"model": "tiny", "prompt": None, "max_tokens": r["n"],
                                  "temperature": 0, "extra_body": segs_body(r["doc"], r["q"])})[0]

        first = _together_by(ask, reqs)
        assert app.state.engine.counts["peak_running"] == len(reqs)  # one batch
        compiles = model.runtime.compiles
        assert 1 <= compiles <= 4  # batches of 1, 2, 4 and 8 rows, one cache length
        second = _together_by(ask, reqs)
        assert model.runtime.compiles == compiles  # nothing compiled for the later requests
        # a request alone (no window to wait out), as the last row of a round ran
        monkeypatch.setattr(app.state.engine.cfg, "batch_window_ms", 0)
        assert ask(reqs[3]) == first[3]
        assert model.runtime.compiles == compiles
    assert first == second
    model.runtime.compile = "off"
    for r, text in zip(reqs, first):
        assert text == model.generate([Segment(r["doc"]), Segment(r["q"], compress=False)],
                                      max_new_tokens=r["n"])
    with pytest.raises(KTMError, match="compile must be one of"):
        ServeConfig(model=tiny_model_dir, runtime=RuntimeSpec(compile="fast"))
    with pytest.raises(KTMError, match="--compile on is an option of the torch backend"):
        ServeConfig(model=tiny_model_dir, runtime=RuntimeSpec(backend="llamacpp", compile="on"))
    with pytest.raises(KTMError, match="weights must be one of"):
        ServeConfig(model=tiny_model_dir, runtime=RuntimeSpec(weights="int4"))
    with pytest.raises(KTMError, match="--weights int8 is an option of the torch backend"):
        ServeConfig(model=tiny_model_dir, runtime=RuntimeSpec(backend="llamacpp",
                                                              weights="int8"))


def _together_by(ask, reqs: list[dict]) -> list:
    """``ask(r)`` for every request at once, one thread each, released together."""
    start = threading.Barrier(len(reqs))

    def one(r):
        start.wait()
        return ask(r)

    with ThreadPoolExecutor(len(reqs)) as pool:
        return list(pool.map(one, reqs))


def test_the_first_token_is_told_even_when_its_text_is_held_back(tiny_model_dir):
    # the reply starts (its headers and role chunk) when the first token is chosen, as time to
    # first token is measured; here that token's text is held back as the start of a stop string
    from helpers import fresh_model

    from ktm.serving.engine import Engine, Job

    model = fresh_model(tiny_model_dir)
    ids = tuple(model.tokenize("The quick brown fox jumps over the lazy dog.", first=True))
    prompt = (Segment("", ids=ids), Segment("", ids=ids[:2], compress=False))
    first = model.generate([list(prompt)], max_new_tokens=1)[0]
    assert first.strip(), "the test needs a first token with text"
    engine = Engine(model, ServeConfig(model=tiny_model_dir, batch_window_ms=0))
    told: dict[str, list] = {}
    for stop in ((), (first + "\u2603",)):  # that stop string never ends: decoding goes on
        events = told.setdefault(stop, [])
        with torch.no_grad():
            engine._admit([Job(prompt, 3, events.append, temperature=0.0, stop=stop)])
            engine._step()
            assert [(e.text, e.finish) for e in events] == [
                (first if not stop else "", None)]
            while engine._rows:
                engine._step()
    assert "".join(e.text for e in told[()]) == "".join(e.text for e in told[stop])
