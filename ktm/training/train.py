"""The training loop, written out plainly: AdamW, accumulation, clipping, eval, atomic checkpoints.

    OUT/metrics.jsonl      one JSON row per logged step / evaluation
    OUT/checkpoint/        a loadable KTMModel checkpoint + optimizer and trainer state

Data order is a pure function of (seed, step), so ``resume=True`` continues a killed run
exactly where its last checkpoint left off (what is on disk, and what a resume checks:
``ktm.training.state``). ``train_step`` is the one optimizer step, shared with the benchmark.
Under ``torchrun`` or ``accelerate launch`` each process trains on its shard of every step's
window and rank 0 alone writes (``ktm.training.distributed``).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ktm.core.allocate import quiet_ratio
from ktm.core.checkpoint import model_record
from ktm.core.loss import target_ids
from ktm.errors import KTMError
from ktm.model import trainable_parameters
from ktm.tasks.base import Example, check_examples
from ktm.tasks.fits import check_examples_fit
from ktm.training import distributed
from ktm.training.ahead import Ahead
from ktm.training.compiled import compiled_body
from ktm.training.compiled import resolve as resolve_compile
from ktm.training.config import TrainConfig, lr_factor
from ktm.training.ema import WeightAverage
from ktm.training.precision import mixed_precision
from ktm.training.run_lock import main_holds
from ktm.training.state import (
    CHECKPOINT,
    METRICS,
    check_fresh,
    data_signature,
    interrupted_note,
    last_cpu,
    load_checkpoint,
    record_start,
    remove_temps,
    save_checkpoint,
    trim_metrics,
)
from ktm.util.fileio import WriteError, read_metrics
from ktm.util.provenance import git_revision, versions
from ktm.util.timing import clock


class _Order:
    """Example index for stream position i: epoch e = i // n uses permutation(seed + e)."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._perms: dict[int, list[int]] = {}

    def __getitem__(self, i: int) -> int:
        epoch = i // self.n
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed + epoch)
            # host-side (a CPU generator), whatever torch's default device is
            self._perms = {epoch: torch.randperm(self.n, generator=g, device="cpu").tolist()}
        return self._perms[epoch][i % self.n]


def adamw(params, lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """AdamW with the fused kernel where torch has one: it updates all tensors at once, faster
    than the per-tensor loop on CPU (how much: docs/guide.md#defaults)."""
    flat = [p for g in params for p in g["params"]] if isinstance(params[0], dict) else params
    fused = all(p.device.type in ("cpu", "cuda") for p in flat)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused)


def param_groups(model, cfg: TrainConfig) -> list[dict]:
    """LoRA, slot weights and gate at ``lr``; the encoder MLP's wide layers at ``encoder_lr``;
    with ``slot_lr`` set, the slot weights and gate at that rate instead; the weights reading
    context at ``context_lr`` (default ``encoder_lr``)."""
    wide = {id(p) for p in model.encoder.wide_parameters()}
    order = ({id(p) for p in model.encoder.order_parameters()} if cfg.slot_lr is not None
             else set())
    context = {id(p) for p in getattr(model.encoder, "context_parameters", list)()}
    special = wide | order | context
    named = trainable_parameters(model)
    groups = [{"params": [p for _, p in named if id(p) not in special], "base_lr": cfg.lr,
               "name": "main"},
              {"params": [p for _, p in named if id(p) in wide], "base_lr": cfg.encoder_lr,
               "name": "encoder_mlp"},
              {"params": [p for _, p in named if id(p) in order], "base_lr": cfg.slot_lr,
               "name": "encoder_order"},
              {"params": [p for _, p in named if id(p) in context],
               "base_lr": cfg.encoder_lr if cfg.context_lr is None else cfg.context_lr,
               "name": "encoder_context"}]
    return [g for g in groups if g["params"]]


def cross_entropy_loss(model, batch: Sequence[Example]):
    """The default objective: cross-entropy on each example's target tokens."""
    return model([e.segments for e in batch], [e.target for e in batch])


@dataclass
class StepStats:
    """One optimizer step's numbers. Input tokens are every token of the uncompressed training
    sequences (prompt before merging + target): the one definition of input tokens/s that
    ``ktm train`` and ``ktm bench --mode train`` share."""

    loss_sum: float = 0.0  # summed loss over the window's target tokens
    target_tokens: int = 0
    prompt_tokens: int = 0  # before merging
    lm_prompt_tokens: int = 0  # positions the LM read
    grad_norm: float = 0.0  # before clipping, over every trainable weight
    apart_norms: dict[str, float] = field(default_factory=dict)  # group name: its norm, if apart
    parts: dict[str, list[float]] = field(default_factory=dict)  # objective: [sum, tokens]

    @property
    def input_tokens(self) -> int:
        return self.prompt_tokens + self.target_tokens

    @property
    def lm_tokens(self) -> int:
        return self.lm_prompt_tokens + self.target_tokens


def check_trainable(model) -> None:
    if not trainable_parameters(model):  # AdamW failed on the empty list with an IndexError
        raise KTMError("the model has no trainable weights (KTMModel.load freezes a checkpoint "
                       "by default): expected KTMModel.load(..., trainable=True) or from_base")
    if model.dtype == torch.float16:
        raise KTMError("training with a float16 base model is not supported: fp16 gradients "
                       "need loss scaling; use --dtype bfloat16 or float32")


def train_step(model, opt, window: Sequence[Example], batch_size: int,
               loss_fn: Callable = cross_entropy_loss, clip_norm: float = 1.0,
               world: distributed.World = distributed.ONE,
               clip_apart: Sequence[str] = ()) -> StepStats:
    """One optimizer step over ``window`` in micro-batches of ``batch_size``: the step's loss is
    the mean over every target token of the window; clip (0: off), AdamW, zero the grads.
    Each forward runs in mixed precision where the LM is bf16 (``ktm.training.precision``).
    The parameter groups named in ``clip_apart`` are each clipped to ``clip_norm`` on their own;
    the rest together.

    With several processes ``window`` is this process's shard: token counts, gradients and the
    statistics are summed over processes first, so the step is that of the whole window.
    """
    check_trainable(model)
    stats = StepStats()
    window_tokens = distributed.sum_numbers(
        [sum(len(target_ids(model, e.target)) for e in window)], world, model.device)[0]
    for start in range(0, len(window), batch_size):
        with mixed_precision(model):
            res = loss_fn(model, window[start:start + batch_size])
        res.nll.sum().div(window_tokens).backward()
        for name, (v, n) in res.parts.items():
            acc = stats.parts.setdefault(name, [0.0, 0])
            acc[0] += v
            acc[1] += n
        stats.loss_sum += float(res.nll.detach().sum())
        stats.target_tokens += int(res.n_tokens.sum())
        stats.prompt_tokens += res.tokens_in
        stats.lm_prompt_tokens += res.tokens_out
    params = [p for g in opt.param_groups for p in g["params"]]
    if world.size > 1:
        distributed.sum_grads(params, world)
        (stats.loss_sum, stats.target_tokens, stats.prompt_tokens,
         stats.lm_prompt_tokens) = distributed.sum_numbers(
            [stats.loss_sum, stats.target_tokens, stats.prompt_tokens, stats.lm_prompt_tokens],
            world, model.device)
        stats.parts = distributed.sum_by_key(stats.parts, world)
    limit = clip_norm if clip_norm > 0 else math.inf
    rest = [p for g in opt.param_groups if g.get("name") not in clip_apart for p in g["params"]]
    squares = float(torch.nn.utils.clip_grad_norm_(rest, limit)) ** 2 if rest else 0.0
    for g in opt.param_groups:
        if g.get("name") in clip_apart:
            norm = float(torch.nn.utils.clip_grad_norm_(g["params"], limit))
            stats.apart_norms[g["name"]] = norm
            squares += norm ** 2
    stats.grad_norm = math.sqrt(squares)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return stats


def _cuda_devices(model) -> list[int]:
    return list(range(torch.cuda.device_count())) if model.device.type == "cuda" else []


@quiet_ratio()  # the rows report the ratio read
def train(
    model,
    examples: Sequence[Example],
    config: TrainConfig,
    evaluate: Callable[[object], dict] | None = None,
    on_step: Callable[[int, dict], None] | None = None,
    loss_fn: Callable = cross_entropy_loss,
    run_extra: dict | None = None,
    save_extra: Callable[[Path], None] | None = None,
) -> dict:
    """Fine-tune the encoder and LoRA on ``examples``; returns the last logged metrics (with
    ``"eval"``: ``evaluate(model)``'s result, run every ``eval_every`` steps and at the end).

    Writes ``config.out_dir``: ``metrics.jsonl``, ``run.json`` and ``checkpoint/`` (which
    ``config.resume`` continues). Raises ``KTMError`` for a model with no trainable weights, a
    folder that already holds a run (without ``resume``) and other bad input; ``RunLocked``
    (a ``KTMError``) when another process is writing the same folder.

    ``loss_fn(model, batch) -> LossOutput`` computes a micro-batch's summed per-sample loss
    (``nll``) over ``n_tokens`` target tokens; the default is cross-entropy on the targets.
    ``save_extra(folder)`` writes more files into every checkpoint, inside its atomic swap.
    The caller's random state is left as it was: the run seeds and restores its own.
    """
    if not isinstance(config, TrainConfig):
        raise KTMError(f"config must be a TrainConfig, got {type(config).__name__}")
    check_examples(examples)
    if not getattr(examples, "is_stream", False):  # a window stream checks its own sizes
        check_examples_fit(model, examples, "training")
    check_trainable(model)
    out = Path(config.out_dir)
    if out.exists() and not out.is_dir():
        raise KTMError(f"out_dir {str(out)!r} is a file: expected a folder for the run")
    world = distributed.setup(model.device)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file on the way, no permission
        raise KTMError(f"cannot create out_dir {str(out)!r}: {e}") from e
    # one run writes a folder at a time: a second one on it is refused before it reads it
    with main_holds(out, world, model.device), torch.random.fork_rng(
            devices=_cuda_devices(model)):
        torch.manual_seed(config.seed + world.rank)  # rank 0 draws what a 1-process run draws
        return _run(model, examples, config, evaluate, on_step, loss_fn, run_extra, save_extra,
                    world)


def _log(metrics_file, row: dict) -> None:
    """Append one row to metrics.jsonl; a crash mid-line is dropped by ``read_metrics``."""
    try:
        metrics_file.write(json.dumps(row) + "\n")
        metrics_file.flush()
    except OSError as e:
        raise WriteError(f"cannot append to {metrics_file.name!r}: {e}; a checkpoint saved "
                         "before is intact (--resume continues from it)") from e


def _complete(model, out: Path, step: int, config: TrainConfig, ema, world) -> dict:
    """A resume of a run that has reached ``max_steps`` trains nothing and writes nothing: say
    so, and return its last logged metrics, as the run itself did."""
    if ema is not None:  # the checkpoint's weights are the average, as a finished run hands out
        ema.copy_to_params()
    model.eval()
    if world.is_main:
        print(f"{str(out)!r} is already complete at step {step} (max_steps "
              f"{config.max_steps}); its checkpoint: {str(out / CHECKPOINT)!r}; nothing to train",
              file=sys.stderr)
    last: dict = {}
    for row in read_metrics(out / METRICS):
        if row.get("step") == step:  # the step's row, then its evaluation's
            last.update(row)
    return last


def _optimizer(model, config, world) -> tuple[torch.optim.Optimizer, tuple[str, ...]]:
    """AdamW over the model's parameter groups, the same weights in every process; the groups
    whose gradient norm is clipped apart."""
    groups = param_groups(model, config)
    clip_apart = ("encoder_context",) if config.clip_context_apart else ()
    if clip_apart and not any(g["name"] in clip_apart for g in groups):
        raise KTMError("clip_context_apart is set but the model has no contextual encoder "
                       "weights: expected --context-blocks, --context-layers or "
                       "--context-transformer (or no --clip-context-apart)")
    opt = adamw(groups, lr=config.lr, weight_decay=config.weight_decay)
    distributed.broadcast_params([p for g in opt.param_groups for p in g["params"]], world)
    return opt, clip_apart


def _step_row(st, step: int, opt, dt: float, elapsed: float, cpu_s: float) -> dict:
    """A step's metrics row (``metrics.jsonl``)."""
    return {"step": step, "loss": st.loss_sum / max(1, st.target_tokens),
            "lr": opt.param_groups[0]["lr"], "grad_norm": st.grad_norm,
            **{f"grad_norm_{k}": v for k, v in st.apart_norms.items()}, "step_s": dt,
            "input_tokens_per_s": st.input_tokens / dt, "lm_tokens_per_s": st.lm_tokens / dt,
            "elapsed_s": elapsed, "cpu_s": cpu_s,
            **{f"loss_{k}": v / max(1, n) for k, (v, n) in st.parts.items()}}


def _evaluate_during(model, evaluate, ema):
    """``evaluate(model)`` in eval mode (the weight average's weights where there is one), on a
    forked random state: evaluation may draw random numbers (sampling, a shuffled subset), so
    a run with --eval-every trains exactly as one without it."""
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=_cuda_devices(model)), \
                (ema.applied() if ema is not None else nullcontext()):
            return evaluate(model)
    finally:
        model.train()


def _windows(examples, order, config, world) -> Callable[[int], list[Example] | None]:
    """Step i's window of examples in this process (None past the last step)."""
    per_step = config.batch_size * config.grad_accum * world.size  # the global window

    def window_at(i: int) -> list[Example] | None:
        return ([examples[order[i * per_step + j]] for j in world.shard(per_step)]
                if i < config.max_steps else None)

    return window_at


def _start_files(model, out: Path, config, data: dict, run_extra, world, step: int) -> None:
    """The run folder once every process has checked it: temp files of a killed save gone,
    the metrics of steps past a resumed checkpoint trimmed, the run's start recorded."""
    distributed.barrier(world)  # every process has checked the folder before rank 0 writes
    if not world.is_main:
        return
    remove_temps(out)
    if config.resume:
        trim_metrics(out / METRICS, step)
    record_start(out, {"config": asdict(config), "model": model_record(model),
                       "versions": versions(), "git": git_revision(), **data,
                       "processes": world.size, **(run_extra or {})}, step)


def _run(model, examples, config, evaluate, on_step, loss_fn, run_extra, save_extra,
         world) -> dict:
    out = Path(config.out_dir)
    opt, clip_apart = _optimizer(model, config, world)
    data = data_signature(examples)
    ema = (WeightAverage([p for _, p in trainable_parameters(model)], config.ema_decay)
           if config.ema_decay else None)
    step = 0
    if config.resume:
        step = load_checkpoint(model, opt, out, config, data, world, ema)
        if step >= config.max_steps:
            return _complete(model, out, step, config, ema, world)
    else:
        check_fresh(out)
    main = world.is_main  # the one process that writes
    _start_files(model, out, config, data, run_extra, world, step)
    # a stream (reader pretraining) is random per index already: read it in order, so its
    # length, which is open-ended, never changes the data a step sees
    order = range(len(examples)) if getattr(examples, "is_stream", False) else _Order(
        len(examples), config.seed)
    metrics_file = (out / METRICS).open("a") if main else None
    last: dict = {}
    bar = tqdm(total=config.max_steps, initial=step, desc="train",
               disable=not (config.progress and main))
    model.train()
    t_start = time.perf_counter()
    # process CPU seconds (all threads, summed over processes): the cost axis of recipe
    # comparisons, robust to other jobs on the machine; carried across a resume (rank 0's
    # count, read after its trim: every process returns the same metrics)
    cpu_start = time.process_time()
    cpu_before = distributed.from_main([last_cpu(out / METRICS) if config.resume and main
                                        else 0.0], world, model.device)[0]
    compiled_on = resolve_compile(config.compile, model.device)
    window_at = _windows(examples, order, config, world)

    ahead = Ahead(model)  # each window tokenized while the step before it runs
    try:
        while step < config.max_steps:
            t0 = clock(model.device)  # on CUDA: after the last step's kernels, AdamW's too
            for g in opt.param_groups:
                g["lr"] = g["base_lr"] * lr_factor(step, config)
            window = ahead.take(step, window_at)
            with compiled_body(model, compiled_on):
                st = train_step(model, opt, window, config.batch_size, loss_fn,
                                config.clip_norm, world, clip_apart)
            step += 1
            if ema is not None:
                ema.update()
            dt = clock(model.device) - t0
            cpu = distributed.sum_numbers([time.process_time() - cpu_start], world,
                                          model.device)[0]
            last = _step_row(st, step, opt, dt, time.perf_counter() - t_start, cpu_before + cpu)
            if main and (step % config.log_every == 0 or step == config.max_steps):
                _log(metrics_file, last)
            bar.update(1)
            bar.set_postfix(loss=f"{last['loss']:.4f}")
            if main and evaluate and ((config.eval_every and step % config.eval_every == 0)
                                      or step == config.max_steps):
                result = _evaluate_during(model, evaluate, ema)
                last = {**last, "eval": result}
                _log(metrics_file, {"step": step, "cpu_s": last["cpu_s"], "eval": result})
            if (config.save_every and step % config.save_every == 0) or step == config.max_steps:
                save_checkpoint(model, opt, step, config, out, data, save_extra, world, ema)
            if on_step:
                on_step(step, last)
        if ema is not None:  # the run is complete: hand out the average, as the checkpoint does
            ema.copy_to_params()
    except (KeyboardInterrupt, distributed.PeerLost):  # Ctrl-C, another process ended
        if main:
            bar.close()
            print(interrupted_note(out, step), file=sys.stderr)
        raise
    finally:
        ahead.close()
        bar.close()
        _close_quietly(metrics_file)
        model.eval()
    return last


def _close_quietly(file) -> None:
    if file:
        try:
            file.close()
        except OSError:  # the failed write is already being reported
            pass
