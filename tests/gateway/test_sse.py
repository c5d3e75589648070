"""`gateway.sse.EventStream` under a real uvicorn (httptools, as the gateway runs): a client that
stays connected but stops reading is cut off once an event waits `write_timeout` to be taken,
its source closed (a generation's sequence stopped on the broker) and its slot given back."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import uvicorn
from starlette.types import Receive, Scope, Send

from gateway.sse import EventStream, event
from tests.support.waiting import until


async def test_a_stream_whose_client_stops_reading_is_cut_off_and_closed() -> None:
    closed = asyncio.Event()
    released: list[bool] = []
    sent = [0]

    async def source() -> AsyncIterator[bytes]:
        try:
            while sent[0] < 4096:  # 16 MiB, more than the socket buffers between them hold
                sent[0] += 1
                yield event({"text": "x" * 4096})
            await asyncio.Event().wait()  # then a generation still going: it never ends itself
        finally:
            closed.set()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        stream = EventStream(source(), on_close=lambda: released.append(True), write_timeout=0.5)
        await stream(scope, receive, send)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, http="httptools", lifespan="off", log_level="critical"
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    await until(lambda: server.started, "the server to start", timeout=30)
    client = socket.socket()
    try:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", port))
        client.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        await until(lambda: sent[0] > 0, "the stream to start", timeout=30)
        # Connected, reading nothing: the buffers fill, the server's write waits, and past the
        # timeout the stream is cut off and its source closed.
        await asyncio.wait_for(closed.wait(), timeout=60)
        assert released == [True]
    finally:
        client.close()
        server.should_exit = server.force_exit = True  # (a stream stuck on its write: no wait)
        await serving
