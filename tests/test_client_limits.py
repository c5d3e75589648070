"""The SDK learns the broker's limits on each connection, and one oversized call fails alone.

Issue 20: an infer over twice the broker's limit made libzmq drop the connection; the client sent
every call in flight again, the oversized one included, which dropped the new connection too, and
80 of 100 small calls in flight failed with Unavailable. Here the client runs in-process on a
socket that records what is sent, and the broker's side (its Welcome, a lost connection, answers)
is played by the test.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import client_sdk.connection as connection_mod
from broker.core import BrokerCore
from client_sdk import errors
from client_sdk.client import AsyncClient
from flowmesh import protocol as p
from flowmesh.errors import Code
from tests.support.waiting import within_turns

MiB = 1 << 20
WIDTH = 64
SMALL = 100


class RecordingSocket:
    """What the client's DEALER is to it here: sends recorded, always taken."""

    closed = False

    def __init__(self) -> None:
        self.sent: list[p.Message] = []

    def send_multipart(self, frames: list[Any], copy: bool = True, flags: int = 0) -> Any:
        msg = p.decode([bytes(memoryview(f)) for f in frames])
        if isinstance(msg, p.Bundle):
            self.sent += [p.decode_member(m) for m in msg.members]
        else:
            self.sent.append(msg)
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    def take(self) -> list[p.Message]:
        sent, self.sent = self.sent, []
        return sent

    def disable_monitor(self) -> None:
        pass

    def close(self, linger: int | None = None) -> None:
        self.closed = True


@pytest.fixture
def sock(monkeypatch: pytest.MonkeyPatch) -> Iterator[RecordingSocket]:
    """The socket every AsyncClient of the test gets; its reader and watcher wait forever."""
    fake = RecordingSocket()

    async def forever(*args: Any, **kwargs: Any) -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr(connection_mod, "connect_dealer", lambda *a, **k: fake)
    monkeypatch.setattr(connection_mod, "read_frames", forever)
    monkeypatch.setattr(connection_mod, "watch_handshakes", forever)
    yield fake


def answer(client: AsyncClient, msg: p.Message) -> None:
    client.connection._on_frames([bytes(memoryview(f)) for f in p.encode(msg)])


def welcome(client: AsyncClient, sock: RecordingSocket, max_message_bytes: int) -> None:
    (hello,) = sock.take()
    assert isinstance(hello, p.Hello), hello
    answer(
        client, p.Welcome(id=hello.id, max_message_bytes=max_message_bytes, max_header_bytes=MiB)
    )


def answer_infers(client: AsyncClient, sent: list[p.Message]) -> None:
    for msg in sent:
        assert isinstance(msg, p.Infer), msg
        x = msg.tensors[""].tensor()
        answer(client, p.Result(id=msg.id, tensors={"": x * 2}))


def calls(client: AsyncClient) -> tuple[list[torch.Tensor], list[asyncio.Task[Any]], Any]:
    """SMALL small infers, then one of 3 MiB (over twice a 1 MiB limit), all at once."""
    xs = [torch.full((2, WIDTH), float(i)) for i in range(SMALL)]
    small = [asyncio.create_task(client.infer("m", x)) for x in xs]
    big = asyncio.create_task(client.infer("m", torch.zeros(3 * MiB // (4 * WIDTH), WIDTH)))
    return xs, small, big


async def test_calls_wait_for_the_brokers_limits_and_one_over_them_is_refused_unsent(
    sock: RecordingSocket,
) -> None:
    async with AsyncClient("tcp://broker", timeout=30) as client:
        xs, small, big = calls(client)
        await within_turns(lambda: len(client.connection._pending) == SMALL + 1, "every call made")
        assert [type(m) for m in sock.sent] == [p.Hello]  # nothing else before the limits
        welcome(client, sock, MiB)
        (exc,) = await asyncio.wait_for(asyncio.gather(big, return_exceptions=True), 5)
        assert isinstance(exc, errors.TooLarge), exc
        reason = exc.reason
        assert exc.code == Code.TOO_LARGE and "infer not sent" in reason, reason
        size = re.search(r"it is (\d+) bytes", reason)
        assert size is not None and int(size[1]) > 3 * MiB, reason
        assert f"limit of {MiB} of the broker at tcp://broker" in reason, reason
        sent = sock.take()
        assert len(sent) == SMALL and all(m.tensors[""].nbytes < MiB for m in sent)  # type: ignore[attr-defined]
        answer_infers(client, sent)
        outs = await asyncio.wait_for(asyncio.gather(*small), 5)
        for x, out in zip(xs, outs, strict=True):
            torch.testing.assert_close(out, x * 2)
        # Known now: the next oversized call fails at once, and nothing is held back.
        with pytest.raises(errors.TooLarge, match=f"limit of {MiB} of the broker"):
            await client.infer("m", torch.zeros(MiB // (4 * WIDTH) + 1, WIDTH))
        assert sock.sent == [] and client.resent == 0


async def test_a_call_over_the_limits_of_the_next_connection_is_never_sent_again(
    sock: RecordingSocket,
) -> None:
    """The broker came back with a smaller limit than the one the calls were sent under (or
    dropped the connection for the oversized call): that call fails, the others go again."""
    async with AsyncClient("tcp://broker", timeout=30) as client:
        client.connection.connect()
        welcome(client, sock, 1 << 30)
        xs, small, big = calls(client)
        await within_turns(lambda: len(sock.sent) == SMALL + 1, "every call sent")
        sock.take()
        client.connection._on_link(client.connection._sock, False)  # type: ignore[arg-type]
        late = asyncio.create_task(client.infer("m", torch.ones(1, WIDTH)))  # made meanwhile
        await within_turns(
            lambda: len(client.connection._pending) == SMALL + 2, "the late call made"
        )
        client.connection._on_link(client.connection._sock, True)  # type: ignore[arg-type]
        welcome(client, sock, MiB)  # only a Hello went out on the new connection
        (exc,) = await asyncio.wait_for(asyncio.gather(big, return_exceptions=True), 5)
        assert isinstance(exc, errors.TooLarge), exc
        assert "infer not sent again" in exc.reason, exc.reason
        assert f"limit of {MiB} of the broker" in exc.reason, exc.reason
        sent = sock.take()
        assert len(sent) == SMALL + 1, len(sent)  # the small ones and the late one; not the big
        assert client.resent == SMALL
        answer_infers(client, sent)
        outs = await asyncio.wait_for(asyncio.gather(*small, late), 5)
        for x, out in zip([*xs, torch.ones(1, WIDTH)], outs, strict=True):
            torch.testing.assert_close(out, x * 2)


async def test_a_broker_that_knows_no_hello_leaves_the_clients_own_limits(
    sock: RecordingSocket,
) -> None:
    async with AsyncClient("tcp://broker", timeout=30) as client:
        task = asyncio.create_task(client.infer("m", torch.ones(1, WIDTH)))
        await within_turns(lambda: len(client.connection._pending) == 1, "the call made")
        (hello,) = sock.take()
        answer(client, p.Error(id=hello.id, code="unknown_type", reason="unknown 'hello'"))  # type: ignore[attr-defined]
        assert client.broker_limits is None
        answer_infers(client, sock.take())
        torch.testing.assert_close(await asyncio.wait_for(task, 5), torch.ones(1, WIDTH) * 2)


async def test_calls_waiting_for_the_limits_fail_at_once_with_the_connection(
    sock: RecordingSocket,
) -> None:
    async with AsyncClient("tcp://broker", timeout=30) as client:
        task = asyncio.create_task(client.infer("m", torch.ones(1, WIDTH)))
        await within_turns(lambda: len(client.connection._pending) == 1, "the call made")
        client.connection._refused(client.connection._sock, "the broker refused this key")  # type: ignore[arg-type]
        with pytest.raises(errors.ClientError, match="refused this key") as info:
            await asyncio.wait_for(task, 5)
        assert info.value.code == Code.UNAUTHORIZED


def test_the_broker_states_its_limits_to_any_connection() -> None:
    core = BrokerCore()
    core.limits = p.Limits(max_message_bytes=4 * MiB)
    core.auth = True  # even one whose key grants nothing: the limits are no secret
    core.on_client(b"c", p.Hello(id=7), 0.0, identity=None)
    ((_, addr, msg),) = core.drain()
    assert addr == b"c"
    assert msg == p.Welcome(id=7, max_message_bytes=4 * MiB, max_header_bytes=MiB)
