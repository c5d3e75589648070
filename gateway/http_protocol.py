"""The gateway's HTTP/1.1 connections: uvicorn's httptools protocol with a bound on each
request's head, in bytes and in time.

httptools buffers a request line and headers for as long as they come, with no limit and no
clock (uvicorn's keep-alive timer runs only between requests): one caller could hold the
gateway's memory with a header that never ends, or its connections with heads that never
finish, before the app (and `gateway.guard.Guard`'s 431 and 408) sees anything. Here a head
over `max_head` bytes is answered 431 and one not complete `head_timeout` seconds after its
connection opened, or after its first byte on a kept-alive one, 408; the connection is closed
either way. The bound sits above the guard's own header limit, so that a request a little over
it still gets the guard's answer in its protocol's error body.
"""

from __future__ import annotations

import asyncio
import http
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# Bytes of a request line the head bound allows above the headers' own limit.
REQUEST_LINE = 8 * 2**10


def bounded_head_protocol(max_header: int, head_timeout: float) -> type[HttpToolsProtocol]:
    """uvicorn's `http` protocol class for the gateway: heads of at most `max_header` bytes of
    headers (plus `REQUEST_LINE` for the request line) arriving within `head_timeout` s."""
    return type(
        "BoundedHeadProtocol",
        (BoundedHeadProtocol,),
        {"max_head": max_header + REQUEST_LINE, "head_timeout": head_timeout},
    )


class BoundedHeadProtocol(HttpToolsProtocol):
    max_head: int
    head_timeout: float

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # When the head being read began (None: none is), and the timer on it: armed only once
        # a chunk ends with the head still incomplete (a whole head in one chunk, the common
        # case, costs no timer), or at the connection's start (a caller may send nothing).
        self._head_since: float | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._body_in_chunk = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_since = self.loop.time()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._body_in_chunk = 0
        super().data_received(data)
        if self._head_since is None or self.transport.is_closing():
            return
        # Every byte of the chunk that is no request's body counts: the head being read, and
        # any head that ended before it in the same chunk (so a head across chunks is always
        # counted whole, however the chunks fall, and a legitimate one is far under the bound).
        self._head_bytes += len(data) - self._body_in_chunk
        if self._head_bytes > self.max_head:
            self._refuse(http.HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request head too large")
            return
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        if self._head_since is None:
            self._head_since = self.loop.time()

    def on_headers_complete(self) -> None:
        self._head_since = None
        self._disarm()
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._body_in_chunk += len(body)
        super().on_body(body)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._head_since is not None and not self._answering():
            # A pipelined head that waited for the answers before it (uvicorn reads no more
            # meanwhile): timed from now.
            self._head_since = self.loop.time()
            self._arm()

    def _answering(self) -> bool:
        """Whether a request before the head being read is still being answered."""
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self) -> None:
        # Not while an earlier request is answered: uvicorn then stops reading a pipelined
        # head, which could not be completed however quick its client.
        if self._head_timer is None and self._head_since is not None and not self._answering():
            deadline = self._head_since + self.head_timeout
            self._head_timer = self.loop.call_at(deadline, self._too_slow)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _too_slow(self) -> None:
        self._head_timer = None
        self._refuse(http.HTTPStatus.REQUEST_TIMEOUT, "request head not received in time")

    def _refuse(self, status: http.HTTPStatus, why: str) -> None:
        self._head_since = None
        self._disarm()
        if self.transport.is_closing():
            return
        if self._answering():
            # No answer of its own can go out before the earlier request's, nor in its
            # middle: the connection is only closed.
            self.transport.close()
            return
        body = why.encode("ascii")
        self.transport.write(
            b"".join(
                [
                    f"HTTP/1.1 {status.value} {status.phrase}\r\n".encode("ascii"),
                    b"content-type: text/plain; charset=utf-8\r\n",
                    f"content-length: {len(body)}\r\n".encode("ascii"),
                    b"connection: close\r\n\r\n",
                    body,
                ]
            )
        )
        self.transport.close()
