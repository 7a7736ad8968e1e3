"""Type-checking a task's constructor options against its dataclass fields.

Options reach a task from the shell (``--task-option max_chars=abc``) as whatever
``parse_options`` made of the text, so a wrong type must be caught here, with the option's name,
rather than deep inside data loading. Hand-written because the supported annotations are few
(``int``, ``float``, ``bool``, ``str``, ``Path``, ``Literal``, ``X | None``) and a validation
library would be a dependency for five lines of checks.
"""

from __future__ import annotations

import types
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal, Union

from ktm.errors import KTMError


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    return "None" if hint is type(None) else getattr(hint, "__name__", str(hint))


def _convert(value: Any, hint: Any) -> tuple[bool, Any]:
    """(True, value as the field wants it) when ``value`` fits ``hint``, else (False, None)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return (value in typing.get_args(hint), value)
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(hint):
            ok, out = _convert(value, arg)
            if ok:
                return True, out
        return False, None
    if hint is type(None):
        return value is None, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:  # a bool is an int to Python, not to a user
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else None
    if hint is Path:
        return isinstance(value, (str, Path)), value
    if isinstance(hint, type):
        return isinstance(value, hint), value
    return True, value  # an annotation this checker does not know: the task checks it


def check_options(task_name: str, cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with each value checked (and ints widened to float) against ``cls``'s fields;
    a clear error names the option, its value and what was expected."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls) if f.init}
    unknown = sorted(set(options) - known)
    if unknown:
        raise KTMError(f"task {task_name!r} has no option {', '.join(unknown)}: "
                       f"expected some of {', '.join(sorted(known))}")
    out = {}
    for name, value in options.items():
        ok, out[name] = _convert(value, hints[name])
        if not ok:
            raise KTMError(f"task {task_name!r} option {name}={value!r}: "
                           f"expected {_describe(hints[name])}")
    return out
