"""Reading ``ktm eval`` result files for ``ktm report``: one JSON object each, checked field by
field, so a hand-edited, truncated or foreign file is an error naming the file and the field
rather than a traceback or a silently wrong number in a table.

A classification row must carry ``balanced_accuracy`` (P in the report); a perplexity row a
positive ``perplexity``; a readability row its per-set NLLs and token counts. The same result
given twice (overlapping globs, a copied file) is kept once. Each row gets ``result_file``, the
path it was read from (the report tells namesakes apart by their folders). Files other ktm
commands write (``ktm bench`` rows, ``ktm demo``'s result, the ``run.json`` of a ``ktm train`` or
``ktm pretrain`` run folder) are recognised and set aside, so a glob over a results or runs
folder (``results/*/*.json``) reads its evaluation rows; anything else is an error.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ktm.errors import KTMError

REQUIRED = ("task", "method", "length_reduction")
READ_FIELDS = ("nll_merged", "nll_plain", "nll_none", "tokens_in", "tokens_out")


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _check(path: str, name: str, value: object, ok: bool, expected: str) -> None:
    if not ok:
        raise KTMError(f"result file {path!r}: {name}={value!r}: expected {expected}")


def _check_common(path: str, row: dict) -> None:
    for key in ("task", "method"):
        v = row.get(key)
        _check(path, key, v, isinstance(v, str) and bool(v), "a non-empty string")
    k = row.get("k")
    _check(path, "k", k, k is None or (isinstance(k, int) and not isinstance(k, bool)),
           "an integer or null")


def _check_readability(path: str, row: dict) -> None:
    sets = row.get("readability")
    _check(path, "readability", sets, isinstance(sets, dict) and bool(sets) and all(
        isinstance(v, dict) for v in sets.values()), "an object of held-out sets")
    for name, v in sets.items():
        for key in READ_FIELDS:
            _check(path, f"{name}.{key}", v.get(key), _is_number(v.get(key)), "a finite number")
        r, ci = v.get("R"), v.get("R_ci95")
        _check(path, f"{name}.R", r, r is None or _is_number(r), "a finite number or null")
        _check(path, f"{name}.R_ci95", ci, ci is None or (
            isinstance(ci, list) and len(ci) == 2 and all(map(_is_number, ci))),
            "[low, high] or null")


def _check_task(path: str, row: dict) -> None:
    missing = [k for k in REQUIRED if k not in row]
    if "perplexity" not in row:
        missing += [k for k in ("accuracy", "balanced_accuracy") if k not in row]
    if missing:
        raise KTMError(f"result file {path!r} lacks {missing}: expected a file written by "
                       "`ktm eval`")
    lr = row["length_reduction"]
    _check(path, "length_reduction", lr, _is_number(lr) and lr <= 1, "a finite number <= 1")
    if "perplexity" in row:
        ppl = row["perplexity"]
        _check(path, "perplexity", ppl, _is_number(ppl) and ppl > 0, "a finite number > 0")
    else:
        for key in ("accuracy", "balanced_accuracy"):
            v = row[key]
            _check(path, key, v, _is_number(v) and 0 <= v <= 1, "a number in [0, 1]")
    cost = row.get("compression_ms_per_1k_tokens")
    _check(path, "compression_ms_per_1k_tokens", cost, cost is None or _is_number(cost),
           "a finite number or null")


def written_by(data: object) -> str | None:
    """The ktm command other than ``ktm eval`` that writes JSON of this shape, if any."""
    if isinstance(data, list) and data and all(
            isinstance(r, dict) and {"mode", "method"} <= r.keys() for r in data):
        return "ktm bench"
    if isinstance(data, dict) and "task" not in data and {"start", "trained"} <= data.keys():
        return "ktm demo"
    if isinstance(data, dict) and "method" not in data and {
            "config", "model", "n_examples"} <= data.keys():  # a run folder's run.json
        return "ktm train/pretrain"
    return None


def load_results(paths: list[str]) -> tuple[list[dict], dict[str, list[str]]]:
    """The checked rows of ``paths``, each distinct result once, in the order given, and the
    files set aside as another command's output (command -> paths)."""
    rows, seen, others = [], set(), {}
    for p in paths:
        try:
            row = json.loads(Path(p).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise KTMError(f"result file {p!r} cannot be read as JSON: {e}") from e
        if command := written_by(row):
            others.setdefault(command, []).append(str(p))
            continue
        if not isinstance(row, dict):
            raise KTMError(f"result file {p!r} holds a JSON {type(row).__name__}: expected one "
                           "object, as `ktm eval` writes")
        if row.get("task") == "readability":
            _check_common(p, row)
            _check_readability(p, row)
        else:
            _check_task(p, row)
            _check_common(p, row)
        key = json.dumps(row, sort_keys=True)
        if key not in seen:
            seen.add(key)
            rows.append({**row, "result_file": str(p)})
    if not rows:
        raise KTMError(f"no `ktm eval` result files given{skipped_note(others, ': ')}")
    return rows, others


def skipped_note(others: dict[str, list[str]], lead: str = "") -> str:
    """``others`` (from ``load_results``) in one line: how many files of each, and where."""
    if not others:
        return ""
    parts = [f"{len(ps)} `{cmd}` file{'s' * (len(ps) > 1)} in "
             f"{', '.join(sorted({str(Path(p).parent) for p in ps}))}"
             for cmd, ps in others.items()]
    return f"{lead}skipped, not `ktm eval` results: {'; '.join(parts)}"
