"""The Textualized Tree curriculum: train a stage, evaluate, advance once it passes a threshold.

Each round is an ordinary ``ktm.training.train`` run in its own folder (``OUT/<stage>-r<round>``)
on fresh examples of the stage; the model carries over from round to round.
``OUT/curriculum.jsonl`` gets one row per round.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ktm.core.checkpoint import model_record
from ktm.errors import KTMError
from ktm.evaluation.evaluate import evaluate_classification
from ktm.tasks.tree import PASS_ACCURACY, TreeTask
from ktm.tasks.tree_gen import STAGES
from ktm.training import distributed
from ktm.training.config import TrainConfig
from ktm.training.run_lock import main_holds
from ktm.training.state import CHECKPOINT, METRICS
from ktm.training.train import train
from ktm.util.fileio import existing_dir, write_text_atomic
from ktm.util.provenance import git_revision, versions


@dataclass
class CurriculumConfig:
    start_stage: str = field(default="small", metadata={"help": "first stage"})
    final_stage: str = field(default="xmedium", metadata={"help": "last stage"})
    threshold: float | None = field(
        default=None, metadata={"help": "balanced accuracy to advance (default: the paper's "
                                         "0.85, 0.95 for x3large)"})
    steps_per_round: int = field(default=100, metadata={"help": "optimizer steps per round"})
    max_rounds: int = field(default=3, metadata={"help": "rounds per stage before giving up"})
    n_eval: int = field(default=128, metadata={"help": "balanced eval pairs per round"})

    def __post_init__(self) -> None:
        for name in ("start_stage", "final_stage"):
            if getattr(self, name) not in STAGES:
                raise KTMError(f"{name}={getattr(self, name)!r}: expected one of {list(STAGES)}")
        if STAGES.index(self.start_stage) > STAGES.index(self.final_stage):
            raise KTMError(f"start_stage {self.start_stage!r} comes after final_stage "
                           f"{self.final_stage!r}; expected the order {list(STAGES)}")
        if self.threshold is not None and not 0 < self.threshold <= 1:
            raise KTMError(f"threshold must be in (0, 1], got {self.threshold}")
        if self.steps_per_round < 1 or self.max_rounds < 1:
            raise KTMError("steps_per_round and max_rounds must be >= 1")


def run_curriculum(model, cfg: CurriculumConfig, train_cfg: TrainConfig,
                   prompt_mode: str = "context") -> list[dict]:
    """Returns one row per round: stage, round, balanced accuracy, passed."""
    out = Path(train_cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # a second curriculum on the folder would rewrite curriculum.jsonl and unlink the rounds'
    # metrics: refused (each round's own folder is locked by ``train`` too)
    world = distributed.setup(model.device)
    with main_holds(out, world, model.device):
        return _rounds(model, cfg, train_cfg, prompt_mode, out, world)


def _rounds(model, cfg: CurriculumConfig, train_cfg: TrainConfig, prompt_mode: str,
            out: Path, world: distributed.World) -> list[dict]:
    stages = STAGES[STAGES.index(cfg.start_stage): STAGES.index(cfg.final_stage) + 1]
    rows: list[dict] = []
    # what made the rows, in each row of the file (as every result row of ktm has)
    made_by = {"config": {"curriculum": asdict(cfg), "train": asdict(train_cfg),
                          "model": model_record(model), "prompt_mode": prompt_mode},
               "versions": versions(), "git": git_revision()}
    for stage in stages:
        task = TreeTask(stage=stage, prompt_mode=prompt_mode)
        need = cfg.threshold if cfg.threshold is not None else PASS_ACCURACY[stage]
        eval_set = task.eval_examples(cfg.n_eval, seed=train_cfg.seed + 1)
        for rnd in range(1, cfg.max_rounds + 1):
            # every process's shard of every step (global batch = processes x batch_size x
            # grad_accum): the examples a 1-process run with the same global batch reads
            n = cfg.steps_per_round * train_cfg.batch_size * train_cfg.grad_accum * world.size
            seed = train_cfg.seed + 1000 * rnd  # fresh pairs every round
            folder = out / f"{stage}-r{rnd}"
            # --resume: rounds that saved a checkpoint continue from it (a finished one just
            # loads its weights); a round killed before its first save, or never reached,
            # starts afresh (the steps it logged are redone, on the same data)
            resume = train_cfg.resume and existing_dir(folder / CHECKPOINT).is_dir()
            if train_cfg.resume and not resume and world.is_main:  # rank 0 alone writes
                (folder / METRICS).unlink(missing_ok=True)
            round_cfg = TrainConfig(**{**asdict(train_cfg), "out_dir": str(folder),
                                       "max_steps": cfg.steps_per_round, "seed": seed,
                                       "resume": resume})
            train(model, task.train_examples(n, seed=seed), round_cfg)
            # evaluated on rank 0 (as train's evaluation is), its number given to every process:
            # all must take the same branch below, and accuracies that differ in a last bit
            # between devices could send the processes into different rounds (a hang)
            acc = (evaluate_classification(model, eval_set, task.labels)["balanced_accuracy"]
                   if world.is_main else 0.0)
            acc = distributed.from_main([acc], world, model.device)[0]
            row = {"stage": stage, "round": rnd, "balanced_accuracy": acc, "threshold": need,
                   "passed": acc >= need}
            rows.append(row)
            # this invocation's rows, whole: a resume re-evaluates the finished rounds; written
            # by rank 0 alone, as train's files are (every process computes the same rows)
            if world.is_main:
                write_text_atomic(out / "curriculum.jsonl",
                                  "".join(json.dumps({**r, **made_by}) + "\n" for r in rows))
            if row["passed"]:
                break
        if not rows[-1]["passed"]:
            break  # the stage did not pass within max_rounds: stop, as the paper's schedule does
    return rows
