"""Long answers at a bounded KV: merging the answer as it grows (``merge_window``) against the
full cache, truncation and a KV press during decoding, on held-out code.

Each window: a prompt of ``--prompt-tokens`` held-out code tokens (read plain) and the
``--answer-tokens`` that follow it, read token by token through ktm's decode loop with the true
tokens fed back (teacher forcing: the answer is the file's own continuation, so every reading is
scored on the same tokens). Readings, by a reader (``--readers``):

    plain       the whole answer's KV kept (the reference)
    merge       ``merge_window`` W: past W plain answer tokens, the oldest merged K to a position
                and read again (ktm.decode.merge_generated)
    truncate    the same KV as merge at every step: the oldest plain answer tokens dropped where
                merge merges them (m tokens out where merge leaves m / K rows)
    PRESS       kvpress's DecodingPress with that scorer (``--presses``), compressing the whole
                cache every W / 2 steps to merge's final KV for that window: at every step at
                least as much KV as merge keeps

Scores, over the answer tokens after the first W (where the readings differ): the mean NLL and
R = (NLL truncate - NLL reading) / (NLL truncate - NLL plain), the share of what truncation loses
that a reading keeps (1: as plain, 0: as truncation at the same KV). One JSON row per (reader,
reading) with the mean and final KV positions, CPU seconds, configuration, versions, revision.

    python results/generation/long_answers.py --out results/generation/long_answers.json
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import ExitStack

import torch

from ktm.decode.generate import Decoding, GenerationConfig
from ktm.decode.press import import_kvpress, kvpress_compatible
from ktm.evaluation.readability import heldout_sets
from ktm.model import KTMModel
from ktm.tasks.corpus import WindowSpec
from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import stamped


def teacher_forced(model, prompt: list[int], answer: list[int], window: int,
                   reading: str, press=None, press_args=None) -> tuple[list[float], list[int]]:
    """Per answer token, its NLL and the KV positions held when it was predicted."""
    runtime = model.runtime
    cfg = GenerationConfig(max_new_tokens=len(answer), stop_at_eos=False,
                           merge_window=window if reading in ("merge", "truncate") else 0)
    if reading == "truncate":
        real = runtime.merge_generated

        def drop(state, ids, plain):  # the same positions out as merge frees
            k, m = model.k, ids.shape[1]
            start = state.mask.shape[1] - plain
            cut = m - m // k
            for layer in state.cache.layers:
                layer.keys = torch.cat([layer.keys[:, :, :start],
                                        layer.keys[:, :, start + cut:]], 2)
                layer.values = torch.cat([layer.values[:, :, :start],
                                          layer.values[:, :, start + cut:]], 2)
            state.mask = torch.cat([state.mask[:, :start], state.mask[:, start + cut:]], 1)

        runtime.merge_generated = drop
    lm = model.decode_lm() or model.peft.get_base_model()
    nll, kv = [], []
    try:
        with torch.no_grad():
            cp = model.encode_prompts([[_plain(prompt)]], merge=False)
            with ExitStack() as stack:
                if press is not None:  # kvpress's hooks on the LM decoding reads through
                    stack.enter_context(kvpress_compatible(lm))
                    stack.enter_context(press(lm))
                state = runtime.prefill(cp, [cfg])
                dec = Decoding(runtime, state, [cfg], [None])
                for i, tok in enumerate(answer):
                    lp = torch.log_softmax(dec.logits.float(), -1)[0, tok]
                    nll.append(-float(lp))
                    kv.append(state.cache.layers[0].keys.shape[2])
                    if i + 1 < len(answer):
                        if press is not None:  # a press shrank the cache: the mask follows it
                            state.mask = state.mask.new_ones(1, kv[-1])
                        dec.advance(torch.tensor([tok]))
                        state = dec.state
    finally:
        if reading == "truncate":
            runtime.merge_generated = real
    return nll, kv


def _plain(ids: list[int]):
    from ktm.core.prompt import Segment

    return Segment("", compress=False, ids=tuple(ids))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--readers", nargs="+", default=["smollm2-135m-k4-seq", "smollm2-135m-k4"])
    ap.add_argument("--n", type=int, default=3, help="windows of held-out code")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--answer-tokens", type=int, default=256)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--presses", nargs="*", default=["knorm", "streaming_llm"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kvpress = import_kvpress() if args.presses else None
    from ktm.decode.press import SCORERS

    rows = []
    spec = WindowSpec(context_tokens=args.prompt_tokens, target_tokens=args.answer_tokens,
                      min_tokens=args.prompt_tokens + args.answer_tokens)
    for name in args.readers:
        model = KTMModel.load(name).requires_grad_(False).eval()
        windows = heldout_sets(model.tokenizer, ["code"], args.n, args.seed, spec=spec)["code"]
        windows = [w for w in windows if len(w.target) == args.answer_tokens]
        readings = ["plain", "merge", "truncate", *args.presses]
        sums = {r: {"nll": [], "kv": [], "final_kv": [], "cpu_s": 0.0} for r in readings}
        for j, w in enumerate(windows):
            merged_kv = None
            for r in readings:
                t0 = time.process_time()
                press = None
                if r in args.presses:
                    press = kvpress.DecodingPress(
                        base_press=getattr(kvpress, SCORERS[r])(),
                        compression_interval=args.window // 2, target_size=merged_kv)
                nll, kv = teacher_forced(model, list(w.context), list(w.target), args.window,
                                         r, press)
                if r == "merge":
                    merged_kv = kv[-1]
                s = sums[r]
                s["nll"] += nll[args.window:]
                s["kv"] += kv
                s["final_kv"].append(kv[-1])
                s["cpu_s"] += time.process_time() - t0
            print(f"{name}: window {j + 1}/{len(windows)}", flush=True)
        mean = {r: sum(s["nll"]) / len(s["nll"]) for r, s in sums.items()}
        for r, s in sums.items():
            gap = mean["truncate"] - mean["plain"]
            row = {"reader": name, "reading": r, "windows": len(windows),
                   "nll": mean[r], "R_vs_truncate": (mean["truncate"] - mean[r]) / gap
                   if gap else None,
                   "mean_kv": sum(s["kv"]) / len(s["kv"]),
                   "final_kv": sum(s["final_kv"]) / len(s["final_kv"]), "cpu_s": s["cpu_s"]}
            rows.append(row)
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()},
                  flush=True)
    write_json_atomic(args.out, stamped(rows, {k: v for k, v in vars(args).items()
                                               if k != "out"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
