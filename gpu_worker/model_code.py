"""Who may run model code in a worker process at the same time.

Two things model code touches are process-wide, not per thread: torch's default generator (a
training task sets it to its job's RNG state; building a seeded model reseeds it) and torch.fx's
tracer, which patches `nn.Module.__call__` for every thread while it traces (a forward elsewhere
then fails with "module is not installed as a submodule").

- `MODEL_CODE_LOCK`: held by a training task's compute, and by whatever builds, seeds, traces or
  profiles a model (`building_model`), or a job opened while others train changes their dropout
  masks and its own initial weights.
- `SERVING_CALLS`: serving runs use no generator (inference mode) but do call modules, so they
  share it with each other and with training, and only a model being built excludes them. Its
  exclusive side is taken at once by a builder: new serving calls wait behind it (it lasts
  milliseconds) instead of starving it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

MODEL_CODE_LOCK = threading.RLock()


class SharedLock:
    """Many holders of the shared side at once, or one of the exclusive side (reentrant for
    its thread); a waiting exclusive holder goes first."""

    def __init__(self) -> None:
        # The shared side takes `_lock` itself: the same lock as `_cond`'s, without the Python
        # frames of Condition.__enter__/__exit__ on every serving forward.
        self._lock = threading.Lock()  # never taken twice by a thread
        self._cond = threading.Condition(self._lock)
        self._shared = 0
        self._owner: int | None = None
        self._depth = 0
        self._waiting = 0
        self._shared_side = _SharedSide(self)

    def shared(self) -> _SharedSide:
        """The shared side, as a context manager (one object: it is taken for every serving
        forward, where a generator-based one costs more than the forward of a small model)."""
        return self._shared_side

    def acquire_shared(self) -> None:
        with self._lock:
            while self._owner is not None or self._waiting:
                self._cond.wait()
            self._shared += 1

    def release_shared(self) -> None:
        with self._lock:
            self._shared -= 1
            # Only an exclusive holder waits for the shared side to empty.
            if not self._shared and self._waiting:
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            if self._owner != me:
                self._waiting += 1
                while self._owner is not None or self._shared:
                    self._cond.wait()
                self._waiting -= 1
                self._owner = me
            self._depth += 1
        try:
            yield
        finally:
            with self._cond:
                self._depth -= 1
                if not self._depth:
                    self._owner = None
                    self._cond.notify_all()


class _SharedSide:
    __slots__ = ("lock",)

    def __init__(self, lock: SharedLock) -> None:
        self.lock = lock

    def __enter__(self) -> None:
        self.lock.acquire_shared()

    def __exit__(self, *exc: object) -> None:
        self.lock.release_shared()


SERVING_CALLS = SharedLock()


@contextmanager
def building_model() -> Iterator[None]:
    """Held while a model is built, seeded, traced or profiled in a worker process."""
    with MODEL_CODE_LOCK, SERVING_CALLS.exclusive():
        yield
