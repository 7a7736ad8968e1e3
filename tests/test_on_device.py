"""Training, exact resume and serving on the test device (``KTM_TEST_DEVICE``, ``KTM_TEST_DTYPE``).

The other device-aware suites check the forward paths (tests/test_layout_parity.py,
tests/core/test_context_on_device.py); these check what runs around them on a device:

- a short training run lowers the held-out loss;
- a run killed and resumed from its checkpoint ends where the uninterrupted run ends, LoRA
  dropout drawing from the device's generator (on CUDA: its RNG state saved and restored);
- ``ktm serve`` answers a completion, merged and plain, as ``generate`` does, and streams it.

On the CPU they repeat checks of tests/training and tests/serving at the default settings; on a
GPU they are the ones that run there.

    KTM_TEST_DEVICE=cuda KTM_TEST_DTYPE=bfloat16 python -m pytest -q tests/test_on_device.py
"""

import json
import urllib.request

import pytest
import torch
from helpers import DEVICE, DTYPE, NORM_TOL, close, perturb, require_device

from ktm import Segment
from ktm.model import KTMModel, trainable_parameters
from ktm.tasks.tree import TreeTask
from ktm.training.config import TrainConfig
from ktm.training.train import train


@pytest.fixture(scope="module", autouse=True)
def device_is_there():
    require_device()


def fresh(model_dir: str) -> KTMModel:
    torch.manual_seed(0)
    return KTMModel.from_base(model_dir, k=4, device=DEVICE, dtype=DTYPE)


def mean_nll(model, examples) -> float:
    with torch.no_grad():
        out = model([e.segments for e in examples], [e.target for e in examples])
    return float(out.nll.sum() / out.n_tokens.sum())


def test_a_short_training_run_lowers_the_loss(tiny_model_dir, tmp_path):
    task = TreeTask(stage="small")
    model, held = fresh(tiny_model_dir), task.eval_examples(16, seed=1)
    before = mean_nll(model, held)
    cfg = TrainConfig(out_dir=str(tmp_path / "run"), max_steps=25, batch_size=8, lr=3e-3,
                      save_every=0, progress=False)
    train(model, task.train_examples(64, seed=0), cfg)
    after = mean_nll(model, held)
    assert after < 0.7 * before, (before, after)
    loaded = KTMModel.load(tmp_path / "run" / "checkpoint", device=DEVICE, dtype=DTYPE)
    assert mean_nll(loaded, held) == pytest.approx(after, rel=NORM_TOL[DTYPE])


class Interrupt(Exception):
    pass


def test_a_resumed_run_ends_where_the_uninterrupted_run_ends(tiny_model_dir, tmp_path):
    data = TreeTask(stage="small").train_examples(20, seed=0)  # batch 4 x accum 2: epochs wrap
    kw = dict(max_steps=6, batch_size=4, grad_accum=2, lr=1e-3, save_every=3, progress=False)
    straight = fresh(tiny_model_dir)
    train(straight, data, TrainConfig(out_dir=str(tmp_path / "a"), **kw))

    def die_at_4(step, _):
        if step == 4:
            raise Interrupt

    with pytest.raises(Interrupt):
        train(fresh(tiny_model_dir), data, TrainConfig(out_dir=str(tmp_path / "b"), **kw),
              on_step=die_at_4)
    if DEVICE.startswith("cuda"):  # the resumed run must restore the device's RNG, not inherit
        torch.cuda.manual_seed_all(12345)
    resumed = fresh(tiny_model_dir)  # as a new process: weights only from the checkpoint
    train(resumed, data, TrainConfig(out_dir=str(tmp_path / "b"), resume=True, **kw))
    for (name, a), (_, b) in zip(trainable_parameters(straight),
                                 trainable_parameters(resumed)):
        if DTYPE == "float32":
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
        else:  # fp32 masters moved by steps whose forward rounds to 16 bits
            close(b, a, 1e-3)


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def stream(url: str, body: dict) -> str:
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


def test_serve_answers_as_generate_does(tiny_model_dir):
    from ktm.serving.app import BackgroundServer, create_app
    from ktm.serving.config import ServeConfig

    model = fresh(tiny_model_dir)
    perturb(model)
    model.requires_grad_(False)  # served as a loaded checkpoint is
    doc, question = "Tree: AB\n+CD\n++EF\n+GH. The quick brown fox jumps.", " Answer:"
    cfg = ServeConfig(model=tiny_model_dir, served_name="tiny", batch_window_ms=0,
                      log_level="warning")
    with BackgroundServer(create_app(model, cfg)) as srv:
        url = srv.url + "/v1/completions"
        for merge in (True, False):
            body = {"model": "tiny", "prompt": None, "max_tokens": 12, "temperature": 0,
                    "ktm": {"segments": [{"text": doc, "merge": merge},
                                         {"text": question, "merge": False}]}}
            want = model.generate([Segment(doc, compress=merge),
                                   Segment(question, compress=False)], max_new_tokens=12)
            got = post(url, body)
            assert got["choices"][0]["text"] == want
            assert stream(url, body) == want
            cp = model.compress([Segment(doc, compress=merge), Segment(question, compress=False)],
                                merge=merge)
            assert (got["usage"]["prompt_tokens"], got["usage"]["prompt_tokens_merged"]) == (
                cp.tokens_in, cp.tokens_out)
