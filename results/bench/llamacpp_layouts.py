"""llama.cpp's repacked weight layouts for the CPU (its "extra buffer types") on and off.

Plain and K=4 readings of 2,048-token prompts through the llama.cpp backend, prefill and
decode, with the K=4 reader's export in two weight types: Q8_0 (ktm's default fold) and Q4_1
(the embedded base's own type, ``fold_type="same"``). A plain reading goes through the same
export, so each weight type is timed plain and merged on the same weights.

Each (type, layouts) point runs in a process of its own, so a crash (llama-cpp-python 0.3.36
with the layouts on a Xeon with AMX and AVX-512: a segmentation fault at the first decode) is
a row saying so, not a lost run. Points are interleaved: every repeat runs all of them in
turn, reversed on odd repeats.

Usage:
    python results/bench/llamacpp_layouts.py [--length 2048] [--output-tokens 128]
        [--repeats 3] [--threads 1] [--out results/bench/llamacpp_layouts.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

READER = "smollm2-135m-k4-seq"
TYPES = {"Q8_0": "Q8_0", "Q4_1": "same"}  # weight type -> export's fold_type


def child(args) -> None:
    """One point: load the export with the layouts on or off, time plain and K=4 (one untimed
    pass first), print one JSON line."""
    import torch

    from ktm import KTMModel
    from ktm.bench.measure import infer_once, synthetic_text, word_pool
    from ktm.llamacpp.runtime import RuntimeConfig

    torch.set_num_threads(args.threads)
    model = KTMModel.load(READER)
    rc = RuntimeConfig(context=args.length + args.output_tokens + 8, sequences=1,
                       threads=args.threads, extra_buffers=args.layouts == "on")
    model.use_backend("llamacpp", gguf=args.gguf, config=rc)
    text = synthetic_text(model, args.length, 0, word_pool(model.tokenizer, 0))
    ids = [model.tokenize(text, first=True)]
    out = {}
    for reading, merge in (("plain", False), ("K=4", True), ("plain", False), ("K=4", True)):
        r = infer_once(model, ids, merge, args.output_tokens, sample_memory=False)
        out[reading] = {k: r[k] for k in ("prefill_s", "ttft_s", "decode_s",
                                          "decode_tokens_per_s", "e2e_s", "compressed_tokens")}
        out[reading]["first_tokens"] = r["tokens"][0][:16]
    print(json.dumps(out), flush=True)


def export(quant: str, where: Path) -> Path:
    from ktm import KTMModel
    from ktm.llamacpp.export import GGUFOptions, export_gguf

    dest = where / quant
    if not dest.exists():
        export_gguf(KTMModel.load(READER), dest, opts=GGUFOptions(fold_type=TYPES[quant]))
    return dest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="results/bench/llamacpp_layouts.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--gguf", help=argparse.SUPPRESS)
    p.add_argument("--layouts", choices=("on", "off"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)

    from tqdm import tqdm

    from ktm.util.provenance import git_revision, versions

    where = Path(os.environ.get("KTM_CACHE", Path.home() / ".cache" / "ktm")) / "layouts"
    points = [(q, lay) for q in TYPES for lay in ("off", "on")]
    folders = {q: export(q, where) for q in TYPES}
    runs: dict = {pt: [] for pt in points}
    bar = tqdm(total=args.repeats * len(points), desc="llama.cpp layouts")
    for r in range(args.repeats):
        for q, lay in points if r % 2 == 0 else points[::-1]:
            cmd = [sys.executable, __file__, "--child", "--gguf", str(folders[q]),
                   "--layouts", lay, "--length", str(args.length), "--output-tokens",
                   str(args.output_tokens), "--threads", str(args.threads)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                runs[q, lay].append({"returncode": done.returncode,
                                     "stderr_tail": done.stderr[-600:]})
            else:
                runs[q, lay].append(json.loads(done.stdout.strip().splitlines()[-1]))
            bar.update()
    bar.close()
    rows = []
    for (q, lay), got in runs.items():
        ok = [g for g in got if "returncode" not in g]
        row = {"weights": q, "layouts": lay, "runs": len(got), "crashed": len(got) - len(ok),
               "crashes": [g for g in got if "returncode" in g]}
        for reading in ("plain", "K=4"):
            if ok:
                row[reading] = {k: statistics.median(g[reading][k] for g in ok)
                                for k in ("prefill_s", "ttft_s", "decode_s",
                                          "decode_tokens_per_s", "e2e_s")}
                row[reading]["compressed_tokens"] = ok[0][reading]["compressed_tokens"]
                row[reading]["first_tokens"] = ok[0][reading]["first_tokens"]
        rows.append(row)
    for q in TYPES:  # on against off, from the medians
        on, off = (next(r for r in rows if r["weights"] == q and r["layouts"] == lay)
                   for lay in ("on", "off"))
        for reading in ("plain", "K=4"):
            if reading in on and reading in off:
                on[reading]["prefill_speedup_vs_off"] = (off[reading]["prefill_s"]
                                                         / on[reading]["prefill_s"])
                on[reading]["decode_speedup_vs_off"] = (on[reading]["decode_tokens_per_s"]
                                                        / off[reading]["decode_tokens_per_s"])
                on[reading]["same_tokens_as_off"] = (on[reading]["first_tokens"]
                                                     == off[reading]["first_tokens"])
    record = {"reader": READER, "length": args.length, "output_tokens": args.output_tokens,
              "repeats": args.repeats, "threads": args.threads, "cpu": cpu_name(),
              "machine": platform.machine(), "versions": {**versions(), **llama_version()},
              "git": git_revision(),
              "command": "python results/bench/llamacpp_layouts.py " + " ".join(sys.argv[1:]),
              "rows": rows}
    out = Path(args.out)
    with tempfile.NamedTemporaryFile("w", dir=out.parent, delete=False, suffix=".tmp") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f.name, out)
    for row in rows:
        print(row["weights"], row["layouts"], "crashed", row["crashed"],
              {k: {m: round(v, 3) for m, v in row[k].items() if isinstance(v, float)}
               for k in ("plain", "K=4") if k in row})


def llama_version() -> dict:
    try:
        import llama_cpp
    except ImportError:
        return {}
    return {"llama_cpp_python": llama_cpp.__version__}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
