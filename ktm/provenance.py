"""What produced a result: package versions and the git revision."""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path

from ktm.fileio import atomic_path, replace_dir, write_json_atomic  # noqa: F401  (old home)

PACKAGES = ("ktm", "torch", "transformers", "peft", "safetensors", "gguf")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def git_revision() -> str | None:
    """The repository's HEAD (with '-dirty' for uncommitted changes), or None outside a repo."""
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("-dirty" if dirty else "")
