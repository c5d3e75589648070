"""The broker's cache of partitioner answers (plan and declared inputs), by request hash.

Any client key may ask for a plan, and each distinct request is an entry: the cache is bounded by
the bytes its entries take in memory, and the least recently used go first. A deploy of a spec
planned before, or the same plan asked for again, is answered from it without a partitioner.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Any

import msgspec

PLAN_CACHE_BYTES = 8 << 20


def deep_size(obj: Any) -> int:
    """The bytes `obj` takes as Python objects, with what its dicts, lists and structs (a plan,
    a spec) hold (shared
    objects counted each time they are held: an upper bound). No recursion: a plan echoes the
    client's spec, nested as deep as the client likes."""
    size, todo = 0, [obj]
    while todo:
        item = todo.pop()
        size += sys.getsizeof(item)
        if isinstance(item, dict):
            todo += item.keys()
            todo += item.values()
        elif isinstance(item, list | tuple):
            todo += item
        elif isinstance(item, msgspec.Struct):
            todo += (getattr(item, f) for f in item.__struct_fields__)
    return size


class PlanCache:
    def __init__(self, max_bytes: int = PLAN_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, dict[str, Any]] = OrderedDict()  # least recent first
        self.sizes: dict[str, int] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: str) -> dict[str, Any] | None:
        answer = self.entries.get(key)
        if answer is not None:
            self.entries.move_to_end(key)
        return answer

    def put(self, key: str, answer: dict[str, Any]) -> None:
        """Keep `answer`, making room by dropping the least recently used (one over the whole
        bound is not kept at all)."""
        self._drop(key)
        size = deep_size(answer)
        if size > self.max_bytes:
            return
        while self.nbytes + size > self.max_bytes:
            self._drop(next(iter(self.entries)))
        self.entries[key] = answer
        self.sizes[key] = size
        self.nbytes += size

    def _drop(self, key: str) -> None:
        if self.entries.pop(key, None) is not None:
            self.nbytes -= self.sizes.pop(key)
