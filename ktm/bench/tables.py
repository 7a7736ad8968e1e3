"""The benchmark's tables: the main columns of each kind of row, as Markdown (numbers are
formatted only here)."""

from __future__ import annotations

COLUMNS = {
    "infer": [("method", "{}"), ("backend", "{}"), ("k", "{}"), ("ratio", "{:g}"),
              ("press", "{}"), ("compile", "{}"), ("weights", "{}"),
              ("mlp_ratio", "{}"),
              ("input_tokens", "{}"), ("compressed_tokens", "{}"), ("batch", "{}"),
              ("encoder_s", "{:.3f}"),
              ("prefill_s", "{:.3f}"), ("encoder_share", "{:.0%}"), ("ttft_s", "{:.3f}"),
              ("decode_tokens_per_s", "{:.1f}"), ("e2e_s", "{:.2f}"),
              ("kv_ratio", "{:.3f}"), ("speedup_prefill", "{:.2f}x"), ("speedup_e2e", "{:.2f}x")],
    "train": [("method", "{}"), ("k", "{}"), ("compile", "{}"), ("mlp_ratio", "{}"),
              ("input_tokens", "{}"), ("compressed_tokens", "{}"), ("batch", "{}"),
              ("step_s", "{:.3f}"),
              ("input_tokens_per_s", "{:.0f}"), ("model_tflops_per_s", "{:.1f}"),
              ("mfu", "{:.1%}"), ("speedup_train", "{:.2f}x")],
    "serve": [("method", "{}"), ("backend", "{}"), ("k", "{}"),
              ("input_tokens", "{}"),
              ("prompt_tokens_merged", "{}"), ("clients", "{}"), ("requests_per_s", "{:.2f}"),
              ("latency_p50_s", "{:.2f}"), ("latency_p95_s", "{:.2f}"), ("ttft_p50_s", "{:.2f}"),
              ("ttft_p95_s", "{:.2f}"), ("output_tokens_per_s", "{:.1f}")],
    "hf": [("method", "{}"), ("input_tokens", "{}"), ("output_tokens", "{}"), ("batch", "{}"),
           ("ttft_s", "{:.3f}"), ("decode_tokens_per_s", "{:.2f}"), ("e2e_s", "{:.2f}"),
           ("vs_hf_decode", "{:.3f}x"), ("vs_hf_e2e", "{:.3f}x"), ("same_tokens_as_hf", "{}")],
    "serve-prefix": [("backend", "{}"), ("k", "{}"), ("input_tokens", "{}"),
                     ("cached_positions", "{}"),
                     ("ttft_uncached_s", "{:.3f}"), ("ttft_cached_s", "{:.3f}"),
                     ("speedup_ttft_cached", "{:.1f}x")],
}


def _table_kind(row: dict) -> str:
    return "serve-prefix" if row.get("kind") == "prefix" else row["mode"]


def format_table(rows: list[dict]) -> str:
    """Markdown table of the main columns (numbers are formatted only here)."""
    tables = []
    for kind in dict.fromkeys(_table_kind(r) for r in rows):
        cols, part = COLUMNS[kind], [r for r in rows if _table_kind(r) == kind]
        cell = [[("-" if r.get(c) is None else fmt.format(r[c])) for c, fmt in cols]
                for r in part]
        lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
        tables.append("\n".join(lines + ["| " + " | ".join(c) + " |" for c in cell]))
    return "\n\n".join(tables)
