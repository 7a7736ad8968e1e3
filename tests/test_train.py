import json

import pytest
import torch

from ktm import KTMError
from ktm.model import KTMModel
from ktm.tasks.tree import TreeTask
from ktm.train import TrainConfig, train


def fresh(tiny_model_dir, k=4):
    torch.manual_seed(0)
    return KTMModel.from_base(tiny_model_dir, k=k)


@pytest.fixture(scope="module")
def tree_task():
    return TreeTask(stage="small")


def mean_nll(model, examples):
    with torch.no_grad():
        out = model([e.segments for e in examples], [e.target for e in examples])
    return float(out.nll.sum() / out.n_tokens.sum())


def test_short_training_run_on_tree_task_lowers_loss(tiny_model_dir, tree_task, tmp_path):
    model = fresh(tiny_model_dir)
    train_set = tree_task.train_examples(64, seed=0)
    held = tree_task.eval_examples(16, seed=1)
    before = mean_nll(model, held)
    cfg = TrainConfig(out_dir=str(tmp_path / "run"), max_steps=25, batch_size=8, lr=3e-3,
                      save_every=0, progress=False)
    last = train(model, train_set, cfg, evaluate=lambda m: {"nll": mean_nll(m, held)})
    after = mean_nll(model, held)
    assert after < 0.7 * before, (before, after)
    assert last["eval"]["nll"] == pytest.approx(after, rel=1e-5)
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 26))
    assert all(r["input_tokens_per_s"] > 0 for r in steps)
    # the final checkpoint loads as a model and reproduces the trained model
    loaded = KTMModel.load(str(tmp_path / "run" / "checkpoint"))
    assert mean_nll(loaded, held) == pytest.approx(after, rel=1e-5)


class Interrupt(Exception):
    pass


def test_resume_after_interrupted_run_matches_uninterrupted(tiny_model_dir, tree_task, tmp_path):
    data = tree_task.train_examples(20, seed=0)  # 20 examples, batch 4 x accum 2: epochs wrap
    kw = dict(max_steps=6, batch_size=4, grad_accum=2, lr=1e-3, save_every=3, progress=False)
    straight = fresh(tiny_model_dir)
    train(straight, data, TrainConfig(out_dir=str(tmp_path / "a"), **kw))

    def die_at_4(step, _):
        if step == 4:
            raise Interrupt

    killed = fresh(tiny_model_dir)
    with pytest.raises(Interrupt):
        train(killed, data, TrainConfig(out_dir=str(tmp_path / "b"), **kw), on_step=die_at_4)
    with pytest.raises(KTMError, match="already holds a run"):
        train(killed, data, TrainConfig(out_dir=str(tmp_path / "b"), **kw))
    resumed = fresh(tiny_model_dir)  # a new process: weights come only from the checkpoint
    train(resumed, data, TrainConfig(out_dir=str(tmp_path / "b"), resume=True, **kw))
    for (name, a), (_, b) in zip(straight.trainable_parameters(), resumed.trainable_parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
    rows = [json.loads(r) for r in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]


def test_resume_with_another_k_is_refused(tiny_model_dir, tree_task, tmp_path):
    data = tree_task.train_examples(8, seed=0)
    kw = dict(out_dir=str(tmp_path / "r"), max_steps=1, batch_size=4, progress=False)
    train(fresh(tiny_model_dir, k=4), data, TrainConfig(**kw))
    with pytest.raises(KTMError, match="K=2"):
        train(fresh(tiny_model_dir, k=2), data, TrainConfig(resume=True, **kw))


def test_resume_without_checkpoint_is_refused(tiny_model_dir, tree_task, tmp_path):
    with pytest.raises(KTMError, match="no checkpoint"):
        train(fresh(tiny_model_dir), tree_task.train_examples(4, seed=0),
              TrainConfig(out_dir=str(tmp_path), resume=True, max_steps=1, progress=False))


@pytest.mark.parametrize("field,value", [("batch_size", 0), ("max_steps", 0), ("lr", 0.0)])
def test_bad_train_config(field, value):
    with pytest.raises(KTMError, match=field):
        TrainConfig(**{field: value})
