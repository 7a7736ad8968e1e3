"""The ``ktm`` command line. Each subcommand's flags are built from a typed config dataclass.

Every ``KTMError`` becomes one line on stderr and exit code 2; nothing prints a traceback for bad
input.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from ktm.cli.args import (
    add_dataclass_args,
    add_model_args,
    backend_args,
    data_args,
    from_args,
    load_or_build,
    method_args,
    parse_options,
    threads_arg,
)
from ktm.cli.eval import eval_parser
from ktm.cli.serve import export_parser, serve_parser
from ktm.cli.train import cmd_curriculum as cmd_curriculum  # still importable from ktm.cli
from ktm.cli.train import cmd_pretrain as cmd_pretrain
from ktm.cli.train import cmd_train as cmd_train
from ktm.cli.train import curriculum_parser, pretrain_parser, train_parser
from ktm.errors import KTMError


def set_threads(args: argparse.Namespace) -> None:
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def cmd_pack_reader(args: argparse.Namespace) -> int:
    from ktm.readers import check_finished, lineage_info, pack_reader, run_info

    check_finished(args.run_dir)
    info = lineage_info(args.after, run_info(args.run_dir))
    layout = {k: v for k, v in (("ratio", args.ratio), ("allocator", args.allocator))
              if v is not None}
    path = pack_reader(Path(args.run_dir) / "checkpoint", args.name, info, layout)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    print(f"reader {args.name!r}: {path} ({size / 2**20:.1f} MiB), "
          f"{info['steps']} steps, {info['cpu_minutes']:.0f} CPU-minutes "
          f"({info['cpu_minutes_total']:.0f} with {len(info['lineage'])} earlier stages)")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from ktm.compressors.record import resolve
    from ktm.core.allocate import RatioWarning
    from ktm.core.fit import encode_fitted
    from ktm.core.prompt import Segment, as_segments
    from ktm.decode.generate import GenerationConfig
    from ktm.readers import open_checkpoint
    from ktm.serving.history import check_history_press

    # the options and the prompt are checked before the model is loaded (seconds, or minutes)
    given = [a for a in (args.prompt, args.prompt_file, args.chat) if a is not None]
    if len(given) != 1:
        raise KTMError("give the prompt as --prompt TEXT or --prompt-file PATH, or a chat as "
                       f"--chat FILE.jsonl: expected one of them, got {len(given)}")
    if args.prompt_file is not None:
        args.prompt = read_prompt_file(args.prompt_file)
    if args.chat is not None and (args.plain or args.question is not None):
        raise KTMError("--plain and --question go with --prompt; a chat's plain parts are its "
                       "messages (\"ktm\": {\"merge\": false}) or its history budget, its "
                       "question the newest user message's end")
    if args.history_budget is not None and args.chat is None:
        raise KTMError("--history-budget reads a chat: expected --chat FILE.jsonl")
    check_history_press(args.history_press, args.history_budget, args.press)
    messages = read_chat_file(args.chat) if args.chat is not None else None
    segments = None if messages is not None else list(as_segments(
        [Segment(args.prompt)] + [Segment(p, compress=False) for p in args.plain]
        + ([Segment(args.question, question=True)] if args.question else [])))
    opts = from_args(GenerationConfig, args).to_dict()
    # read once; a baseline's checkpoint reads its prompts as the method it records rewrote
    ckpt = open_checkpoint(args.checkpoint) if args.checkpoint else None
    name, options = resolve(ckpt, args.compressor, parse_options(args.compressor_option))
    model = load_or_build(args, ckpt)
    if messages is not None:
        from ktm.serving.prompts import chat_prompt, press_to_fit
        from ktm.serving.protocol import RequestError

        pressed = args.history_press is not None and opts["merge"]
        segments = list(chat_prompt(model, messages, args.history_budget, opts["merge"],
                                    pressed))
        if pressed:
            try:
                press = press_to_fit(model, tuple(segments), args.history_budget,
                                     args.history_press)
            except RequestError as e:
                raise KTMError(str(e)) from None
            if press is not None:
                model.use_press(press)
    before = None
    if name:
        segments, before = _baseline_prompt(args, name, options, model, segments)
    if args.stream:
        for piece in model.stream(segments, **opts):
            print(piece, end="", flush=True)
        print()
    else:
        print(model.generate(segments, **opts))
    # as it was read: a prompt past the window at the ratio that fits it (ktm.core.fit),
    # which the warning above names
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RatioWarning)
        _, (cp,) = encode_fitted(model, [segments], opts["merge"],
                                 [max(opts["max_new_tokens"] - 1, 0)], embed=False)
    how = "" if before is None else f" ({name}: {before} tokens rewritten to {cp.tokens_in})"
    n_in = cp.tokens_in if before is None else before
    press = model.runtime.press
    if press is not None:
        from ktm.decode.press import kept_positions

        how += f"; KV of {kept_positions(cp, press)} kept ({press.name} at {press.ratio:.3g})"
    print(f"[prompt tokens {n_in} -> {cp.tokens_out}{how}, K={model.k}]",
          file=sys.stderr)
    return 0


def read_prompt_file(path: str) -> str:
    """The text of ``--prompt-file`` (``-``: standard input), read as UTF-8: a document too long
    for the command line's arguments."""
    try:
        if path == "-":
            return sys.stdin.buffer.read().decode("utf-8")
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise KTMError(f"cannot read prompt file {path!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise KTMError(f"prompt file {path!r} is not UTF-8 text: byte {e.object[e.start]:#04x} "
                       f"at offset {e.start}") from None


def read_chat_file(path: str) -> list[dict]:
    """The messages of a JSONL chat file, one JSON object per line (blank lines skipped)."""
    import json

    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise KTMError(f"cannot read chat file {path!r}: {e.strerror}") from None
    messages = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
        except json.JSONDecodeError as e:
            raise KTMError(f"{path}:{n}: not JSON ({e.msg}): expected one message object per "
                           "line") from None
        if not isinstance(msg, dict):
            raise KTMError(f"{path}:{n}: a {type(msg).__name__}, expected a message object "
                           "({\"role\": ..., \"content\": ...})")
        messages.append(msg)
    if not messages:
        raise KTMError(f"chat file {path!r} holds no messages: expected one JSON object per "
                       "line")
    return messages


def _baseline_prompt(args: argparse.Namespace, name: str, options: dict, model, segments):
    """``segments`` rewritten by method ``name`` (its fitted state restored from the checkpoint),
    and the original prompt's token count."""
    from ktm.compressors.apply import apply_compressor
    from ktm.compressors.ltsc import STATE_JSON
    from ktm.tasks.base import Example

    if name == "ltsc" and not (args.checkpoint and (Path(args.checkpoint) / STATE_JSON).is_file()):
        raise KTMError(f"--compressor ltsc learns its meta-tokens in training, but "
                       f"{args.checkpoint or 'the model'!r} holds none ({STATE_JSON}): expected "
                       "--checkpoint of a model trained with --compressor ltsc")
    applied = apply_compressor(name, options, model, [], [Example(tuple(segments), "")],
                               state_dir=args.checkpoint, replace_encoder=not args.checkpoint,
                               compress_train=False)
    ex = applied.eval_examples[0]
    return list(ex.segments), ex.meta.get("tokens_before")


def cmd_report(args: argparse.Namespace) -> int:
    from ktm.evaluation.report import report

    print(report(args.results, args.plot))
    if args.plot:
        print(f"\nplot: {args.plot}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from ktm.bench.bench import main_bench
    from ktm.bench.config import BenchConfig

    return main_bench(from_args(BenchConfig, args))


def cmd_demo(args: argparse.Namespace) -> int:
    from ktm.cli.demo import DemoConfig, run_demo

    run_demo(from_args(DemoConfig, args))
    return 0


def _demo_parser(demo: argparse.ArgumentParser) -> None:
    from ktm.cli.demo import DemoConfig

    add_dataclass_args(demo, DemoConfig)
    data_args(demo)
    threads_arg(demo)
    demo.set_defaults(run=cmd_demo)


def _generate_parser(gen: argparse.ArgumentParser) -> None:
    from ktm.decode.generate import GenerationConfig
    from ktm.decode.press import press_names

    # grouped in --help: what is read first, then how it is decoded, the model's settings,
    # where it runs, a baseline and the machine
    what = gen.add_argument_group("generate", "the model read, and what it reads")
    what.add_argument("--checkpoint", help="a ktm checkpoint folder or reader (its config is used; "
                                           "model flags given must agree with it)")
    what.add_argument("--prompt", help="text to compress")
    what.add_argument("--prompt-file", metavar="PATH",
                      help="the text to compress read from a file ('-': standard input), for a "
                           "document too long for the command line")
    what.add_argument("--plain", action="append", default=[],
                      help="text appended as plain tokens (repeatable)")
    what.add_argument("--question", metavar="TEXT",
                      help="what the prompt asks, read plain after it (and after --plain) as "
                           "its question: the question allocator reads the document with it "
                           "in view (ktm.core.question)")
    what.add_argument("--chat", metavar="FILE.jsonl",
                      help="a chat instead of --prompt: one message per line, as OpenAI's "
                           "({\"role\": \"user\", \"content\": \"...\"}, optionally \"ktm\": "
                           "{\"merge\": false}), read through the model's chat template as "
                           "ktm serve reads it")
    what.add_argument("--history-budget", type=int, metavar="N",
                      help="--chat: read the chat within N positions, its unmarked messages "
                           "plain while it fits and the oldest merged (whole) past it; system "
                           "messages and the newest user message stay plain")
    what.add_argument("--history-press", metavar="NAME", choices=press_names(), default=None,
                      help="--chat with --history-budget, torch backend: over the budget, read "
                           "the older messages plain and press their KV to fit with this "
                           "kvpress press (names as --press) instead of merging them")
    what.add_argument("--stream", action="store_true", help="print pieces as they are decoded")
    add_dataclass_args(gen.add_argument_group("generation"), GenerationConfig)
    add_model_args(gen.add_argument_group("model", "a fresh model's settings (with "
                                          "--checkpoint: given ones must agree with its own)"))
    backend_args(gen)
    method_args(gen.add_argument_group("baseline"))
    threads_arg(gen.add_argument_group("machine"))
    gen.set_defaults(run=cmd_generate)


def cmd_ask(args: argparse.Namespace) -> int:
    from ktm.cli.args import runtime_spec
    from ktm.cli.ask import AskConfig, ask
    from ktm.model import load_any

    config = from_args(AskConfig, args)  # checked before the model loads
    ask(config, load_any(config.reader, runtime=runtime_spec(args)))
    return 0


def _ask_parser(ask: argparse.ArgumentParser) -> None:
    from ktm.cli.ask import AskConfig

    ask.add_argument("paths", nargs="+", metavar="PATH",
                     help="files or folders to read ('-': standard input)")
    add_dataclass_args(ask, AskConfig, skip=("paths",))
    backend_args(ask)
    threads_arg(ask)
    ask.set_defaults(run=cmd_ask)


def _pack_parser(pack: argparse.ArgumentParser) -> None:
    pack.add_argument("run_dir", help="a finished `ktm pretrain` --out-dir")
    pack.add_argument("--name", required=True, help="registered reader name, e.g. smollm2-135m-k4")
    pack.add_argument("--after", nargs="+", default=[], metavar="RUN_DIR",
                      help="the earlier stages this run continues, oldest first (their run "
                           "folders: run.json + metrics.jsonl), recorded as the reader's lineage")
    pack.add_argument("--ratio", type=float, default=None,
                      help="the ratio the reader reads compressed segments at by default "
                           "(None: as trained)")
    pack.add_argument("--allocator", default=None,
                      help="the allocator that spends a ratio's positions by default (None: as "
                           "trained)")
    pack.set_defaults(run=cmd_pack_reader)


def _report_parser(rep: argparse.ArgumentParser) -> None:
    rep.add_argument("results", nargs="+",
                     help="`ktm eval` result JSON files, or the metrics.jsonl of training runs "
                          "(`ktm pretrain` / `ktm train` with --eval-every): their metric "
                          "against CPU-minutes")
    rep.add_argument("--plot", help="write the plot here: performance against length reduction "
                                    "with the Pareto frontier, or the metric against CPU-minutes")
    rep.set_defaults(run=cmd_report, light=True)


def _bench_parser(bench: argparse.ArgumentParser) -> None:
    from ktm.bench.config import BenchConfig

    add_dataclass_args(bench, BenchConfig)
    bench.set_defaults(run=cmd_bench)


# name -> (help, flags); a command's flags (and the modules they come from) are only built
# when it runs, so `ktm report --help` never imports torch
COMMANDS = {
    "demo": ("train and evaluate a K=4 merger on the embedded model", _demo_parser),
    "train": ("fine-tune encoder + LoRA on a task", train_parser),
    "pretrain": ("train a reader on unlabeled text (no task labels)", pretrain_parser),
    "generate": ("generate from a compressed prompt", _generate_parser),
    "ask": ("answer a question about files or folders with the question reader", _ask_parser),
    "eval": ("evaluate a checkpoint on a task; write one JSON result", eval_parser),
    "pack-reader": ("store a pretraining run as a shipped reader (fp16)", _pack_parser),
    "report": ("tables and plots from `ktm eval` results or training metrics", _report_parser),
    "curriculum": ("tree curriculum: advance a stage once it passes", curriculum_parser),
    "bench": ("prefill / decode / training-throughput benchmark", _bench_parser),
    "serve": ("OpenAI-compatible HTTP server (completions, chat, SSE)", serve_parser),
    "export": ("export for another engine: --format vllm|gguf DIR", export_parser),
}


def _parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser, with full flags for the command named in ``argv`` (all of them if none)."""
    command = next((a for a in argv if not a.startswith("-")), None)
    p = argparse.ArgumentParser(prog="ktm", description="K-Token Merging for causal LMs")
    sub = p.add_subparsers(dest="command", required=True)
    for name, (text, build) in COMMANDS.items():
        sp = sub.add_parser(name, help=text, description=text)
        if command not in COMMANDS or name == command:
            build(sp)
    return p


def _quiet_libraries() -> None:
    """Our own tqdm bars are the progress report; silence the libraries' per-load bars."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"ktm: warning: {message}", file=sys.stderr if file is None else file)


def program() -> int:
    """The ``ktm`` program (console script, ``python -m ktm.cli``): ``main`` with caveats shown
    the CLI's way. The library says a caveat in one way, ``warnings.warn`` (a library user can
    filter it or make it an error); the program prints each as one ``ktm: warning:`` line, not
    Python's file-and-line form. The server's request events go to the ``ktm.serving`` logger.
    ``main`` itself leaves the warnings machinery as it finds it, for callers in Python."""
    warnings.showwarning = _show_warning
    return main()


LAUNCHABLE = ("train", "pretrain", "curriculum")  # the commands that train on several processes


def _check_launcher(command: str) -> None:
    """Under torchrun / accelerate launch every process ran the whole of any other command:
    the work N times, its output printed N times and its files written N times over."""
    size = os.environ.get("WORLD_SIZE", "1")
    if command not in LAUNCHABLE and size.strip() not in ("", "0", "1"):
        raise KTMError(f"ktm {command} runs in one process, but a launcher started "
                       f"WORLD_SIZE={size} of them: run it without torchrun / accelerate "
                       f"launch (only {', '.join(LAUNCHABLE)} run on several)")


def main(argv: Sequence[str] | None = None) -> int:
    import shlex

    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser(argv).parse_args(argv)
    args.command_line = shlex.join(["ktm", *argv])  # recorded with runs that ship
    if not getattr(args, "light", False):
        _quiet_libraries()
    try:
        _check_launcher(args.command)
        set_threads(args)
        if getattr(args, "data_dir", None):
            from ktm.tasks.jsonl import set_data_dir

            set_data_dir(args.data_dir)
        return args.run(args)
    except KTMError as e:
        print(f"ktm: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)  # 1: another process of the run failed first
    except KeyboardInterrupt:
        print("ktm: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `ktm report ... | head`: the reader left; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:  # a failed read or write the command did not name itself
        print(f"ktm: error: {e}", file=sys.stderr)
        return 1
