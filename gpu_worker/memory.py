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
import threading
from collections.abc import Callable
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

    def alloc(self, nbytes: int, below: int | None = None) -> Extent:
        """The best-fitting range; with `below`, one that ends at or before that offset."""
        size = self.round(nbytes)
        limit = self.capacity if below is None else below
        best: int | None = None
        best_room = 0
        for i, ext in enumerate(self._free):
            room = min(ext.size, limit - ext.offset)  # a range is taken from its extent's start
            if room >= size and (best is None or room < best_room):
                best, best_room = i, room
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

    def take(self, offset: int, nbytes: int) -> Extent | None:
        """The range [offset, offset + round(nbytes)) if it is free, else None."""
        size = self.round(nbytes)
        for i, ext in enumerate(self._free):
            if ext.offset <= offset and offset + size <= ext.offset + ext.size:
                after = [m for m in ext.after if not m.done()]
                pieces = []
                if offset > ext.offset:
                    pieces.append(Extent(ext.offset, offset - ext.offset, list(after)))
                end = ext.offset + ext.size
                if offset + size < end:
                    pieces.append(Extent(offset + size, end - offset - size, list(after)))
                self._free[i : i + 1] = pieces
                self.in_use += size
                self.peak = max(self.peak, self.in_use)
                return Extent(offset, size, list(after))
        return None

    def alloc_many(self, sizes: list[int], below: int | None = None) -> list[Extent]:
        """All or nothing: either every size gets a range, or nothing is taken."""
        got: list[Extent] = []
        try:
            for n in sizes:
                got.append(self.alloc(n, below))
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


class DeviceMemory:
    """The one owner of a worker's device arena: serving stages and training tasks both take
    their ranges here, and inference comes first.

    - Serving is planned by the broker against `serving_bytes`; training is guaranteed
      `train_bytes` (the broker places jobs against it). The arena is their sum, and serving's
      ranges all lie in its first `serving_bytes`: the rest is training's alone, so however
      serving's stages are placed, a task of up to `train_bytes` finds one range once
      training's earlier tasks have left it. (Stages placed anywhere split it: once serving
      went idle, a task could wait for ever for bytes that were free, only not in one piece.)
    - Training fills the gaps: a training task may take any free range, also one serving is not
      using. Serving takes it back at once: a serving load that does not fit while training holds
      ranges in serving's part (`lent`) *claims* memory; from then on training admits nothing,
      and its executor gives back every range whose task has not started computing
      (`reclaim`). A task already computing released its range when its compute was ordered, so
      a serving load waits for at most one training compute (the copy is ordered after it, as
      any reuse is).
    - On the CPU stand-in copies and computes share the cores: training computes only while no
      serving load or run is in flight (`serving_busy`); on a GPU, stream priorities order them.
    - A pipelined job's stage holds its bytes for the job's life (`hold`): at the top of the
      arena, each below the last, so that what training's tasks take from stays one piece below
      them (`alloc_training` never reaches into the held top, nor into the range a `hold` waits
      for: its tasks' ranges leave it as they end, and none is given it meanwhile).

    Thread-safe: serving allocates on the event loop, training on its driver thread. Listeners
    run on the thread that caused the event and must only hand work to their own thread.
    """

    def __init__(self, serving_bytes: int, train_bytes: int = 0, align: int = 256) -> None:
        if serving_bytes < 0 or train_bytes < 0 or serving_bytes + train_bytes <= 0:
            raise ValueError("device memory needs a positive serving or training budget")
        self.serving_bytes = serving_bytes
        self.train_bytes = train_bytes
        self.arena = Arena(serving_bytes + train_bytes, align)
        # Serving's ranges end at or before this offset (an aligned range ends on the boundary).
        self.split = serving_bytes // align * align
        self._lock = threading.RLock()
        self.used = {"serving": 0, "training": 0}
        self.lent = 0  # bytes of training's ranges below `split`: what a claim can take back
        self.peak = {"serving": 0, "training": 0}
        self.claims = 0  # serving loads waiting for training to give ranges back
        self.busy = 0  # serving loads and runs in flight
        self.counters = {"claims": 0, "reclaimed_bytes": 0, "borrowed_peak": 0}
        # Called when training must give back every range it can.
        self.on_claim: list[Callable[[], None]] = []
        # Called when training freed a range: a waiting serving load may fit now.
        self.wake_serving: list[Callable[[], None]] = []
        # Called when serving freed a range, stopped claiming or went idle: training may go on.
        self.wake_training: list[Callable[[], None]] = []
        # Ranges held for a pipelined stage's life, at the top (`hold`); `fence`: bytes below
        # them a hold waits for, which no training task is given meanwhile.
        self.holds: list[Extent] = []
        self.fence = 0

    @property
    def capacity(self) -> int:
        return self.arena.capacity

    def round(self, nbytes: int) -> int:
        return self.arena.round(nbytes)

    def _below_split(self, ext: Extent) -> int:
        return max(0, min(ext.offset + ext.size, self.split) - ext.offset)

    def _took(self, tenant: str, size: int) -> None:
        self.used[tenant] += size
        self.peak[tenant] = max(self.peak[tenant], self.used[tenant])
        if tenant == "training":
            borrowed = self.used["training"] - self.train_bytes
            self.counters["borrowed_peak"] = max(self.counters["borrowed_peak"], borrowed)

    def alloc_serving(self, sizes: list[int]) -> list[Extent]:
        """All or nothing, below `split`; raises OutOfSpace (then `claim` if training holds
        ranges there, `lent`)."""
        with self._lock:
            got = self.arena.alloc_many(sizes, self.split)
            self._took("serving", sum(e.size for e in got))
            return got

    @property
    def held_bytes(self) -> int:
        """Bytes from the lowest hold to the arena's end (a hole a hold left there included:
        tasks are not given it until the holds above it go)."""
        return self.capacity - self._top() if self.holds else 0

    def _top(self) -> int:
        return min((e.offset for e in self.holds), default=self.capacity)

    def task_room(self) -> int:
        """The largest training task that can ever be given a range (the holds and a hold's
        wait kept out)."""
        return self.train_bytes - self.held_bytes - self.fence

    def alloc_training(self, nbytes: int) -> Extent | None:
        """A range for a training task, or None: no room, or serving is claiming memory."""
        with self._lock:
            if self.claims:
                return None
            try:
                ext = self.arena.alloc(nbytes, below=self._top() - self.fence)
            except OutOfSpace:
                return None
            self._took("training", ext.size)
            self.lent += self._below_split(ext)
            return ext

    def hold(self, nbytes: int) -> Extent | None:
        """A range for a pipelined stage's life: in a hole a closed stage left among the holds,
        else just below them (the top of the arena first), within training's part; None while
        training's tasks still use part of it: from now on none is given that part (`fence`),
        and the caller tries again once a task's range was freed (`wake_training`). Raises
        OutOfSpace if it can never fit."""
        with self._lock:
            size = self.arena.round(nbytes)
            top, align = self._top(), self.arena.align
            for start, room in reversed(self.arena.free_extents()):
                if start >= top and room >= size:  # a hole a closed stage left among the holds
                    ext = self.arena.take((start + room - size) // align * align, size)
                    if ext is not None:
                        self.holds.append(ext)
                        self._took("training", ext.size)
                        return ext
            offset = (top - size) // align * align
            if offset < self.split:
                free = self._top() - self.split
                raise OutOfSpace(size, max(0, free), max(0, free))
            ext = self.arena.take(offset, size)
            if ext is None:
                self.fence = max(self.fence, self._top() - offset)
                return None
            self.fence = 0
            self.holds.append(ext)
            self._took("training", ext.size)
            return ext

    def unfence(self) -> None:
        """A hold that waited gave up: training's tasks may have its part again."""
        with self._lock:
            self.fence = 0
        for fn in self.wake_training:
            fn()

    def release(self, ext: Extent, after: list[Marker]) -> None:
        """A hold's range back (its stage closed), its next owner ordered after `after`."""
        with self._lock:
            self.holds.remove(ext)
        self.free(ext, after, "training")

    def free(self, ext: Extent, after: list[Marker], tenant: str, reclaimed: bool = False) -> None:
        """Return `ext`; its next owner is ordered after `after`. `reclaimed`: training gave it
        back unused because serving claimed memory."""
        with self._lock:
            self.arena.free(ext, after)
            self.used[tenant] -= ext.size
            if tenant == "training":
                self.lent -= self._below_split(ext)
            if reclaimed:
                self.counters["reclaimed_bytes"] += ext.size
            fenced = self.fence > 0
        for fn in self.wake_serving if tenant == "training" else self.wake_training:
            fn()
        if fenced and tenant == "training":  # a hold waits for training's ranges to leave
            for fn in self.wake_training:
                fn()

    def claim(self) -> None:
        """A serving load is waiting: training stops admitting and gives back what it can."""
        with self._lock:
            self.claims += 1
            self.counters["claims"] += 1
        for fn in self.on_claim:
            fn()

    def unclaim(self) -> None:
        with self._lock:
            self.claims -= 1
            quiet = self.claims == 0
        if quiet:
            for fn in self.wake_training:
                fn()

    def serving_started(self) -> None:
        with self._lock:
            self.busy += 1

    def serving_ended(self) -> None:
        with self._lock:
            self.busy -= 1
            quiet = self.busy == 0
        if quiet:
            for fn in self.wake_training:
                fn()

    def serving_busy(self) -> bool:
        return self.busy > 0 or self.claims > 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "arena_bytes": self.arena.capacity,
                "arena_in_use": self.arena.in_use,
                "arena_peak": self.arena.peak,
                "arena_largest_free": self.arena.largest_free,
                "serving_in_use": self.used["serving"],
                "training_in_use": self.used["training"],
                "training_held": self.held_bytes,
                "memory_claims": self.counters["claims"],
                "train_reclaimed_bytes": self.counters["reclaimed_bytes"],
                "train_borrowed_peak": max(0, self.counters["borrowed_peak"]),
            }
