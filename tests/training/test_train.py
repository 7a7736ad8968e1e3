import json

import pytest
import torch
from helpers import fresh_model as fresh

from ktm import KTMError
from ktm.model import KTMModel, trainable_parameters
from ktm.tasks.base import Example
from ktm.tasks.tree import TreeTask
from ktm.training.config import TrainConfig
from ktm.training.train import train


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


def test_evaluating_during_training_does_not_change_the_training(tiny_model_dir, tree_task,
                                                                 tmp_path):
    # the evaluation draws random numbers, as sampling would; LoRA dropout draws them in training
    data = tree_task.train_examples(16, seed=0)
    kw = dict(max_steps=4, batch_size=4, lr=1e-3, save_every=0, progress=False)
    quiet = fresh(tiny_model_dir)
    train(quiet, data, TrainConfig(out_dir=str(tmp_path / "a"), **kw))
    watched = fresh(tiny_model_dir)
    train(watched, data, TrainConfig(out_dir=str(tmp_path / "b"), eval_every=1, **kw),
          evaluate=lambda m: {"noise": float(torch.rand(()))})
    for (name, a), (_, b) in zip(trainable_parameters(quiet), trainable_parameters(watched)):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


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
    for (name, a), (_, b) in zip(trainable_parameters(straight), trainable_parameters(resumed)):
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


@pytest.mark.parametrize("field,value", [("batch_size", 0), ("max_steps", 0), ("lr", 0.0),
                                         ("slot_lr", 0.0), ("clip_norm", -1.0)])
def test_bad_train_config(field, value):
    with pytest.raises(KTMError, match=field):
        TrainConfig(**{field: value})


def test_training_leaves_the_callers_random_state_alone(tiny_model_dir, tree_task, tmp_path):
    data = tree_task.train_examples(8, seed=0)
    weights = []
    for caller_seed in (123, 456):
        model = fresh(tiny_model_dir)
        torch.manual_seed(caller_seed)
        expected = torch.rand(3)
        torch.manual_seed(caller_seed)
        train(model, data, TrainConfig(out_dir=str(tmp_path / str(caller_seed)), max_steps=2,
                                       batch_size=4, lr=1e-3, progress=False))
        torch.testing.assert_close(torch.rand(3), expected, atol=0, rtol=0)
        weights.append([p.detach().clone() for _, p in trainable_parameters(model)])
    for a, b in zip(*weights):  # and the run itself does not depend on the caller's state
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def two_step_run(tiny_model_dir, data, out, **kw):
    base = dict(out_dir=str(out), max_steps=2, batch_size=2, grad_accum=1, seed=0, lr=1e-3,
                save_every=1, progress=False)
    train(fresh(tiny_model_dir), data, TrainConfig(**{**base, **kw}))
    return base


@pytest.mark.parametrize("change,match", [
    ({"batch_size": 4}, "batch_size=2, this run has batch_size=4"),
    ({"grad_accum": 2}, "grad_accum=1, this run has grad_accum=2"),
    ({"seed": 1}, "seed=0, this run has seed=1"),
    ({"n_train": 12}, "n_train=8, this run has n_train=12"),
    ({"other_examples": True}, "examples=the checkpoint's"),
])
def test_resume_refuses_a_changed_data_order(tiny_model_dir, tree_task, tmp_path, change, match):
    data = tree_task.train_examples(8, seed=0)
    base = two_step_run(tiny_model_dir, data, tmp_path)
    if change.pop("n_train", None):
        data = tree_task.train_examples(12, seed=0)
    if change.pop("other_examples", None):
        data = tree_task.train_examples(8, seed=5)
    cfg = TrainConfig(**{**base, "max_steps": 4, "resume": True, **change})
    with pytest.raises(KTMError, match=match):
        train(fresh(tiny_model_dir), data, cfg)


def test_resume_refuses_other_lora_alpha(tiny_model_dir, tree_task, tmp_path):
    from ktm.core.config import LoraSettings

    data = tree_task.train_examples(8, seed=0)
    base = two_step_run(tiny_model_dir, data, tmp_path)
    other = KTMModel.from_base(tiny_model_dir, k=4, lora=LoraSettings(alpha=32))
    with pytest.raises(KTMError, match="lora.alpha=16, but this run has lora.alpha=32"):
        train(other, data, TrainConfig(**{**base, "max_steps": 4, "resume": True}))


def test_run_json_keeps_the_history_of_starts(tiny_model_dir, tree_task, tmp_path):
    data = tree_task.train_examples(8, seed=0)
    base = two_step_run(tiny_model_dir, data, tmp_path)
    train(fresh(tiny_model_dir), data, TrainConfig(**{**base, "max_steps": 3, "resume": True}))
    info = json.loads((tmp_path / "run.json").read_text())
    assert [h["started_at_step"] for h in info["history"]] == [0, 2]
    assert info["started_at_step"] == 2 and info["config"]["max_steps"] == 3
    assert [h["config"]["max_steps"] for h in info["history"]] == [2, 3]


def test_a_fresh_run_never_appends_to_old_metrics(tiny_model_dir, tree_task, tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    with pytest.raises(KTMError, match="metrics.jsonl from an earlier run but no checkpoint"):
        train(fresh(tiny_model_dir), tree_task.train_examples(4, seed=0),
              TrainConfig(out_dir=str(tmp_path), max_steps=1, batch_size=2, progress=False))
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 9.0}\n'


@pytest.mark.parametrize("damage,match", [
    ("garbage", "optimizer state .* is corrupt"),
    ("no_rng", "optimizer state .* is corrupt"),
    ("trainer_state", "trainer state .* is corrupt"),
])
def test_a_corrupt_optimizer_state_is_a_clear_error(tiny_model_dir, tree_task, tmp_path, damage,
                                                    match):
    from safetensors.torch import load_file, save_file

    data = tree_task.train_examples(8, seed=0)
    base = two_step_run(tiny_model_dir, data, tmp_path)
    opt_file = tmp_path / "checkpoint" / "optimizer.safetensors"
    if damage == "garbage":
        opt_file.write_bytes(opt_file.read_bytes()[:100])
    elif damage == "no_rng":
        tensors = load_file(str(opt_file))
        save_file({k: v for k, v in tensors.items() if k != "rng.torch"}, str(opt_file))
    else:
        (tmp_path / "checkpoint" / "trainer_state.json").write_text('{"step": ')
    with pytest.raises(KTMError, match=match):
        train(fresh(tiny_model_dir), data, TrainConfig(**{**base, "max_steps": 3,
                                                          "resume": True}))


def test_extra_state_is_written_inside_the_atomic_checkpoint(tiny_model_dir, tree_task, tmp_path,
                                                             checkpoint_swaps):
    train(fresh(tiny_model_dir), tree_task.train_examples(4, seed=0),
          TrainConfig(out_dir=str(tmp_path), max_steps=1, batch_size=2, progress=False),
          save_extra=lambda folder: (folder / "extra.json").write_text("{}"))
    assert checkpoint_swaps and all("extra.json" in names for names in checkpoint_swaps)


def test_cuda_rng_states_are_saved_and_restored(monkeypatch):
    import ktm.training.state as train_state

    state = torch.arange(8, dtype=torch.uint8)
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [state])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: restored.append(states))
    tensors = train_state._rng_tensors()
    assert torch.equal(tensors["rng.cuda.0"], state) and "rng.torch" in tensors
    train_state._restore_rng(tensors)
    assert len(restored) == 1 and torch.equal(restored[0][0], state)


def test_rank0_restores_its_cuda_rng_beside_other_ranks_states(monkeypatch):
    """A checkpoint of a multi-GPU run also holds the other processes' CUDA states
    (rng.cuda.rank1): rank 0 restores only its own devices' states (the key was read as a
    device number and every resume failed as a corrupt optimizer state)."""
    import ktm.training.state as train_state

    mine, theirs = torch.arange(8, dtype=torch.uint8), torch.ones(8, dtype=torch.uint8)
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: restored.append(states))
    train_state._restore_rng({"rng.torch": torch.get_rng_state(), "rng.cuda.0": mine,
                              "rng.torch.rank1": torch.get_rng_state(),
                              "rng.cuda.rank1": theirs})
    assert len(restored) == 1 and len(restored[0]) == 1 and torch.equal(restored[0][0], mine)


def test_step_time_waits_for_the_device(tiny_model_dir, tree_task, tmp_path, monkeypatch):
    """step_s (and tokens/s) read the device-waiting clock: on CUDA the optimizer step's kernels
    are still queued when train_step returns, and a plain clock counted them in the next step."""
    import sys

    train_module = sys.modules["ktm.training.train"]  # the package exports train() under this name
    model, seen, ticks = fresh(tiny_model_dir), [], iter([0.0, 2.0, 10.0, 13.0])
    monkeypatch.setattr(train_module, "clock",
                        lambda device: seen.append(device) or next(ticks))
    last = train(model, tree_task.train_examples(4, seed=0),
                 TrainConfig(out_dir=str(tmp_path), max_steps=2, batch_size=2, save_every=0,
                             progress=False))
    assert last["step_s"] == 3.0 and seen == [model.device] * 4


def test_slot_lr_moves_the_slot_weights_at_their_own_rate(tiny_model_dir, tree_task, tmp_path):
    """One Adam step moves each weight by about its group's rate: with slot_lr 1e-2 the slot
    weights and gate move 100x as far as at lr 1e-4, and LoRA and the MLP are untouched by it."""
    from ktm.training.train import param_groups

    moved = {}
    for slot_lr in (None, 1e-2):
        torch.manual_seed(0)
        model = KTMModel.from_base(tiny_model_dir, k=4, slot_weights=True, mlp_gate=True)
        cfg = TrainConfig(out_dir=str(tmp_path / str(slot_lr)), max_steps=1, batch_size=4,
                          lr=1e-4, encoder_lr=1e-5, slot_lr=slot_lr, save_every=0,
                          progress=False)
        groups = {g["name"]: g for g in param_groups(model, cfg)}
        order = {id(p) for p in model.encoder.order_parameters()}
        assert len(order) == 2  # slots and gate
        if slot_lr is None:
            assert set(groups) == {"main", "encoder_mlp"}  # as before: old checkpoints resume
        else:
            assert {id(p) for p in groups["encoder_order"]["params"]} == order
            assert groups["encoder_order"]["base_lr"] == slot_lr
            assert not order & {id(p) for p in groups["main"]["params"]}
        before = model.encoder.slots.detach().clone()
        train(model, tree_task.train_examples(4, seed=0), cfg)
        moved[slot_lr] = float((model.encoder.slots.detach() - before).abs().max())
    assert moved[None] == pytest.approx(1e-4, rel=0.05)
    assert moved[1e-2] == pytest.approx(1e-2, rel=0.05)


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_learning_rate_schedule_after_warm_up(tiny_model_dir, tree_task, tmp_path, schedule):
    # README / --schedule: linear warm-up, then constant or a cosine decay to 10% of lr; each
    # step's lr is logged in metrics.jsonl
    cfg = TrainConfig(out_dir=str(tmp_path / "run"), max_steps=8, batch_size=2, lr=1e-3,
                      warmup_steps=2, schedule=schedule, save_every=0, progress=False)
    train(fresh(tiny_model_dir), tree_task.train_examples(16, seed=0), cfg)
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] / cfg.lr for r in rows if "lr" in r]
    assert lrs[:3] == pytest.approx([0.5, 1.0, 1.0])  # warm-up, then the full rate
    if schedule == "constant":
        assert lrs[2:] == pytest.approx([1.0] * 6)
    else:  # strictly falling from the full rate towards a tenth of it, never below
        assert all(a > b for a, b in zip(lrs[2:], lrs[3:])), lrs
        assert 0.1 < lrs[-1] < 0.2, lrs
        from ktm.training.config import lr_factor

        assert lr_factor(cfg.max_steps, cfg) == pytest.approx(0.1)


def _bad_data(tree_task, tmp_path):
    ex = tree_task.train_examples(2, seed=0)
    (tmp_path / "a_file").write_text("x")
    return [
        ((e for e in ex), "out", "got generator: wrap an iterable in list"),
        ([{"segments": "a", "target": "b"}], "out", r"examples\[0\] is a dict"),
        ([ex[0], "text"], "out", r"examples\[1\] is a str"),
        ([Example(ex[0].segments, 5)], "out", r"examples\[0\] is malformed"),
        ([Example((3,), "x")], "out", r"examples\[0\] is malformed"),
        (ex, "a_file", "is a file"),
        (ex, "a_file/sub", "cannot create out_dir"),
    ]


def test_bad_training_data_or_out_dir_is_refused_before_writing(tiny_model_dir, tree_task,
                                                                   tmp_path):
    model = KTMModel.from_base(tiny_model_dir, k=2)
    for examples, out, match in _bad_data(tree_task, tmp_path):
        cfg = TrainConfig(out_dir=str(tmp_path / out), max_steps=1, batch_size=2, progress=False)
        with pytest.raises(KTMError, match=match):
            train(model, examples, cfg)
        assert not (tmp_path / "out").exists()  # nothing half-written
    with pytest.raises(KTMError, match="config must be a TrainConfig"):
        train(model, tree_task.train_examples(2, seed=0), {"out_dir": str(tmp_path / "out")})


def test_a_frozen_model_is_refused_before_anything_is_written(tiny_model_dir, tmp_path):
    fresh(tiny_model_dir).save(str(tmp_path / "ckpt"))
    frozen = KTMModel.load(str(tmp_path / "ckpt"))  # inference: trainable=False
    with pytest.raises(KTMError, match=r"no trainable weights.*trainable=True"):
        train(frozen, TreeTask(stage="small").train_examples(4, seed=0),
              TrainConfig(out_dir=str(tmp_path / "run"), max_steps=1, batch_size=4,
                          progress=False))
    assert not (tmp_path / "run").exists()
