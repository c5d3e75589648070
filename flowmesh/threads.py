"""Thread pools for torch work that honour the process's torch thread count.

`torch.set_num_threads(n)` sets OpenMP's thread count for the calling thread only. A thread
started later gets OpenMP's default (every core) until torch happens to initialise it, and some
kernels (GELU, for one) open a parallel region before that: on a worker started with
`--threads 1`, each such op then ran on every core, and OpenMP's idle threads spin after each
region, so a 16-float GELU cost twice its CPU time. Every pool that runs torch work is built
here and sets the creating thread's count in each of its threads at start.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

T = TypeVar("T")

# How long the interpreter's exit waits, in all, for lane threads still finishing a call.
EXIT_JOIN_S = 5.0


def torch_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A pool whose threads run torch with the thread count of the thread creating it."""
    return ThreadPoolExecutor(
        workers,
        thread_name_prefix=name,
        initializer=torch.set_num_threads,
        initargs=(torch.get_num_threads(),),
    )


class TorchLanes:
    """Threads that run torch calls for an event loop: `submit` returns an asyncio future,
    settled on the loop when the call returns.

    What `loop.run_in_executor` on a `torch_pool` does, without concurrent.futures' machinery
    between the two (a Future with its condition variable per call, chained to the asyncio
    future through callbacks), which shows on every run of a small model
    (scripts/bench_lanes.py compares the two). Like a `torch_pool`, each thread runs torch with
    the thread count of the thread creating the lanes.

    The threads are daemons, so that a call that never returns cannot hold the process up, but
    the interpreter's exit stops and joins them first (`_join_at_exit`, up to `EXIT_JOIN_S` in
    all): a daemon thread still alive when the interpreter finalizes is ended where
    it next takes the GIL, inside torch's C++ as likely as not, which aborts the process
    ("terminate called without an active exception") after its work was done.
    """

    def __init__(self, workers: int, name: str) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        threads = torch.get_num_threads()
        self._threads = [
            threading.Thread(target=self._work, args=(threads,), name=f"{name}_{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()
        _LIVE_LANES.add(self)

    def submit(
        self, loop: asyncio.AbstractEventLoop, fn: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        if self._closed:
            raise RuntimeError("cannot run on lanes that were shut down")
        fut: asyncio.Future[T] = loop.create_future()
        self._queue.put((loop, fut, fn, args))
        return fut

    def shutdown(self, wait: bool = False, cancel_futures: bool = True) -> None:
        """Stop the threads once they finish their current call; calls not started are
        cancelled (`cancel_futures`) or still run first."""
        self._closed = True
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    loop, fut = item[0], item[1]
                    with contextlib.suppress(RuntimeError):  # its loop is closed already
                        loop.call_soon_threadsafe(fut.cancel)
        for _ in self._threads:
            self._queue.put(None)  # one each: a second shutdown's are never read
        if wait:
            for t in self._threads:
                t.join()

    def _work(self, threads: int) -> None:
        torch.set_num_threads(threads)
        while True:
            item = self._queue.get()
            if item is None:
                return
            run_one(*item)
            # What the call was given must not outlive it while the thread waits for the next
            # (a stage's host buffer goes back to its slab when nothing holds the stage).
            del item


_LIVE_LANES: weakref.WeakSet[TorchLanes] = weakref.WeakSet()


@atexit.register
def _join_at_exit() -> None:
    """At the interpreter's exit (atexit runs before daemon threads are stopped): every lane
    thread still alive ends its call and stops (see `TorchLanes`), within `EXIT_JOIN_S` for
    them all."""
    every = list(_LIVE_LANES)
    for lanes in every:
        lanes.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + EXIT_JOIN_S
    for lanes in every:
        for t in lanes._threads:
            t.join(max(0.0, deadline - time.monotonic()))


def run_one(
    loop: asyncio.AbstractEventLoop,
    fut: asyncio.Future[Any],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    """`fn(*args)` here, its result or error settling `fut` on `loop`."""
    try:
        result, error = fn(*args), None
    except BaseException as exc:  # the caller's future carries it, whatever it is
        result, error = None, exc
    with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits
        loop.call_soon_threadsafe(_settle, fut, result, error)


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.done():  # cancelled meanwhile
        return
    if error is None:
        fut.set_result(result)
    elif isinstance(error, StopIteration):  # a future cannot hold one
        fut.set_exception(RuntimeError(f"StopIteration: {error}"))
    else:
        fut.set_exception(error)
