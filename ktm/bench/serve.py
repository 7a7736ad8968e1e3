"""Serve load benchmark (``ktm bench --mode serve``): ``ktm serve`` under concurrent clients.

For each K a real ``ktm serve`` process is started on a loopback port (a separate process, so
the clients never compete with the engine for the interpreter). Then, for each number of
concurrent clients, that many threads send ``requests`` streaming completions in total and the
benchmark records requests/s, p50/p95 latency and p50/p95 time to first token (TTFT):

    load rows    method ktm (K=2, K=4, ...) and uncompressed (the same server, ``ktm.merge``
                 false), each prompt a distinct synthetic text of exactly ``length`` tokens,
                 merged, plus a plain cue; ``max_tokens=output_tokens`` with ``ignore_eos``
    prefix rows  TTFT on a repeated long context: a new context with one question (uncached),
                 then the same context with another question (its merged KV is reused);
                 ``repeats`` pairs, medians

Every request goes through the public HTTP API with the standard library's client, so the
numbers include HTTP, SSE and JSON work, as an application would see them.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

from ktm.core.tokens import SegmentTokenizer
from ktm.errors import KTMError
from ktm.util.provenance import git_revision, versions

CUE = "\nAnswer:"


class Tokens:
    """Just enough of a model for ``synthetic_text``: the served model's tokenizer."""

    def __init__(self, model: str):
        from transformers import AutoTokenizer

        from ktm.core.base_model import resolve_model_path
        from ktm.core.checkpoint import model_config
        from ktm.readers import READERS, resolve_checkpoint

        self.checkpoint_k = None
        base = model
        if (Path(model) / "ktm_config.json").is_file() or model in READERS:
            cfg = model_config(resolve_checkpoint(model))
            base, self.checkpoint_k = cfg.base_model, cfg.k
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(base))
        self.tokenize = SegmentTokenizer(self.tokenizer)  # as KTMModel.tokenize


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]."""
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class Server:
    """``ktm serve`` in a child process on a free loopback port."""

    def __init__(self, config, k: int | None, backend: str = "torch"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "ktm.cli", "serve", "--model", config.model,
               "--port", str(self.port), "--served-name", "bench", "--log-level", "warning",
               "--device", config.device, "--dtype", config.dtype,
               "--max-batch", str(max(config.clients)),
               "--max-tokens-limit", str(config.output_tokens), "--backend", backend]
        if k is not None:
            cmd += ["--k", str(k)]
        if config.threads:
            cmd += ["--threads", str(config.threads)]
        # stderr to a file, not a pipe: processes the server starts (vLLM's engine) inherit it,
        # and a pipe held open by one of them would never reach its end
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.err,
                                     env={**os.environ, "TQDM_DISABLE": "1"})

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read().decode("utf-8", "replace")

    def __enter__(self) -> Server:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise KTMError(f"ktm serve exited with {self.proc.returncode}: "
                               f"{self.stderr()[-2000:]}")
            try:
                if json.loads(self.get("/health"))["status"] == "ok":
                    return self
            except OSError:
                time.sleep(0.2)
        raise KTMError("ktm serve did not start within 600 s")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.err.close()

    def get(self, path: str) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", path)
            return conn.getresponse().read().decode()
        finally:
            conn.close()

    def complete(self, text: str, merge: bool, max_tokens: int, cue: str = CUE) -> dict:
        """One streaming completion; latency, TTFT and the usage the server reported."""
        body = {"model": "bench", "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True},
                "ktm": {"merge": merge, "ignore_eos": True,
                        "segments": [{"text": text}, {"text": cue, "merge": False}]}}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=3600)
        t0 = time.perf_counter()
        ttft = usage = None
        try:
            conn.request("POST", "/v1/completions", json.dumps(body),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise KTMError(f"ktm serve answered {resp.status}: {resp.read()[:500]!r}")
            for line in resp:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise KTMError(f"ktm serve error: {event['error']}")
                if ttft is None and event["choices"] and event["choices"][0]["text"]:
                    ttft = time.perf_counter() - t0
                usage = event.get("usage") or usage
        finally:
            conn.close()
        latency = time.perf_counter() - t0
        return {"latency_s": latency, "ttft_s": ttft if ttft is not None else latency,
                "usage": usage}


def _load(server: Server, prompts: list[str], merge: bool, clients: int, max_tokens: int
          ) -> tuple[list[dict], float]:
    """Send every prompt with ``clients`` threads; per-request results and the wall time."""
    results: list[dict | None] = [None] * len(prompts)
    errors: list[BaseException] = []
    nxt = iter(range(len(prompts)))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = next(nxt, None)
            if i is None or errors:
                return
            try:
                results[i] = server.complete(prompts[i], merge, max_tokens)
            except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
                errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, time.perf_counter() - t0


def _load_row(results: list[dict], wall: float, clients: int) -> dict:
    lat = [r["latency_s"] for r in results]
    ttft = [r["ttft_s"] for r in results]
    usage = results[0]["usage"]
    out_tokens = sum(r["usage"]["completion_tokens"] for r in results)
    return {"clients": clients, "requests": len(results), "wall_s": wall,
            "requests_per_s": len(results) / wall, "output_tokens_per_s": out_tokens / wall,
            "latency_p50_s": percentile(lat, 50), "latency_p95_s": percentile(lat, 95),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
            "prompt_tokens": usage["prompt_tokens"],
            "prompt_tokens_merged": usage["prompt_tokens_merged"],
            "per_request": {"latency_s": lat, "ttft_s": ttft}}


def run_serve_bench(config) -> list[dict]:
    """Load rows for every (K, method, clients) and length, plus one prefix row per K."""
    from tqdm.auto import tqdm

    from ktm.bench.measure import synthetic_text, word_pool

    tok = Tokens(config.model)
    ks = [tok.checkpoint_k] if tok.checkpoint_k else list(config.ks)
    pool = word_pool(tok.tokenizer, config.seed)
    common = {"mode": "serve", "model": config.model, "device": config.device,
              "dtype": config.dtype, "threads": config.threads or None,
              "output_tokens": config.output_tokens, "config": asdict(config),
              "versions": versions(), "git": git_revision()}
    methods = [(k, True) for k in ks] + ([(ks[0], False)] if config.uncompressed else [])
    backends = getattr(config, "backends", ("torch",))
    total = (len(config.lengths) * len(config.clients) * len(methods) + len(ks)) * len(backends)
    bar = tqdm(total=total, desc="bench serve", disable=not config.progress)
    rows: list[dict] = []
    try:
        for backend, k in ((b, k) for b in backends for k in ks):
            with Server(config, None if tok.checkpoint_k else k, backend) as server:
                for merge in [m for kk, m in methods if kk == k]:
                    for length in config.lengths:
                        def prompts(n: int, tag: int, length=length) -> list[str]:
                            return [synthetic_text(tok, length, config.seed * 1_000_003 + tag
                                                   + 7919 * i, pool) for i in range(n)]
                        for j in range(config.warmup):
                            server.complete(prompts(1, 10**6 + j)[0], merge, config.output_tokens)
                        for c in config.clients:
                            batch = prompts(config.requests, 1009 * c + (0 if merge else 1))
                            res, wall = _load(server, batch, merge, c, config.output_tokens)
                            rows.append({"kind": "load", "backend": backend,
                                         "method": "ktm" if merge else "uncompressed",
                                         "k": k if merge else None, "input_tokens": length,
                                         **_load_row(res, wall, c), **common})
                            bar.update(1)
                rows.append({"kind": "prefix", "method": "ktm", "k": k, "backend": backend,
                             **_prefix_row(server, tok, pool, config), **common})
                bar.update(1)
    finally:
        bar.close()
    return rows


def _prefix_row(server: Server, tok, pool, config) -> dict:
    """TTFT of a new long context (uncached) against the same context again (cached)."""
    from ktm.bench.measure import synthetic_text

    length = max(config.lengths)
    cold, warm, cached = [], [], 0
    for r in range(config.repeats):
        ctx = synthetic_text(tok, length, config.seed * 1_000_003 + 31 * r + 5, pool)
        first = server.complete(ctx, True, 1, cue="\nQuestion one? Answer:")
        again = server.complete(ctx, True, 1, cue="\nQuestion two? Answer:")
        cold.append(first["ttft_s"])
        warm.append(again["ttft_s"])
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": length, "repeats": config.repeats,
            "ttft_uncached_s": statistics.median(cold), "ttft_cached_s": statistics.median(warm),
            "speedup_ttft_cached": statistics.median(c / w for c, w in zip(cold, warm)),
            "cached_positions": cached, "per_repeat": {"ttft_uncached_s": cold,
                                                       "ttft_cached_s": warm}}
