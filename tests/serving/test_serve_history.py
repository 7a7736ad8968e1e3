"""Greedy answers of ``ktm serve`` do not depend on the server's history or load: the same 8
prompts one at a time, then as 24 concurrent requests while streams are dropped and bad requests
sent, then one at a time again, on torch and on llama.cpp's deterministic option (vLLM: in
``tests/vllm/test_vllm_engine.py``; the default llama.cpp context's rate:
``results/determinism.py``). On every runtime, each stream dropped while others share the batch
is cancelled and frees its rows."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from ktm.llamacpp.runtime import RuntimeConfig
from ktm.model import KTMModel
from ktm.serving.app import BackgroundServer, create_app
from ktm.serving.config import ServeConfig

pytestmark = pytest.mark.slow

SOURCE = (Path(__file__).parents[2] / "ktm" / "decode" / "generate.py").read_text()


def _requests() -> list[dict]:
    return [{"model": "k4", "prompt": None, "max_tokens": 12, "temperature": 0,
             "extra_body": {"ktm": {"segments": [
                 {"text": SOURCE[700 * i: 700 * i + 1200], "merge": True},
                 {"text": "\nQuestion: what does this code do? Answer:", "merge": False}]}}}
            for i in range(8)]


def _ask(url: str, kw: dict, **extra):
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    return c.completions.create(**kw, **extra)


def _faults(url: str, reqs: list[dict]) -> None:
    for kw in reqs:  # ignoring EOS, each would run 48 steps: it ends by its client going
        ktm = {**kw["extra_body"]["ktm"], "ignore_eos": True}
        stream = _ask(url, {**kw, "max_tokens": 48, "extra_body": {"ktm": ktm}}, stream=True)
        next(iter(stream))
        stream.close()
    for kw in [dict(reqs[0], model="other"), dict(reqs[0], max_tokens=10**6)] * 3:
        with pytest.raises(openai.APIStatusError):
            _ask(url, kw)


def _history(model) -> tuple[list[str], list[str], list[str]]:
    reqs = _requests()
    app = create_app(model, ServeConfig(model="smollm2-135m-k4-seq", served_name="k4",
                                        log_level="warning", batch_window_ms=50))
    with BackgroundServer(app) as srv:
        before = [_ask(srv.url, kw).choices[0].text for kw in reqs]
        with ThreadPoolExecutor(25) as pool:
            noise = pool.submit(_faults, srv.url, reqs)
            together = list(pool.map(lambda kw: _ask(srv.url, kw).choices[0].text, reqs * 3))
            noise.result()
        after = [_ask(srv.url, kw).choices[0].text for kw in reqs]
        counts = app.state.engine.counts
        assert counts["peak_running"] >= 4  # decoded together
        assert counts["cancelled"] == len(reqs), counts  # every dropped stream, noticed
        assert counts["failed"] == 0 and app.state.engine.stats()["running"] == 0
    assert not getattr(model.runtime, "busy", None)  # llama.cpp: every sequence free again
    return before, together, after


@pytest.fixture(scope="module")
def reader():
    model = KTMModel.load("smollm2-135m-k4-seq")
    yield model
    model.use_backend("torch")


def test_on_torch(reader):
    before, together, after = _history(reader)
    assert together == before * 3 and after == before


@pytest.mark.llamacpp
def test_on_llama_cpp_by_default_dropped_streams_free_their_sequences(reader):
    """The default context's answers may move under load (its rate: results/determinism.py);
    what a dropped stream leaves behind may not."""
    reader.use_backend("llamacpp", config=RuntimeConfig(sequences=16))
    try:
        _history(reader)
    finally:
        reader.use_backend("torch")


@pytest.mark.llamacpp
def test_on_llama_cpp_with_the_deterministic_option(reader):
    reader.use_backend("llamacpp", config=RuntimeConfig(sequences=16, deterministic=True))
    try:
        before, together, after = _history(reader)
    finally:
        reader.use_backend("torch")
    assert together == before * 3 and after == before
