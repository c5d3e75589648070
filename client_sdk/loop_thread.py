"""The blocking client's event loop, run on a thread of its own, and the blocking calls into it:
`Client` runs its coroutines there, and so does each of its training jobs (`client_sdk.jobs`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

import uvloop

from client_sdk.connection import GRACE_S
from client_sdk.errors import Timeout
from flowmesh.errors import Code

T = TypeVar("T")


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
        the answer is overdue by then: the coroutine's own timeout ends it first."""
        fut = self.submit(coro)
        limit = seconds + 2 * GRACE_S
        try:
            return fut.result(limit)
        except TimeoutError:
            fut.cancel()
            raise Timeout(Code.TIMEOUT, f"no answer within {limit:.1f} s") from None

    def wait(self, coro: Coroutine[Any, Any, T]) -> T:
        """`coro`'s result, however long it takes."""
        return self.submit(coro).result()

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
