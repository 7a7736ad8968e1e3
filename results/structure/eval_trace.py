"""Where ``ktm eval --checkpoint X``'s arguments go: the ktm modules its first 400 function calls
pass through, and how often the path returns to a module it had left.

Counted from the command's entry (``cmd_eval``) on a tiny checkpoint saved by another process
(``tests/helpers.py``'s tiny Llama, K=4); a call is a ktm function entered, not a module body run
by an import nor a generator resumed. Writes ``results/structure/eval_trace.json``.

    python results/structure/eval_trace.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WINDOW = 400


def _checkpoint(folder: str) -> str:
    code = (f"import sys; sys.path.insert(0, {str(REPO / 'tests')!r})\n"
            "from helpers import save_tiny_llama\nimport torch\nfrom ktm.model import KTMModel\n"
            f"base = save_tiny_llama({folder!r} + '/base'); torch.manual_seed(0)\n"
            f"KTMModel.from_base(base, k=4).save({folder!r} + '/ckpt')\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    return folder + "/ckpt"


def trace(argv: list[str]) -> tuple[list[str], int | None]:
    """The module of each of the first ``WINDOW`` ktm function calls of ``ktm *argv``, and how
    many of them came before the model's load (``KTMModel.load``)."""
    from ktm.cli.main import main

    calls: list[str] = []
    imports, started, load = [0], [False], [None]

    def profile(frame, event, _arg):
        if frame.f_code.co_name == "<module>":  # an import runs a module body
            imports[0] += {"call": 1, "return": -1}.get(event, 0)
            return
        started[0] = started[0] or frame.f_code.co_name == "cmd_eval"
        module = frame.f_globals.get("__name__", "")
        if (event == "call" and started[0] and not imports[0] and frame.f_lasti <= 0
                and module.startswith("ktm") and len(calls) < WINDOW):
            if load[0] is None and module == "ktm.model" and frame.f_code.co_name == "load":
                load[0] = len(calls)
            calls.append(module)

    sys.setprofile(profile)
    try:
        main(argv)
    finally:
        sys.setprofile(None)
    return calls, load[0]


def _path(calls: list[str], name: str) -> dict:
    """The modules ``calls`` pass through, in order, and the returns to a module left."""
    path: list[str] = []
    for m in calls:
        if not path or path[-1] != m:
            path.append(m)
    returns = sum(1 for i, m in enumerate(path) if m in path[:i])
    return {f"{name}_modules": len(dict.fromkeys(calls)), f"{name}_returns": returns,
            f"{name}_path": path}


def main() -> None:
    from ktm.util.fileio import write_json_atomic
    from ktm.util.provenance import git_revision, versions

    with tempfile.TemporaryDirectory() as tmp:
        argv = ["eval", "--checkpoint", _checkpoint(tmp), "--task", "tree", "--stage", "small",
                "--n-eval", "2"]
        calls, before_load = trace(argv)
    row = {"command": "ktm eval --checkpoint CKPT --task tree --stage small --n-eval 2",
           "window": WINDOW, **_path(calls, "window"),
           "calls_before_load": before_load, **_path(calls[:before_load], "before_load"),
           "git": git_revision(), "versions": versions()}
    write_json_atomic(REPO / "results/structure/eval_trace.json", row)
    print(json.dumps({k: v for k, v in row.items() if not isinstance(v, (list, dict))}))


if __name__ == "__main__":
    main()
