"""The device-aware parity suites on a device, in fp32 and bf16, recorded as one JSON file.

    python results/device/parity.py OUT.json [--device cuda] [-- PYTEST_ARGS]

Each dtype runs in a process of its own (``KTM_TEST_DEVICE``, ``KTM_TEST_DTYPE``: tests/helpers.py)
over the suites below, the two at once; the record holds every case's outcome, the failures'
messages, and the device, versions and source revision (``KTM_SOURCE_REVISION`` where the copy
has no .git).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import UTC, datetime
from pathlib import Path

SUITES = ("tests/test_layout_parity.py", "tests/core/test_context_on_device.py",
          "tests/test_on_device.py", "tests/decode/test_compiled.py",
          "tests/training/test_compiled_training.py", "tests/training/test_precision.py")
DTYPES = ("float32", "bfloat16")


def run(device: str, dtype: str, extra: list[str], suites=SUITES,
        limit: float | None = None) -> dict:
    """One dtype's pytest run; ``limit``: seconds before it is stopped, and recorded as
    stopped with the tail of what it printed (a device's time is short: a run that overruns
    still leaves a record)."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        env = {**os.environ, "KTM_TEST_DEVICE": device, "KTM_TEST_DTYPE": dtype}
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p",
                                   "no:cacheprovider", f"--junitxml={xml}", *extra, *suites],
                                  env=env, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            print(f"{dtype}: stopped after {limit} s\n{out[-2000:]}", flush=True)
            return {"timed_out": True, "seconds": limit, "stdout_tail": out[-2000:]}
        seconds = time.perf_counter() - t0
        print(proc.stdout[-3000:], proc.stderr[-2000:], sep="\n", flush=True)
        cases, failed = [], {}
        if xml.is_file():
            for case in ET.parse(xml).getroot().iter("testcase"):
                name = f"{case.get('classname')}::{case.get('name')}"
                bad = case.find("failure") if case.find("failure") is not None else case.find(
                    "error")
                skipped = case.find("skipped") is not None
                cases.append({"case": name,
                              "outcome": "failed" if bad is not None else
                              "skipped" if skipped else "passed"})
                if bad is not None:
                    failed[name] = (bad.get("message") or "")[:500]
    return {"tests": len(cases), "passed": sum(c["outcome"] == "passed" for c in cases),
            "skipped": sum(c["outcome"] == "skipped" for c in cases), "failed": failed,
            "exit_code": proc.returncode, "seconds": round(seconds, 1),
            "cases": [c["case"] for c in cases if c["outcome"] == "passed"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--suites", nargs="+", default=list(SUITES),
                    help="test files to run (default: every device-aware suite)")
    ap.add_argument("--limit", type=float, default=None,
                    help="seconds each dtype's run may take before it is stopped and recorded "
                         "as stopped (default: none)")
    args, rest = ap.parse_known_args()
    args.pytest_args = [a for a in rest if a != "--"]
    import peft
    import torch
    import transformers

    record = {
        "what": "the device-aware parity suites in fp32 and bf16 (results/device/parity.py)",
        "command": f"python results/device/parity.py OUT.json --device {args.device} "
                   f"--suites {' '.join(args.suites)}",
        "suites": args.suites,
        "suite_sha256": {s: hashlib.sha256(Path(s).read_bytes()).hexdigest()
                         for s in args.suites},
        "device": (torch.cuda.get_device_name() if args.device.startswith("cuda")
                   else args.device),
        "python": sys.version.split()[0], "torch": torch.__version__,
        "transformers": transformers.__version__, "peft": peft.__version__,
        "git_revision": os.environ.get("KTM_SOURCE_REVISION"),
        "timestamp": datetime.now(UTC).isoformat(),
        "by_dtype": {},
    }
    with ThreadPoolExecutor(len(DTYPES)) as pool:
        runs = {pool.submit(run, args.device, dt, args.pytest_args, args.suites, args.limit): dt
                for dt in DTYPES}
        for done in as_completed(runs):  # the record is rewritten as each dtype ends
            record["by_dtype"][runs[done]] = done.result()
            tmp = args.out.with_name(args.out.name + ".tmp")
            tmp.write_text(json.dumps(record, indent=1) + "\n")
            tmp.replace(args.out)
    for dt, r in record["by_dtype"].items():
        if r.get("timed_out"):
            print(f"{dt}: stopped after {r['seconds']} s")
            continue
        print(f"{dt}: {r['passed']} of {r['tests']} passed, {len(r['failed'])} failed, "
              f"{r['seconds']} s")
        for name, msg in r["failed"].items():
            print(f"  FAILED {name}: {msg[:300]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
