"""Calls to the broker that stop when their HTTP client goes away.

A route that answers once (an infer, a completion that is not streamed) awaits its call to the
broker with nothing to write until it is done, so the server would notice a client gone only
when the answer is written, after the mesh spent all of its work on it (a generation's whole
sequence, its KV memory held throughout). `unless_gone` watches for the disconnect meanwhile
and cancels the call when it comes: the SDK's cancelled call tells the broker (a generation's
sequences are stopped and freed at once), and the route answers `GONE` to nobody.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive

T = TypeVar("T")

# How long a call runs before a watcher looks out for its client's disconnect: most calls (a
# small infer) are answered sooner and never pay for one (a task, started and cancelled, a few
# percent of the gateway's CPU per small infer); a disconnect is noticed at most this late.
WATCH_AFTER_S = 0.05

# nginx's "client closed request": only counted (the metrics' status), as nobody reads it.
GONE = 499


class ClientGone(Exception):
    """The request's client disconnected before its answer was ready."""


async def unless_gone(request: Request, call: Awaitable[T]) -> T:
    """`call`'s result, awaited in this task; `ClientGone` if the client disconnects first
    (`call` cancelled then). The request's body must have been read already: what comes from
    `receive` after it is only the disconnect."""
    return await unless_gone_on(request.receive, call)


async def unless_gone_on(receive: Receive, call: Awaitable[T]) -> T:
    """`unless_gone` on the ASGI `receive` itself (the raw ASGI routes have no `Request`)."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    gone = False
    watcher: asyncio.Task[None] | None = None

    async def watch() -> None:
        nonlocal gone
        while (await receive())["type"] != "http.disconnect":
            pass
        gone = True
        task.cancel()

    def look_out() -> None:
        nonlocal watcher
        watcher = loop.create_task(watch())

    # The call runs in the route's own task, which the watcher (one task more, once the call
    # has taken WATCH_AFTER_S) cancels; a disconnect before then waits in `receive` for it.
    timer = loop.call_later(WATCH_AFTER_S, look_out)
    try:
        return await call
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()
        raise ClientGone from None
    finally:
        timer.cancel()
        if watcher is not None:
            watcher.cancel()


def on_client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=GONE)
