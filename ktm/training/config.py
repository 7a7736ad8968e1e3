"""``TrainConfig``: one training run's settings (folder, steps, batch, optimizer, schedule,
logging, checkpoints), validated on construction, and the learning-rate schedule it defines.
The loop that reads it is ``ktm.training.train``, which re-exports both names."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ktm.errors import KTMError
from ktm.util.field_types import check_at_least, check_field_types


@dataclass
class TrainConfig:
    """One training run (``train``, and ``ktm train / pretrain / curriculum``): the run's folder,
    steps, batch, optimizer and schedule, logging and checkpointing. Every field has a help
    text (``--help``). Raises ``KTMError`` on construction for an out-of-range value."""

    out_dir: str = field(default="runs/ktm", metadata={
        "help": "the run's folder: metrics.jsonl, run.json, checkpoint/"})
    max_steps: int = field(default=100, metadata={"help": "optimizer steps"})
    batch_size: int = field(default=8, metadata={
        "help": "examples per forward pass (per process under a launcher)"})
    grad_accum: int = field(default=1, metadata={
        "help": "forward passes per optimizer step; global batch = processes x batch size x "
                "grad accum"})
    lr: float = field(default=1e-4, metadata={
        "help": "AdamW learning rate of LoRA (and of the slot weights and gate, unless "
                "--slot-lr)"})
    # the encoder MLP has a K*D-wide fan-in, so one Adam step at the LoRA rate moves its output
    # by far more than an embedding's norm; its weights get this smaller rate. The slot weights
    # and the gate (fan-in 1) use ``lr``. Why this default: docs/guide.md#defaults
    encoder_lr: float = field(default=5e-5, metadata={
        "help": "learning rate of the encoder MLP's weights"})
    # the slot weights and the gate: the encoder's order-aware part. They start at the mean (1/K)
    # and at ``lr`` move by ~lr per step, too slowly to learn the order inside a block
    # (docs/guide.md#defaults). None: lr.
    slot_lr: float | None = field(default=None, metadata={
        "help": "learning rate of the encoder's slot weights and gate (default: --lr)"})
    # the weights that read context (context_blocks, _layers, _transformer) start at zero in a
    # reader continued with them; a rate of their own lets them move while the trained MLP moves
    # gently. None: encoder_lr (they have the MLP's wide fan-in)
    context_lr: float | None = field(default=None, metadata={
        "help": "learning rate of the encoder's weights that read context (--context-blocks, "
                "--context-layers, --context-transformer; default: --encoder-lr)"})
    ema_decay: float = field(default=0.0, metadata={
        "help": "keep an exponential moving average of the trainable weights with this decay "
                "(e.g. 0.95): evaluations, the checkpoint and the returned model use it, the "
                "last iterate is kept in checkpoint/live; 0: off"})
    schedule: str = field(default="constant", metadata={"choices": ["constant", "cosine"],
                          "help": "after warm-up: constant, or cosine decay to 10% of lr"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    warmup_steps: int = field(default=0, metadata={
        "help": "steps of linear learning-rate warm-up (0: none)"})
    clip_norm: float = field(default=1.0, metadata={
        "help": "clip the gradient norm to this (0: no clipping)"})
    # a contextual encoder's new weights (context_blocks, _layers, _transformer) can start with
    # gradients several times the LoRA's (results/README.md#contextual-merging); under one
    # global clip they shrink every other weight's step. Apart, each set is clipped to clip_norm
    # on its own and the rest trains as it would without them.
    clip_context_apart: bool = field(default=False, metadata={
        "help": "clip the contextual encoder weights' gradient norm on its own, not with the "
                "LoRA's and the MLP's (--context-blocks, --context-layers, "
                "--context-transformer)"})
    seed: int = field(default=0, metadata={
        "help": "random seed: the examples drawn and their order, new weights, dropout"})
    log_every: int = field(default=1, metadata={
        "help": "a metrics.jsonl row every N steps (and at the last step)"})
    eval_every: int = field(default=0, metadata={
        "help": "evaluate every N steps, logged to metrics.jsonl (0: only at the end)"})
    save_every: int = field(default=50, metadata={
        "help": "save checkpoint/ every N steps (0: only at the end)"})
    resume: bool = field(default=False, metadata={
        "help": "continue the run in out-dir from its checkpoint (off: the folder must hold "
                "no earlier run)"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})
    compile: str = field(default="auto", metadata={
        "choices": ["auto", "off", "on"],
        "help": "training steps through the LM's decoder layers compiled (torch.compile, "
                "dynamic shapes; ktm.training.compiled): on, off, or auto, where measured to "
                "pay (on CUDA)"})

    def __post_init__(self) -> None:
        check_field_types(self)
        if not self.out_dir:
            raise KTMError("TrainConfig.out_dir is empty: expected the run's folder")
        check_at_least(self, 1, "max_steps", "batch_size", "grad_accum", "log_every")
        check_at_least(self, 0, "warmup_steps", "eval_every", "save_every")
        for name in ("lr", "encoder_lr", "slot_lr", "context_lr", "weight_decay", "clip_norm"):
            v = getattr(self, name)  # NaN passed every comparison and trained to NaN weights
            if v is not None and not math.isfinite(v):
                raise KTMError(f"{name} must be a finite number, got {v}")
        if self.clip_norm < 0:  # was read as 0, no clipping
            raise KTMError(f"clip_norm must be >= 0 (0: no clipping), got {self.clip_norm}")
        if self.weight_decay < 0:
            raise KTMError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.lr <= 0:
            raise KTMError(f"lr must be > 0, got {self.lr}")
        if self.schedule not in ("constant", "cosine"):
            raise KTMError(f"schedule must be 'constant' or 'cosine', got {self.schedule!r}")
        from ktm.decode.compiled import check_mode  # torch and transformers: imported here

        check_mode(self.compile)  # refused now, not when the loop starts
        if self.encoder_lr <= 0:
            raise KTMError(f"encoder_lr must be > 0, got {self.encoder_lr}")
        if self.slot_lr is not None and self.slot_lr <= 0:
            raise KTMError(f"slot_lr must be > 0 (or unset: lr), got {self.slot_lr}")
        if self.context_lr is not None and self.context_lr <= 0:
            raise KTMError(f"context_lr must be > 0 (or unset: encoder_lr), got {self.context_lr}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise KTMError(f"ema_decay must be in [0, 1) (0: no average), got {self.ema_decay}")


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then constant or a cosine decay to 10% at ``max_steps``."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "cosine":
        span = max(1, cfg.max_steps - cfg.warmup_steps)
        done = min(1.0, (step - cfg.warmup_steps) / span)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * done))
    return 1.0
