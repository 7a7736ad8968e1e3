"""An answer depends on its own request only, on the real reader: good requests batched with
each hostile kind against the quiet server's answers, and what a chat of 2,048 long messages
costs two normal clients.

The server runs in its own process (``ktm serve --model READER``, a key, one thread, a batch
window of 100 ms so that requests sent together are prefilled together). Four well-behaved
clients ask greedy questions (two completions, two chats) alone first: the quiet answers. Then,
for each hostile kind, the four and the hostile request are sent at once:

    ktm.ratio 5 and 1e308, a segment's ratio 5.5     a 400 naming the field (past K=4)
    temperature 5e-324, top_p 1e-300 and 2.2e-311    a 200: the most likely tokens
    "stream": "yes", "ktm": {"merge": "no"},
    "temperature": "0.5", "ktm": {"ratio": "2"}       a 400 naming the field (strict types)
    10,000 ktm.segments                              a 400 naming ktm.segments

A row per kind: the hostile answer (status, param, seconds), how many good requests failed and
how many changed. Then a chat of 2,048 messages of 600 characters (1.3 MB), and one of 2,048
short messages, each sent with two normal clients (``--repeats`` times, each time after the two
alone): the chat's answer and seconds, the normal clients' seconds against the quiet server's.
One JSON file with the configuration, versions and revision.

    python results/serving/isolation.py --out results/serving/isolation.json
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from attack import KEY, send, start_server

from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import stamped

COMP, CHAT = "/v1/completions", "/v1/chat/completions"
DOC = ("def add(a, b):\n    return a + b\n\nclass Tree:\n    def __init__(self):\n"
       "        self.children = []\n")
GOOD = [(COMP, {"prompt": DOC + "# 0\n", "max_tokens": 8}),
        (COMP, {"ktm": {"segments": [{"text": DOC}, {"text": "\n# What does add return?\n#",
                                                     "merge": False}]}, "max_tokens": 8}),
        (CHAT, {"messages": [{"role": "user", "content": DOC + "What does add return?"}],
                "max_tokens": 8}),
        (CHAT, {"messages": [{"role": "system", "content": "Answer briefly."},
                             {"role": "user", "content": "The museum opened in 1911. When?"}],
                "max_tokens": 8})]
HOSTILE = [
    ("ktm.ratio 5", COMP, {"prompt": "The museum opened in 1911.", "ktm": {"ratio": 5}}),
    ("ktm.ratio 1e308", COMP, {"prompt": "The museum opened in 1911.",
                               "ktm": {"ratio": 1e308}}),
    ("a segment's ratio 5.5", COMP, {"ktm": {"segments": [{"text": DOC, "ratio": 5.5}]}}),
    ("temperature 5e-324", COMP, {"prompt": "The museum", "temperature": 5e-324,
                                  "max_tokens": 4}),
    ("top_p 1e-300", COMP, {"prompt": "The museum", "temperature": 1, "top_p": 1e-300,
                            "max_tokens": 4}),
    ("top_p 2.2e-311", CHAT, {"messages": [{"role": "user", "content": "Hi"}],
                              "temperature": 1, "top_p": 2.2e-311, "max_tokens": 4}),
    ('"stream": "yes"', COMP, {"prompt": "Hi", "stream": "yes"}),
    ('"ktm": {"merge": "no"}', COMP, {"prompt": "Hi", "ktm": {"merge": "no"}}),
    ('"temperature": "0.5"', COMP, {"prompt": "Hi", "temperature": "0.5"}),
    ('"ktm": {"ratio": "2"}', COMP, {"prompt": "Hi", "ktm": {"ratio": "2"}}),
    ("10,000 ktm.segments", COMP, {"ktm": {"segments": [{"text": "a"}] * 10_000}}),
]


def post(port: int, path: str, body: dict) -> dict:
    """The answer to ``body`` (greedy unless it says otherwise): status, error, seconds, text."""
    data = json.dumps({"model": "m", "temperature": 0, **body}).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: ktm\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: {len(data)}\r\n\r\n").encode()
    return send(port, head + data, iter(()), answer=True)


def text(row: dict) -> str | None:
    choices = (row.get("answer") or {}).get("choices")
    if not choices:
        return None
    return choices[0]["message"]["content"] if "message" in choices[0] else choices[0]["text"]


def together(port: int, asks: list[tuple[str, dict]]) -> list[dict]:
    with ThreadPoolExecutor(len(asks)) as pool:
        return list(pool.map(lambda a: post(port, *a), asks))


def long_chat(n: int, chars: int) -> dict:
    words = "the museum opened in 1911 and its tree of rooms grew every year".split()
    line = " ".join(words[i % len(words)] for i in range(chars))[:chars]
    return {"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": line}
                         for i in range(n)], "max_tokens": 4}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-k4-seq")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    proc, port = start_server(args.model, args.threads, "--batch-window-ms", "100",
                              "--max-tokens-limit", "16")
    rows = []
    try:
        quiet = [post(port, *a) for a in GOOD]
        want = [text(r) for r in quiet]
        for name, path, body in HOSTILE:
            got = together(port, [*GOOD, (path, body)])
            hostile = got[-1]
            rows.append({"kind": name, "status": hostile["status"],
                         "param": hostile["param"], "message": hostile["message"],
                         "seconds": hostile["seconds"],
                         "good_failed": sum(r["status"] != 200 for r in got[:-1]),
                         "good_changed": sum(text(r) != w for r, w in zip(got[:-1], want))})
            print(json.dumps(rows[-1]), flush=True)
        normal = GOOD[2:]  # two normal clients: the chats
        for name, chat in (("2,048 messages x 600 characters", long_chat(2048, 600)),
                           ("2,048 messages x 12 characters", long_chat(2048, 12))):
            alone, runs = [], []
            for _ in range(args.repeats):  # interleaved: the two alone, then beside the chat
                alone.append(max(r["seconds"] for r in together(port, normal)))
                runs.append(together(port, [*normal, (CHAT, chat)]))
            big = runs[0][-1]
            rows.append({"kind": name, "status": big["status"], "param": big["param"],
                         "message": big["message"],
                         "seconds": statistics.median(r[-1]["seconds"] for r in runs),
                         "normal_seconds_median": statistics.median(
                             max(x["seconds"] for x in r[:-1]) for r in runs),
                         "normal_seconds_max": max(x["seconds"] for r in runs for x in r[:-1]),
                         "quiet_seconds_median": statistics.median(alone),
                         "quiet_seconds_max": max(alone),
                         "good_changed": sum(text(x) != w for r in runs
                                             for x, w in zip(r[:-1], want[2:]))})
            print(json.dumps(rows[-1]), flush=True)
        proc.send_signal(signal.SIGTERM)
        rows.append({"kinds": len(HOSTILE), "good_failed": sum(r.get("good_failed", 0)
                                                               for r in rows),
                     "good_changed": sum(r["good_changed"] for r in rows),
                     "quiet_seconds": max(r["seconds"] for r in quiet),
                     "sigterm_exit_code": proc.wait(timeout=120)})
    finally:
        if proc.poll() is None:
            proc.kill()
    write_json_atomic(args.out, stamped(rows, {k: v for k, v in vars(args).items()
                                               if k != "out"}))
    return 0


if __name__ == "__main__":
    started = time.perf_counter()
    code = main()
    print(f"{time.perf_counter() - started:.0f} s", file=sys.stderr)
    sys.exit(code)
