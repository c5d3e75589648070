"""The blocking client's event loop, run on a thread of its own, and the blocking calls into it:
`Client` runs its coroutines there, and so does each of its training jobs (`client_sdk.jobs`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

import uvloop

from client_sdk.connection import GRACE_S
from client_sdk.errors import Timeout
from flowmesh.errors import Code

T = TypeVar("T")

# How long a blocking call whose caller stopped waiting (Ctrl-C, its deadline) lets the
# cancellation of its coroutine run on the loop before it returns: what the coroutine does as it
# ends (a generate call's StopGenerate to the broker) is done by then. A coroutine that takes
# longer to end goes on ending on the loop, unwaited for.
CANCEL_S = 1.0


class LoopThread:
    """An event loop on a daemon thread. Safe to use from any thread; each call blocks its caller
    only."""

    def __init__(self, name: str = "flowmesh-client") -> None:
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Start `coro` on the loop; its result comes in the returned future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], seconds: float) -> T:
        """`coro`'s result; Timeout past `seconds` (the call's timeout) and twice the grace, as
        the answer is overdue by then: the coroutine's own timeout ends it first. A wait that
        ends otherwise than with the coroutine's result (Timeout, or KeyboardInterrupt or any
        other exception raised in the waiting thread) cancels the coroutine (`_cancel`)."""
        fut = self.submit(coro)
        limit = seconds + 2 * GRACE_S
        try:
            return fut.result(limit)
        except TimeoutError:
            if fut.done():  # its own TimeoutError, or its result just as the wait ended
                return fut.result()
            self._cancel(fut, coro)
            raise Timeout(Code.TIMEOUT, f"no answer within {limit:.1f} s") from None
        except BaseException:
            self._cancel(fut, coro)
            raise

    def wait(self, coro: Coroutine[Any, Any, T]) -> T:
        """`coro`'s result, however long it takes; a wait that ends otherwise (KeyboardInterrupt,
        say) cancels the coroutine (`_cancel`)."""
        fut = self.submit(coro)
        try:
            return fut.result()
        except BaseException:
            self._cancel(fut, coro)
            raise

    def _cancel(self, fut: Future[Any], coro: Coroutine[Any, Any, Any]) -> None:
        """The caller stopped waiting for `coro` (started as `fut`) before its end: cancel it on
        the loop, as a cancelled coroutine of an `AsyncClient` would be, and wait for its
        cancellation to run, for at most CANCEL_S, so that what it does as it ends (a generate
        call stops its sequences on the broker) is done before the caller goes on; a Ctrl-C
        that comes meanwhile ends the wait. Nothing to do when `fut` is done: the exception
        is the coroutine's own, or came as it ended."""
        if fut.done():
            return

        def cancel() -> None:
            # The coroutine's task (made on the loop by `submit`; cancelled here rather than
            # through `fut`, which would be marked done at once, before the task has ended).
            for task in asyncio.all_tasks(self.loop):
                if task.get_coro() is coro:
                    task.cancel()

        try:
            self.loop.call_soon_threadsafe(cancel)
        except RuntimeError:  # the loop is closed: nothing runs on it any more
            fut.cancel()
            return
        if threading.current_thread() is self._thread:
            return  # (the loop cannot run the cancellation while we wait on it)
        concurrent.futures.wait([fut], CANCEL_S)

    @property
    def closed(self) -> bool:
        return self.loop.is_closed()

    def stop(self) -> None:
        """Stop the loop and its thread (once `close` of what runs on it is done)."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)
        self.loop.close()
