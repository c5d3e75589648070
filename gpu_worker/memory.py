"""The device tier's allocator: byte ranges of one arena, reusable in stream order.

The arena is one buffer of exactly the budget, so the budget can never be exceeded. A freed range
goes back to the free list at once, together with the markers of its last users; whoever is
given that range next must order its work after those markers (a CUDA stream waits on their
events, a CPU copy thread waits on them). Memory is therefore reusable as soon as its release is
*scheduled*, not after a global synchronisation — the Waterwave memory-flow rule.

Pure bookkeeping: no torch, driven in-process by unit tests.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Protocol


class Marker(Protocol):
    """A point in some lane's work (a CUDA event, or a CPU task's completion)."""

    def done(self) -> bool: ...


@dataclass
class Extent:
    offset: int
    size: int
    # Work that last used these bytes; a new owner must be ordered after it.
    after: list[Marker] = field(default_factory=list)


class OutOfSpace(Exception):
    """No free range is large enough (the bytes may exist, split by fragmentation)."""

    def __init__(self, wanted: int, free: int, largest: int) -> None:
        super().__init__(f"need {wanted} contiguous bytes; {free} free, largest range {largest}")
        self.wanted, self.free, self.largest = wanted, free, largest


class Arena:
    """Best-fit allocator over [0, capacity) with coalescing and stream-ordered reuse."""

    def __init__(self, capacity: int, align: int = 256) -> None:
        if capacity <= 0:
            raise ValueError("arena capacity must be positive")
        self.capacity = capacity
        self.align = align
        self._free: list[Extent] = [Extent(0, capacity)]  # sorted by offset, never adjacent
        self.in_use = 0
        self.peak = 0

    def round(self, nbytes: int) -> int:
        return max(self.align, -(-nbytes // self.align) * self.align)

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.in_use

    @property
    def largest_free(self) -> int:
        return max((e.size for e in self._free), default=0)

    def alloc(self, nbytes: int) -> Extent:
        size = self.round(nbytes)
        best: int | None = None
        for i, ext in enumerate(self._free):
            if ext.size >= size and (best is None or ext.size < self._free[best].size):
                best = i
        if best is None:
            raise OutOfSpace(size, self.free_bytes, self.largest_free)
        ext = self._free[best]
        after = [m for m in ext.after if not m.done()]
        got = Extent(ext.offset, size, list(after))
        if ext.size == size:
            del self._free[best]
        else:
            self._free[best] = Extent(ext.offset + size, ext.size - size, after)
        self.in_use += size
        self.peak = max(self.peak, self.in_use)
        return got

    def alloc_many(self, sizes: list[int]) -> list[Extent]:
        """All or nothing: either every size gets a range, or nothing is taken."""
        got: list[Extent] = []
        try:
            for n in sizes:
                got.append(self.alloc(n))
        except OutOfSpace as exc:
            for ext in got:
                self.free(ext, [])
            raise OutOfSpace(
                sum(self.round(n) for n in sizes), self.free_bytes, self.largest_free
            ) from exc
        return got

    def free(self, ext: Extent, after: list[Marker]) -> None:
        """Return `ext`; its next owner will be ordered after `after` (and older markers)."""
        pending = [m for m in (*ext.after, *after) if not m.done()]
        self.in_use -= ext.size
        new = Extent(ext.offset, ext.size, pending)
        offsets = [e.offset for e in self._free]
        i = bisect.bisect_left(offsets, new.offset)
        if i > 0 and self._free[i - 1].offset + self._free[i - 1].size > new.offset:
            raise ValueError(f"double free of range at {new.offset}")
        if i < len(self._free) and new.offset + new.size > self._free[i].offset:
            raise ValueError(f"double free of range at {new.offset}")
        self._free.insert(i, new)
        # Coalesce with the right then the left neighbour; markers of both sides carry over.
        if i + 1 < len(self._free) and new.offset + new.size == self._free[i + 1].offset:
            right = self._free.pop(i + 1)
            new.size += right.size
            new.after.extend(right.after)
        if i > 0 and self._free[i - 1].offset + self._free[i - 1].size == new.offset:
            left = self._free[i - 1]
            left.size += new.size
            left.after.extend(new.after)
            del self._free[i]

    def free_extents(self) -> list[tuple[int, int]]:
        return [(e.offset, e.size) for e in self._free]
