"""Device memory outside the arena that training's stashes may stay in between their tasks.

Memory flow keeps what crosses from one task of a step to a later one (an activation between
sub-models, an incoming gradient, what a kept or selective forward saved for its backward) in
the host tier, copied out on the stash lane and brought back by the copy lane
(`gpu_worker.train_job`). Where the device has room for it, a stash stays where the compute
made it instead: no copy either way (issue 23 §1, "kept resident between the forward and the
backward of the same step when they fit"). The room is memory torch's allocator holds beside
the arena, shared by every job of the worker; a stash takes its bytes when it is made and gives
them back when it is dropped (its backward ran, or its step ended), so that what stays resident
at once never passes the limit.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

# The share of the device memory still free once the arena and the host tier are reserved that
# stashes may keep by default (`CudaDevice`): the rest is for the tasks' own activations while
# they compute, serving's, and the kernels' workspaces.
FREE_SHARE = 0.5
# `ResidentRoom.stats` of a device whose stashes are never copied (the CPU stand-in's default).
NO_ROOM = {
    "stash_device_bytes": 0,
    "stash_device_peak": 0,
    "stash_device_limit": 0,
    "stash_device_kept_bytes": 0,
    "stash_host_bytes": 0,
}


class ResidentRoom:
    """At most `limit` bytes of stashes on the device at once. `take` is called on the compute
    lane; bytes come back from whichever thread drops a stash's last reference (`hold`)."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"a resident room of {limit} bytes")
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.kept_bytes = 0  # stash bytes that stayed on the device, all told
        self.copied_bytes = 0  # stash bytes that did not fit and went to the host tier
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bool:
        """Room for `nbytes` more, taken; else False (counted as copied to the host)."""
        with self._lock:
            if self.used + nbytes > self.limit:
                self.copied_bytes += nbytes
                return False
            self.used += nbytes
            self.peak = max(self.peak, self.used)
            self.kept_bytes += nbytes
            return True

    def hold(self, owner: Any, nbytes: int) -> None:
        """`nbytes`, taken, are given back once `owner` is garbage."""
        weakref.finalize(owner, self._give, nbytes)

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
