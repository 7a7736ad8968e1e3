"""``ktm serve`` on the llama.cpp backend: sixteen concurrent requests equal the same requests one
by one and the torch server's answers (greedy and seeded sampling, stops, chat)."""

import contextlib

import pytest
import torch
from helpers import perturb
from test_chat_history import ask, chat
from test_serve import _ask, _requests, _together

from ktm.llamacpp.runtime import RuntimeConfig
from ktm.model import KTMModel, RuntimeSpec
from ktm.serving.app import BackgroundServer, create_app
from ktm.serving.config import ServeConfig

pytestmark = pytest.mark.llamacpp


@contextlib.contextmanager
def serving(model_dir: str, backend: str, context: int | None = None, **settings):
    torch.manual_seed(0)
    model = KTMModel.from_base(model_dir, k=4)
    perturb(model)
    if backend == "llamacpp":
        model.use_backend("llamacpp", config=RuntimeConfig(kv_type="f32", sequences=16,
                                                           threads=1, context=context))
    cfg = ServeConfig(model=model_dir, served_name="tiny", max_tokens_limit=448,
                      batch_window_ms=100, log_level="warning",
                      runtime=RuntimeSpec(backend=backend), **settings)
    app = create_app(model, cfg)
    with BackgroundServer(app) as srv:
        srv.model, srv.engine, srv.app = model, app.state.engine, app
        yield srv


def test_sixteen_concurrent_requests_equal_one_by_one_and_the_torch_server(tiny_model_dir,
                                                                            tmp_path,
                                                                            monkeypatch):
    monkeypatch.setenv("KTM_CACHE", str(tmp_path))
    reqs = _requests()
    with serving(tiny_model_dir, "torch") as srv:
        want = [_ask(srv.url, kw) for kw in reqs]
    with serving(tiny_model_dir, "llamacpp") as srv:
        one_by_one = [_ask(srv.url, kw) for kw in reqs]
        concurrent = _together(srv.url, reqs)
        assert srv.engine.counts["peak_running"] >= 8  # they really were decoded together
        assert not srv.model.runtime.busy  # every finished request freed its sequence
    assert concurrent == one_by_one
    assert one_by_one == want


def test_requests_wait_for_kv_cells_and_one_that_never_fits_is_refused(tiny_model_dir, tmp_path,
                                                                       monkeypatch):
    """The sequences share one KV cache: with too few cells for all sixteen at once, requests
    wait for running ones to end instead of failing, and still give the same answers; a request
    that cannot fit even alone gets a 400."""
    import openai

    monkeypatch.setenv("KTM_CACHE", str(tmp_path))
    reqs = _requests()
    with serving(tiny_model_dir, "llamacpp") as srv:
        want = [_ask(srv.url, kw) for kw in reqs]
    with serving(tiny_model_dir, "llamacpp", context=96) as srv:
        got = _together(srv.url, reqs)
        assert 2 <= srv.engine.counts["peak_running"] < 16  # some ran together, some waited
        assert srv.engine.counts["failed"] == 0
        with pytest.raises(openai.BadRequestError, match="need .* KV-cache cells, more than "
                                                         "the llama.cpp context's 96"):
            _ask(srv.url, dict(reqs[0], max_tokens=120))
        assert _ask(srv.url, reqs[0]) == want[0]  # and it serves on
    assert got == want


def test_a_chat_within_a_history_budget_answers_on_llamacpp_as_on_torch(tiny_model_dir, tmp_path,
                                                                        monkeypatch):
    """--history-budget on llama.cpp: a chat under the budget answers as the plain chat (as
    without the policy), and one over it, its oldest messages merged, as the torch server."""
    monkeypatch.setenv("KTM_CACHE", str(tmp_path))
    messages, got = chat(5), {}
    for backend in ("torch", "llamacpp"):
        with serving(tiny_model_dir, backend, history_budget=10**6) as srv:
            plain = ask(srv, messages, merge=False)
            budget = plain["usage"]["prompt_tokens"] * 3 // 4
            got[backend] = [ask(srv, messages), plain, ask(srv, messages, history_budget=budget)]
    under, plain, over = got["llamacpp"]
    assert under["choices"] == plain["choices"]
    assert under["usage"]["prompt_tokens_merged"] == under["usage"]["prompt_tokens"]
    assert over["usage"]["prompt_tokens_merged"] < over["usage"]["prompt_tokens"]
    for mine, torch_s in zip(got["llamacpp"], got["torch"]):
        assert mine["choices"] == torch_s["choices"]
        assert mine["usage"]["prompt_tokens_merged"] == torch_s["usage"]["prompt_tokens_merged"]


def test_a_stop_ends_the_streams_in_flight_cleanly_and_frees_their_sequences(tiny_model_dir,
                                                                             tmp_path,
                                                                             monkeypatch):
    """Draining on llama.cpp, as on torch: short streams finish within the grace time, long
    ones end with an error event then [DONE], and every sequence is free again."""
    import json

    from test_serve import DOC, _slow_decoding
    from test_serve_exposed import _rest_of, _sse

    monkeypatch.setenv("KTM_CACHE", str(tmp_path))
    # 4096 cells: the eight rows fit together (448 tokens each may come)
    with serving(tiny_model_dir, "llamacpp", context=4096, shutdown_timeout=1.0) as srv:
        _slow_decoding(srv, monkeypatch, 0.02)  # a long stream's 448 steps take 9 s or more
        streams = []
        for i in range(8):
            long = i % 2 == 0
            conn, r = _sse(srv.port, {"model": "tiny", "prompt": f"{DOC[:20 + 5 * i]} #{i}",
                                      "stream": True, "max_tokens": 448 if long else 3,
                                      "ktm": {"ignore_eos": True}})
            streams.append((long, conn, r, [r.readline()]))
        srv.app.state.drain()
        ends = [(long, *_rest_of(conn, r, lines)) for long, conn, r, lines in streams]
        assert not srv.model.runtime.busy  # the ended rows' sequences are free
    assert [how for long, how, _ in ends] == ["error" if long else "answer" for long, *_ in ends]
    assert all(json.dumps(e).count("server_shutdown") for _, how, e in ends if how == "error")
