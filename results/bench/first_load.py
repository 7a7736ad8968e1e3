"""The first ``KTMModel.load(READER, backend="llamacpp")`` on a machine: the embedded base
converted from its GGUF once, then the reader exported for llama.cpp once (the base's adapted
weights written again in the fold types, with the LoRA folded in where it adapts every row),
each in a fresh process with an empty ``$KTM_CACHE``, and the second load that reuses both.

    python results/bench/first_load.py --threads 2 --out results/bench/first_load.json

One row per reader: the seconds of the first and of the second load (each a new process, its
Python start included), the threads, and what the export wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import git_revision, versions

READERS = ("smollm2-135m-k4-seq", "smollm2-135m-k4-qa")
LOAD = ("import sys, json, torch; from ktm.model import KTMModel; "
        "torch.set_num_threads(int(sys.argv[2])); "
        "m = KTMModel.load(sys.argv[1], backend='llamacpp'); "
        "print(json.dumps(m.runtime.record()))")


def load_once(reader: str, cache: str, threads: int) -> tuple[float, dict]:
    env = {**os.environ, "KTM_CACHE": cache, "OMP_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", LOAD, reader, str(threads)], env=env,
                          check=True, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    return seconds, json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    rows = []
    for reader in READERS:
        with tempfile.TemporaryDirectory() as cache:
            first, record = load_once(reader, cache, args.threads)
            second, _ = load_once(reader, cache, args.threads)
        rows.append({"reader": reader, "first_load_s": first, "second_load_s": second,
                     "runtime": record})
        print(reader, round(first, 1), round(second, 1), flush=True)
    write_json_atomic(args.out, {"rows": rows, "config": {"threads": args.threads,
                                                          "backend": "llamacpp"},
                                 "versions": versions(), "git": git_revision()})


if __name__ == "__main__":
    main()
