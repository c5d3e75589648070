"""Server-sent events whose source is closed the moment the client goes away.

Starlette's `StreamingResponse`, under an ASGI 2.4 server, notices a gone client only at its
next write, and leaves the body's generator to the garbage collector. A token stream must stop
its sequence on the broker at once (its KV memory is freed then), so this one watches for the
disconnect while it streams, cancels the stream when it comes, and always closes the source.
A client that stays connected but stops reading is cut off the same way once an event has
waited `write_timeout` seconds to be taken (the server's write waits while the connection's
buffers are full): else it would hold its sequence, and its key's stream slot, for ever.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import msgspec
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

DONE = b"data: [DONE]\n\n"


def event(data: Any) -> bytes:
    """One server-sent event carrying `data` as JSON."""
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


class EventStream(StreamingResponse):
    """`text/event-stream` from an async generator of encoded events (`event`, `DONE`)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        source: AsyncIterator[bytes],
        on_close: Callable[[], None] | None = None,
        write_timeout: float | None = None,
    ) -> None:
        # No proxy buffering: each event is worth sending as it comes.
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(source, headers=headers)
        self._source = source
        # Called once the stream is over, however it ended (a generator never started does
        # not run its own `finally` when closed, so this cannot live in the source).
        self._on_close = on_close
        self._write_timeout = write_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def timed_send(message: Message) -> None:
            with anyio.fail_after(self._write_timeout):
                await send(message)

        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    # OSError: the client went away mid-write; TimeoutError: it stopped reading.
                    with contextlib.suppress(OSError, TimeoutError):
                        await self.stream_response(timed_send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            try:
                aclose = getattr(self._source, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                if self._on_close is not None:
                    self._on_close()
