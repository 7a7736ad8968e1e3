"""Crash-safe writes: a reader sees the old file or the new one, never half of one, never none.
And the one append-only log, ``metrics.jsonl``, read as a crash left it (``read_metrics``).

Every file is written to a temp file beside its destination, flushed and fsynced, then renamed
over it (``atomic_open``). A folder (a checkpoint) is written whole into a temp folder, fsynced,
and swapped with the old one in one ``renameat2(RENAME_EXCHANGE)`` call (``replace_dir``).
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from ktm.errors import KTMError

try:
    import fcntl
except ImportError:  # Windows: no flock (``flock`` says so; callers go on unguarded)
    fcntl = None  # type: ignore[assignment]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


class WriteError(KTMError):
    """A file could not be written (no space, no permission, a file where a folder should be);
    the previous file, if any, is intact."""


def write_error(path: str | Path, e: BaseException) -> WriteError:
    cause = e.__cause__ if isinstance(e, WriteError) and e.__cause__ else e
    return WriteError(f"cannot write {str(path)!r}: {cause}")


def flock(f: IO[Any] | int, wait: bool = True) -> bool:
    """Take an exclusive advisory lock on an open file (or descriptor), held until it is closed
    or its process ends, however it ends. False where locks are unavailable: no ``fcntl``
    (Windows) or a filesystem that refuses them (some NFS mounts); the caller goes on unguarded.
    Without ``wait``, a lock another process holds raises ``BlockingIOError``."""
    if fcntl is None:
        return False
    try:
        fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        if not wait:
            raise
        return False
    except OSError:
        return False
    return True


def written_once(dest: Path, marker: str, write: Callable[[Path], Any]) -> Path:
    """``dest``, written by ``write(dest)`` unless ``dest / marker`` already exists: a cache
    folder (an export of a model) that two processes asking at once write once, the second
    waiting for the first and then reusing its files."""
    if not (dest / marker).is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest.parent / f".{dest.name}.lock", "a") as lock:
            flock(lock)
            if not (dest / marker).is_file():
                write(dest)
    return dest


def check_writable(path: str | Path) -> None:
    """Refuse an output file that cannot be written before a long run, not after it."""
    path = Path(path)
    if path.is_dir():
        raise WriteError(f"cannot write {str(path)!r}: it is a folder; expected a file path")
    folder = path.parent
    while not folder.exists():  # a file on the way makes its children "not exist" too
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise WriteError(f"cannot write {str(path)!r}: {str(folder)!r} is not a writable folder")


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside ``path`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


TEMP_DIR_PREFIX = ".{}.tmp-"  # a folder's temp copy beside it: .NAME.tmp-PID@HOST-XXXXXXXX
# a file's temp copy beside it: .NAME.PID@HOST-XXXXXXXX.tmp (``atomic_path``: the file's suffix)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, another user's
        return True
    return True


def _owned_prefix(prefix: str) -> str:
    return f"{prefix}{os.getpid()}@{socket.gethostname()}-"


def remove_path(path: Path) -> None:
    """Remove a leftover temp file or folder, whichever it is; gone already is fine."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _remove_dead(folder: Path, prefix: str) -> None:
    """Remove the temps named ``PREFIX PID@HOST-...`` that a killed process of this machine
    left; never a live process's, another machine's (on a shared filesystem) or this one's."""
    host = socket.gethostname()
    for old in folder.glob(f"{glob.escape(prefix)}*"):
        pid, _, where = old.name[len(prefix):].rsplit("-", 1)[0].partition("@")
        if where != host or not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        remove_path(old)


def _temp_file(path: Path, suffix: str) -> tuple[int, str]:
    """A new temp file beside ``path``, after removing those killed writes of it left."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_dead(path.parent, f".{path.name}.")
        return tempfile.mkstemp(prefix=_owned_prefix(f".{path.name}."), suffix=suffix,
                                dir=path.parent)
    except OSError as e:
        raise write_error(path, e) from e


def temp_dir_beside(dest: Path) -> Path:
    """A new temp folder beside ``dest``, named after this process, after removing those that
    a killed process of this machine left for the same ``dest`` (a whole checkpoint or LM each).
    """
    prefix = TEMP_DIR_PREFIX.format(dest.name)
    _remove_dead(dest.parent, prefix)
    return Path(tempfile.mkdtemp(prefix=_owned_prefix(prefix), dir=dest.parent))


@contextmanager
def atomic_open(path: str | Path, mode: str = "w") -> Iterator[IO[Any]]:
    """``with atomic_open(p) as f: f.write(...)``: temp file, fsync, rename over ``p``."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    fd, tmp = _temp_file(path, ".tmp")
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise write_error(path, e) from e
        raise
    fsync_dir(path.parent)


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_open(path) as f:
        f.write(text)


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Write JSON so that readers never see half a file."""
    with atomic_open(path) as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def fsync_tree(root: str | Path) -> None:
    """fsync every file and folder under ``root`` (files written by libraries, e.g. safetensors)."""
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(folder)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2``); False where the system cannot.

    Hand-written because Python's ``os`` has no binding for ``renameat2``, and it is the only
    way to replace a non-empty folder without a moment in which the destination does not exist.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def old_copy(dest: Path) -> Path:
    """Where the fallback swap keeps the previous folder until the new one is in place."""
    return dest.with_name(dest.name + ".old")


def replace_dir(tmp: str | Path, dest: str | Path) -> None:
    """Move a fully written ``tmp`` folder to ``dest``; ``dest`` exists at every moment.

    Where the atomic exchange is unavailable, the old folder is renamed to ``DEST.old`` just
    before the new one moves in; ``existing_dir`` reads that copy if a crash fell in between.
    """
    tmp, dest = Path(tmp), Path(dest)
    fsync_tree(tmp)
    if dest.exists() and _exchange(tmp, dest):
        shutil.rmtree(tmp)  # now the old folder
    else:
        old = old_copy(dest)
        if dest.exists():  # else ``old`` may be the only copy a crash left: keep it till now
            shutil.rmtree(old, ignore_errors=True)
            os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(dest.parent)


def existing_dir(dest: str | Path) -> Path:
    """``dest``, or its ``.old`` copy when a crash hit the fallback swap between its renames."""
    dest = Path(dest)
    if not dest.exists() and old_copy(dest).exists():
        return old_copy(dest)
    return dest


def figure_format(path: str | Path) -> str:
    """The image format a plot path's extension names (none: png), refused before any work
    when matplotlib cannot write it."""
    from matplotlib.backend_bases import FigureCanvasBase

    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    known = FigureCanvasBase.get_supported_filetypes()
    if fmt not in known:
        raise KTMError(f"plot file {str(path)!r}: unknown image format {fmt!r}: expected one of "
                       f"{', '.join('.' + k for k in sorted(known))}")
    return fmt


def save_figure(fig, path: str | Path, dpi: int = 120) -> None:
    """A matplotlib figure, written like every other file (temp, fsync, rename)."""
    fmt = figure_format(path)
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format=fmt, dpi=dpi)


def save_safetensors_atomic(path: str | Path, tensors: dict, metadata: dict | None = None) -> None:
    from safetensors.torch import save

    with atomic_open(path, "wb") as f:
        f.write(save(tensors, metadata=metadata))


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temp path beside ``path`` for a library that writes by name; on success fsync it
    and rename it over ``path``."""
    path = Path(path)
    fd, name = _temp_file(path, path.suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        raise write_error(path, e) from e
    finally:
        tmp.unlink(missing_ok=True)


def read_metrics(path: Path) -> list[dict]:
    """The rows of a metrics file; a half-written last line (a crash mid-write) is dropped."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            raise KTMError(f"{str(path)!r} line {i + 1} is not JSON ({e}): the metrics file is "
                           "corrupt") from e
    return rows


def read_json_object(path: Path, missing: str) -> dict:
    """A JSON file holding one object (an export's manifest); ``missing``: the whole error for
    an absent file. A clear ``KTMError`` for an unreadable file or anything but an object."""
    if not path.is_file():
        raise KTMError(missing)
    try:
        obj = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KTMError(f"{str(path)!r} is corrupt: {e}") from e
    if not isinstance(obj, dict):
        raise KTMError(f"{str(path)!r} is corrupt: expected a JSON object, found "
                       f"{type(obj).__name__}")
    return obj


def sha256_files(paths: list[Path], names: bool = True) -> str:
    """One sha256 over files (sorted by path), each preceded by its name when ``names``."""
    h = hashlib.sha256()
    for p in sorted(Path(p) for p in paths):
        if names:
            h.update(p.name.encode())
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def check_apart(out: Path, sources: list[str | Path]) -> None:
    """Refuse an output folder that is, holds or sits inside a folder a model was read from:
    an export replaces ``out`` whole (a model folder inside it would go with it), and a
    checkpoint is replaced whole by its next save (an export inside it would go with that)."""
    dest = Path(out).expanduser().resolve()
    for source in sources:
        src = Path(source).expanduser()
        if not src.is_dir():
            continue
        src = src.resolve()
        if dest == src or src in dest.parents:
            where = "is" if dest == src else "is inside"
        elif dest in src.parents:
            where = "holds"
        else:
            continue
        raise KTMError(f"output folder {str(out)!r} {where} the model folder {str(source)!r}: "
                       "the export or the model's next save would replace the other; expected "
                       "an output folder apart from the model's")
