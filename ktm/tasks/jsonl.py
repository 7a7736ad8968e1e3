"""Reading the JSONL data files, row by row, with errors that point at the bad line.

Every task reads its data through ``read_jsonl`` so a broken file fails the same way everywhere:
``KTMError: data.jsonl line 17: field 'text' must be str, got int``.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

from ktm.errors import KTMError

# A field spec is a type or a tuple of types; ``float`` accepts ints (JSON has one number type).
FieldSpec = type | tuple[type, ...]


def data_root() -> Path:
    """Where the data lives: ``$KTM_DATA`` (``--data-dir`` sets it), else, in a development
    checkout only, the ``shared/data`` folder beside the repository (see README, "Data")."""
    env = os.environ.get("KTM_DATA")
    if env:
        return Path(env).expanduser()
    repo = Path(__file__).resolve().parents[2]
    return repo.parent / "shared" / "data"


def set_data_dir(path: str | Path) -> Path:
    """``--data-dir``: use ``path`` as the data root for this process (sets ``$KTM_DATA``)."""
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise KTMError(f"data dir {str(path)!r} is not a folder: expected the folder holding "
                       "textualized_tree/, amazon_reviews_fashion/, ... (README, Data)")
    os.environ["KTM_DATA"] = str(root)
    return root


def find_data_file(default: str) -> Path | None:
    """``default`` under ``data_root()``, or the same name gzipped or not (a user's copy may be
    stored either way); None when neither is there."""
    path = data_root() / default
    other = (path.with_name(path.name[:-3]) if path.name.endswith(".gz")
             else path.with_name(path.name + ".gz"))
    return next((p for p in (path, other) if p.is_file()), None)


def resolve_data_path(path: str | Path | None, default: str) -> Path:
    """``path`` if given, else ``default`` under ``data_root()`` (gzipped or not); a missing
    file is an error."""
    if path is None and (found := find_data_file(default)) is not None:
        return found
    resolved = Path(path).expanduser() if path is not None else data_root() / default
    if not resolved.is_file():
        if path is not None:
            how = "pass an existing file"
        else:
            env = os.environ.get("KTM_DATA")
            root = f"$KTM_DATA={env}" if env else "$KTM_DATA is not set"
            how = (f"looked for {default} (or without .gz) in the data folder {data_root()}, "
                   f"{root}; set KTM_DATA (or --data-dir) to the folder holding the data, or "
                   "pass data_path; README, Data, says where to get it")
        raise KTMError(f"data file not found: {resolved} ({how})")
    return resolved


def base_name(name: str) -> str:
    """``name`` without a trailing ``.gz``: a held-out file is the same set gzipped or not."""
    return name[:-3] if name.lower().endswith(".gz") else name


def refuse_eval_only(path: Path, eval_only: tuple[str, ...], what: str) -> None:
    """Raise when a training source is one of the evaluation-only files (matched by name).

    Why by name: these files are held out on purpose (other domains / other repositories), and the
    cheapest reliable guard is to refuse the shipped file or folder names outright.
    """
    names = {base_name(path.name), base_name(path.parent.name)}
    hit = names.intersection(base_name(n) for n in eval_only)
    if hit:
        raise KTMError(
            f"{path} is evaluation-only ({what}); expected training data, so pass it as eval_path"
        )


def is_gzip(path: Path) -> bool:
    """Whether ``path`` starts with the gzip magic bytes (a user's copy may be gzipped or not,
    whatever its name says)."""
    with path.open("rb") as f:
        return f.read(2) == b"\x1f\x8b"


def open_text(path: Path) -> TextIO:
    """A text file, gzipped or not whatever its name says, as UTF-8; utf-8-sig: a byte-order
    mark (Windows editors write one) is not part of its text (or of line 1's JSON). A byte that
    is not UTF-8 arrives as a lone surrogate (surrogateescape), so ``check_utf8`` can name its
    line; a decoding error names only an offset in a read buffer."""
    if is_gzip(path):
        return gzip.open(path, "rt", encoding="utf-8-sig", errors="surrogateescape")
    return path.open("r", encoding="utf-8-sig", errors="surrogateescape")


_UNDECODED = re.compile("[\udc80-\udcff]")  # what surrogateescape makes of bytes 0x80..0xFF


def check_utf8(path: Path, text: str, first_line: int = 1) -> None:
    """Raise naming the line, column and value of the first byte of ``text`` (read by
    ``open_text``, starting at line ``first_line``) that was not UTF-8."""
    if (m := _UNDECODED.search(text)) is not None:
        at = m.start()
        line, column = first_line + text.count("\n", 0, at), at - text.rfind("\n", 0, at)
        # Windows' "Unicode" text: UTF-16, after its byte-order mark (FF FE or FE FF)
        utf16 = at == 0 and first_line == 1 and text[:2] in ("\udcff\udcfe", "\udcfe\udcff")
        raise row_error(path, line, f"byte 0x{ord(m.group()) - 0xDC00:02X} at column {column} "
                        "is not UTF-8: expected UTF-8 text"
                        + (" (this file is UTF-16: save it as UTF-8)" if utf16 else ""))


def _matches(value: Any, spec: FieldSpec) -> bool:
    types = spec if isinstance(spec, tuple) else (spec,)
    if isinstance(value, bool):  # bool is an int subclass; a true/false is never a count or rating
        return bool in types
    if float in types and isinstance(value, int):
        return True
    return isinstance(value, types)


def _spec_name(spec: FieldSpec) -> str:
    types = spec if isinstance(spec, tuple) else (spec,)
    return " or ".join(t.__name__ for t in types)


def row_error(path: Path, line_no: int, expected: str) -> KTMError:
    """The error for a bad row: file, 1-based line number, what was expected."""
    return KTMError(f"{path} line {line_no}: {expected}")


def lone_surrogate(value: Any) -> str | None:
    """The first lone surrogate in a JSON value's strings, if any: JSON may escape one
    (``"\\ud800"``), but it is half of a UTF-16 pair, not a character, and tokenizers refuse it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return value[e.start]
    elif isinstance(value, (list, dict)):
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        return next((c for c in map(lone_surrogate, items) if c is not None), None)
    return None


def parse_row(path: Path, line_no: int, line: str, fields: Mapping[str, FieldSpec]) -> dict:
    """One line as a JSON object carrying each of ``fields`` (name -> type), else a row error."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise row_error(path, line_no, f"expected a JSON object, got bad JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise row_error(path, line_no, f"expected a JSON object, got {type(row).__name__}")
    for name, value in row.items():
        if (bad := lone_surrogate({name: value})) is not None:
            raise row_error(path, line_no, f"field {name!r} holds a lone surrogate {bad!r} (half "
                            "of a UTF-16 pair, not a character): expected valid Unicode text")
    for name, spec in fields.items():
        if name not in row:
            raise row_error(path, line_no, f"missing field {name!r} ({_spec_name(spec)})")
        if not _matches(row[name], spec):
            got = type(row[name]).__name__
            raise row_error(path, line_no, f"field {name!r} must be {_spec_name(spec)}, got {got}")
    return row


def read_jsonl(
    path: Path, fields: Mapping[str, FieldSpec] | None = None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_no, row)`` for each non-blank line (1-based numbers), checking ``fields``.

    Blank lines are skipped (a trailing newline is common); every other line must be a JSON
    object carrying each required field with the given type.
    """
    try:
        with open_text(path) as f:
            for line_no, line in enumerate(f, start=1):
                check_utf8(path, line, line_no)
                # a byte-order mark opening a later line: files that each had one, concatenated
                line = line.removeprefix("\ufeff")
                if line.strip():
                    yield line_no, parse_row(path, line_no, line, fields or {})
    except FileNotFoundError:
        raise KTMError(f"data file not found: {path} (expected a JSONL or JSONL.gz file)") from None
    except (OSError, EOFError, zlib.error) as e:  # zlib.error: a damaged gzip stream
        raise KTMError(f"cannot read {path}: {e} (expected UTF-8 JSONL, gzipped or not)") from e


def task_files(task, default: str, eval_only: tuple[str, ...], what: str
               ) -> tuple[Path, Path | None]:
    """Validate a file-backed task's common options; return (training file, eval file or None).

    ``task`` has ``prompt_mode``, ``max_chars``, ``data_path`` and ``eval_path``; the training
    file must not be one of the evaluation-only sets (``what`` says why they are held out).
    """
    if task.prompt_mode not in ("paper", "context"):
        raise KTMError(f"prompt_mode={task.prompt_mode!r}: expected 'paper' or 'context'")
    if task.max_chars is not None and task.max_chars < 1:
        raise KTMError(f"max_chars={task.max_chars}: expected a positive number or None")
    path = resolve_data_path(task.data_path, default)
    refuse_eval_only(path, eval_only, what)
    return path, None if task.eval_path is None else resolve_data_path(task.eval_path, "")
