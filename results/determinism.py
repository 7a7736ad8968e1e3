"""Does greedy output depend on what a server did before, or on what else it runs?

For each runtime, ``ktm serve`` (in this process, on a loopback port) gets 8 greedy 16-token
completions one at a time; then the same 8 prompts 4 times over as 32 concurrent requests while
8 streams are dropped after their first chunk and 10 bad requests are sent; then the 8 one at a
time again. A row per runtime counts the answers that differ from the first pass, and the wall
time of the concurrent burst (what the deterministic llama.cpp option costs under load):

    python results/determinism.py --runtimes torch llamacpp llamacpp-deterministic vllm \\
        --out results/bench/determinism.json
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from ktm.llamacpp.runtime import RuntimeConfig
from ktm.model import KTMModel
from ktm.serving.app import BackgroundServer, create_app
from ktm.serving.config import ServeConfig
from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import git_revision, versions

READER = "smollm2-135m-k4-seq"
SOURCE = (Path(__file__).parents[1] / "ktm" / "decode" / "generate.py").read_text()
RUNTIMES = {"torch": ("torch", None), "llamacpp": ("llamacpp", RuntimeConfig(sequences=16)),
            "llamacpp-deterministic": ("llamacpp", RuntimeConfig(sequences=16,
                                                                 deterministic=True)),
            "vllm": ("vllm", None)}


def prompts() -> list[dict]:
    """8 greedy completions: a merged slice of a source file, a plain question."""
    out = []
    for i in range(8):
        doc = SOURCE[700 * i: 700 * i + 1500]
        out.append({"model": "k4", "prompt": None, "max_tokens": 16, "temperature": 0,
                    "extra_body": {"ktm": {"segments": [
                        {"text": doc, "merge": True},
                        {"text": "\nQuestion: what does this code do? Answer:", "merge": False}]}}})
    return out


def ask(url: str, kw: dict) -> str:
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    return c.completions.create(**kw).choices[0].text


def faults(url: str, reqs: list[dict]) -> None:
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    for kw in reqs:
        stream = c.completions.create(**{**kw, "max_tokens": 64}, stream=True)
        next(iter(stream))
        stream.close()
    for kw in [dict(reqs[0], model="other"), dict(reqs[0], max_tokens=10**6)] * 5:
        try:
            ask(url, kw)
        except openai.APIStatusError:
            pass


def check(model, name: str) -> dict:
    reqs = prompts()
    cfg = ServeConfig(model=READER, served_name="k4", log_level="warning", batch_window_ms=50)
    app = create_app(model, cfg)
    with BackgroundServer(app) as srv:
        before = [ask(srv.url, kw) for kw in reqs]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(33) as pool:
            noise = pool.submit(faults, srv.url, reqs)
            together = list(pool.map(lambda kw: ask(srv.url, kw), reqs * 4))
            noise.result()
        burst = time.perf_counter() - t0
        after = [ask(srv.url, kw) for kw in reqs]
        peak = app.state.engine.counts["peak_running"]
    return {"runtime": name, "prompts": len(reqs), "concurrent": len(together),
            "changed_under_load": sum(t != before[i % 8] for i, t in enumerate(together)),
            "changed_after_load": sum(a != b for a, b in zip(after, before)),
            "burst_wall_s": burst, "peak_running": peak,
            "runtime_record": model.runtime.record(), "answers": {"before": before,
                                                                  "after": after}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runtimes", nargs="+", default=list(RUNTIMES), choices=list(RUNTIMES))
    ap.add_argument("--out", default="results/bench/determinism.json")
    args = ap.parse_args()
    model = KTMModel.load(READER)
    rows = []
    for name in args.runtimes:
        backend, settings = RUNTIMES[name]
        model.use_backend(backend, config=settings)
        rows.append({**check(model, name), "versions": versions(), "git": git_revision()})
        print(json.dumps({k: v for k, v in rows[-1].items()
                          if k in ("runtime", "changed_under_load", "changed_after_load",
                                   "burst_wall_s", "peak_running")}), flush=True)
    model.use_backend("torch")
    write_json_atomic(args.out, rows)


if __name__ == "__main__":
    main()
