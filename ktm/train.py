"""The training loop, written out plainly: AdamW, accumulation, clipping, eval, atomic checkpoints.

    OUT/metrics.jsonl      one JSON row per logged step / evaluation
    OUT/checkpoint/        a loadable KTMModel checkpoint + optimizer and trainer state

Data order is a pure function of (seed, step), so ``resume=True`` continues a killed run
exactly where its last checkpoint left off.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ktm.checkpoint import load_weights_into, save_atomic, write_model_files
from ktm.errors import KTMError
from ktm.provenance import git_revision, versions, write_json_atomic
from ktm.tasks.base import Example

CHECKPOINT = "checkpoint"
METRICS = "metrics.jsonl"


@dataclass
class TrainConfig:
    out_dir: str = "runs/ktm"
    max_steps: int = 100  # optimizer steps
    batch_size: int = 8  # examples per forward pass
    grad_accum: int = 1  # forward passes per optimizer step
    lr: float = 1e-4
    # the encoder MLP has a K*D-wide fan-in, so one Adam step at the LoRA rate moves its output
    # by far more than an embedding's norm; None uses ``lr``
    encoder_lr: float | None = None
    weight_decay: float = 0.0
    warmup_steps: int = 0
    clip_norm: float = 1.0  # 0 disables clipping
    seed: int = 0
    log_every: int = 1
    eval_every: int = 0  # 0: evaluate only at the end
    save_every: int = 50  # 0: save only at the end
    resume: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "grad_accum", "log_every"):
            if getattr(self, name) < 1:
                raise KTMError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise KTMError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.lr <= 0:
            raise KTMError(f"lr must be > 0, got {self.lr}")
        if self.encoder_lr is not None and self.encoder_lr <= 0:
            raise KTMError(f"encoder_lr must be > 0, got {self.encoder_lr}")


class _Order:
    """Example index for stream position i: epoch e = i // n uses permutation(seed + e)."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._perms: dict[int, list[int]] = {}

    def __getitem__(self, i: int) -> int:
        epoch = i // self.n
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=g).tolist()}
        return self._perms[epoch][i % self.n]


def _save_checkpoint(model, opt, step: int, cfg: TrainConfig, out: Path) -> None:
    def write(tmp: Path) -> None:
        write_model_files(model, tmp)
        sd = opt.state_dict()
        tensors = {f"state.{i}.{name}": (v if torch.is_tensor(v) else torch.tensor(v)).cpu()
                   for i, st in sd["state"].items() for name, v in st.items()}
        tensors["rng.torch"] = torch.get_rng_state()
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        write_json_atomic(tmp / "trainer_state.json", {
            "step": step, "config": asdict(cfg), "param_groups": sd["param_groups"],
        })

    save_atomic(out / CHECKPOINT, write)


def _load_checkpoint(model, opt, out: Path) -> int:
    ckpt = out / CHECKPOINT
    if not ckpt.exists() and ckpt.with_name(CHECKPOINT + ".old").exists():
        ckpt = ckpt.with_name(CHECKPOINT + ".old")  # crashed between the two renames
    if not (ckpt / "trainer_state.json").is_file():
        raise KTMError(f"cannot resume: no checkpoint in {str(out)!r}; run without --resume")
    load_weights_into(model, ckpt)
    try:
        state = json.loads((ckpt / "trainer_state.json").read_text())
        tensors = load_file(str(ckpt / "optimizer.safetensors"))
    except Exception as e:  # noqa: BLE001 - any parse failure means a corrupt checkpoint
        raise KTMError(f"checkpoint {str(ckpt)!r} is corrupt: {e}") from e
    opt_state: dict[int, dict] = {}
    for key, v in tensors.items():
        if key.startswith("state."):
            _, i, name = key.split(".", 2)
            opt_state.setdefault(int(i), {})[name] = v
    opt.load_state_dict({"state": opt_state, "param_groups": state["param_groups"]})
    torch.set_rng_state(tensors["rng.torch"])
    return int(state["step"])


def _trim_metrics(path: Path, step: int) -> None:
    """Drop rows logged after the checkpoint we resume from; they will be logged again."""
    if not path.exists():
        return
    rows = [r for r in path.read_text().splitlines() if r and json.loads(r)["step"] <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(r + "\n" for r in rows))
    tmp.replace(path)


def adamw(params, lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """AdamW with the fused kernel where torch has one: it updates all tensors at once, ~7x
    faster than the per-tensor loop on CPU (AdamW was 20% of a K=8 step in the profile)."""
    flat = [p for g in params for p in g["params"]] if isinstance(params[0], dict) else params
    fused = all(p.device.type in ("cpu", "cuda") for p in flat)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused)


def _warmup(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up factor, then constant."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    return 1.0


def train(
    model,
    examples: Sequence[Example],
    config: TrainConfig,
    evaluate: Callable[[object], dict] | None = None,
    on_step: Callable[[int, dict], None] | None = None,
) -> dict:
    """Fine-tune the encoder and LoRA on ``examples``; returns the last logged metrics."""
    if not examples:
        raise KTMError("no training examples: expected at least one")
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    named = model.trainable_parameters()
    params = [p for _, p in named]
    enc = [p for n, p in named if n.startswith("encoder.")]
    rest = [p for n, p in named if not n.startswith("encoder.")]
    enc_lr = config.encoder_lr or config.lr
    groups = [{"params": rest, "base_lr": config.lr}, {"params": enc, "base_lr": enc_lr}]
    opt = adamw([g for g in groups if g["params"]], lr=config.lr,
                weight_decay=config.weight_decay)
    torch.manual_seed(config.seed)
    step = 0
    if config.resume:
        step = _load_checkpoint(model, opt, out)
        _trim_metrics(out / METRICS, step)
    elif (out / CHECKPOINT).exists():
        raise KTMError(f"{str(out)!r} already holds a run: pass --resume or use another out_dir")
    order = _Order(len(examples), config.seed)
    run_info = {"config": asdict(config), "model": model.config_dict, "versions": versions(),
                "git": git_revision(), "n_examples": len(examples)}
    write_json_atomic(out / "run.json", run_info)
    metrics_file = (out / METRICS).open("a")
    last: dict = {}
    bar = tqdm(total=config.max_steps, initial=step, desc="train", disable=not config.progress)
    model.train()
    t_start = time.perf_counter()
    try:
        while step < config.max_steps:
            t0 = time.perf_counter()
            for g in opt.param_groups:
                g["lr"] = g["base_lr"] * _warmup(step, config)
            loss_sum, n_tok, tok_in, tok_lm = 0.0, 0, 0, 0
            per_step = config.batch_size * config.grad_accum
            window = [examples[order[step * per_step + j]] for j in range(per_step)]
            # the step's loss is a mean over every target token of the accumulation window
            window_tokens = sum(len(model.target_ids(e.target)) for e in window)
            for micro in range(config.grad_accum):
                batch = window[micro * config.batch_size:(micro + 1) * config.batch_size]
                res = model([e.segments for e in batch], [e.target for e in batch])
                res.nll.sum().div(window_tokens).backward()
                loss_sum += float(res.nll.detach().sum())
                n_tok += int(res.n_tokens.sum())
                tok_in += res.tokens_in + int(res.n_tokens.sum())
                tok_lm += res.tokens_out + int(res.n_tokens.sum())
            grad_norm = torch.nn.utils.clip_grad_norm_(
                params, config.clip_norm if config.clip_norm > 0 else math.inf)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            dt = time.perf_counter() - t0
            last = {"step": step, "loss": loss_sum / max(1, n_tok), "lr": opt.param_groups[0]["lr"],
                    "grad_norm": float(grad_norm), "step_s": dt, "input_tokens_per_s": tok_in / dt,
                    "lm_tokens_per_s": tok_lm / dt, "elapsed_s": time.perf_counter() - t_start}
            if step % config.log_every == 0 or step == config.max_steps:
                metrics_file.write(json.dumps(last) + "\n")
                metrics_file.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{last['loss']:.4f}")
            if evaluate and ((config.eval_every and step % config.eval_every == 0)
                             or step == config.max_steps):
                model.eval()
                with torch.no_grad():
                    result = evaluate(model)
                model.train()
                last = {**last, "eval": result}
                metrics_file.write(json.dumps({"step": step, "eval": result}) + "\n")
                metrics_file.flush()
            if (config.save_every and step % config.save_every == 0) or step == config.max_steps:
                _save_checkpoint(model, opt, step, config, out)
            if on_step:
                on_step(step, last)
    finally:
        bar.close()
        metrics_file.close()
        model.eval()
    return last

