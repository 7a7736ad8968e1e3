"""Requests that mean harm against ``ktm serve``, and what each costs the server: the status
and time of each answer, the server's memory against its idle size, and the greedy answers of
well-behaved clients served meanwhile against those of a quiet server.

The server runs in its own process (``ktm serve --model smollm2-135m``, a key, the default
limits, one thread), so its memory is its own: VmRSS from /proc, sampled every few
milliseconds during each attack, against its size once warm and idle. The attacks, one after
another, each beside four well-behaved clients asking the greedy questions they asked the
quiet server, while a client that sends its body a byte at a time holds a connection through
them all:

    no key, a wrong key                 401
    200 MB, by Content-Length           413 (the body sent as fast as the socket takes it)
    200 MB, chunked (no length)         413
    1 MiB of "[" (nesting)              400 naming the field
    10,000 stop strings                 400
    10,000 messages                     400
    a logit_bias of 50,000 entries      400
    n = 1,000,000; 100,000 prompts      400
    a prompt of 8x the context          400 (context_length_exceeded: tokenized, then refused)
    a body sent a byte at a time        held while the others are served, then answered

"seconds" is from the first byte sent to the whole answer read. One JSON file: a row per attack
(its answer, the memory over idle, whether the others' answers were the quiet server's), a last
row over all of them with the exit of a SIGTERM after, the configuration, versions and
revision.

    python results/serving/attack.py --out results/serving/attack.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import stamped

KEY = "attack-bench-key"
DOC = ("def add(a, b):\n    return a + b\n\nclass Tree:\n    def __init__(self):\n"
       "        self.children = []\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, threads: int, *flags: str, key: str | None = KEY
                 ) -> tuple[subprocess.Popen, int]:
    """``ktm serve --model MODEL`` in its own process on a free loopback port, served as "m"
    with ``key`` (None: none) and ``flags``, once it takes connections: (the process, its
    port)."""
    port = free_port()
    cmd = [sys.executable, "-m", "ktm.cli", "serve", "--model", model, "--port", str(port),
           "--served-name", "m", "--threads", str(threads), "--log-level", "warning", *flags]
    env = {k: v for k, v in os.environ.items() if k != "KTM_API_KEY"}
    env.update({"OMP_NUM_THREADS": str(threads), **({"KTM_API_KEY": key} if key else {})})
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 600
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, port
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"ktm serve did not start: {proc.stderr.read()[-2000:]}"
                                 ) from None
            time.sleep(0.5)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


class Sampler(threading.Thread):
    """The server's largest VmRSS while it runs."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.done = pid, 0.0, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, rss_mb(self.pid))
            time.sleep(0.005)


def request(port: int, path: str, body: bytes, key: str | None = KEY,
            content_length: bool = True) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: ktm", "Content-Type: application/json"]
    if key is not None:
        head.append(f"Authorization: Bearer {key}")
    head.append(f"Content-Length: {len(body)}" if content_length else
                "Transfer-Encoding: chunked")
    return ("\r\n".join(head) + "\r\n\r\n").encode()


def send(port: int, head: bytes, chunks, answer: bool = False) -> dict:
    """``head`` then the body's ``chunks`` as fast as the socket takes them, reading all the
    while: the answer's status, error and seconds, and the bytes sent before it came
    (``answer``: its JSON body too)."""
    t0, sent, got = time.perf_counter(), 0, b""
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(head)
        sock.setblocking(False)
        pending = b""
        while True:
            if b"\r\n\r\n" in got:
                header, _, rest = got.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in header.split(b"\r\n")
                               if line.lower().startswith(b"content-length")), None)
                if length is not None and len(rest) >= length:
                    break
            readable, writable, _ = select.select([sock], [sock] if chunks else [], [], 120)
            if readable:
                data = sock.recv(2**16)
                if not data:
                    break
                got += data
            elif writable:
                if not pending:
                    pending = next(chunks, b"")
                    if not pending:
                        chunks = None
                        continue
                try:
                    n = sock.send(pending)
                except OSError:  # the server closed: read what it answered
                    chunks = None
                    continue
                sent, pending = sent + n, pending[n:]
    seconds = time.perf_counter() - t0
    header, _, rest = got.partition(b"\r\n\r\n")
    status = int(header.split()[1]) if header else None
    error = json.loads(rest).get("error", {}) if status and status >= 400 else {}
    out = {"status": status, "code": error.get("code"), "param": error.get("param"),
           "message": error.get("message"), "seconds": seconds, "bytes_sent": sent}
    return {**out, "answer": json.loads(rest) if rest else None} if answer else out


def body_of(obj: dict) -> bytes:
    return json.dumps(obj).encode()


def attacks(port: int) -> list[tuple[str, callable]]:
    def plain(path: str, obj: dict | bytes, key: str | None = KEY):
        body = obj if isinstance(obj, bytes) else body_of({"model": "m", **obj})
        return lambda: send(port, request(port, path, body, key) + body, iter(()))

    def flood(content_length: bool):
        block = b"a" * 2**16
        total = 200 * 2**20

        def chunks():
            for _ in range(total // len(block)):
                yield block if content_length else b"%x\r\n%s\r\n" % (len(block), block)

        head = request(port, "/v1/completions", b"", KEY, content_length)
        if content_length:
            head = head.replace(b"Content-Length: 0", b"Content-Length: %d" % total)
        return lambda: send(port, head, chunks())

    comp, chat = "/v1/completions", "/v1/chat/completions"
    return [
        ("no key", plain(comp, {"prompt": "hi"}, key=None)),
        ("a wrong key", plain(comp, {"prompt": "hi"}, key="guess")),
        ("200 MB by Content-Length", flood(True)),
        ("200 MB chunked", flood(False)),
        ("1 MiB of nesting", plain(comp, b'{"model": "m", "prompt": ' + b"[" * 2**20 + b"}")),
        ("10,000 stop strings", plain(comp, {"prompt": "hi", "stop": [
            f"s{i}" for i in range(10_000)]})),
        ("10,000 messages", plain(chat, {"messages": [{"role": "user", "content": "hi"}]
                                         * 10_000})),
        ("a logit_bias of 50,000 entries", plain(comp, {"prompt": "hi", "logit_bias": {
            str(i): 1 for i in range(50_000)}})),
        ("n = 1,000,000", plain(comp, {"prompt": "hi", "n": 10**6})),
        ("100,000 prompts", plain(comp, {"prompt": ["hi"] * 100_000})),
        ("a prompt of 8x the context", plain(comp, {"prompt": "word " * (8 * 8192)})),
    ]


def ask(port: int, kw: dict) -> tuple[str, float]:
    path = "/v1/chat/completions" if "messages" in kw else "/v1/completions"
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", path, body_of(kw), {"Content-Type": "application/json",
                                             "Authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    out = json.loads(r.read())
    conn.close()
    choice = out["choices"][0]
    return (choice["message"]["content"] if "messages" in kw else choice["text"],
            time.perf_counter() - t0)


def slow_client(port: int, held: threading.Event, release: threading.Event) -> dict:
    """A body sent a byte at a time: half of it, then (once the others are answered) the rest."""
    body = body_of({"model": "m", "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=600) as sock:
        sock.sendall(request(port, "/v1/completions", body))
        for i in range(len(body) // 2):
            sock.sendall(body[i:i + 1])
            time.sleep(0.05)
        held.set()
        release.wait()
        sock.sendall(body[len(body) // 2:])
        r = http.client.HTTPResponse(sock)
        r.begin()
        r.read()
        return {"status": r.status, "seconds": time.perf_counter() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    proc, port = start_server(args.model, args.threads)
    try:
        asks = [{"model": "m", "prompt": DOC + f"# {i}\n", "max_tokens": 16, "temperature": 0}
                for i in range(2)]
        asks += [{"model": "m", "messages": [{"role": "user", "content": DOC + f"Q{i}?"}],
                  "max_tokens": 16, "temperature": 0} for i in range(2)]
        quiet = [ask(port, kw) for kw in asks]
        idle = rss_mb(proc.pid)
        held, release = threading.Event(), threading.Event()
        rows = []
        with ThreadPoolExecutor(1) as holder:
            slow = holder.submit(slow_client, port, held, release)
            held.wait(600)
            for name, run in attacks(port):  # one at a time, the others asking meanwhile
                sampler = Sampler(proc.pid)
                sampler.start()
                with ThreadPoolExecutor(1 + len(asks)) as pool:
                    hit = pool.submit(run)
                    busy = list(pool.map(lambda kw: ask(port, kw), asks))
                    row = {"attack": name, **hit.result()}
                sampler.done.set()
                sampler.join()
                rows.append({**row, "rss_over_idle_mb": sampler.peak - idle,
                             "answers_unchanged": [t for t, _ in busy] == [t for t, _ in quiet],
                             "answers_seconds": max(s for _, s in busy)})
            release.set()
            rows.append({"attack": "a body a byte at a time, held through the others",
                         **slow.result()})
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        rows.append({"idle_rss_mb": idle, "rss_over_idle_mb": max(
            r.get("rss_over_idle_mb", 0) for r in rows),
            "answers_unchanged": all(r.get("answers_unchanged", True) for r in rows),
            "quiet_answers_seconds": max(s for _, s in quiet),
            "sigterm_exit_code": code, "sigterm_seconds": time.perf_counter() - t0})
    finally:
        if proc.poll() is None:
            proc.kill()
    for row in rows:
        print(json.dumps(row), flush=True)
    write_json_atomic(args.out, stamped(rows, {k: v for k, v in vars(args).items()
                                               if k != "out"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
