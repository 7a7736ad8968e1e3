"""``ktm curriculum`` on several processes: launched for real (torchrun, gloo), a killed run
resumed, every process advancing together; and what rank 0 alone writes or removes."""

import json
import subprocess
import textwrap

import pytest
import torch
from test_distributed import ENV, assert_same, run, start_checkpoint, torchrun, trainable

from ktm import KTMError
from ktm.model import KTMModel
from ktm.training.config import TrainConfig
from ktm.training.distributed import World


@pytest.fixture(scope="module")
def start(tiny_model_dir, tmp_path_factory):
    return start_checkpoint(tiny_model_dir, tmp_path_factory)


KILLED_CURRICULUM = textwrap.dedent("""
    import os, sys
    import ktm.training.curriculum as curriculum
    from ktm.cli.main import main

    real, rank = curriculum.train, int(os.environ["RANK"])

    def train(model, examples, cfg):
        def on_step(step, _):
            if cfg.out_dir.endswith("small-r2") and step == 1 and rank == 0:
                os.kill(os.getpid(), 9)  # killed in round 2 once its checkpoint of step 1 is in
        return real(model, examples, cfg, on_step=on_step)

    curriculum.train = train
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.slow  # launches 2 processes, twice
def test_a_killed_two_process_curriculum_resumes_as_one_process_runs_it(tiny_model_dir, start,
                                                                        tmp_path):
    """``ktm curriculum`` under torchrun: each round draws the examples of the global batch
    (2 x batch 2 == 1 x batch 4), and a run killed in its second round continues exactly with
    --resume: the rows, losses and weights are those of one process run uninterrupted."""
    from ktm.training.curriculum import CurriculumConfig, run_curriculum

    script = tmp_path / "worker.py"
    script.write_text(KILLED_CURRICULUM)
    out = tmp_path / "two"
    argv = ["curriculum", "--model", tiny_model_dir, "--k", "4", "--init", start,
            "--start-stage", "small", "--final-stage", "small", "--steps-per-round", "2",
            "--max-rounds", "2", "--n-eval", "4", "--threshold", "1.0", "--batch-size", "2",
            "--save-every", "1", "--lr", "2e-3", "--out-dir", str(out), "--no-progress"]
    killed = run(torchrun(str(script), *argv), ok=False)
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr
    assert json.loads((out / "small-r2" / "checkpoint" / "trainer_state.json").read_text())[
        "step"] == 1
    r = run(torchrun("-m", "ktm.cli", *argv, "--resume"), ok=False)
    assert r.returncode in (0, 1), r.stderr[-3000:]  # 1: the stage did not pass
    one = KTMModel.load(start, trainable=True)
    rows = run_curriculum(one, CurriculumConfig(start_stage="small", final_stage="small",
                                                steps_per_round=2, max_rounds=2, n_eval=4,
                                                threshold=1.0),
                          TrainConfig(out_dir=str(tmp_path / "one"), batch_size=4, lr=2e-3,
                                      progress=False))
    assert_same(trainable(KTMModel.load(str(out / "small-r2" / "checkpoint"), trainable=True)),
                trainable(one))
    mine = [json.loads(x) for x in (out / "curriculum.jsonl").read_text().splitlines()]
    assert [(m["round"], m["balanced_accuracy"]) for m in mine] == [
        (x["round"], x["balanced_accuracy"]) for x in rows] and len(rows) == 2
    for rnd in ("small-r1", "small-r2"):  # each step logged once, with the loss of one process
        losses = [json.loads(x)["loss"] for x in
                  (tmp_path / "one" / rnd / "metrics.jsonl").read_text().splitlines()]
        assert [json.loads(x)["loss"] for x in (out / rnd / "metrics.jsonl")
                .read_text().splitlines()] == pytest.approx(losses, rel=1e-5)


def test_a_curriculum_resume_leaves_rank_0_to_remove_a_restarted_rounds_metrics(tmp_path,
                                                                                monkeypatch):
    """A round killed before its first checkpoint starts afresh on --resume: its metrics.jsonl
    goes, removed by the process that writes the run's files, not by each of them."""
    import ktm.training.curriculum as curriculum
    from ktm.training import distributed
    from ktm.training.curriculum import CurriculumConfig, run_curriculum

    class Model:
        device = torch.device("cpu")

    monkeypatch.setattr(curriculum, "model_record", lambda model: {})

    seen = []
    monkeypatch.setattr(distributed, "setup", lambda device: World(1, 2))
    monkeypatch.setattr(distributed, "sum_numbers", lambda values, world, device: [0.0])
    monkeypatch.setattr(distributed, "from_main", lambda values, world, device: [1.0])
    monkeypatch.setattr(curriculum, "train", lambda model, examples, cfg: seen.append(
        (tmp_path / "small-r1" / "metrics.jsonl").exists()))
    (tmp_path / "small-r1").mkdir()
    (tmp_path / "small-r1" / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    run_curriculum(Model(), CurriculumConfig(start_stage="small", final_stage="small", n_eval=2),
                   TrainConfig(out_dir=str(tmp_path), batch_size=1, resume=True,
                               progress=False))
    assert seen == [True]  # rank 1 left it to rank 0


def test_a_curriculum_resume_continues_a_round_from_the_copy_a_crashed_swap_left(tmp_path,
                                                                                 monkeypatch):
    """A crash between the fallback swap's renames leaves only checkpoint.old, which train's
    resume reads: the round resumes from it (it was restarted, and refused as a run's
    folder)."""
    import ktm.training.curriculum as curriculum
    from ktm.training.curriculum import CurriculumConfig, run_curriculum

    class Model:
        device = torch.device("cpu")

    monkeypatch.setattr(curriculum, "model_record", lambda model: {})

    resumed = []
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(curriculum, "train", lambda model, examples, cfg: resumed.append(
        cfg.resume))
    monkeypatch.setattr(curriculum, "evaluate_classification",
                        lambda model, examples, labels: {"balanced_accuracy": 1.0})
    (tmp_path / "small-r1" / "checkpoint.old").mkdir(parents=True)
    (tmp_path / "small-r1" / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    run_curriculum(Model(), CurriculumConfig(start_stage="small", final_stage="small", n_eval=2),
                   TrainConfig(out_dir=str(tmp_path), batch_size=1, resume=True,
                               progress=False))
    assert resumed == [True] and (tmp_path / "small-r1" / "metrics.jsonl").exists()


SPLIT_EVAL = textwrap.dedent("""
    import json, os, sys
    import ktm.training.curriculum as curriculum
    from ktm.training.curriculum import CurriculumConfig, run_curriculum
    from ktm.model import KTMModel
    from ktm.training.train import TrainConfig

    start, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    # accuracies that differ between processes (as a last bit can between GPUs), either side
    # of the threshold
    curriculum.evaluate_classification = lambda model, examples, labels: {
        "balanced_accuracy": 0.9 if rank == 0 else 0.8}
    rows = run_curriculum(KTMModel.load(start, trainable=True),
                          CurriculumConfig(start_stage="small", final_stage="small",
                                           steps_per_round=1, max_rounds=2, n_eval=2,
                                           threshold=0.85),
                          TrainConfig(out_dir=out, batch_size=1, progress=False))
    with open(os.path.join(out, f"rows{rank}.json"), "w") as f:
        json.dump(rows, f)
""")


@pytest.mark.slow  # launches 2 processes
def test_curriculum_processes_advance_together_on_rank_0s_accuracy(start, tmp_path):
    """Each process deciding from its own evaluation could pass on one and go on to another
    round on the other, whose collectives then wait for a process that has left."""
    script = tmp_path / "worker.py"
    script.write_text(SPLIT_EVAL)
    out = tmp_path / "run"
    r = subprocess.run(torchrun(str(script), start, str(out)), env=ENV, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads((out / f"rows{rank}.json").read_text()) for rank in (0, 1)]
    assert rows[0] == rows[1] == [{"stage": "small", "round": 1, "balanced_accuracy": 0.9,
                                   "threshold": 0.85, "passed": True}]


def test_ktm_curriculum_joins_the_process_group_before_it_builds_the_model(tiny_model_dir,
                                                                           tmp_path,
                                                                           monkeypatch):
    """Joining sets this process's GPU (cuda:LOCAL_RANK); a model built before it went to
    cuda:0 on every process, and rank 1 then refused its model's device."""
    import ktm.cli.train as cli_train
    from ktm.cli.main import main
    from ktm.training import distributed

    calls = []
    monkeypatch.setattr(distributed, "setup", lambda device: calls.append(f"join {device}")
                        or World())

    def build(args):
        calls.append("build")
        raise KTMError("stop here")

    monkeypatch.setattr(cli_train, "init_or_build", build)
    assert main(["curriculum", "--model", tiny_model_dir, "--device", "cuda", "--out-dir",
                 str(tmp_path)]) == 2
    assert calls == ["join cuda", "build"]


@pytest.mark.parametrize("rank", [0, 1])
def test_curriculum_jsonl_is_written_by_rank_0_alone(rank, tmp_path, monkeypatch):
    import ktm.training.curriculum as curriculum
    from ktm.training import distributed
    from ktm.training.curriculum import CurriculumConfig, run_curriculum

    class Model:  # what run_curriculum reads of a model; train and eval are faked below
        device = torch.device("cpu")

    monkeypatch.setattr(curriculum, "model_record", lambda model: {})

    monkeypatch.setattr(distributed, "setup", lambda device: World(rank, 2))
    monkeypatch.setattr(distributed, "sum_numbers", lambda values, world, device: [0.0])
    monkeypatch.setattr(distributed, "from_main", lambda values, world, device: [1.0])
    monkeypatch.setattr(curriculum, "train", lambda model, examples, cfg: None)
    monkeypatch.setattr(curriculum, "evaluate_classification",
                        lambda model, examples, labels: {"balanced_accuracy": 1.0})
    rows = run_curriculum(Model(), CurriculumConfig(start_stage="small", final_stage="small",
                                                    n_eval=2),
                          TrainConfig(out_dir=str(tmp_path), batch_size=1, progress=False))
    assert [r["passed"] for r in rows] == [True]  # every process computes the rows
    assert (tmp_path / "curriculum.jsonl").exists() == (rank == 0)


def test_a_stage_that_did_not_pass_says_why_the_exit_code_is_1(tiny_model_dir, tmp_path,
                                                                 monkeypatch, capsys):
    """Under torchrun exit code 1 shows up as a ChildFailedError with a long traceback of the
    launcher's own; ktm said nothing of why on stderr."""
    import ktm.training.curriculum
    from ktm.cli.main import main

    row = {"stage": "small", "round": 2, "balanced_accuracy": 0.5, "threshold": 0.85,
           "passed": False}
    monkeypatch.setattr(ktm.training.curriculum, "run_curriculum", lambda *args: [row])
    assert main(["curriculum", "--model", tiny_model_dir, "--max-rounds", "2",
                 "--out-dir", str(tmp_path), "--no-progress"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out) == row
    assert err.splitlines() == ["ktm: curriculum stopped: stage 'small' reached balanced "
                                "accuracy 0.500 < 0.85 in 2 round(s) (--max-rounds 2); exit "
                                "code 1"]
