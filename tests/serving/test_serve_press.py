"""``ktm serve`` with KV presses: the server's --press and a request's own in the ``ktm`` field
answer as ``generate`` does under the same press, side by side in one batch; bad presses get a
400 naming them."""

import pytest
import torch
from helpers import perturb, require_module
from test_serve import DOC, openai_client, segs_body

from ktm import Segment
from ktm.decode.press import PressConfig
from ktm.model import KTMModel, RuntimeSpec
from ktm.serving.app import BackgroundServer, create_app
from ktm.serving.config import ServeConfig

QUESTION = "Question: who? Answer:"
PROMPT = [Segment(DOC * 2), Segment(QUESTION, compress=False)]


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    require_module("kvpress", "the [kvpress] extra and kvpress (the README's test command)")
    torch.manual_seed(0)
    model = KTMModel.from_base(tiny_model_dir, k=2)
    perturb(model)
    cfg = ServeConfig(model=tiny_model_dir, served_name="tiny", batch_window_ms=200,
                      log_level="warning", runtime=RuntimeSpec(press="knorm", press_ratio=0.5))
    model.use_press(cfg.runtime.press, cfg.runtime.press_ratio)
    app = create_app(model, cfg)
    with BackgroundServer(app) as srv:
        srv.model = model
        yield srv


def want(model, press, **kw) -> str:
    before = model.runtime.press
    model.use_press(press)
    try:
        return model.generate(PROMPT, max_new_tokens=12, **kw)
    finally:
        model.use_press(before)


def test_server_and_request_presses_answer_as_generate(served):
    from concurrent.futures import ThreadPoolExecutor

    client = openai_client(served)
    asks = [{}, {"press": "tova", "press_ratio": 0.75}, {"press": "none"}, {"press_ratio": 0.25}]
    expect = [want(served.model, PressConfig("knorm", 0.5)),
              want(served.model, PressConfig("tova", 0.75)), want(served.model, None),
              want(served.model, PressConfig("knorm", 0.25))]
    assert len(set(expect)) > 1  # the presses differ on this prompt: the check can fail

    def ask(ext):
        body = segs_body(DOC * 2, QUESTION)
        body["ktm"].update(ext)
        return client.completions.create(model="tiny", prompt=None, max_tokens=12,
                                         temperature=0, extra_body=body).choices[0].text

    with ThreadPoolExecutor(4) as pool:  # they share the server's batches
        got = list(pool.map(ask, asks))
    assert got == expect


@pytest.mark.parametrize("ext, match", [
    ({"press": "nope"}, "unknown press"),
    ({"press": "knorm", "press_ratio": 1.0}, "press_ratio"),
    ({"press": "knorm", "press_ratio": -0.5}, "press_ratio"),
])
def test_bad_presses_get_a_400(served, ext, match):
    import openai

    body = segs_body(DOC, QUESTION)
    body["ktm"].update(ext)
    with pytest.raises(openai.BadRequestError, match=match):
        openai_client(served).completions.create(model="tiny", prompt=None, max_tokens=4,
                                                 extra_body=body)
