"""``ktm serve``: an answer depends on its own request only. Good requests batched with each
hostile kind get exactly the quiet server's answers, a failure inside a batch fails only its own
request, and a cached prefix never changes a greedy answer (the tiny in-process model).

The same on the real reader, with the time a 2,048-message chat costs the others:
``results/serving/isolation.py``."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import fresh_model, perturb
from test_serve_exposed import raw, serving

from ktm.decode.generate import GenerationConfig, sampling_probs

GOOD = [  # four greedy requests, completions and a chat
    ("/v1/completions", {"prompt": "The museum opened in 1911. It", "max_tokens": 6}),
    ("/v1/completions", {"prompt": "def add(a, b):\n    return", "max_tokens": 5}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tree: AB\n+CD\nWho?"}],
                              "max_tokens": 6}),
    ("/v1/completions", {"ktm": {"segments": [{"text": "The quick brown fox jumps over it."},
                                              {"text": " Who jumps?", "merge": False}]},
                         "max_tokens": 4}),
]

HOSTILE = [  # (name, path, body, the status, the param its 4xx names: None for a 200)
    ("ratio past K", "/v1/completions",
     {"prompt": "The museum opened in 1911.", "ktm": {"ratio": 5}}, 400, "ktm.ratio"),
    ("ratio 1e308", "/v1/completions",
     {"prompt": "The museum opened in 1911.", "ktm": {"ratio": 1e308}}, 400, "ktm.ratio"),
    ("a segment's ratio past K", "/v1/completions",
     {"ktm": {"segments": [{"text": "The museum opened.", "ratio": 5.5}]}}, 400,
     "ktm.segments.0.ratio"),
    ("a message segment's ratio past K", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": None, "ktm": {"segments": [
         {"text": "Hello there", "ratio": 9}]}}]}, 400, "messages.0.ktm.segments.0.ratio"),
    ("temperature 5e-324", "/v1/completions",
     {"prompt": "The museum", "temperature": 5e-324, "max_tokens": 3}, 200, None),
    ("top_p 1e-300", "/v1/completions",
     {"prompt": "The museum", "temperature": 1, "top_p": 1e-300, "max_tokens": 3}, 200, None),
    ("top_p 2.2e-311", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Hi"}], "temperature": 1, "top_p": 2.2e-311,
      "max_tokens": 3}, 200, None),
    ("stream 'yes'", "/v1/completions", {"prompt": "Hi", "stream": "yes"}, 400, "stream"),
    ("merge 'no'", "/v1/completions", {"prompt": "Hi", "ktm": {"merge": "no"}}, 400,
     "ktm.merge"),
    ("temperature '0.5'", "/v1/completions", {"prompt": "Hi", "temperature": "0.5"}, 400,
     "temperature"),
    ("ratio '2'", "/v1/completions", {"prompt": "Hi", "ktm": {"ratio": "2"}}, 400, "ktm.ratio"),
    ("10,000 segments", "/v1/completions",
     {"ktm": {"segments": [{"text": "a"}] * 10_000}}, 400, "ktm.segments"),
]


def _post(srv, path: str, body: dict) -> tuple[int, dict]:
    status, _, answer = raw(srv, path, json.dumps({"model": "tiny", "temperature": 0,
                                                   **body}).encode())
    return status, answer


def _text(answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    model = fresh_model(tiny_model_dir, k=4)
    perturb(model)
    with serving(model, tiny_model_dir, batch_window_ms=200) as srv:
        yield srv


@pytest.fixture(scope="module")
def quiet(server) -> list[str]:
    """The good requests' answers, each sent alone."""
    answers = [_post(server, path, body) for path, body in GOOD]
    assert all(status == 200 for status, _ in answers)
    return [_text(a) for _, a in answers]


@pytest.mark.parametrize("name,path,body,status,param", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_good_requests_batched_with_a_hostile_one_get_the_quiet_answers(
        server, quiet, name, path, body, status, param):
    asks = [*GOOD, (path, body)]
    with ThreadPoolExecutor(len(asks)) as pool:  # within one batch window
        got = list(pool.map(lambda a: _post(server, *a), asks))
    assert [_text(a) for _, a in got[:-1]] == quiet
    assert all(s == 200 for s, _ in got[:-1])
    hostile_status, answer = got[-1]
    assert hostile_status == status, answer
    if param is not None:
        assert answer["error"]["param"] == param, answer
        assert param.split(".")[-1] in answer["error"]["message"] or "ratio" in param
    else:
        assert answer["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_failure_inside_a_batch_fails_only_its_own_request(server, quiet, monkeypatch):
    """A request that passes every check yet fails in the batch's prefill (here: a poisoned
    prompt the encoder refuses to read) ends alone; its batch-mates are read again, alone, and
    get the quiet answers."""
    model, real = server.engine.model, server.engine.model.encode_prompts

    def poisoned(prompts, *args, **kw):
        if any("POISON" in (s.text or "") for p in prompts for s in p):
            raise RuntimeError("a poisoned prompt")
        return real(prompts, *args, **kw)

    monkeypatch.setattr(model, "encode_prompts", poisoned)
    asks = [*GOOD, ("/v1/completions", {"prompt": "POISON here", "max_tokens": 3})]
    with ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(lambda a: _post(server, *a), asks))
    assert [_text(a) for _, a in got[:-1]] == quiet
    assert got[-1][0] == 500 and "a poisoned prompt" in got[-1][1]["error"]["message"]


def test_a_temperature_or_top_p_near_zero_samples_the_most_likely_token():
    logits = torch.tensor([[2.0, 5.0, 1.0, 5.0 - 1e-3], [0.5, -1.0, 3.0, 2.9]])
    for cfg in (GenerationConfig(do_sample=True, temperature=5e-324),
                GenerationConfig(do_sample=True, temperature=1e-300),
                GenerationConfig(do_sample=True, top_p=1e-300),
                GenerationConfig(do_sample=True, top_p=2.2e-311)):
        probs = sampling_probs(logits, cfg)
        assert torch.isfinite(probs).all()
        assert probs.argmax(-1).tolist() == [1, 2] and (probs > 0).sum().item() == 2


# ---------------------------------------------------------------- a cached prefix

DOC = ("".join(f"line {i} says nothing much here\n" for i in range(10))
       + "the secret code is fox\n"
       + "".join(f"line {i} says little\n" for i in range(10))
       + "the backup word is owl\n"
       + "".join(f"line {i} is filler\n" for i in range(10)))
QUESTIONS = ["\nWhat is the secret code? It is", "\nWhat is the backup word? It is",
             "\nWhich line says little? It is"]


@pytest.fixture(scope="module")
def reader(tiny_model_dir):
    """A reader whose reading of a document depends on its question (the question
    allocator reads the lines a question names plain)."""
    model = fresh_model(tiny_model_dir, k=4, inner_k=2, allocator="question", ratio=3.0)
    perturb(model)
    return model.eval()


def _ask(srv, question: str) -> str:
    status, answer = _post(srv, "/v1/completions", {"max_tokens": 5, "ktm": {"segments": [
        {"text": DOC}, {"text": question, "merge": False}]}})
    assert status == 200, answer
    return answer["choices"][0]["text"]


@pytest.mark.parametrize("order", [[0, 1, 2, 0], [1, 0, 2, 1], [2, 1, 0, 2]])
def test_a_cached_document_never_changes_an_answer_whatever_the_order(reader, tiny_model_dir,
                                                                      order):
    with serving(reader, tiny_model_dir, prefix_cache_mb=0) as off:
        want = {q: _ask(off, QUESTIONS[q]) for q in set(order)}
    with serving(reader, tiny_model_dir) as on:
        got = [_ask(on, QUESTIONS[q]) for q in order]
        cached = on.engine.stats()["prefix_cache"]["kv"]
    assert got == [want[q] for q in order]
    assert cached["entries"] >= 1  # the document's KV was kept, and asked of again


def test_one_document_read_the_same_whatever_is_asked_is_read_once_per_ratio(tiny_model_dir):
    """``quote="all"``: the document's reading is the same for every question, so after its
    first question at a ratio every other one reads it from the cache (all of it), and the
    answers are a cache-off server's."""
    from ktm import Segment

    model = fresh_model(tiny_model_dir, k=4, inner_k=2, allocator="question", ratio=3.0,
                        quote="all")
    perturb(model)
    model.eval()
    asks = [(0, None), (1, None), (0, 4.0), (1, 4.0), (2, None), (2, 4.0)]

    def ask(srv, q, ratio):
        ext = {"question": QUESTIONS[q], **({"ratio": ratio} if ratio else {})}
        status, answer = _post(srv, "/v1/completions", {"prompt": DOC, "max_tokens": 5,
                                                        "ktm": ext})
        assert status == 200, answer
        return answer["choices"][0]["text"], answer["usage"]["prompt_tokens_details"][
            "cached_tokens"]

    with serving(model, tiny_model_dir, prefix_cache_mb=0) as off:
        want = [ask(off, q, r)[0] for q, r in asks]
    with serving(model, tiny_model_dir) as on:
        got = [ask(on, q, r) for q, r in asks]
    assert [text for text, _ in got] == want
    rows = {r: model.encode_prompts([(Segment(DOC, ratio=r or 3.0),)], embed=False)[0].tokens_out
            for r in (None, 4.0)}
    assert [cached for _, cached in got] == [0, rows[None], 0, rows[4.0], rows[None], rows[4.0]]
