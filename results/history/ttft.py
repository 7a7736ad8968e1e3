"""A long chat turn by turn against ``ktm serve --history-budget``: time to first token, the
positions read and the rows the prefix cache served, per turn, with the prefix cache on and off.

One in-process server per setting (the reader, the torch runtime, one thread); an unchanged
OpenAI client sends a growing chat: a system message, then per turn a user message holding a
held-out stdlib file (``--filler-tokens``) and the assistant's streamed answer
(``--answer-tokens``, greedy), ``--turns`` turns. Every turn's request is the whole chat so far,
as chat clients send it. Rows (one per setting and turn) go to ``--out`` with the configuration,
versions and revision.

    python results/history/ttft.py --out results/history/ttft.json
    python results/history/ttft.py --history-press knorm --cache-mb 512 \
        --out results/history/ttft-press.json
    python results/history/ttft.py --shape qwen2.5-0.5b --history-budget 1024 \
        --out results/history/ttft-0.5b.json
    python results/history/ttft.py --turns 64 --filler-tokens 200 --history-budget 1024 \
        --cache-mb 512 --out results/history/ttft-64.json

Each row also says how the server read the chat's history (the response's ``ktm.history``:
messages merged, read deeper, left out) and the KV rows the turn ends with.

``--shape`` times the same chat at another model's size: an LM of that architecture
(``ktm.bench.shapes``) with random weights, the reader's tokenizer and chat template (or
``--tokenizer``'s, a folder), and a new K=4 encoder as the shipped readers are built (two K=2
levels, MLP ratio 0.5). Its answers are noise, and the timings are those of the real size.
"""

from __future__ import annotations

import argparse
import sys
import time

import openai
import torch
from transformers import AutoTokenizer

from ktm.bench.shapes import random_model
from ktm.core.base_model import parse_dtype
from ktm.evaluation.readability import heldout_sets, read_spec
from ktm.model import KTMModel
from ktm.serving.app import BackgroundServer, create_app
from ktm.serving.config import ServeConfig
from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import stamped

SYSTEM = "You are a helpful coding assistant."


def run_chat(model, cfg: ServeConfig, files: list[str], answer_tokens: int,
             think_s: float = 0.0) -> list[dict]:
    rows = []
    with BackgroundServer(create_app(model, cfg)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                               timeout=600)
        msgs = [{"role": "system", "content": SYSTEM}]
        for turn, text in enumerate(files, 1):
            msgs.append({"role": "user", "content": "Here is a file:\n" + text})
            if turn > 1:
                time.sleep(think_s)  # the user reads the answer and types the next message
            t0 = time.perf_counter()
            ttft, parts, usage, history = None, [], None, None
            for chunk in client.chat.completions.create(
                    model=cfg.served_name, messages=msgs, max_tokens=answer_tokens,
                    temperature=0, stream=True, stream_options={"include_usage": True}):
                if chunk.choices:  # the first comes when the first token is chosen
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    parts.append(chunk.choices[0].delta.content or "")
                if history is None:  # how the history was read: the first chunk says
                    history = (chunk.model_extra or {}).get("ktm", {}).get("history")
                if chunk.usage is not None:
                    usage = chunk.usage
            msgs.append({"role": "assistant", "content": "".join(parts) or "OK."})
            extra = usage.model_extra or {}
            rows.append({"turn": turn, "ttft_s": ttft, "e2e_s": time.perf_counter() - t0,
                         "prompt_tokens": usage.prompt_tokens,
                         "positions": extra.get("prompt_tokens_merged"),
                         "cached_rows": usage.prompt_tokens_details.cached_tokens,
                         # the KV the turn ends with: its prompt's rows and the answer's
                         "kv_rows": extra.get("prompt_tokens_merged") + usage.completion_tokens,
                         "history": history})
            print(cfg.prefix_cache_mb, rows[-1], flush=True)
    return rows


def load(args) -> KTMModel:
    """The reader, or with ``--shape`` a random LM of that shape read by a new K=4 encoder."""
    if args.shape is None:
        return KTMModel.load(args.reader, device=args.device, dtype=args.dtype)
    tok = (AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer
           else KTMModel.load(args.reader).tokenizer)
    lm, tok = random_model(args.shape, args.device, parse_dtype(args.dtype), args.seed, tok)
    return KTMModel.from_base(lm, k=4, tokenizer=tok, mlp_ratio=0.5, inner_k=2,
                              device=args.device, dtype=args.dtype)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reader", default="smollm2-135m-k4-seq")
    ap.add_argument("--turns", type=int, default=16)
    ap.add_argument("--filler-tokens", type=int, default=128)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--history-budget", type=int, default=768)
    ap.add_argument("--history-press", default=None,
                    help="the server's --history-press (the older messages pressed, not merged)")
    ap.add_argument("--cache-mb", type=float, nargs="+", default=[512.0, 0.0],
                    help="prefix cache sizes, a server each")
    ap.add_argument("--history-ahead", action="store_true",
                    help="the server's --history-ahead (the next turn read ahead)")
    ap.add_argument("--think-s", type=float, default=0.0,
                    help="seconds between an answer and the next turn (a user reading and typing)")
    ap.add_argument("--shape", default=None,
                    help="time a random-weight LM of this architecture (a ktm.bench.shapes name "
                         "or an HF config.json) with a new K=4 encoder, not the reader")
    ap.add_argument("--tokenizer", default=None,
                    help="with --shape: a tokenizer folder in place of the reader's")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load(args).requires_grad_(False).eval()
    files = [model.tokenizer.decode(w.context) for w in heldout_sets(
        model.tokenizer, ["stdlib"], args.turns, args.seed,
        spec=read_spec(args.filler_tokens))["stdlib"]]
    rows = []
    for cache_mb in args.cache_mb:
        cfg = ServeConfig(model=args.shape or args.reader, served_name="chat",
                          log_level="warning", device=args.device, dtype=args.dtype,
                          history_budget=args.history_budget, prefix_cache_mb=cache_mb,
                          max_tokens_limit=args.answer_tokens, batch_window_ms=0,
                          history_press=args.history_press,
                          history_ahead=args.history_ahead)
        for row in run_chat(model, cfg, files, args.answer_tokens, args.think_s):
            rows.append({"prefix_cache_mb": cache_mb, **row})
    write_json_atomic(args.out, stamped(rows, {k: v for k, v in vars(args).items()
                                               if k != "out"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
