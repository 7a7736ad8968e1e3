"""What produced a result: package versions and the git revision."""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("ktm", "torch", "transformers", "tokenizers", "peft", "safetensors", "gguf", "numpy",
            "matplotlib")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _git(where: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=where, capture_output=True, text=True, timeout=5,
                          check=True).stdout.strip()


def git_revision(package_dir: Path | None = None) -> str | None:
    """The repository's HEAD, with '-dirty' for uncommitted changes to tracked files or new
    files in the package itself (a module not yet added ran too); None outside a repository,
    or when the package is not tracked by the repository it sits in (a copy installed into a
    venv inside some clone: that clone's HEAD says nothing about this code)."""
    here = Path(__file__).resolve().parent if package_dir is None else Path(package_dir)
    try:
        rev = _git(here, "rev-parse", "HEAD")
        _git(here, "ls-files", "--error-unmatch", "--", "__init__.py")
        dirty = _git(here, "status", "--porcelain", "--untracked-files=no")
        dirty += _git(here, "status", "--porcelain", "--untracked-files=all", "--", ".")
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("-dirty" if dirty else "")


def stamped(rows: list[dict], config: dict) -> list[dict]:
    """Result rows with what made them: ``config``, the command line, the package versions and
    the git revision (a results script's rows, as every result file carries them)."""
    import sys

    made = {"config": config, "command": " ".join(sys.argv), "versions": versions(),
            "git": git_revision()}
    return [{**row, **made} for row in rows]


def plain(value: Any) -> Any:
    """A JSON-plain copy for a result row (paths as strings, tuples as lists, anything else
    its repr)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)
