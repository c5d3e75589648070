"""What keeping a stage on a device is worth: shared by the broker (which replica to load) and
the worker (which of its stages to evict), so both rank stages by the same rule."""

from __future__ import annotations

import math


class ArrivalRate:
    """An exponentially decayed count of arrivals: about the arrivals per second over the last
    `tau` seconds, cheap to update and to read at any time."""

    __slots__ = ("t", "tau", "value")

    def __init__(self, tau: float = 30.0) -> None:
        self.tau, self.value, self.t = tau, 0.0, 0.0

    def add(self, now: float, n: float = 1.0) -> None:
        self.value = self.at(now) + n / self.tau
        self.t = now

    def at(self, now: float) -> float:
        return self.value * math.exp(-max(0.0, now - self.t) / self.tau)


def stage_value(rate: float, nbytes: int, bandwidth: float, kv_bytes: int = 0) -> float:
    """What keeping a stage resident is worth: the expected cost of bringing it back per second,
    its model's arrival rate times the seconds its bytes take to copy in (`bandwidth` bytes/s).

    `kv_bytes`: the live KV cache it holds beside its weights, which would go with it (copied
    back, or recomputed from the tokens: at least as dear), so it counts as bytes to bring back:
    a model with live sequences is worth more to keep than its weights alone."""
    return rate * (nbytes + kv_bytes) / max(bandwidth, 1.0)
