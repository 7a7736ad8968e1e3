"""Checks a config dataclass's scalar fields against their annotations, on construction.

A wrong type would otherwise pass silently (``use_mlp="no"`` is truthy, so it meant True) or
fail far from the call (``seed="x"`` inside torch, ``lr="1e-4"`` inside the optimizer). A leaf
module: no torch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import get_type_hints

from ktm.errors import KTMError

# annotation -> (accepts the value, what was expected)
_SCALARS = {
    bool: (lambda v: isinstance(v, bool), "a bool (True or False)"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    # an int is a fine float (lr=1); a bool is not; NaN or a range is the class's own rule
    float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    str: (lambda v: isinstance(v, str), "a str"),
}


@functools.cache
def _checked_fields(cls: type) -> tuple[tuple[str, type, bool], ...]:
    """A dataclass's fields whose annotation is a scalar of ``_SCALARS``: (name, scalar, may it
    be None), worked out once per class (``get_type_hints`` evaluates every annotation, which
    costs more than the check: a prompt of thousands of segments checks thousands)."""
    hints = get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        args = getattr(hint, "__args__", None)
        optional = bool(args) and type(None) in args and len(args) == 2
        if optional:
            hint = next(a for a in args if a is not type(None))
        if hint in _SCALARS:
            out.append((f.name, hint, optional))
    return tuple(out)


def check_field_types(obj: object) -> None:
    """Raise a KTMError naming the first field whose value does not match a ``bool``, ``int``,
    ``float`` or ``str`` annotation (optionally ``| None``); other annotations are the class's
    own business."""
    for name, hint, optional in _checked_fields(type(obj)):
        value = getattr(obj, name)
        if optional and value is None:
            continue
        ok, expected = _SCALARS[hint]
        if not ok(value):
            raise KTMError(f"{type(obj).__name__}.{name} must be {expected}"
                           f"{' or None' if optional else ''}, got {value!r}")


def check_at_least(obj: object, minimum: int, *names: str, flags: bool = False) -> None:
    """Raise a KTMError naming the first of ``names`` (fields of ``obj``) below ``minimum``:
    the one home of the config classes' ``>= 1`` / ``>= 0`` checks. ``flags=True`` names the
    field as its CLI flag (``n_train`` -> ``--n-train``), for configs only the CLI builds."""
    for name in names:
        value = getattr(obj, name)
        shown = f"--{name.replace('_', '-')}" if flags else name
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise KTMError(f"{shown} must be a number >= {minimum}, got {value!r}")
        if not value >= minimum:  # NaN too
            raise KTMError(f"{shown} must be >= {minimum}, got {value!r}")
