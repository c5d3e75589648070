"""`gateway.http_protocol` under a real uvicorn (uvloop, as the gateway runs it) with a small app,
over raw sockets: a request head is bounded in bytes however the reads cut it, a pipelined head
waiting for earlier answers is not timed while uvicorn reads nothing, and no refusal is written
into an answer under way. (The gateway's own process: tests/gateway/test_guard.py.)"""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from gateway.http_protocol import bounded_head_protocol
from tests.support.waiting import until, until_blocking

HEAD_TIMEOUT_S = 1.0


@dataclass
class Rig:
    port: int
    server: uvicorn.Server
    started: list[str] = field(default_factory=list)  # the paths the app was called for

    def closed(self) -> bool:
        """Whether the server holds no connection (it closed the test's)."""
        return not self.server.server_state.connections

    def queued(self) -> bool:
        """Whether a pipelined request waits for the answers before it (uvicorn has read its
        whole head, and reads no more meanwhile)."""
        return any(c.pipeline for c in self.server.server_state.connections)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    started: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        started.append(scope["path"])
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/slow":  # answered after several head timeouts
            await asyncio.sleep(3 * HEAD_TIMEOUT_S)
        body = b"<" + scope["path"].encode() + b">"
        length = [(b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": length})
        await send({"type": "http.response.body", "body": body})

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=free,
        loop="uvloop",
        http=bounded_head_protocol(2048, HEAD_TIMEOUT_S),  # heads of at most 10 KiB
        lifespan="off",
        log_level="critical",
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    await until(lambda: server.started, "the server to start", timeout=30)
    yield Rig(free, server, started)
    server.should_exit = True
    await serving


Step = tuple[bytes, Callable[[], bool] | None]


def exchange(port: int, *steps: Step) -> bytes:
    """All the server answers a connection that sends each step's bytes in turn, each once the
    server shows it read the step before (its condition), so that each is a read of its own;
    until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        for data, read in steps:
            try:
                sock.sendall(data)
            except OSError:  # closed by the server: what it said is read below
                break
            if read is not None:
                until_blocking(read, "the server to read what was sent", timeout=30)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
    return answer


async def run(fn: Callable[[], bytes]) -> bytes:
    return await asyncio.to_thread(fn)


async def test_a_head_across_reads_is_counted_whole_whatever_ends_in_them(rig: Rig) -> None:
    # Each read ends one request and begins the next, whose head then runs on into the next
    # read: a count that skipped reads where a request ended let 30 KB heads through.
    big = b"y" * 30000
    answer = await run(
        lambda: exchange(
            rig.port,
            (
                b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nX: " + big,
                lambda: "/a" in rig.started or rig.closed(),
            ),
            (
                big + b"\r\n\r\nGET /c HTTP/1.1\r\nX: " + big,
                lambda: "/b" in rig.started or rig.closed(),
            ),
            (big + b"\r\nConnection: close\r\n\r\n", None),
        )
    )
    assert b"</b>" not in answer and b"</c>" not in answer, answer[:300]


async def test_a_pipelined_head_is_not_timed_while_earlier_requests_are_answered(
    rig: Rig,
) -> None:
    # /slow answers after 3 head timeouts; meanwhile uvicorn reads nothing more, so the third
    # head, split across two reads, cannot end: it used to be cut off, /slow's answer with it.
    answer = await run(
        lambda: exchange(
            rig.port,
            (b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n", lambda: "/slow" in rig.started),
            (b"GET /b HTTP/1.1\r\nHost: x\r\n\r\nGET /c HTTP/1.1\r\nHo", rig.queued),
            (b"st: x\r\nConnection: close\r\n\r\n", None),
        )
    )
    assert re.findall(rb"HTTP/1\.1 (\d+)", answer) == [b"200"] * 3, answer
    assert re.findall(rb"<(/\w+)>", answer) == [b"/slow", b"/b", b"/c"], answer


async def test_no_refusal_is_written_into_an_answer_under_way(rig: Rig) -> None:
    # A pipelined head over the bound while /slow is answered: the connection is closed; a
    # 431 written then would have been read as /slow's answer.
    answer = await run(
        lambda: exchange(
            rig.port,
            (b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n", lambda: "/slow" in rig.started),
            (b"GET /b HTTP/1.1\r\nX: " + b"y" * 20000, None),
        )
    )
    assert b"431" not in answer, answer[:300]
    # Alone, the same head is answered 431.
    answer = await run(lambda: exchange(rig.port, (b"GET /b HTTP/1.1\r\nX: " + b"y" * 20000, None)))
    assert answer.startswith(b"HTTP/1.1 431"), answer[:300]
