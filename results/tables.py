"""The measured numbers of README.md and results/README.md, generated from the result files.

Each table lives between two marker lines in those pages:

    <!-- generated: NAME (python results/tables.py) -->
    ...
    <!-- /generated -->

    python results/tables.py           # rewrite every block from the committed result files
    python results/tables.py --check   # exit 1 naming each block that differs from its files

A number in a page is then always the one in a file: the check runs in the test suite
(tests/test_results_tables.py), so an edited number or a changed result file fails there.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from ktm.errors import KTMError
from ktm.evaluation.report import report, score
from ktm.evaluation.result_rows import load_results
from ktm.util.fileio import write_text_atomic

RESULTS = Path(__file__).resolve().parent
REPO = RESULTS.parent
PAGES = (REPO / "README.md", RESULTS / "README.md", REPO / "docs" / "vllm.md",
         REPO / "docs" / "llamacpp.md", RESULTS / "question" / "README.md")
START = re.compile(r"^<!-- generated: ([\w-]+) \(python results/tables\.py\) -->$", re.M)
END = "<!-- /generated -->"

TASKS = RESULTS / "tasks" / "shared-budget"
# the headline's rows and the task columns, in the order they are shown
METHODS = ("uncompressed", "k2", "k4", "mean_pool", "selective_context", "llmlingua", "ltsc")
NAMES = {"uncompressed": "uncompressed", "k2": "**ktm K=2**", "k4": "**ktm K=4**",
         "mean_pool": "mean pooling (K=4)", "selective_context": "SelectiveContext (0.5)",
         "llmlingua": "LLMLingua (0.5)", "ltsc": "LTSC"}
TASK_COLUMNS = (("tree small", "balanced acc."), ("amazon", "balanced acc."),
                ("commitpack", "perplexity"))
BENCH = RESULTS / "bench" / "prefill_2048.json"
# the uncompressed fine-tune of each task with each KV press (results/presses/tasks.sh), beside
# ktm's rows; the presses' prefill from the press benchmark (results/presses/speed.json)
PRESS_TASKS = RESULTS / "presses" / "tasks"
PRESS_TASK_NAMES = {"tree": "tree small", "amazon": "amazon", "commitpack": "commitpack"}
PRESS_SPEED = RESULTS / "presses" / "speed.json"
PRESS_SPEED_MORE = RESULTS / "presses" / "speed-more.json"  # KVzip's among them
# the headline's press rows: the press ratio, at the KV share of the ktm row it stands beside
PRESS_HEADLINE = {0.5: "k2", 0.75: "k4"}
# long chats at a bounded number of positions (results/history/chat_bench.py, ttft.py)
HISTORY = RESULTS / "history"
# long answers, merged as they grow (results/generation/long_answers.py)
LONG_ANSWERS = RESULTS / "generation" / "long_answers.json"
# the shipped readers and the pretraining run each was packed from (results/readers/)
SHIPPED_READERS = {"smollm2-135m-k2": "k2", "smollm2-135m-k4": "k4e",
                   "smollm2-135m-k2-seq": "k2s", "smollm2-135m-k4-seq": "k4s2"}
# R of the consecutive-position K=4 reader on llama.cpp, by how its LoRA runs there
LLAMACPP_R = {"torch (fp32, the Q4_1 weights dequantised)": "k4s2_readability.json",
              "llama.cpp, LoRA folded into Q8_0 (the default)": "k4s2_readability_llamacpp.json",
              "llama.cpp, LoRA folded back into Q4_1 (--fold-type same)":
                  "k4s2_readability_llamacpp_foldq4.json",
              "llama.cpp, Q4_1 base + LoRA adapter (--no-fold-lora)":
                  "k4s2_readability_llamacpp_adapter.json"}
# ktm serve on both runtimes under concurrent clients (ktm bench --mode serve --backends)
SERVE_LLAMACPP = RESULTS / "bench" / "serve_llamacpp.json"
# contextual merging against the block encoder at equal CPU-minutes: each K=4 run continues the
# same consecutive-position reader (runs/readers/k4s) on the same windows (seed 5), the block
# encoder's run being the shipped reader's last stage (k4s2); each K=2 run continues the shipped
# K=2 consecutive-position reader (runs/readers/k2s) the same way. label: (K, run folder, name);
# the prefill benchmark is results/bench/context_prefill_NAME.json, R with a 4-token plain suffix
# at the run's end results/readers/context_suffix4/NAME.json
PROBES = RESULTS / "readers" / "probes"
CONTEXT_RUNS = {"block MLP (the paper's; k4s2, shipped as smollm2-135m-k4-seq)":
                    (4, RESULTS / "readers" / "runs" / "k4s2", "block"),
                "(c) + the block before (--context-blocks 1)": (4, PROBES / "k4x-conv1", "conv1"),
                "(a) + the LM's first layer (--context-layers 1)":
                    (4, PROBES / "k4x-layers1", "layers1"),
                "(a) + the LM's first 2 layers (--context-layers 2)":
                    (4, PROBES / "k4x-layers2", "layers2"),
                "(a) + the LM's first 4 layers (--context-layers 4)":
                    (4, PROBES / "k4x-layers4", "layers4"),
                "(a) 2 layers, ARC's pooled queries (--context-pool query)":
                    (4, PROBES / "k4x-layers2-query", "layers2-query"),
                "(a) 2 layers, lm only (--objectives lm)":
                    (4, PROBES / "k4x-layers2-lm", "layers2-lm"),
                "(a) 2 layers, distill + ae (--objectives distill ae=0.5)":
                    (4, PROBES / "k4x-layers2-distill", "layers2-distill"),
                "(a) 2 layers, lm + ae one per step (--objective-mix step: ARC's alternation)":
                    (4, PROBES / "k4x-layers2-alt", "layers2-alt"),
                "block MLP, 150 steps more (from smollm2-135m-k4-seq, seed 6)":
                    (4, PROBES / "k4x-block-more", "block-more"),
                "(a) 2 layers, pooled queries, 150 steps more (seed 6)":
                    (4, PROBES / "k4x-layers2-query-more", "layers2-query-more"),
                "(b) + 1 transformer layer of its own (--context-transformer 1)":
                    (4, PROBES / "k4x-mixer1", "mixer1"),
                "(b), its new weights at 1e-3 (--context-lr 1e-3)":
                    (4, PROBES / "k4x-mixer1-lr1e-3", "mixer1-lr1e-3"),
                "block MLP (K=2, continuing smollm2-135m-k2-seq)":
                    (2, PROBES / "k2x-block", "k2-block"),
                "(c) + the block before (K=2, --context-blocks 1)":
                    (2, PROBES / "k2x-conv1", "k2-conv1"),
                "(a) 2 layers, pooled queries (K=2, --context-layers 2 --context-pool query)":
                    (2, PROBES / "k2x-layers2-query", "k2-layers2-query")}
CONTEXT_SUFFIX = RESULTS / "readers" / "context_suffix4"
# the two runtimes side by side (ktm bench --backends torch llamacpp), per answer length
LLAMACPP_BENCH = {128: RESULTS / "bench" / "llamacpp_out128.json",
                  16: RESULTS / "bench" / "llamacpp_out16.json"}
# R of the same reader on vLLM's CPU build, fp32 and bf16, beside torch's (ktm eval --readability)
VLLM_R = {"torch (fp32)": "k4s2_readability.json", "vLLM, fp32": "k4s2_readability_vllm.json",
          "vLLM, bf16": "k4s2_readability_vllm_bf16.json"}
# vLLM's CPU build (ktm bench --backends vllm): one reader's timings, and ktm serve in front of it
VLLM_BENCH = RESULTS / "bench" / "vllm_out128.json"
VLLM_SERVE = (RESULTS / "bench" / "vllm_serve_k4.json", RESULTS / "bench" / "vllm_serve_k2.json")
# greedy answers before, under and after load and faults, per runtime (results/determinism.py)
DETERMINISM = RESULTS / "bench" / "determinism.json"


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def task_files() -> list[Path]:
    """The shared-budget experiment's eval rows (the task-distillation ``-teach`` rows are a
    lever, not a method)."""
    return sorted(p for p in TASKS.glob("*/*.json") if "-teach" not in p.name)


def press_task_rows() -> dict[str, list[dict]]:
    """Per task folder (tree, amazon, commitpack): its press rows, each with its press."""
    out: dict[str, list[dict]] = {}
    for path in sorted(PRESS_TASKS.glob("*/*.json")):
        row = json.loads(path.read_text())
        row["press"] = row["config"]["eval"]["backend"].get("press")
        if row["press"] is not None:  # uncompressed.json: the pressed checkpoint read plain
            out.setdefault(path.parent.name, []).append(row)
    return out


def quality(row: dict) -> float:
    """The task metric, higher better (balanced accuracy, or minus perplexity)."""
    return -row["perplexity"] if "perplexity" in row else row["balanced_accuracy"]


def best_press(rows: list[dict], ratio: float) -> dict | None:
    """The best press at ``ratio`` among those that kept the least KV there (to 2 %): a press
    that left a task's short prompts whole (SnapKV's 64-row window) kept more, and is not
    compared at equal KV."""
    picked = [r for r in rows if r["press"]["ratio"] == ratio]
    if not picked:
        return None
    least = min(r["kv_after"] for r in picked)
    return max((r for r in picked if r["kv_after"] <= least * 1.02), key=quality)


def metric_text(row: dict) -> str:
    return f"{row['perplexity']:.2f}" if "perplexity" in row else f"{row['balanced_accuracy']:.3f}"


def press_prefill() -> str:
    """The presses' prefill against plain's at 2,048 tokens (one input, the press scoring
    included), as a range over the presses benchmarked."""
    rows = [r for path in (PRESS_SPEED, PRESS_SPEED_MORE) if path.exists()
            for r in json.loads(path.read_text())
            if r.get("input_tokens") == 2048 and r["method"] != "ktm" and r.get("press")]
    lo, hi = (min(r["speedup_prefill"] for r in rows), max(r["speedup_prefill"] for r in rows))
    return f"{lo:.2f}–{hi:.2f}× (the whole prompt read)"


def headline() -> str:
    """Quality per task and the prefill speed-up at 2,048 tokens, K=2 and K=4 against
    uncompressed, the baselines and the best KV press at the KV each keeps."""
    rows, _ = load_results([str(p) for p in task_files()])
    by_task = score(rows)
    cells: dict[str, dict[str, str]] = {m: {} for m in METHODS}
    for task, _ in TASK_COLUMNS:
        found = {r["method"]: r for r in by_task.get(task, [])}
        for m in METHODS:
            r = found.get(m)
            if r is None:
                cells[m][task] = "–"
                continue
            quality = (f"{r['perplexity']:.2f}" if "perplexity" in r
                       else f"{r['balanced_accuracy']:.3f}")
            cells[m][task] = f"{quality} ({r['length_reduction']:.0%} shorter)"
    bench = [r for r in json.loads(BENCH.read_text()) if r.get("mode") == "infer"]
    speed = {"uncompressed": "1.00× (reference)"}
    for r in bench:
        if r["method"] != "uncompressed" and f"k{r['k']}" in METHODS:
            speed[f"k{r['k']}"] = f"{r['speedup_prefill']:.2f}× faster"
    lines = ["| method | " + " | ".join(f"{t}: {metric}" for t, metric in TASK_COLUMNS)
             + " | prefill at 2,048 tokens |", "|---" * (len(TASK_COLUMNS) + 2) + "|"]
    for m in METHODS:
        lines.append(f"| {NAMES[m]} | " + " | ".join(cells[m][t] for t, _ in TASK_COLUMNS)
                     + f" | {speed.get(m, '–')} |")
    pressed = press_task_rows()
    if pressed:
        folder = {v: k for k, v in PRESS_TASK_NAMES.items()}
        for ratio, beside in PRESS_HEADLINE.items():
            row_cells = []
            for task, _ in TASK_COLUMNS:
                best = best_press(pressed.get(folder[task], []), ratio)
                row_cells.append("–" if best is None else
                                 f"{metric_text(best)} ({best['press']['name']}; KV "
                                 f"{1 - best['kv_after'] / best['tokens_before']:.0%} smaller)")
            lines.append(f"| uncompressed + best KV press ({ratio:g}, beside "
                         f"{NAMES[beside].strip('*')}) | " + " | ".join(row_cells)
                         + f" | {press_prefill()} |")
    n = {t: next((r["n"] for r in by_task.get(t, [])), "–") for t, _ in TASK_COLUMNS}
    ratios = sorted({r["mlp_ratio"] for r in bench if r.get("mlp_ratio")})
    files = [f"{rel(TASKS)}/*/*.json", rel(BENCH)]
    if pressed:
        files += [f"{rel(PRESS_TASKS)}/*/*.json", rel(PRESS_SPEED), rel(PRESS_SPEED_MORE)]
    notes = [
        "Embedded SmolLM2-135M, fp32, 2 CPU cores; every method fine-tuned with the same LoRA and "
        "budget, ktm from the shipped readers. Eval examples: tree small "
        f"{n['tree small']}, amazon {n['amazon']}, commitpack {n['commitpack']}.",
        "Balanced accuracy: higher is better (0.5 is chance); perplexity: lower is better.",
        "Shorter: the share of prompt tokens the LM no longer reads (for ktm, also the KV "
        "dropped).",
        f"Prefill (`ktm bench`): encoder included (MLP ratio {', '.join(f'{x:g}' for x in ratios)}"
        "), batch 1, median of paired repeats."]
    if pressed:
        notes.append("A KV press (kvpress) reads the whole prompt of the uncompressed fine-tune, "
                     "then keeps part of its context's KV. Its cell: the best press at that ratio "
                     "among those that pressed every prompt (SnapKV leaves prompts under its "
                     "window whole), and the KV dropped; its prefill: the presses' range in the "
                     "press benchmark at 2,048 tokens (KVzip re-reads the context: the low end).")
    notes.append("Files: " + ", ".join(f"`{f}`" for f in files) + ".")
    return "\n".join(lines) + "\n\n" + "\n".join(
        textwrap.fill(note, 99, initial_indent="- ", subsequent_indent="  ",
                      break_long_words=False, break_on_hyphens=False) for note in notes)


def press_tasks() -> str:
    """Per task: the uncompressed fine-tune with each press at ratio 0.5 and 0.75 beside ktm
    K=2 and K=4 (fine-tuned from the shipped readers), by the share of the prompt's KV kept."""
    rows, _ = load_results([str(p) for p in task_files()])
    by_task = score(rows)
    out = []
    for folder, pressed in press_task_rows().items():
        task = PRESS_TASK_NAMES[folder]
        found = {r["method"]: r for r in by_task.get(task, [])}
        metric = "perplexity" if "perplexity" in pressed[0] else "balanced acc."
        out += [f"### {task}", "", f"| reading | KV kept | {metric} |", "|---|---|---|"]
        own = PRESS_TASKS / folder / "uncompressed.json"  # the checkpoint pressed, read plain
        if own.exists():
            found["uncompressed"] = json.loads(own.read_text())
        for m in ("uncompressed", "k2", "k4"):
            if m in found:
                r = found[m]
                out.append(f"| {NAMES[m]} | {r['tokens_after'] / r['tokens_before']:.0%} | "
                           f"{metric_text(r)} |")
        for r in sorted(pressed, key=lambda r: (r["press"]["ratio"], -quality(r))):
            out.append(f"| uncompressed + {r['press']['name']} {r['press']['ratio']:g} | "
                       f"{r['kv_after'] / r['tokens_before']:.0%} | {metric_text(r)} |")
        out.append("")
    return "\n".join(out)


def tasks() -> str:
    """``ktm report``'s tables over the shared-budget experiment, as the command prints them."""
    return report([str(p) for p in task_files()])


def readers() -> str:
    """Readability R of the shipped readers on the held-out sets (torch; and on llama.cpp with
    the shipped Q4_1 base and the LoRA folded in, for the consecutive-position readers that run
    there)."""
    lines = ["| reader | K | positions | R code | R reviews | on llama.cpp (Q4_1 base, LoRA "
             "folded into Q8_0): code / reviews | held-out windows | files |",
             "|---|---|---|---|---|---|---|---|"]
    for name, run in SHIPPED_READERS.items():
        path = RESULTS / "readers" / f"{run}_readability.json"
        if not path.is_file():
            continue
        row = json.loads(path.read_text())
        r = row["readability"]
        spread = row["config"]["model"]["config"]["spread_positions"]
        llama = path.with_name(f"{run}_readability_llamacpp.json")
        files = f"`{rel(path)}`"
        on_llama = "– (spread positions)" if spread else "–"
        if llama.is_file():
            lr = json.loads(llama.read_text())["readability"]
            on_llama = f"{lr['code']['R']:.2f} / {lr['reviews']['R']:.2f}"
            files += f", `{rel(llama)}`"
        lines.append(f"| {name} | {row['k']} | {'spread' if spread else 'consecutive'} | "
                     f"{r['code']['R']:.2f} | {r['reviews']['R']:.2f} | {on_llama} | "
                     f"{r['code']['windows']} + {r['reviews']['windows']} | {files} |")
    return "\n".join(lines)


def llamacpp_r(runs: dict[str, str] = LLAMACPP_R) -> str:
    """The K=4 consecutive-position reader's R on torch and on llama.cpp, per way of running its
    LoRA there (``ktm eval --readability``, ``--backend llamacpp``)."""
    lines = ["| runtime | R code | R reviews | revision | file |", "|---|---|---|---|---|"]
    for label, name in runs.items():
        path = RESULTS / "readers" / name
        row = json.loads(path.read_text())
        r = row["readability"]
        lines.append(f"| {label} | {r['code']['R']:.3f} | {r['reviews']['R']:.3f} | "
                     f"`{row['git'][:7]}` | `{rel(path)}` |")
    return "\n".join(lines)


def llamacpp() -> str:
    """End to end on both runtimes: every method on torch and on llama.cpp, per prompt length
    and answer length, with the speed-ups against plain llama.cpp (``ktm bench --backends``)."""
    lines = ["| tokens in + out | method | runtime | tokens read | time to first token | decode "
             "| end to end | vs plain llama.cpp |", "|---|---|---|---|---|---|---|---|"]
    files = []
    for out, path in LLAMACPP_BENCH.items():
        if not path.is_file():
            continue
        files.append(path)
        rows = [r for r in json.loads(path.read_text()) if r.get("mode") == "infer"]
        for n in sorted({r["input_tokens"] for r in rows}):
            at = [r for r in rows if r["input_tokens"] == n]
            plain = next(r for r in at if r["method"] == "uncompressed"
                         and r["backend"] == "llamacpp")
            for r in at:
                name = "plain" if r["method"] == "uncompressed" else f"K={r['k']}"
                lines.append(
                    f"| {n:,} + {out} | {name} | {r['backend']} | {r['compressed_tokens']:,} | "
                    f"{r['ttft_s']:.2f} s | {r['decode_tokens_per_s']:.0f} tok/s | "
                    f"{r['e2e_s']:.2f} s | {plain['e2e_s'] / r['e2e_s']:.2f}× |")
    if not files:
        return "(no result files yet: see the command below)"
    return "\n".join(lines) + "\n\nFiles: " + ", ".join(f"`{rel(p)}`" for p in files) + "."


def bench() -> str:
    """Prefill speed-ups and the KV cache at 2,048 tokens (``ktm bench``)."""
    lines = ["| method | K | prefill (s) | speed-up | time to first token | KV cache |",
             "|---|---|---|---|---|---|"]
    for r in json.loads(BENCH.read_text()):
        if r.get("mode") != "infer":
            continue
        lines.append(f"| {r['method']} | {r['k']} | {r['prefill_s']:.2f} | "
                     f"{r['speedup_prefill']:.2f}× | {r['speedup_ttft']:.2f}× | "
                     f"{r['kv_cache_bytes'] / 2**20:.0f} MiB |")
    return "\n".join(lines) + f"\n\nFile: `{rel(BENCH)}`."


def serve_llamacpp() -> str:
    """``ktm serve`` on torch and on llama.cpp: throughput and latency per number of clients,
    and the time to first token of a repeated context (its merged KV reused)."""
    rows = json.loads(SERVE_LLAMACPP.read_text())
    lines = ["| runtime | prompt | clients | requests/s | latency p50 | time to first token p50 "
             "| output tokens/s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] != "load":
            continue
        what = "plain" if r["method"] == "uncompressed" else f"K={r['k']}"
        lines.append(f"| {r['backend']} | {what} | {r['clients']} | {r['requests_per_s']:.2f} | "
                     f"{r['latency_p50_s']:.2f} s | {r['ttft_p50_s']:.2f} s | "
                     f"{r['output_tokens_per_s']:.1f} |")
    lines += ["", "| runtime | repeated context: first token, new | again (KV reused) |",
              "|---|---|---|"]
    for r in rows:
        if r["kind"] == "prefix":
            lines.append(f"| {r['backend']} | {r['ttft_uncached_s']:.2f} s | "
                         f"{r['ttft_cached_s']:.2f} s |")
    return "\n".join(lines) + f"\n\nFile: `{rel(SERVE_LLAMACPP)}`."


def vllm_r() -> str:
    """The same reader's R on vLLM in fp32 and bf16, beside torch's."""
    return llamacpp_r(VLLM_R)


def vllm() -> str:
    """Plain vLLM against K=2 and K=4 on vLLM: prefill, first token, decode, end to end."""
    if not VLLM_BENCH.is_file():
        return "(no result file yet: see the command below)"
    rows = json.loads(VLLM_BENCH.read_text())
    lines = ["| tokens in + out | method | positions read | time to first token | decode | "
             "end to end | first token vs plain | end to end vs plain | encoder: merged "
             "positions/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = "plain" if r["method"] == "uncompressed" else f"K={r['k']}"
        enc = ("–" if r["method"] == "uncompressed"
               else f"{r['compressed_tokens'] / r['encoder_s']:,.0f}")
        lines.append(f"| {r['input_tokens']:,} + {r['output_tokens']} | {name} | "
                     f"{r['compressed_tokens']:,} | {r['ttft_s']:.2f} s | "
                     f"{r['decode_tokens_per_s']:.0f} tok/s | {r['e2e_s']:.2f} s | "
                     f"{r['speedup_ttft']:.2f}× | {r['speedup_e2e']:.2f}× | {enc} |")
    return "\n".join(lines) + f"\n\nFile: `{rel(VLLM_BENCH)}`."


def serve_vllm() -> str:
    """``ktm serve --backend vllm`` under 1, 4 and 16 clients, per reader."""
    files = [p for p in VLLM_SERVE if p.is_file()]
    if not files:
        return "(no result files yet: see the commands below)"
    lines = ["| prompt | clients | requests/s | vs plain | latency p50 | time to first token p50 "
             "| output tokens/s |", "|---|---|---|---|---|---|---|"]
    rows = [r for p in files for r in json.loads(p.read_text()) if r["kind"] == "load"]
    plain = {r["clients"]: r["requests_per_s"] for r in rows if r["method"] == "uncompressed"}
    for r in sorted(rows, key=lambda r: (r["k"] or 0, r["clients"])):
        what = "plain" if r["method"] == "uncompressed" else f"K={r['k']}"
        ratio = r["requests_per_s"] / plain[r["clients"]] if r["clients"] in plain else None
        lines.append(f"| {what} | {r['clients']} | {r['requests_per_s']:.2f} | "
                     + (f"{ratio:.2f}× | " if ratio else "– | ")
                     + f"{r['latency_p50_s']:.2f} s | {r['ttft_p50_s']:.2f} s | "
                     f"{r['output_tokens_per_s']:.1f} |")
    lines += ["", "| reader | repeated context: first token, new | again (vLLM's prefix cache) |",
              "|---|---|---|"]
    for r in (r for p in files for r in json.loads(p.read_text()) if r["kind"] == "prefix"):
        lines.append(f"| K={r['k']} | {r['ttft_uncached_s']:.2f} s | {r['ttft_cached_s']:.2f} s |")
    return "\n".join(lines) + "\n\nFiles: " + ", ".join(f"`{rel(p)}`" for p in files) + "."


def determinism() -> str:
    """Greedy answers that changed under load and after it, and the concurrent burst's time."""
    if not DETERMINISM.is_file():
        return "(no result file yet: see the command below)"
    lines = ["| runtime | changed under load | changed after load | burst of 32: wall time |",
             "|---|---|---|---|"]
    for r in json.loads(DETERMINISM.read_text()):
        lines.append(f"| {r['runtime']} | {r['changed_under_load']} of {r['concurrent']} | "
                     f"{r['changed_after_load']} of {r['prompts']} | {r['burst_wall_s']:.1f} s |")
    return "\n".join(lines) + f"\n\nFile: `{rel(DETERMINISM)}`."


def context() -> str:
    """R on held-out code / reviews (32 windows each) against CPU-minutes for the contextual
    encoders and the block encoder, from the runs' metrics.jsonl (``ktm pretrain``), with the
    end's R read with a 4-token plain suffix (``ktm eval --plain-suffix 4``) where measured."""
    lines = ["| K | encoder | step 50 | step 100 | step 150 | step 150, 4-token plain suffix "
             "| files |", "|---|---|---|---|---|---|---|"]
    speed = ["| K | encoder | prefill speed-up, 2,048 tokens | 4,096 tokens | encoder's share of "
             "the prefill | file |", "|---|---|---|---|---|---|"]
    for label, (k, folder, name) in CONTEXT_RUNS.items():
        bench_file = RESULTS / "bench" / f"context_prefill_{name}.json"
        if bench_file.is_file():
            rows = {r["input_tokens"]: r for r in json.loads(bench_file.read_text())
                    if r["method"] == "ktm"}
            speed.append(f"| {k} | {label} | {rows[2048]['speedup_prefill']:.2f}× | "
                         f"{rows[4096]['speedup_prefill']:.2f}× | "
                         f"{rows[2048]['encoder_share']:.0%} / {rows[4096]['encoder_share']:.0%}"
                         f" | `{rel(bench_file)}` |")
        path = folder / "metrics.jsonl"
        if not path.is_file():
            continue
        evals = {}
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if "eval" in row:
                evals[row["step"]] = row
        cells = []
        for step in (50, 100, 150):
            row = evals.get(step)
            if row is None:
                cells.append("–")
                continue
            e = row["eval"]
            cells.append(f"{e['code']['R']:.3f} / {e['reviews']['R']:.3f} "
                         f"({row['cpu_s'] / 60:.0f} CPU-min)")
        files = [f"`{rel(path)}`"]
        suffix = CONTEXT_SUFFIX / f"{name}.json"
        if suffix.is_file():
            r = json.loads(suffix.read_text())["readability"]
            cells.append(f"{r['code']['R']:.3f} / {r['reviews']['R']:.3f}")
            files.append(f"`{rel(suffix)}`")
        else:
            cells.append("–")
        lines.append(f"| {k} | {label} | {' | '.join(cells)} | {', '.join(files)} |")
    return "\n".join(lines + [""] + speed + [""] + context_ablation())


def context_ablation() -> list[str]:
    """R at a contextual run's end with its context branch switched off, and that branch's
    share of each merged vector (``results/readers/context_ablation.py``)."""
    lines = ["| run | R code / reviews | context branch off | the branch's share of a merged "
             "vector (median) | file |", "|---|---|---|---|---|"]
    for path in sorted(RESULTS.glob("readers/context_ablation_*.json")):
        for r in json.loads(path.read_text())["rows"]:
            c, v = r["code"], r["reviews"]
            lines.append(f"| {r['name']} (K={r['k']}) | {c['R']:.3f} / {v['R']:.3f} | "
                         f"{c['R_context_off']:.3f} / {v['R_context_off']:.3f} | "
                         f"{c['branch_share_median']:.1%} / {v['branch_share_median']:.1%} | "
                         f"`{rel(path)}` |")
    return lines


def committed_at(path: Path) -> int:
    """When git first committed ``path`` (seconds; a file not yet committed counts as newest)."""
    out = subprocess.run(["git", "log", "--diff-filter=A", "--format=%ct", "--", str(path)],
                         cwd=REPO, capture_output=True, text=True).stdout.split()
    return int(out[-1]) if out else 2**62


def demo() -> str:
    """The demo's accuracy before and after its fine-tune over every seed committed, and its
    long prompt where the run read one."""
    files = sorted((RESULTS / "demo").glob("demo-seed*.json"))
    files += [max((RESULTS / "demo").glob("demo-fresh-venv-*.json"), key=committed_at)]
    files += sorted((RESULTS / "demo").glob("demo-k*.json"))  # from another reader
    lines = ["| run | start (balanced acc.) | after fine-tuning | fine-tuning (s) | file |",
             "|---|---|---|---|---|"]
    long = []
    for path in files:
        d = json.loads(path.read_text())
        start = d["config"].get("reader", "auto")
        run = f"seed {d['config']['seed']}" + ("" if start == "auto" else f", from {start}")
        lines.append(f"| {run} | {d['start']['balanced_accuracy']:.3f} | "
                     f"{d['trained']['balanced_accuracy']:.3f} | {d['train_s']:.0f} | "
                     f"`{rel(path)}` |")
        if d.get("long_prompt"):
            long.append((path, d["long_prompt"]))
    for path, lp in long:
        lines += ["", f"Its long prompt ({lp['merged']['tokens_in']} tokens of {lp['sources']}, "
                      f"a {lp['answer_tokens']}-token answer, read by {lp['model']}; R = "
                      + ("–" if lp["R"] is None else f"{lp['R']:.2f}")
                      + f" over {lp['R_windows']} such windows; `{rel(path)}`):", "",
                  "| prompt | tokens read | time to first token | whole answer | decode |",
                  "|---|---|---|---|---|"]
        for key in ("merged", "plain"):
            o = lp[key]
            lines.append(f"| {key} | {o['tokens_out']} | {o['ttft_s']:.2f} s | "
                         f"{o['e2e_s']:.2f} s | {o['decode_tokens_per_s']:.1f} tokens/s |")
    return "\n".join(lines)


def _chat_rows(rows: list[dict], note: str = "") -> list[str]:
    return [f"| {r['reading']}{note} | {r['positions']:.0f} | {r['kv_kept']:.0%} | "
            f"{r['R_recall']:.2f} | {r['R_continuation']:.2f} | {r['cpu_s']:.0f} |"
            for r in rows]


def history() -> str:
    """What each way of bounding a chat keeps of its first turn (``chat.json``), and the time
    to first token per turn with the history policy, prefix cache on and off (``ttft.json``)."""
    rows = json.loads((HISTORY / "chat.json").read_text())
    cfg = rows[0]["config"]
    out = [f"{rows[0]['chats']} chats of {cfg['turns']} user turns (turn 1: a held-out code file "
           f"of {cfg['doc_tokens']} tokens; then stdlib files of {cfg['filler_tokens']}), read "
           f"within {cfg['budget_share']:.0%} of the full chat's positions or the fewest the "
           f"policy reaches at the reader's K; reader `{cfg['reader']}`; revision "
           f"{rows[0]['git'][:7]}.", "",
           "| reading | positions read | KV kept | recall R (turn 1) | continuation R (turn 1) "
           "| CPU s |", "|---|---|---|---|---|---|"]
    out += _chat_rows(rows)
    pressed = HISTORY / "chat-press.json"
    if pressed.exists():  # the history policy pressing instead of merging, at the same budgets
        more = json.loads(pressed.read_text())
        out += _chat_rows([r for r in more if r["reading"].startswith("ktm+")],
                          f" (`chat-press.json`, revision {more[0]['git'][:7]})")
    quarter = HISTORY / "chat-quarter.json"
    if quarter.exists():
        more = json.loads(quarter.read_text())
        refused = next((r for r in more if r["reading"] == "ktm"), {}).get("refused", 0)
        out += ["", f"The same chats within {more[0]['config']['budget_share']:.0%} of the full "
                    f"chat's positions, under what merging reaches (it refuses {refused} of "
                    f"{2 * more[0]['chats']} readings there; `chat-quarter.json`, revision "
                    f"{more[0]['git'][:7]}):", "",
                "| reading | positions read | KV kept | recall R (turn 1) | continuation R "
                "(turn 1) | CPU s |", "|---|---|---|---|---|---|"]
        out += _chat_rows([r for r in more if "positions" in r])
        chat_quarter = HISTORY / "chat-reader-quarter.json"
        if chat_quarter.exists():  # the same, the policy pressing read by the chat reader
            rows = json.loads(chat_quarter.read_text())
            out += _chat_rows([r for r in rows if r["reading"].startswith("ktm+")],
                              f" (`{rows[0]['config']['reader']}`, `{chat_quarter.name}`, "
                              f"revision {rows[0]['git'][:7]})")
    readers = [HISTORY / f for f in ("chat-shipped-reader.json", "chat-reader.json")]
    if all(f.exists() for f in readers):  # the policy read by a reader trained on chats
        both = [json.loads(f.read_text()) for f in readers]
        out += ["", f"The same chats at {both[0][0]['config']['budget_share']:.0%}, the history "
                    "policy read by the shipped reader and by a reader pretrained further on "
                    "chat-shaped windows (`ktm pretrain --chat-share`; "
                    f"`{readers[0].name}`, revision {both[0][0]['git'][:7]}, and "
                    f"`{readers[1].name}`, revision {both[1][0]['git'][:7]}):", "",
                "| reader | reading | positions read | KV kept | recall R (turn 1) | "
                "continuation R (turn 1) | CPU s |", "|---|---|---|---|---|---|---|"]
        for rows in both:
            name = rows[0]["config"]["reader"]
            out += [f"| `{name}` " + line for line in
                    _chat_rows([r for r in rows if r["reading"].startswith("ktm")])]
    path = HISTORY / "ttft.json"
    pressed_path = HISTORY / "ttft-press.json"
    pressed_ttft = ({t["turn"]: t for t in json.loads(pressed_path.read_text())}
                    if pressed_path.exists() else {})
    ahead_path = HISTORY / "ttft-ahead.json"
    ahead = ({t["turn"]: t for t in json.loads(ahead_path.read_text())}
             if ahead_path.exists() else {})
    if path.exists():
        turns = json.loads(path.read_text())
        cfg = turns[0]["config"]
        out += ["", f"One chat turn by turn against `ktm serve --history-budget "
                    f"{cfg['history_budget']}` ({cfg['turns']} turns, stdlib files of "
                    f"{cfg['filler_tokens']} tokens, {cfg['answer_tokens']}-token answers; "
                    f"revision {turns[0]['git'][:7]}): time to first token, positions read and "
                    "rows the prefix cache served.", "",
                "| turn | prompt tokens | positions | TTFT s, cache on | rows served | "
                "TTFT s, cache off |" + (" TTFT s, pressed |" if pressed_ttft else "")
                + (" TTFT s, read ahead | rows served, read ahead |" if ahead else ""),
                "|---|---|---|---|---|---|" + ("---|" if pressed_ttft else "")
                + ("---|---|" if ahead else "")]
        on = [t for t in turns if t["prefix_cache_mb"] > 0]
        off = {t["turn"]: t for t in turns if t["prefix_cache_mb"] == 0}
        for t in on:
            o, p = off.get(t["turn"]), pressed_ttft.get(t["turn"])
            out.append(f"| {t['turn']} | {t['prompt_tokens']} | {t['positions']} | "
                       f"{t['ttft_s']:.2f} | {t['cached_rows']} | "
                       f"{'–' if o is None else format(o['ttft_s'], '.2f')} |"
                       + (f" {'–' if p is None else format(p['ttft_s'], '.2f')} |"
                          if pressed_ttft else "")
                       + (_ahead_cells(ahead.get(t["turn"])) if ahead else ""))
        if pressed_ttft:
            first = next(iter(pressed_ttft.values()))
            out += ["", f"Pressed: the same server with `--history-press "
                        f"{first['config']['history_press']}` (the older messages read plain "
                        f"and pressed to the budget, every turn read whole; `ttft-press.json`, "
                        f"revision {first['git'][:7]})."]
        if ahead:
            first = next(iter(ahead.values()))
            out += ["", f"Read ahead: the same server with `--history-ahead` (after each "
                        f"answer it reads the next turn as it guesses it), the client pausing "
                        f"{first['config']['think_s']:g} s between an answer and its next "
                        f"message as a user would (`ttft-ahead.json`, revision "
                        f"{first['git'][:7]})."]
    return "\n".join(out)


def _ahead_cells(t: dict | None) -> str:
    return " – | – |" if t is None else f" {t['ttft_s']:.2f} | {t['cached_rows']} |"


def long_answers() -> str:
    """Long answers at a bounded KV (``long_answers.json``): merging the answer as it grows
    beside the full cache, truncation at the same KV and kvpress's DecodingPress."""
    rows = json.loads(LONG_ANSWERS.read_text())
    cfg = rows[0]["config"]
    out = [f"{rows[0]['windows']} held-out code windows: a {cfg['prompt_tokens']}-token prompt "
           f"read plain, then its next {cfg['answer_tokens']} tokens fed back one by one; "
           f"merge window {cfg['window']}; NLL over the answer tokens after the first "
           f"{cfg['window']}; revision {rows[0]['git'][:7]}.", "",
           "| reader | reading | mean KV | final KV | NLL / token | R vs truncation | CPU s |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| `{r['reader']}` | {r['reading']} | {r['mean_kv']:.0f} | "
                   f"{r['final_kv']:.0f} | {r['nll']:.3f} | {r['R_vs_truncate']:.2f} | "
                   f"{r['cpu_s']:.0f} |")
    return "\n".join(out)


# questions about long documents (results/question/run.sh): TASK/LENGTH/METHOD.json
QUESTION = RESULTS / "question"
QUESTION_NAMES = {
    "plain": "plain (the base model)", "truncate": "truncation (its last 30 %)",
    "bm25": "BM25 lines (30 % kept, the base model)",
    "truncate-window": "truncation to the window (last 8,000 tokens)",
    "k2": "ktm K=2 (k2-seq)", "k4": "ktm K=4 (k4-seq)",
    "k4-question": "ktm K=4 reader (k4-seq), question allocator (ratio 4)",
    "qa-k4": "question reader (k4-qa), K=4",
    "qa-question": "**question reader (k4-qa): ratio 4, question allocator**",
    "qa-window": "**question reader (k4-qa), question allocator, ≤ 8,192 positions**",
    "qa-deep": "**question reader (k4-qa) at ratio 8, its deeper level, as fitted**",
    "qachat-question": "question reader for chats (k4-qa-chat): ratio 4, question allocator",
    "qachat-deep": "question reader for chats (k4-qa-chat) at ratio 8, its deeper level",
    "qacode-question": "question reader for code (k4-qa-chat fine-tuned on code questions): "
                       "ratio 4, question allocator",
    "qacode-window": "question reader for code, question allocator, ≤ 8,192 positions",
    "qanat-question": "k4-qa-chat fine-tuned on the four natural kinds: ratio 4, question "
                      "allocator",
    "qa-scope": "question reader (k4-qa), scope allocator",
    "qacode-scope": "k4-qa-chat + assign, scope allocator",
    "code-question": "**reader for code (k4-qa-code): ratio 4, scope allocator**",
    "code-window": "**reader for code (k4-qa-code), scope allocator, ≤ 8,192 positions**",
    "llmlingua": "LLMLingua (30 % kept)", "longllmlingua": "LongLLMLingua (30 % kept)",
    "expected_attention": "ExpectedAttention (30 % of KV)", "snapkv": "SnapKV (30 % of KV)",
    "tova": "TOVA (30 % of KV)", "streaming_llm": "StreamingLLM (30 % of KV)",
    "kvzip": "KVzip (30 % of KV)",
    "snapkv-question": "SnapKV, the question in its window (30 % of KV)"}


def question_rows(task: str, length: int) -> dict[str, dict]:
    """The rows of one task and document length, by method."""
    folder = QUESTION / task / str(length)
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def _question_cells(r: dict | None) -> list[str]:
    """Hits, the KV kept (of the prompt's tokens) and the seconds to the first token."""
    if r is None:
        return ["–"] * 3
    first = (r["compression_s"] + r["prefill_s"]) / r["n"]
    return [f"{r['accuracy']:.2f}", f"{r['kv_after'] / r['tokens_before']:.0%}",
            f"{first:.2f}"]


def question_table(task: str, lengths: tuple[int, ...], methods: tuple[str, ...]) -> str:
    rows = {n: question_rows(task, n) for n in lengths}
    out = ["| reading | " + " | ".join(f"{n:,} tokens: found | KV kept | first token (s)"
                                      for n in lengths) + " |",
           "|---" * (1 + 3 * len(lengths)) + "|"]
    for m in methods:
        if not any(m in rows[n] for n in lengths):
            continue
        cells = [c for n in lengths for c in _question_cells(rows[n].get(m))]
        out.append(f"| {QUESTION_NAMES[m]} | " + " | ".join(cells) + " |")
    ns = sorted({r["n"] for n in lengths for r in rows[n].values()})
    out.append("")
    out.append(f"Questions: {', '.join(map(str, ns))} per length, the same documents for every "
               "reading; found: the share answered with every asked value; KV kept: the "
               "positions whose keys and values the LM holds after the prompt, over its tokens "
               "(the question included); first token: merging, allocating, compressing and "
               "prefilling, one thread, per question.")
    return "\n".join(out)


def question_headline() -> str:
    """The front page's needle: found by plain, uniform K=4, the best press and the question
    reader at 1,024 and 4,096 tokens, and past the model's window."""
    near = {n: question_rows("needle", n) for n in (1024, 4096)}
    far = question_rows("needle", 32768)
    cols = ["1,024 tokens", "4,096 tokens", "32,768 tokens (window: 8,192)"]
    lines = ["| reading | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]

    def cell(r: dict | None) -> str:
        if r is None:
            return "–"
        first = (r["compression_s"] + r["prefill_s"]) / r["n"]
        return f"{r['accuracy']:.2f} ({r['kv_after'] / r['tokens_before']:.0%} KV, {first:.1f} s)"

    presses = ("expected_attention", "snapkv", "tova", "streaming_llm", "kvzip",
               "snapkv-question")
    for m, far_m in (("plain", "truncate-window"), ("k4", None), ("best press", None),
                     ("qa-question", "qa-window")):
        cells = []
        for n in (1024, 4096):
            if m == "best press":
                found = [near[n][p] for p in presses if p in near[n]]
                best = max(found, key=lambda r: r["accuracy"], default=None)
                cells.append("–" if best is None else cell(best)[:-1] + f"; {best['method']})")
            else:
                cells.append(cell(near[n].get(m)))
        cells.append(cell(far.get(far_m)) if far_m else "–")
        name = {"plain": "plain (past the window: its last 8,000 tokens)",
                "best press": "the best KV press (30 % of KV)"}.get(m) or QUESTION_NAMES[m]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "A needle (a line of a fact) at every depth of held-out code, then its question "
              "plain: the share found, the KV kept and the seconds to the first token on one "
              "thread. Files and every other reading: [results/question/README.md]"
              "(results/question/README.md)."]
    return "\n".join(lines)


def question() -> str:
    """A needle at 1,024 and 4,096 tokens: every reading side by side."""
    return question_table("needle", (1024, 4096), tuple(QUESTION_NAMES))


def question_tasks() -> str:
    """The other question tasks at 1,024 tokens (and 4,096 where run): the main readings."""
    main = ("plain", "truncate", "bm25", "k4", "qa-k4", "qa-question", "longllmlingua",
            "expected_attention", "kvzip")
    out = []
    for task, title in (("needle-multikey", "needle, 4 keys (one asked)"),
                        ("needle-multivalue", "needle, 4 values (all asked)"),
                        ("vartrack", "variable tracking (4 hops)"),
                        ("codeqa", "code: what a function returns"),
                        ("codeqa-methods", "code: the methods a class defines")):
        lengths = tuple(n for n in (1024, 4096) if question_rows(task, n))
        if lengths:
            out += [f"**{title}**", "", question_table(task, lengths, main), ""]
    return "\n".join(out) or "(no rows yet)"


NATURAL = (("codeqa-assign", "what a module's or class's name is set to"),
           ("codeqa-params", "which parameters a function takes"),
           ("codeqa-default", "a parameter's default value"),
           ("codeqa-within", "which function a quoted line is in"))
NATURAL_METHODS = {"plain": "plain", "truncate": "truncation", "bm25": "BM25 lines",
                   "qa-question": "question reader", "qa-wide": "question reader, K=8 rest",
                   "qachat-question": "k4-qa-chat", "qacode-question": "k4-qa-chat + assign",
                   "qanat-question": "k4-qa-chat + natural",
                   "qa-scope": "question reader, scope", "qacode-scope": "+ assign, scope",
                   "code-question": "**k4-qa-code (scope)**"}


def question_natural() -> str:
    """Natural questions about real code (nothing inserted): hits of each reading by kind and
    the positions kept."""
    rows = {task: question_rows(task, 1024) for task, _ in NATURAL}
    methods = [m for m in NATURAL_METHODS if any(m in r for r in rows.values())]
    if not methods:
        return "(no rows yet)"
    out = ["| question (1,024 tokens) | " + " | ".join(NATURAL_METHODS[m] for m in methods)
           + " |", "|---" * (len(methods) + 1) + "|"]
    kept: dict[str, list[float]] = {}
    for task, title in NATURAL:
        r = rows[task]
        if not r:
            continue
        cells = []
        for m in methods:
            row = r.get(m)
            cells.append("–" if row is None else
                         f"{round(row['accuracy'] * row['n'])} / {row['n']}")
            if row is not None:
                kept.setdefault(m, []).append(row["kv_after"] / row["tokens_before"])
        out.append(f"| {title} | " + " | ".join(cells) + " |")
    out.append("| KV kept (mean of the kinds) | " + " | ".join(
        f"{sum(kept[m]) / len(kept[m]):.0%}" if m in kept else "–" for m in methods) + " |")
    out += ["", "Hits of 20 questions a kind, the same documents for every reading "
            "(`results/question/codeqa-KIND/1024/METHOD.json`); the question reader is k4-qa at "
            "ratio 4 with the question allocator, its K=8 rest the same at ratio 4.01 (its units "
            "the deeper level's, so more of the question's lines are read plain at the same "
            "positions); k4-qa-chat the question reader for chats as it loads; "
            "\"+ assign\" and \"+ natural\" k4-qa-chat fine-tuned on questions of the "
            "training code, `assign` ones (50 steps) or the four kinds in turn (100 steps; "
            "`results/question/train_code_reader.sh KIND`), read with the question allocator; "
            "\"scope\": the same read with the scope allocator; "
            "k4-qa-code the natural run shipped, read as it loads: ratio 4, the scope "
            "allocator (a question's lines plain with the `def` and `class` lines they sit "
            "in); truncation and BM25 keep 30 % of the tokens, read by the base model."]
    return "\n".join(out)


def question_remainder() -> str:
    """Each question reader against its own plain lines with the merged rest dropped
    (results/question/remainder*.json, results/question/remainder.py)."""
    paths = sorted(QUESTION.glob("remainder*.json"))
    if not paths:
        return "(no rows yet)"
    out = ["| question (1,024 tokens) | reader | ratio | reader: plain lines and merged rest | "
           "its plain lines alone | plain tokens (mean) | positions (mean) |",
           "|---" * 7 + "|"]
    titles = {f"codeqa:variant={t.split('-')[1]}": title for t, title in NATURAL}
    titles["needle"] = "the template needle"
    commands = []
    for path in paths:
        rows = json.loads(path.read_text())
        cfg = rows[0]["config"]
        name = f"`{_reader_label(cfg['reader'])}`"
        for r in rows:
            out.append(f"| {titles.get(r['kind'], r['kind'])} | {name} | {r['ratio']:g} | "
                       f"{r['reader_hits']} / {r['n']} | {r['lines_alone_hits']} / {r['n']} | "
                       f"{r['plain_tokens_mean']:.0f} | {r['positions_mean']:.0f} |")
        ratios = " ".join(f"{x:g}" for x in cfg["ratios"])
        commands.append(f"`python results/question/remainder.py --reader {cfg['reader']} "
                        f"--ratios {ratios} --out results/question/{path.name}`")
    out += ["", "; ".join(commands) + f" ({rows[0]['n']} questions a kind, greedy; each reader "
            "as it loads, at the ratio given); lines alone: the base model reading only the "
            "tokens the reader reads plain, in its order, then the question."]
    return "\n".join(out)


def question_depth() -> str:
    """The needle found at each depth and length (the picture needle results are read by):
    the question reader against plain, and past the window against truncation."""
    lengths = sorted(int(p.name) for p in (QUESTION / "needle").glob("*") if p.name.isdigit())
    out = ["| reading | length | " + " | ".join(f"depth {d:.2f}" for d in (0, .25, .5, .75, 1))
           + " | all |", "|---" * 8 + "|"]
    for m in ("plain", "qa-question", "bm25", "truncate-window", "qa-window", "qacode-window",
              "code-question", "code-window"):
        for n in lengths:
            r = question_rows("needle", n).get(m)
            if r is None:
                continue
            by = {float(d): v for d, v in r["accuracy_by_depth"].items()}
            cells = []
            for lo in (0, .25, .5, .75, 1):  # the depths nearest each fifth of the document
                near = [v for d, v in by.items() if abs(d - lo) <= 0.125 + 1e-9]
                cells.append(f"{sum(near) / len(near):.2f}" if near else "–")
            out.append(f"| {QUESTION_NAMES[m]} | {n:,} | " + " | ".join(cells)
                       + f" | {r['accuracy']:.2f} |")
    return "\n".join(out)


GRID_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def question_depth_grid() -> str:
    """Past the window, the needle at fixed depths: the same documents with the needle at each
    (results/question/needle-DEPTH/LENGTH/METHOD.json, ``--task-option depth=DEPTH``)."""
    rows = []
    for method, n in (("qa-window", 16384), ("qa-window", 32768), ("qa-deep", 32768),
                      ("qachat-deep", 32768),
                      ("qa-question", 65536), ("qa-question", 131072)):
        found = {d: QUESTION / f"needle-{d}" / str(n) / f"{method}.json" for d in GRID_DEPTHS}
        got = {d: json.loads(p.read_text()) for d, p in found.items() if p.is_file()}
        if not got:
            continue
        cells = [f"{round(got[d]['accuracy'] * got[d]['n'])} / {got[d]['n']}" if d in got
                 else "–" for d in GRID_DEPTHS]
        hits = sum(round(r["accuracy"] * r["n"]) for r in got.values())
        total = sum(r["n"] for r in got.values())
        kept = sum(r["kv_after"] * r["n"] for r in got.values()) / total
        name = (QUESTION_NAMES[method] if method != "qa-question"
                else "**question reader (k4-qa) as it loads, fitted to the window**")
        rows.append(f"| {name} | {n:,} | " + " | ".join(cells)
                    + f" | {hits} / {total} | {kept:,.0f} |")
    if not rows:
        return "(no rows yet)"
    head = ("| reading | length | " + " | ".join(f"depth {d:.2f}" for d in GRID_DEPTHS)
            + " | all | positions (mean) |")
    return "\n".join([head, "|---" * 9 + "|", *rows])


def _rows_table(name: str, header: list[str], cells: Callable[[dict], list[str]]) -> str:
    """A table of the rows of results/question/NAME: one line of ``cells`` a row."""
    path = QUESTION / name
    if not path.exists():
        return "(no rows yet)"
    out = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    out += ["| " + " | ".join(cells(r)) + " |" for r in json.loads(path.read_text())]
    return "\n".join(out)


def _reader_label(reader: str) -> str:
    """A result row's reader as a table names it: a shipped reader by its name, a code-question
    run (``runs/codeqa-KIND-qachat/checkpoint``: results/question/train_code_reader.sh KIND) as
    "k4-qa-chat + KIND", a training checkpoint (``runs/readers/STAGE/checkpoint``) as "stage
    STAGE"."""
    if reader.startswith("runs/codeqa-") and reader.endswith("-qachat/checkpoint"):
        return f"k4-qa-chat + {reader.split('-')[1]}"
    return reader if "/" not in reader else f"stage {reader.split('/')[-2]}"


def question_chat_answer() -> str:
    """A needle asked four ways of each reader, the answer objective's among them
    (results/question/chat_answer*.json, results/question/chat_reader.py)."""
    paths = sorted(QUESTION.glob("chat_answer*.json"))
    if not paths:
        return "(no rows yet)"
    out = ["| reader | chat | task's question and cue | question alone | "
           "\"Question: ... Answer:\" |", "|---" * 5 + "|"]
    for r in (r for p in paths for r in json.loads(p.read_text())):
        name = _reader_label(r["reader"])
        if r.get("step") is not None:  # a training checkpoint, kept as STAGE-STEP or in place
            name = name.removesuffix(f"-{r['step']}") + f" @ {r['step']}"
        quote = r["config"]["model"].get("quote", "far")  # read with --quote
        name = f"`{name}`" + ("" if quote == "far" else f", quote {quote}")
        h, n = r["hits"], r["n"]
        out.append(f"| {name} | " + " | ".join(f"{h[k]} / {n}" for k in
                                               ("chat", "library", "bare", "cue")) + " |")
    return "\n".join(out)


def question_long_speed() -> str:
    """Past the window, where the time to the first token goes, readings interleaved, one run
    per runtime (results/question/long_speed*.json, results/question/long_speed.py)."""
    paths = sorted(QUESTION.glob("long_speed*.json"))
    if not paths:
        return "(no rows yet)"
    out = ["| runtime | at | reading | positions | laying out | merging | prefill | first token | "
           "÷ plain window | found |", "|---" * 10 + "|"]
    for path in paths:
        data = json.loads(path.read_text())
        backend = data["config"].get("backend", "torch")
        at = (data["git"] or "?")[:7]
        for r in data["rows"]:
            out.append(f"| {backend} | `{at}` | {r['reading']} | {r['positions']:,.0f} | "
                       f"{r['layout_s']:.1f} s | {r['merge_s']:.1f} s | {r['prefill_s']:.1f} s | "
                       f"{r['first_token_s']:.1f} s | {r['of_plain_window']:.2f} × | "
                       f"{r['hits']} / {r['n']} |")
    return "\n".join(out)


def question_ablations() -> str:
    """Each lever of question-aware reading switched off on the same needles
    (results/question/ablations.py)."""
    return _rows_table("ablations.json", ["lever", "setting", "reader", "length", "found",
                                          "KV kept"],
                       lambda r: [r["lever"], r["setting"], f"`{r['reader']}`",
                                  f"{r['length']:,}" + (f", depth {r['depth']}"
                                                        if "depth" in r else ""),
                                  f"{r['accuracy']:.2f} ({r['n']})",
                                  f"{r['kv_after'] / r['tokens_before']:.0%}"])


def question_speed() -> str:
    """Seconds to the first token, the readings interleaved (results/question/speed.py)."""
    path = QUESTION / "speed.json"
    if not path.exists():
        return "(no rows yet)"
    data = json.loads(path.read_text())
    cfg = data["config"]
    out = ["| length | reading | first token (s, median) | of plain's |", "|---" * 4 + "|"]
    for r in data["rows"]:
        out.append(f"| {r['length']:,} | {r['reading']} | {r['median_s']:.2f} | "
                   f"{r['of_plain']:.2f}× |")
    out += ["", f"{cfg['docs']} documents a length, {cfg['repeats']} timing(s) each, the readings "
            f"interleaved in one process, {cfg['threads']} thread; KVzip keeps "
            f"{1 - cfg['press']['ratio']:.0%} of the KV; the question reader's scoring and "
            "merging included."]
    return "\n".join(out)


def question_chat() -> str:
    """A chat that pastes a document and asks about it, read as ktm serve reads a chat
    (results/question/chat.py)."""
    return _rows_table("chat.json", ["reader", "reading", "found", "positions"],
                       lambda r: [f"`{r['reader']}`", r["reading"], f"{r['hits']} / {r['n']}",
                                  f"{r['positions']:.0f}"])


def question_entries() -> str:
    """One needle question through each entry a user has, read by ktm and plain, per reader
    (results/question/entries*.json, results/question/entries.py)."""
    paths = sorted(QUESTION.glob("entries*.json"))
    if not paths:
        return "(no rows yet)"
    out = ["| reader | entry | ktm: found | positions | plain: found | positions | "
           "ktm of plain |", "|---" * 7 + "|"]
    for path in paths:
        rows = json.loads(path.read_text())
        by = {(r["entry"], r["reading"]): r for r in rows}
        cfg = rows[0]["config"]
        name = f"`{_reader_label(cfg['reader'])}`"
        for entry in dict.fromkeys(r["entry"] for r in rows):
            k, p = by.get((entry, "ktm")), by.get((entry, "plain"))
            cells = [f"{k['hits']} / {cfg['n']}" if k else "–",
                     f"{k['positions']:.0f}" if k else "–",
                     f"{p['hits']} / {cfg['n']}" if p else "–",
                     f"{p['positions']:.0f}" if p else "–",
                     f"{k['hits'] / p['hits']:.2f}×" if k and p and p["hits"] else "–"]
            out.append(f"| {name} | {entry} | " + " | ".join(cells) + " |")
    out += ["", f"{cfg['n']} needles in {cfg['length']:,} tokens of held-out code, greedy; "
            "library: `KTMModel.generate` with the question marked; the others over HTTP to "
            "`ktm serve` (one thread); positions: the prompt's after merging, mean."]
    return "\n".join(out)


def question_many() -> str:
    """One document, many questions through ktm serve (results/question/many.py)."""
    path = QUESTION / "many.json"
    if not path.exists():
        return "(no rows yet)"
    rows = json.loads(path.read_text())
    plain = next(r for r in rows if r["reading"] == "plain")
    out = ["| reading | found | first question: first token (s) | later questions (s) | "
           "later, of plain's first | KV held | of plain's | reused from the cache |",
           "|---" * 8 + "|"]
    for r in rows:
        out.append(f"| {r['reading']} | {r['hits']} / {r['questions']} | "
                   f"{r['first_s_first']:.2f} | {r['first_s_later']:.2f} | "
                   f"{r['first_s_later'] / plain['first_s_first']:.2f}× | "
                   f"{r['positions']:.0f} | {r['positions'] / plain['positions']:.2f}× | "
                   f"{r['cached_later']:.0f} |")
    cfg = rows[0]["config"]
    out += ["", f"{cfg['docs']} documents of {cfg['length']:,} tokens of held-out code, each "
            "holding 5 needles of distinct keys, every key asked in turn as a completion with "
            f"`ktm.question` (`{cfg['reader']}`; greedy; one thread; each server with its "
            "default prefix cache); first token: medians, the readings interleaved document by "
            "document; KV held: positions after the prompt, mean; reused: the positions of a "
            "later question read from the cache, mean."]
    return "\n".join(out)


BLOCKS: dict[str, Callable[[], str]] = {"headline": headline, "tasks": tasks,
                                        "press_tasks": press_tasks, "history": history,
                                        "readers": readers, "bench": bench, "demo": demo,
                                        "llamacpp": llamacpp, "llamacpp_r": llamacpp_r,
                                        "context": context, "serve_llamacpp": serve_llamacpp,
                                        "vllm": vllm, "serve_vllm": serve_vllm,
                                        "determinism": determinism, "vllm_r": vllm_r,
                                        "long_answers": long_answers, "question": question,
                                        "question_headline": question_headline,
                                        "question_tasks": question_tasks,
                                        "question_natural": question_natural,
                                        "question_remainder": question_remainder,
                                        "question_depth": question_depth,
                                        "question_depth_grid": question_depth_grid,
                                        "question_ablations": question_ablations,
                                        "question_chat": question_chat,
                                        "question_chat_answer": question_chat_answer,
                                        "question_long_speed": question_long_speed,
                                        "question_speed": question_speed,
                                        "question_entries": question_entries,
                                        "question_many": question_many}


def render(text: str, page: Path) -> str:
    """``text`` with every generated block made anew; a block without its end, or of an
    unknown name, is an error naming the page and line."""
    out, pos = [], 0
    for m in START.finditer(text):
        if m.start() < pos:
            continue
        line = text.count("\n", 0, m.start()) + 1
        name = m.group(1)
        if name not in BLOCKS:
            raise KTMError(f"{page}:{line}: unknown generated block {name!r}: expected one of "
                           f"{', '.join(BLOCKS)}")
        end = text.find(END, m.end())
        nxt = START.search(text, m.end())
        if end < 0 or (nxt and nxt.start() < end):
            raise KTMError(f"{page}:{line}: block {name!r} has no {END} line before the next "
                           "block or the end of the page")
        out += [text[pos:m.end()], "\n", BLOCKS[name]().rstrip(), "\n"]
        pos = end
    return "".join(out) + text[pos:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 naming each page whose blocks are out of date")
    args = ap.parse_args(argv)
    stale = []
    try:
        for page in PAGES:
            text = page.read_text(encoding="utf-8")
            new = render(text, page)
            if new == text:
                continue
            if args.check:
                stale.append(rel(page))
            else:
                write_text_atomic(page, new)
                print(f"rewrote {rel(page)}")
    except (KTMError, OSError, KeyError, ValueError) as e:
        print(f"tables: error: {e}", file=sys.stderr)
        return 2
    if stale:
        print("out of date (run python results/tables.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
