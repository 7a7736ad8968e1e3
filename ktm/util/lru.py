"""Least-recently-used entries within a byte budget: the server's prefix caches.

Two instances: merged embeddings of compressed segments (keyed by the segment's token ids, used
by ``ktm.core.prefix.merge_segments``, held by the serving engine) and the KV of a prompt's
leading context (keyed by its segments, held by ``ktm.decode.runtime.TorchRuntime``, which also
finds the entry sharing the most leading rows with a prompt). Only the
engine thread touches them. A plain ``OrderedDict`` does LRU in a few lines;
``functools.lru_cache`` cannot bound bytes or be filled from outside.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator, MutableMapping
from typing import Any

import torch


def nbytes(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    raise TypeError(f"cannot size a {type(value).__name__}")


class LRUCache(MutableMapping):
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._data: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self.bytes = self.hits = self.stores = 0

    def __getitem__(self, key: Hashable) -> Any:
        value, _ = self._data[key]
        self._data.move_to_end(key)
        self.hits += 1
        return value

    def peek(self, key: Hashable) -> Any:
        """The value, leaving the order and the hit count as they are (a search's look)."""
        return self._data[key][0]

    def __setitem__(self, key: Hashable, value: Any) -> None:
        size = nbytes(value)
        if size > self.max_bytes:
            return  # larger than the whole budget (or caching is off): not kept
        if key in self._data:
            del self[key]
        self._data[key] = (value, size)
        self.bytes += size
        self.stores += 1
        while self.bytes > self.max_bytes:
            del self[next(iter(self._data))]

    def __delitem__(self, key: Hashable) -> None:
        _, size = self._data.pop(key)
        self.bytes -= size

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def stats(self) -> dict:
        return {"entries": len(self), "bytes": self.bytes, "max_bytes": self.max_bytes,
                "hits": self.hits, "stores": self.stores}
