"""schemathesis against ``ktm serve`` on the real reader: requests generated from the server's
own ``/openapi.json`` (its examples, coverage, fuzzing and stateful phases, deterministic), with
every check, each operation tested on past its first failure, with and without an API key;
each status answered and each check's failures counted.

The server runs in its own process (``ktm serve --model READER``, one thread,
``--max-tokens-limit 4`` so that each generated request is short). ``--examples`` is
schemathesis' ``--max-examples`` (per operation and phase). A row per run: the cases generated,
the statuses answered (from its NDJSON events), in all and by route, the failures by check with
their operations, and the engine's counts after (``/health``: the requests it answered, and
those that failed inside it). ``positive_data_acceptance``
(ST202, a request valid in form answered with a 4xx) is counted but is not a defect: a request
of the right shape is refused for what it says (a prompt that tokenizes to nothing, a chat
whose messages hold no text), which JSON Schema does not state (``tests/serving/
test_serve_fuzz.py`` runs the rest in the suite). One JSON file with the configuration, versions
and revision.

    python results/serving/fuzz.py --out results/serving/fuzz.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import urllib.request

from attack import KEY, start_server

from ktm.util.fileio import write_json_atomic
from ktm.util.provenance import stamped


def statuses(ndjson: str) -> dict[str, dict[str, int]]:
    """Every response's status in a schemathesis NDJSON event log, counted by the route and
    method it answered."""
    seen: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    with open(ndjson) as f:
        for line in f:
            event = json.loads(line)
            done = event.get("ScenarioFinished")
            if not done:
                continue
            for step in done.get("recorder", {}).get("interactions", {}).values():
                if step.get("response"):
                    request = step["request"]
                    route = request["uri"].split("/", 3)[-1].split("?")[0]
                    route = "/v1/models/{id}" if route.startswith("v1/models/") else f"/{route}"
                    seen[f"{request['method']} {route}"][str(step["response"]["status_code"])] += 1
    return {op: dict(sorted(n.items())) for op, n in sorted(seen.items())}


def fuzz(port: int, examples: int, keyed: bool, folder: str) -> dict:
    """One schemathesis run, every check: its report, summed up."""
    report, events = os.path.join(folder, "run.json"), os.path.join(folder, "run.ndjson")
    cmd = [os.path.join(os.path.dirname(sys.executable), "schemathesis"), "run",
           f"http://127.0.0.1:{port}/openapi.json", "--checks", "all", "--continue-on-failure",
           "--max-examples", str(examples), "--generation-deterministic", "--workers", "1",
           "--request-timeout", "120", "--report", "json,ndjson", "--report-json-path", report,
           "--report-ndjson-path", events,
           *(["--header", f"Authorization: Bearer {KEY}"] if keyed else [])]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=folder)  # its cache there
    out = json.loads(open(report).read())
    seen = statuses(events)
    every = collections.Counter()
    for n in seen.values():
        every.update(n)
    return {"keyed": keyed, "examples": examples, "cases": out["test_cases"]["generated"],
            "operations_tested": out["operations"]["tested"],
            "statuses": dict(sorted(every.items())), "by_operation": seen,
            "responses_5xx": sum(n for s, n in every.items() if s.startswith("5")),
            "failures": [{k: f[k] for k in ("code", "title", "count", "operations")}
                         for f in out["failures"]],
            "errors": out["errors"], "exit_code": run.returncode,
            "seconds": out["running_time"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-k4-seq")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--examples", type=int, default=400)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for keyed in (True, False):
        proc, port = start_server(args.model, args.threads, "--max-tokens-limit", "4",
                                  key=KEY if keyed else None)
        try:
            with tempfile.TemporaryDirectory() as folder:
                row = fuzz(port, args.examples, keyed, folder)
            req = urllib.request.Request(f"http://127.0.0.1:{port}/health")
            with urllib.request.urlopen(req, timeout=60) as r:
                health = json.loads(r.read())
            row["engine"] = {k: health[k] for k in ("finished", "rejected", "failed")}
            proc.send_signal(signal.SIGTERM)
            row["sigterm_exit_code"] = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        print(json.dumps(row), flush=True)
        rows.append(row)
    write_json_atomic(args.out, stamped(rows, {k: v for k, v in vars(args).items()
                                               if k != "out"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
