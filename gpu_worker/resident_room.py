"""Device memory outside the arena that training's stashes may stay in between their tasks.

Memory flow keeps what crosses from one task of a step to a later one (an activation between
sub-models, an incoming gradient, what a kept or selective forward saved for its backward) in
the host tier, copied out on the stash lane and brought back by the copy lane
(`gpu_worker.train_job`). Where the device has room for it, a stash stays where the compute
made it instead: no copy either way (issue 23 §1, "kept resident between the forward and the
backward of the same step when they fit"). The room is memory torch's allocator holds beside
the arena, shared by every job of the worker. A stash holds a lease on its tensor's storage,
one per storage however many stashes share it (autograd saves one tensor for several
operations; a sub-model's output is also the next one's input): the lease takes the storage's
bytes when the first of them is made and gives them back once the last is dropped (its
backward ran, or its step ended or failed), so that what stays resident at once never passes
the limit.
"""

from __future__ import annotations

import threading
import weakref

import torch

# The share of the device memory still free once the arena is reserved that stashes may keep by
# default (`CudaDevice`): the rest is for the tasks' own activations while they compute (which
# live there too, beside the arena), serving's, and the kernels' workspaces.
FREE_SHARE = 0.25
# `ResidentRoom.stats` of a device whose stashes are never copied (the CPU stand-in's default).
NO_ROOM = {
    "stash_device_bytes": 0,
    "stash_device_peak": 0,
    "stash_device_limit": 0,
    "stash_device_kept_bytes": 0,
    "stash_host_bytes": 0,
}


class Lease:
    """Held by every stash of one storage; its bytes go back when the last one is dropped."""

    __slots__ = ("__weakref__",)

    def done(self) -> bool:
        return True  # what a stash's `landed` says: nothing to wait for, it never moved


class ResidentRoom:
    """At most `limit` bytes of stashes on the device at once (0: none, every stash goes to
    the host tier). Leases are taken on the compute lane; bytes come back on whichever thread
    drops a lease's last reference, perhaps the garbage collector's, under this very lock (a
    reentrant one)."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"a resident room of {limit} bytes")
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.kept_bytes = 0  # stash bytes that stayed on the device, all told
        self.copied_bytes = 0  # stash bytes that did not fit and went to the host tier
        self._lock = threading.RLock()
        # Storage address -> its live lease (an address is one storage's while a lease on it
        # lives: the stashes holding the lease hold the storage).
        self._leases: weakref.WeakValueDictionary[int, Lease] = weakref.WeakValueDictionary()

    def lease(self, t: torch.Tensor) -> Lease | None:
        """A lease on `t`'s storage (its whole storage stays alive, a view's base too, so that
        is what is counted), shared with the stashes already holding one; else None: no room
        (counted as copied to the host tier)."""
        storage = t.untyped_storage()
        with self._lock:
            lease = self._leases.get(storage.data_ptr())
            if lease is not None:
                return lease
            nbytes = storage.nbytes()
            if not self.limit or self.used + nbytes > self.limit:
                self.copied_bytes += t.numel() * t.element_size()
                return None
            self.used += nbytes
            self.peak = max(self.peak, self.used)
            self.kept_bytes += nbytes
            lease = self._leases[storage.data_ptr()] = Lease()
        weakref.finalize(lease, self._give, nbytes)
        return lease

    def _give(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "stash_device_bytes": self.used,
                "stash_device_peak": self.peak,
                "stash_device_limit": self.limit,
                "stash_device_kept_bytes": self.kept_bytes,
                "stash_host_bytes": self.copied_bytes,
            }
