"""A typed config's settings by flag name: which fields a dataclass offers as settings, and the
dataclass built back from a mapping of them (the CLI's parsed flags, or settings a library
caller gives by name).

A field's name is its own (``metadata["flag"]`` renames it; None: not a setting); a nested
dataclass field adds its own fields with a prefix, the field's name and an underscore
(``metadata["prefix"]`` renames it; "": none), so ``KTMConfig.lora.r`` is ``lora_r``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any


def unwrap(kind: Any) -> Any:
    """``X | None`` -> ``X``; ``int | tuple[int, ...]`` -> the tuple (a flag taking values)."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kinds = [t for t in typing.get_args(kind) if t is not type(None)]
        return next((t for t in kinds if typing.get_origin(t) is tuple), kinds[0])
    return kind


def nested_prefix(prefix: str, f: dataclasses.Field) -> str:
    """A nested dataclass's settings: the field's name (or ``metadata["prefix"]``; "": none)
    and an underscore before each of its own."""
    own = f.metadata.get("prefix", f.name)
    return prefix + own + "_" if own else prefix


def flag_fields(cls: type, prefix: str = "", nested: bool = True, group: str | None = None
                ) -> Iterator[tuple[str, dataclasses.Field, Any, str | None]]:
    """(name, field, type, group) for every setting of ``cls``, nested dataclasses flattened
    with their prefix (``nested`` False: left out). The group, for ``--help``, is the field's
    ``metadata["group"]``, else that of the nested dataclass field holding it."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = unwrap(hints[f.name])
        here = f.metadata.get("group", group)
        if dataclasses.is_dataclass(kind):
            if nested:
                yield from flag_fields(kind, nested_prefix(prefix, f), True, here)
        elif f.metadata.get("flag", f.name) is not None:
            yield prefix + f.metadata.get("flag", f.name), f, kind, here


def from_flags(cls: type, values: Mapping[str, Any], base: Any = None, prefix: str = "",
               **fields: Any) -> Any:
    """Build ``cls`` from settings by flag name; a setting absent from ``values`` takes
    ``base``'s value (else the field's default). Tuple fields get tuples back. ``fields``: some
    of ``cls``'s fields given outright, by field name."""
    hints = typing.get_type_hints(cls)
    built = dict(fields)
    for f in dataclasses.fields(cls):
        if f.name in fields:
            continue
        kind = unwrap(hints[f.name])
        if dataclasses.is_dataclass(kind):
            inner, sub = getattr(base, f.name, None), nested_prefix(prefix, f)
            # an optional config left as it was (None), none of its settings changed, stays None
            if kind is not hints[f.name] and inner is None and not _changed(kind, values, sub):
                built[f.name] = None
            else:
                built[f.name] = from_flags(kind, values, inner, sub)
            continue
        flag = f.metadata.get("flag", f.name)
        name = None if flag is None else prefix + flag
        if name is not None and name in values:
            v = values[name]
            if typing.get_origin(kind) is tuple and isinstance(v, list):
                v = tuple(v)
            built[f.name] = v
        elif base is not None:
            built[f.name] = getattr(base, f.name)
    return cls(**built)


def default(f: dataclasses.Field) -> Any:
    """The field's default value (its factory's, for a mutable one)."""
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _changed(cls: type, values: Mapping[str, Any], prefix: str) -> bool:
    """Whether ``values`` set any of ``cls``'s settings to other than its default."""
    return any(name in values and values[name] != default(f)
               for name, f, *_ in flag_fields(cls, prefix))
