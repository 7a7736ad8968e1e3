"""Long chats at a bounded number of positions: what each way of bounding a chat keeps of its
first turn, on held-out code.

Each chat: a system message, turn 1 a user message holding a held-out code file (``--doc-tokens``)
and the assistant's short reply, then filler turns (other held-out files, ``--filler-tokens``
each, and the same reply) up to ``--turns`` user turns, then the question. Two questions, as ktm's
R and recall R read a document (docs/readers.md):

    recall        "In the first file, what comes after this? <cue>"   target: the tokens after
                  the cue (a place in the file drawn as recall R draws it)
    continuation  "Continue the first file from where it stops."        target: the file's next
                  tokens

R = (NLL without turn 1's file - NLL of the reading) / (NLL without it - NLL of the full chat read
plain), every reading at (or under) a budget of ``--budget-share`` of the full chat's positions,
or of the fewest positions the policy can reach where that is more (the chat template's role
tokens, the system message and the question stay plain, the rest merged at the reader's K):

    plain          the full chat (the reference, R = 1), no budget
    truncate       the oldest messages dropped until the chat fits (what chat front ends do)
    PRESS          the full chat prefilled, then its history's KV pressed (kvpress, on the torch
                   runtime) to the budget: streaming_llm (sinks and a recent window) and the rest
    ktm            the history policy (``ktm.chat_prompt(..., history_budget=N)``): the oldest
                   messages merged, whole, by the reader (``--reader``); under what merging
                   them all reaches (``--no-floor``), the oldest read deeper, then left out
                   (its row gives the mean messages merged, read deeper and left out)
    ktm+PRESS      the history policy with a press (``ktm serve --history-press PRESS``,
                   ``--history-presses``): the reader reads the older messages plain and presses
                   their KV to the budget (``ktm.serving.prompts.press_to_fit``)

Plain, truncated and pressed readings are the base model's (LoRA off), as in
results/presses/; ktm's is the reader's. One JSON row per reading with both R, the mean positions
and KV kept, the CPU seconds, the configuration, versions and revision.

    python results/history/chat_bench.py --out results/history/chat.json
    python results/history/chat_bench.py --presses --history-presses kvzip knorm \
        --out results/history/chat-press.json
    python results/history/chat_bench.py --budget-share 0.25 --no-floor \
        --history-presses kvzip knorm --out results/history/chat-quarter.json
    python results/history/chat_bench.py --budget-share 0.25 --no-floor --presses \
        --out results/history/chat-outgrown-25.json
    python results/history/chat_bench.py --budget-share 0.18 --no-floor --presses \
        --out results/history/chat-outgrown-18.json
    python results/history/chat_bench.py --budget-share 0.1 --no-floor --presses \
        --out results/history/chat-outgrown-10.json
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import ktm
from ktm.core.prompt import Segment
from ktm.decode.press import kept_positions
from ktm.evaluation.readability import context_ratio, heldout_sets, read_spec
from ktm.model import KTMModel
from ktm.serving.prompts import chat_reading, press_to_fit
from ktm.serving.protocol import ChatRequest, RequestError
from ktm.tasks.corpus import recall_question
from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import stamped

SYSTEM = "You are a helpful coding assistant."
OPEN = "Here is a file:\n"
REPLY = "Got it."
RECALL = "In the first file, what comes right after this?\n"
CONTINUE = "Continue the first file from where it stops."


def chats(tokenizer, args) -> list[dict]:
    """Per chat: its messages up to the question, the two questions and their targets."""
    docs = heldout_sets(tokenizer, ["code"], args.n, args.seed,
                        spec=read_spec(args.doc_tokens))["code"]
    fill = heldout_sets(tokenizer, ["stdlib"], args.n * (args.turns - 1), args.seed + 1,
                        spec=read_spec(args.filler_tokens))["stdlib"]
    out = []
    for i, w in enumerate(docs):
        text = tokenizer.decode(w.context)
        msgs = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": OPEN + text}, {"role": "assistant", "content": REPLY}]
        for f in fill[i * (args.turns - 1):(i + 1) * (args.turns - 1)]:
            msgs += [{"role": "user", "content": OPEN + tokenizer.decode(f.context)},
                     {"role": "assistant", "content": REPLY}]
        cue, target = recall_question(w, args.seed)
        out.append({"messages": msgs, "questions": {
            "recall": (RECALL + tokenizer.decode(cue), list(target)),
            "continuation": (CONTINUE, list(w.target))}})
    return out


def without_file(msgs: list[dict]) -> list[dict]:
    return [msgs[0], {"role": "user", "content": OPEN}, *msgs[2:]]


def plain(model, msgs) -> tuple[Segment, ...]:
    return ktm.chat_prompt(model, msgs, merge=False)


def truncated(model, msgs, budget: int) -> tuple[Segment, ...]:
    """The oldest messages after the system message dropped, a user turn and its reply at a
    time, until the chat fits ``budget`` positions."""
    kept = list(msgs)
    while len(kept) > 2 and positions(model, plain(model, kept)) > budget:
        kept = [kept[0], *kept[3:]] if len(kept) > 3 else [kept[0], kept[-1]]
    return plain(model, kept)


def pressed_layout(model, msgs) -> tuple[Segment, ...]:
    """The chat with its history marked compressible (what a press presses), the system
    message and the question plain, to be read with merging off."""
    marked = [{**m, "ktm": {"merge": 0 < i < len(msgs) - 1}} for i, m in enumerate(msgs)]
    return ktm.chat_prompt(model, marked)


def positions(model, segs, merge: bool = False) -> int:
    return model.encode_prompts([segs], merge, embed=False)[0].tokens_out


def nll(model, segs, target, merge: bool) -> float:
    with torch.no_grad():
        out = model([segs], [target], merge=merge)
    return float(out.nll[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reader", default="smollm2-135m-k4-seq")
    ap.add_argument("--base", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=8, help="chats")
    ap.add_argument("--turns", type=int, default=8, help="user turns before the question")
    ap.add_argument("--doc-tokens", type=int, default=256)
    ap.add_argument("--filler-tokens", type=int, default=128)
    ap.add_argument("--budget-share", type=float, default=0.33)
    ap.add_argument("--no-floor", action="store_true",
                    help="the budget is the share alone, even under what merging every older "
                         "message reaches: the ktm reading then has no row where it cannot fit "
                         "(counted in its row's 'refused')")
    ap.add_argument("--presses", nargs="*",
                    default=["streaming_llm", "expected_attention", "knorm", "tova", "kvzip"])
    ap.add_argument("--history-presses", nargs="*", default=[],
                    help="also read with the history policy pressing instead of merging")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = KTMModel.from_base(args.base, k=1).requires_grad_(False).eval()
    base.peft.disable_adapter_layers()
    reader = KTMModel.load(args.reader).requires_grad_(False).eval()
    data = chats(base.tokenizer, args)
    readings = ["plain", "truncate", *args.presses, "ktm",
                *(f"ktm+{p}" for p in args.history_presses)]
    sums = {r: {"recall": [], "continuation": [], "positions": [], "kv": [], "cpu_s": 0.0,
                "refused": 0} for r in readings}
    refs = {"recall": [], "continuation": []}
    for c in data:
        for q, (question, target) in c["questions"].items():
            msgs = [*c["messages"], {"role": "user", "content": question}]
            full = plain(base, msgs)
            # the budget, or the fewest positions the policy reaches (every older message
            # merged at the reader's K) where that is more: every reading at equal positions
            floor = positions(reader, pressed_layout(reader, msgs), merge=True)
            budget = int(positions(base, full) * args.budget_share)
            if not args.no_floor:
                budget = max(budget, floor)
            none = nll(base, plain(base, without_file(msgs)), target, False)
            refs[q].append(none)
            for r in readings:
                t0 = time.process_time()
                if r == "plain":
                    segs, model, merge, press = full, base, False, None
                elif r == "truncate":
                    segs, model, merge, press = truncated(base, msgs, budget), base, False, None
                elif r == "ktm":
                    try:
                        segs, _, how = chat_reading(
                            reader, ChatRequest(model="reader", messages=msgs), budget)
                    except RequestError:  # the question alone over the budget (--no-floor)
                        sums[r]["refused"] += 1
                        continue
                    for step in ("merged", "deeper", "dropped"):
                        sums[r].setdefault(step, []).append(getattr(how, step))
                    model, merge, press = reader, True, None
                elif r.startswith("ktm+"):
                    segs = ktm.chat_prompt(reader, msgs, history_budget=budget, pressed=True)
                    fit = press_to_fit(reader, segs, budget, r.removeprefix("ktm+"))
                    model, merge = reader, True
                    press = None if fit is None else (fit.name, fit.ratio)
                else:
                    segs, model, merge = pressed_layout(base, msgs), base, False
                    cp = base.encode_prompts([segs], False, embed=False)[0]
                    keep_rows = budget - (cp.tokens_out - cp.pressable)
                    ratio = min(0.99, max(0.0, 1 - keep_rows / cp.pressable))
                    press = (r, ratio)
                model.use_press(*(press or (None,)))
                value = nll(model, segs, target, merge)
                cp = model.encode_prompts([segs], merge, embed=False)[0]
                kv = kept_positions(cp, model.runtime.press)
                model.use_press(None)
                s = sums[r]
                s[q].append(value)
                s["positions"].append(cp.tokens_out)
                s["kv"].append(kv / positions(base, full))
                s["cpu_s"] += time.process_time() - t0
        print(f"chat {len(refs['recall'])}/{len(data)}", flush=True)
    rows = []
    for r in readings:
        s = sums[r]
        if not s["positions"]:
            rows.append({"reading": r, "chats": len(data), "refused": s["refused"]})
            continue
        row = {"reading": r, "chats": len(data), "cpu_s": s["cpu_s"], "refused": s["refused"],
               "positions": sum(s["positions"]) / len(s["positions"]),
               "kv_kept": sum(s["kv"]) / len(s["kv"]),
               **{f"messages_{step}": sum(s[step]) / len(s[step])
                  for step in ("merged", "deeper", "dropped") if s.get(step)}}
        for q in ("recall", "continuation"):
            if len(s[q]) != len(refs[q]):  # some chats refused: no R over the same chats
                continue
            mine, top, none = (sum(s[q]), sum(sums["plain"][q]), sum(refs[q]))
            row[f"R_{q}"] = context_ratio(none, mine, top)
            row[f"nll_{q}"] = mine / len(s[q])
        rows.append(row)
        print(r, {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()},
              flush=True)
    write_json_atomic(args.out, stamped(rows, {k: v for k, v in vars(args).items()
                                               if k != "out"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
