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
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await receive())["type"] != "http.disconnect":
            pass
        gone = True
        task.cancel()

    # One task more per request, not two: the call runs in the route's own task, which the
    # watcher cancels.
    watcher = asyncio.ensure_future(watch())
    try:
        return await call
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()
        raise ClientGone from None
    finally:
        watcher.cancel()


def on_client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=GONE)
