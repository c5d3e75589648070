"""The host tier's memory on CUDA: one pinned slab, reserved when the worker starts, sub-allocated.

Without it each stage's host buffer is its own `torch.empty(pin_memory=True)`, which PyTorch's
caching host allocator rounds up to a power of two and never gives back to the system. Here the
worker pins one slab of a fixed size (`--host-tier-bytes`) once, and each host buffer is a range
of it, placed by the same best-fit, coalescing `Arena` as the device tier.

A range goes back to the slab when the buffer's *storage* dies, i.e. when the buffer and every
view taken of it are gone (a view that outlives the buffer tensor keeps the range). The buffer is
a tensor made with `torch.frombuffer` over a small ctypes array that addresses the range; the
tensor's storage holds the only reference to that array, and `weakref.finalize` on the array
returns the range. Callers keep calling `device.host_buffer(nbytes)` and dropping the result.

The slab is any uint8 CPU tensor, so the logic is unit-tested on a plain (unpinned) one.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections import deque

import torch

from flowmesh.errors import Code, FlowmeshError
from gpu_worker.memory import Arena, Extent, OutOfSpace

PAGE = 4096


class HostSlab:
    """Ranges of one host tensor (`slab`), handed out as tensors and returned when they die.

    Thread-safe: buffers are made on the deploy thread and die on whichever thread drops the last
    reference (or in the garbage collector, possibly in the middle of `take` on the same thread).
    A dying buffer therefore only queues its range; the queue is drained under the lock by the
    next `take` or figure read, or at once when the lock is free.
    """

    def __init__(self, slab: torch.Tensor, option: str = "--host-tier-bytes") -> None:
        if slab.dtype != torch.uint8 or slab.dim() != 1 or slab.device.type != "cpu":
            raise ValueError("a host slab is a 1-D uint8 CPU tensor")
        self.slab = slab
        self.option = option  # named in the error when the slab is full
        self._base = slab.data_ptr()
        self._arena = Arena(slab.numel(), PAGE)
        self._lock = threading.Lock()
        self._returned: deque[Extent] = deque()
        self.buffers = 0  # live buffers
        self.taken = 0  # buffers ever handed out

    @property
    def capacity(self) -> int:
        return self._arena.capacity

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of `nbytes` in the slab; NO_SPACE when no free range is large enough."""
        with self._lock:
            self._drain()
            try:
                ext = self._arena.alloc(max(nbytes, 1))
            except OutOfSpace as exc:
                raise FlowmeshError(
                    Code.NO_SPACE,
                    f"host tier full: a {nbytes}-byte host buffer does not fit in the "
                    f"{self.capacity}-byte pinned host tier ({exc}); raise {self.option}",
                ) from None
            self.buffers += 1
            self.taken += 1
        # One ctypes type per page count (ctypes caches array types: keep their number small).
        span = (ctypes.c_uint8 * ext.size).from_address(self._base + ext.offset)
        # `self` (and so the slab) stays alive while the finalizer is pending.
        weakref.finalize(span, self._give_back, ext)
        return torch.frombuffer(span, dtype=torch.uint8, count=nbytes) if nbytes else _empty(span)

    def _give_back(self, ext: Extent) -> None:
        self._returned.append(ext)  # atomic: safe from any thread, and from the GC inside `take`
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self) -> None:
        while self._returned:
            self._arena.free(self._returned.popleft(), [])
            self.buffers -= 1

    def _figures(self) -> tuple[int, int, int, int]:
        with self._lock:
            self._drain()
            a = self._arena
            return a.in_use, a.peak, a.largest_free, self.buffers

    @property
    def used_bytes(self) -> int:
        return self._figures()[0]

    def stats(self) -> dict[str, int]:
        used, peak, largest, buffers = self._figures()
        return {
            "host_tier_bytes": self.capacity,
            "host_tier_used_bytes": used,
            "host_tier_peak_bytes": peak,
            "host_tier_largest_free": largest,
            "host_tier_buffers": buffers,
        }


def _empty(span: ctypes.Array[ctypes.c_uint8]) -> torch.Tensor:
    # A zero-length buffer still holds its (one-page) range until it dies.
    return torch.frombuffer(span, dtype=torch.uint8, count=1)[:0]
