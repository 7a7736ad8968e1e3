"""The ``ktm`` command line. Each subcommand's flags are built from a typed config dataclass.

Every ``KTMError`` becomes one line on stderr and exit code 2; nothing prints a traceback for bad
input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ktm.config_args import add_dataclass_args, from_args
from ktm.errors import KTMError
from ktm.models import DEFAULT_MODEL


@dataclass
class ModelArgs:
    model: str = field(default=DEFAULT_MODEL, metadata={"help": "embedded name or HF folder"})
    k: int = field(default=4, metadata={"help": "tokens merged per block"})
    mlp_ratio: float = field(default=2.0, metadata={"help": "encoder MLP width / (K * hidden)"})
    mlp: bool = field(default=True, metadata={"help": "use the MLP (off: mean pooling)"})
    slot_weights: bool = field(default=False, metadata={
        "help": "order-aware pooling: learnable per-slot weights starting at 1/K"})
    mlp_gate: bool = field(default=False, metadata={
        "help": "ReZero gate on the MLP output instead of a zero last layer"})
    inner_k: int = field(default=1, metadata={
        "help": "recursive merging: merge blocks of inner_k tokens first (1: off)"})
    plain_prefix: int = field(default=0, metadata={
        "help": "first prompt tokens kept plain (the LM's attention sink)"})
    lora_r: int = field(default=4, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha"})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout"})
    device: str = field(default="cpu", metadata={"help": "torch device"})
    dtype: str = field(default="float32", metadata={"help": "float32 | bfloat16 | float16"})


@dataclass
class TaskArgs:
    task: str = field(default="tree", metadata={"help": "tree | amazon | commitpack"})
    stage: str = field(default="xmedium", metadata={"help": "tree stage (tree task only)"})
    prompt_mode: str = field(default="context",
                             metadata={"help": "context: question plain | paper: all compressed"})
    data_path: str | None = field(default=None, metadata={"help": "your own JSONL of the schema"})
    n_train: int = field(default=2000, metadata={"help": "training examples to draw"})
    n_eval: int = field(default=200, metadata={"help": "evaluation examples"})


def build_model(a: ModelArgs):
    from ktm.model import KTMModel, LoraSettings
    from ktm.models import parse_dtype

    lora = LoraSettings(r=a.lora_r, alpha=a.lora_alpha, dropout=a.lora_dropout)
    return KTMModel.from_base(a.model, k=a.k, mlp_ratio=a.mlp_ratio, use_mlp=a.mlp,
                              slot_weights=a.slot_weights, mlp_gate=a.mlp_gate,
                              inner_k=a.inner_k,
                              plain_prefix=a.plain_prefix, lora=lora, device=a.device,
                              dtype=parse_dtype(a.dtype))


def init_or_build(args: argparse.Namespace):
    """A trainable model: from ``--init`` (a checkpoint folder or a shipped reader's name, whose
    K must equal ``--k``), else a fresh one from the model flags."""
    margs = from_args(ModelArgs, args)
    if getattr(args, "init", None) and getattr(args, "init_adapter", None):
        raise KTMError("give --init or --init-adapter, not both")
    if not getattr(args, "init", None):
        model = build_model(margs)
        if getattr(args, "init_adapter", None):
            from ktm.checkpoint import load_adapter_into
            from ktm.readers import resolve_checkpoint

            load_adapter_into(model, resolve_checkpoint(args.init_adapter))
        return model
    from ktm.model import KTMModel
    from ktm.models import parse_dtype

    return KTMModel.load(args.init, k=margs.k, device=margs.device,
                         dtype=parse_dtype(margs.dtype), trainable=True)


def set_threads(args: argparse.Namespace) -> None:
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def build_task(t: TaskArgs, options: Sequence[str] = ()):
    from ktm.compressors.cli import parse_options
    from ktm.tasks import get_task

    kwargs: dict[str, Any] = {"prompt_mode": t.prompt_mode, **parse_options(options)}
    if t.task == "tree":
        kwargs["stage"] = t.stage
    if t.data_path:
        kwargs["data_path"] = t.data_path
    return get_task(t.task, **kwargs)


def cmd_train(args: argparse.Namespace) -> int:
    from ktm.evaluate import evaluate_task
    from ktm.train import TrainConfig, train

    targs = from_args(TaskArgs, args)
    tcfg = from_args(TrainConfig, args)
    task = build_task(targs, args.task_option)
    model = init_or_build(args)
    train_set = task.train_examples(targs.n_train, seed=tcfg.seed)
    eval_set = task.eval_examples(targs.n_eval, seed=tcfg.seed + 1)
    ckpt = Path(tcfg.out_dir) / "checkpoint"
    comp = info = None
    if args.compressor:  # a baseline: rewrite the prompts (or set the encoder) before training
        from ktm.compressors.cli import apply_compressor, parse_options

        model, train_set, eval_set, info, comp = apply_compressor(
            args.compressor, parse_options(args.compressor_option), model, train_set, eval_set,
            state_dir=ckpt if tcfg.resume else None)

    def evaluate(m) -> dict:
        r = evaluate_task(m, task, eval_set)
        r.pop("predictions", None)
        if comp:
            from ktm.compressors.cli import finish_eval_row

            r = finish_eval_row(r, eval_set, info)
        return r

    # the method's fitted state (LTSC vocabulary, meta rows) is written inside each checkpoint
    last = train(model, train_set, tcfg, evaluate=evaluate,
                 save_extra=comp.save_state if comp else None)
    print(json.dumps({k: v for k, v in last.items()}, indent=2))
    return 0


def cmd_pretrain(args: argparse.Namespace) -> int:
    from ktm.pretrain import PretrainConfig, pretrain
    from ktm.train import TrainConfig

    pcfg, tcfg = from_args(PretrainConfig, args), from_args(TrainConfig, args)
    model = init_or_build(args)
    last = pretrain(model, pcfg, tcfg, command=args.command_line)
    print(json.dumps(last, indent=2))
    return 0


def cmd_pack_reader(args: argparse.Namespace) -> int:
    from ktm.readers import pack_reader, run_info

    info = run_info(args.run_dir)
    path = pack_reader(Path(args.run_dir) / "checkpoint", args.name, info)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    print(f"reader {args.name!r}: {path} ({size / 2**20:.1f} MiB), "
          f"{info['steps']} steps, {info['cpu_minutes']:.0f} CPU-minutes")
    return 0


def load_or_build(args: argparse.Namespace):
    from ktm.model import KTMModel
    from ktm.models import parse_dtype

    if args.checkpoint:
        return KTMModel.load(args.checkpoint, device=args.device, dtype=parse_dtype(args.dtype))
    return build_model(from_args(ModelArgs, args))


def cmd_generate(args: argparse.Namespace) -> int:
    from ktm.prompt import Segment

    segments = [Segment(args.prompt)] + [Segment(p, compress=False) for p in args.plain]
    model = load_or_build(args)
    opts = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample,
                temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                merge=not args.no_merge)
    if args.stream:
        for piece in model.stream(segments, **opts):
            print(piece, end="", flush=True)
        print()
    else:
        print(model.generate(segments, **opts))
    cp = model.compress(segments, merge=not args.no_merge)
    print(f"[prompt tokens {cp.tokens_in} -> {cp.tokens_out}, K={model.k}]", file=sys.stderr)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import time

    from ktm.evaluate import evaluate_task
    from ktm.fileio import write_json_atomic
    from ktm.provenance import git_revision, versions

    if args.readability:
        return _eval_readability(args)
    targs = from_args(TaskArgs, args)
    task = build_task(targs, args.task_option)
    model = load_or_build(args)
    t0 = time.perf_counter()
    examples = task.eval_examples(targs.n_eval, seed=args.seed)
    natural = (task.natural_eval_examples(targs.n_eval, args.seed)
               if hasattr(task, "natural_eval_examples") else None)  # tree only
    comp = info = None
    if args.compressor:
        from ktm.compressors import compress_examples
        from ktm.compressors.cli import apply_compressor, parse_options

        # only LTSC fits on training prompts; its state is restored from the checkpoint if there
        model, _, examples, info, comp = apply_compressor(
            args.compressor, parse_options(args.compressor_option), model,
            task.train_examples(targs.n_train, seed=0), examples, state_dir=args.checkpoint,
            replace_encoder=not args.checkpoint, compress_train=False)
        if natural and comp.rewrites_prompts:
            natural, _ = compress_examples(comp, natural)
    merge = not args.no_merge and model.merges
    result = evaluate_task(model, task, examples, merge=merge, progress=True)
    result.pop("predictions", None)
    if comp:
        from ktm.compressors.cli import finish_eval_row

        result = finish_eval_row(result, examples, info)
    if natural:  # tree: accuracy on the natural pair distribution too
        nat = evaluate_task(model, task, natural, merge=merge, progress=True)
        result["natural_accuracy"] = nat["accuracy"]
        result["natural_balanced_accuracy"] = nat["balanced_accuracy"]
    method = args.method or args.compressor or (f"ktm-k{model.k}" if merge else "uncompressed")
    row = {"task": task.name, "method": method, "k": model.k if merge else None, **result,
           "eval_wall_s": time.perf_counter() - t0, "checkpoint": args.checkpoint,
           "config": {**vars_json(args), "model": model.config_dict},
           "versions": versions(), "git": git_revision()}
    if args.json:
        write_json_atomic(args.json, row)
    print(json.dumps({k: v for k, v in row.items() if k not in ("config", "versions")}, indent=2))
    return 0


def _eval_readability(args: argparse.Namespace) -> int:
    """R and the three NLLs on held-out text, per set, as one result row."""
    import time

    from ktm.provenance import git_revision, versions, write_json_atomic
    from ktm.readability import heldout_readability

    model = load_or_build(args)
    t0 = time.perf_counter()
    sets = heldout_readability(model, args.readability, args.n_windows, seed=args.seed,
                               progress=True)
    method = args.method or (f"ktm-k{model.k}" if model.merges else "uncompressed")
    row = {"task": "readability", "method": method, "k": model.k, "readability": sets,
           "n_windows": args.n_windows, "eval_wall_s": time.perf_counter() - t0,
           "checkpoint": args.checkpoint,
           "config": {**vars_json(args), "model": model.config_dict},
           "versions": versions(), "git": git_revision()}
    if args.json:
        write_json_atomic(args.json, row)
    print(json.dumps({k: v for k, v in row.items() if k not in ("config", "versions")}, indent=2))
    return 0


def vars_json(args: argparse.Namespace) -> dict:
    plain = (str, int, float, bool, type(None))
    return {k: v for k, v in vars(args).items() if isinstance(v, plain)}


def cmd_report(args: argparse.Namespace) -> int:
    from ktm.report import report

    print(report(args.results, args.plot))
    if args.plot:
        print(f"\nplot: {args.plot}")
    return 0


def cmd_curriculum(args: argparse.Namespace) -> int:
    from ktm.curriculum import CurriculumConfig, run_curriculum
    from ktm.train import TrainConfig

    ccfg, tcfg = from_args(CurriculumConfig, args), from_args(TrainConfig, args)
    rows = run_curriculum(build_model(from_args(ModelArgs, args)), ccfg, tcfg, args.prompt_mode)
    for r in rows:
        print(json.dumps(r))
    return 0 if rows[-1]["passed"] else 1


def cmd_bench(args: argparse.Namespace) -> int:
    from ktm.bench import BenchConfig, main_bench

    return main_bench(from_args(BenchConfig, args))


def cmd_demo(args: argparse.Namespace) -> int:
    from ktm.demo import DemoConfig, run_demo

    run_demo(from_args(DemoConfig, args))
    return 0


def _compressor_args(parser: argparse.ArgumentParser) -> None:
    from ktm.compressors.cli import METHODS

    parser.add_argument("--task-option", action="append", default=[], metavar="NAME=VALUE",
                        help="task constructor option, e.g. max_chars=400 (repeatable)")
    parser.add_argument("--compressor", choices=METHODS,
                        help="a baseline instead of K-token merging")
    parser.add_argument("--compressor-option", action="append", default=[], metavar="NAME=VALUE",
                        help="e.g. ratio=0.5, unit=token, max_meta_tokens=64 (repeatable)")


def _init_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--init", metavar="CHECKPOINT_OR_NAME",
                        help="start from a reader: a checkpoint folder or a shipped reader's name "
                             "(its K must equal --k; its encoder and LoRA settings are used)")
    parser.add_argument("--init-adapter", metavar="CHECKPOINT_OR_NAME",
                        help="start only LoRA from a checkpoint or reader, with a fresh encoder "
                             "(any K: the K curriculum, e.g. K=4 from the K=2 reader)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice)")


def _parser() -> argparse.ArgumentParser:
    from ktm.demo import DemoConfig
    from ktm.train import TrainConfig

    p = argparse.ArgumentParser(prog="ktm", description="K-Token Merging for causal LMs")
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train and evaluate a K=4 merger on the embedded model")
    add_dataclass_args(demo, DemoConfig)
    demo.set_defaults(run=cmd_demo)

    tr = sub.add_parser("train", help="fine-tune encoder + LoRA on a task")
    add_dataclass_args(tr, ModelArgs)
    add_dataclass_args(tr, TaskArgs)
    add_dataclass_args(tr, TrainConfig)
    tr.set_defaults(run=cmd_train)
    _compressor_args(tr)
    _init_args(tr)

    from ktm.pretrain import PretrainConfig

    pre = sub.add_parser("pretrain", help="train a reader on unlabeled text (no task labels)")
    add_dataclass_args(pre, ModelArgs)
    add_dataclass_args(pre, PretrainConfig)
    add_dataclass_args(pre, TrainConfig)
    _init_args(pre)
    pre.set_defaults(run=cmd_pretrain)

    gen = sub.add_parser("generate", help="generate from a compressed prompt")
    add_dataclass_args(gen, ModelArgs)
    gen.add_argument("--checkpoint", help="a ktm checkpoint folder (overrides --model/--k)")
    gen.add_argument("--prompt", required=True, help="text to compress")
    gen.add_argument("--plain", action="append", default=[],
                     help="text appended as plain tokens (repeatable)")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--sample", action="store_true", help="sample instead of greedy")
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stream", action="store_true", help="print pieces as they are decoded")
    gen.add_argument("--no-merge", action="store_true", help="feed the prompt uncompressed")
    gen.set_defaults(run=cmd_generate)

    ev = sub.add_parser("eval", help="evaluate a checkpoint on a task; write one JSON result")
    add_dataclass_args(ev, ModelArgs)
    add_dataclass_args(ev, TaskArgs)
    ev.add_argument("--checkpoint", help="a ktm checkpoint folder (overrides --model/--k)")
    ev.add_argument("--json", help="write the result object here")
    ev.add_argument("--method", help="method name in tables (default: ktm-kK or uncompressed)")
    ev.add_argument("--no-merge", action="store_true", help="evaluate without merging")
    ev.add_argument("--seed", type=int, default=1, help="seed for drawing eval examples")
    ev.add_argument("--readability", nargs="+", choices=["reviews", "code"],
                    help="instead of a task: readability R on these held-out sets "
                         "(reviews of other categories, code of unseen repositories)")
    ev.add_argument("--n-windows", type=int, default=64,
                    help="held-out windows per readability set")
    ev.set_defaults(run=cmd_eval)
    _compressor_args(ev)

    pack = sub.add_parser("pack-reader", help="store a pretraining run as a shipped reader (fp16)")
    pack.add_argument("run_dir", help="a finished `ktm pretrain` --out-dir")
    pack.add_argument("--name", required=True, help="registered reader name, e.g. smollm2-135m-k4")
    pack.set_defaults(run=cmd_pack_reader)

    rep = sub.add_parser("report", help="tables and Pareto plot from `ktm eval` result files")
    rep.add_argument("results", nargs="+", help="result JSON files")
    rep.add_argument("--plot", help="write the performance-vs-length-reduction plot here")
    rep.set_defaults(run=cmd_report)

    from ktm.curriculum import CurriculumConfig

    cur = sub.add_parser("curriculum", help="tree curriculum: advance a stage once it passes")
    add_dataclass_args(cur, ModelArgs)
    add_dataclass_args(cur, CurriculumConfig)
    add_dataclass_args(cur, TrainConfig)
    cur.add_argument("--prompt-mode", default="context", choices=["context", "paper"])
    cur.set_defaults(run=cmd_curriculum)

    from ktm.bench import BenchConfig

    bench = sub.add_parser("bench", help="prefill / decode / training-throughput benchmark")
    add_dataclass_args(bench, BenchConfig)
    bench.set_defaults(run=cmd_bench)
    return p


def _quiet_libraries() -> None:
    """Our own tqdm bars are the progress report; silence the libraries' per-load bars."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)


def main(argv: Sequence[str] | None = None) -> int:
    import shlex

    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    args.command_line = shlex.join(["ktm", *argv])  # recorded with runs that ship
    _quiet_libraries()
    try:
        set_threads(args)
        return args.run(args)
    except KTMError as e:
        print(f"ktm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ktm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
