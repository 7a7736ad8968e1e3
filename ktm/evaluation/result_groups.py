"""Which ``ktm eval`` rows ``ktm report`` may put in one table and on one Pareto frontier, and an
unambiguous label for each row of a table.

Two rows are comparable when they scored the same test examples the same way: the same task,
the same task settings that decide the test set and the prompts (every constructor setting but
the ones a task marks ``TRAIN_ONLY``, e.g. amazon's ``balance_train``; a setting a row predates
counts as its default), the same number of examples drawn with the same seed, the same scoring
protocol (greedy answer or label likelihood, and its calibration size) and the same metric.
Rows that differ in any of these get tables of their own, titled by what tells them apart.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path

from ktm.tasks import TASKS

UNSET = dataclasses.MISSING


def task_settings(row: dict) -> dict:
    """The row's test-set settings (``config.task``), defaults filled in, training-only and
    machine-specific ones (``file``, the resolved data path) left out."""
    task = (row.get("config") or {}).get("task")
    if not isinstance(task, dict):
        return {}
    cls = TASKS.get(row["task"])
    settings = {k: v for k, v in task.items() if k not in ("name", "file")}
    if cls is None:  # a task this version does not know: its settings as recorded
        return settings
    out = {}
    for f in dataclasses.fields(cls):
        if f.init and f.name not in getattr(cls, "TRAIN_ONLY", ()):
            default = f.default if f.default is not UNSET else None
            out[f.name] = settings.get(f.name, default)
    return out


def protocol(row: dict) -> dict:
    """How the row was scored: examples (count and seed), metric, scoring and calibration."""
    ev = (row.get("config") or {}).get("eval") or {}
    out = {"metric": "perplexity" if "perplexity" in row else "accuracy", "n": row.get("n"),
           "seed": ev.get("seed")}
    if out["metric"] == "accuracy":  # rows written before scoring existed were generated
        out["scoring"] = ev.get("scoring", "generate")
        if out["scoring"] == "likelihood":
            out["n_calibrate"] = ev.get("n_calibrate", 0)
    return out


def base_name(row: dict) -> str:
    """The task, with its stage when it has one (tree small and tree xmedium are two tables)."""
    stage = task_settings(row).get("stage")
    return f"{row['task']} {stage}" if stage else row["task"]


def _key(row: dict) -> str:
    return json.dumps({"task": row["task"], **task_settings(row), **protocol(row)},
                      sort_keys=True, default=str)


def _shown(field: str, value) -> str:
    return str(value) if field == "metric" else f"{field}={value}"


def group_rows(rows: list[dict]) -> dict[str, list[dict]]:
    """Comparable rows together, each group titled by its task (and stage), then the settings
    that tell it from the other groups of that task; likelihood scoring is always named."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        groups[_key(r)].append(r)
    by_base: dict[str, list[str]] = defaultdict(list)
    for key, members in groups.items():
        by_base[base_name(members[0])].append(key)
    out: dict[str, list[dict]] = {}
    for base, keys in by_base.items():
        fields = [{**protocol(groups[k][0]), **task_settings(groups[k][0])} for k in keys]
        for key, d in zip(keys, fields):
            shown = [f for f in d if f in ("scoring", "n_calibrate") and
                     d["scoring"] == "likelihood" or any(f in e and _differ(d[f], e[f])
                                                         for e in fields)]
            suffix = ", ".join(_shown(f, d[f]) for f in shown)
            title = name = f"{base} ({suffix})" if suffix else base
            n = 1
            while title in out:  # settings this version cannot name: keep the tables apart
                n += 1
                title = f"{name} #{n}"
            out[title] = groups[key]
    return out


def _differ(a, b) -> bool:
    return json.dumps(a, default=str) != json.dumps(b, default=str)


def row_labels(rows: list[dict]) -> list[str]:
    """Each row's method name; where several rows of one table share it, the name with the
    folder of its result file (``amazon-seed1/k4``), or where that is shared too (two files of
    one folder), the end of the file's path (``k4 (amazon-long/k4r.json)``)."""
    out = [r["method"] for r in rows]
    clashes: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        clashes[r["method"]].append(i)
    for method, idx in clashes.items():
        if len(idx) > 1:
            # absolute: "k4.json" given in its folder and "../b/k4.json" are a/k4 and b/k4
            paths = [Path(rows[i].get("result_file") or "").absolute() for i in idx]
            for i, name in zip(idx, _tell_apart(method, paths)):
                out[i] = name
    return out


def _tell_apart(method: str, paths: list[Path]) -> list[str]:
    """The shortest of ever longer names that no other of ``paths`` shares, row by row."""
    depth = max(len(p.parts) for p in paths)
    forms = [lambda p, d=d: "/".join(p.parent.parts[-d:] + (method,)) for d in range(1, depth)]
    forms += [lambda p, d=d: f"{method} ({'/'.join(p.parts[-d:])})"
              for d in range(min(2, depth), depth + 1)]
    names: list[str | None] = [None] * len(paths)
    for form in forms:
        pending = [i for i, n in enumerate(names) if n is None]
        cands = {i: form(paths[i]) for i in pending}
        for i, c in cands.items():
            if list(cands.values()).count(c) == 1 and c not in names:
                names[i] = c
    return [n or f"{method} #{i + 1}" for i, n in enumerate(names)]


def is_uncompressed(row: dict) -> bool:
    """The plain prompt, no compressor: the reference a perplexity P should be relative to."""
    cfg = row.get("config") or {}
    if "merge" in (cfg.get("eval") or {}):
        return cfg["eval"]["merge"] is False and not cfg.get("compressor")
    return row["method"] == "uncompressed"
