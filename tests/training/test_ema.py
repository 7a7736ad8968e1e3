"""The weight average (``TrainConfig.ema_decay``): its arithmetic, what a run hands out and
saves, that it never changes the training itself, and an exact resume."""

import pytest
import torch
from helpers import fresh_model as fresh

from ktm import KTMError
from ktm.model import KTMModel
from ktm.tasks.tree import TreeTask
from ktm.training.config import TrainConfig
from ktm.training.ema import WeightAverage, decay_at
from ktm.training.train import train


@pytest.fixture(scope="module")
def data():
    return TreeTask(stage="small").train_examples(16, seed=0)


def weights(model):
    """LoRA and encoder weights (a loaded model is frozen, so not by requires_grad)."""
    return {n: p.detach().clone() for n, p in model.named_parameters()
            if "lora_" in n or n.startswith("encoder.")}


def assert_same(a, b, exact=True):
    assert a.keys() == b.keys()
    for n in a:
        if exact:
            torch.testing.assert_close(a[n], b[n], atol=0, rtol=0, msg=n)
        else:
            torch.testing.assert_close(a[n], b[n], atol=1e-6, rtol=1e-5, msg=n)


def differ(a, b):
    return any(not torch.equal(a[n], b[n]) for n in a)


def test_the_average_follows_the_decay_schedule_by_hand():
    p = torch.nn.Parameter(torch.tensor([0.0, 10.0]))
    avg = WeightAverage([p], decay=0.5)
    expected = p.detach().clone()
    for t, value in enumerate([1.0, 2.0, 4.0, 8.0]):
        with torch.no_grad():
            p.fill_(value)
        avg.update()
        d = min(0.5, (1 + t) / (10 + t))
        expected = d * expected + (1 - d) * torch.full((2,), value)
        torch.testing.assert_close(avg.shadow[0], expected)
    assert decay_at(0.5, 0) == pytest.approx(0.1) and decay_at(0.5, 100) == 0.5
    with avg.applied():
        torch.testing.assert_close(p.detach(), expected)
    assert p.detach().tolist() == [8.0, 8.0]  # the live value is back after the block


@pytest.mark.parametrize("decay", [-0.1, 1.0, 1.5])
def test_bad_decay_is_refused(decay):
    with pytest.raises(KTMError, match="ema_decay"):
        TrainConfig(ema_decay=decay)


def test_the_average_does_not_change_the_training(tiny_model_dir, data, tmp_path):
    kw = dict(max_steps=4, batch_size=4, lr=1e-3, save_every=0, progress=False)
    plain = fresh(tiny_model_dir)
    train(plain, data, TrainConfig(out_dir=str(tmp_path / "a"), **kw))
    averaged = fresh(tiny_model_dir)
    train(averaged, data, TrainConfig(out_dir=str(tmp_path / "b"), ema_decay=0.9, **kw))
    live = KTMModel.load(str(tmp_path / "b" / "checkpoint" / "live"))
    assert_same(weights(plain), weights(live))  # the last iterate is the plain run's
    assert differ(weights(plain), weights(averaged))  # the run hands out the average


def test_evaluations_checkpoint_and_returned_model_use_the_average(tiny_model_dir, data,
                                                                  tmp_path):
    seen = []

    def evaluate(m):
        seen.append(weights(m))
        return {}

    model = fresh(tiny_model_dir)
    start = weights(model)
    train(model, data, TrainConfig(out_dir=str(tmp_path / "r"), max_steps=3, batch_size=4,
                                   lr=1e-3, save_every=0, eval_every=3, ema_decay=0.9,
                                   progress=False), evaluate=evaluate)
    final = weights(model)
    saved = weights(KTMModel.load(str(tmp_path / "r" / "checkpoint")))
    live = weights(KTMModel.load(str(tmp_path / "r" / "checkpoint" / "live")))
    assert_same(seen[-1], final)
    assert_same(saved, final)
    assert differ(live, final) and differ(start, final)


def test_resume_with_an_average_matches_the_uninterrupted_run(tiny_model_dir, data, tmp_path):
    kw = dict(max_steps=6, batch_size=4, lr=1e-3, save_every=3, ema_decay=0.8, progress=False)
    straight = fresh(tiny_model_dir)
    train(straight, data, TrainConfig(out_dir=str(tmp_path / "a"), **kw))

    class Interrupt(Exception):
        pass

    def die_at_4(step, _):
        if step == 4:
            raise Interrupt

    with pytest.raises(Interrupt):
        train(fresh(tiny_model_dir), data, TrainConfig(out_dir=str(tmp_path / "b"), **kw),
              on_step=die_at_4)
    resumed = fresh(tiny_model_dir)  # weights only from the step-3 checkpoint
    train(resumed, data, TrainConfig(out_dir=str(tmp_path / "b"), resume=True, **kw))
    assert_same(weights(straight), weights(resumed), exact=False)
    assert_same(weights(KTMModel.load(str(tmp_path / "a" / "checkpoint" / "live"))),
                weights(KTMModel.load(str(tmp_path / "b" / "checkpoint" / "live"))), exact=False)
