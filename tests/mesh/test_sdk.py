"""Calls that cannot be answered fail at once, and a peer cut off from the broker comes back.

The SDK side on a real mesh whose broker accepts at most 1 MiB per message (its socket drops the
connection beyond twice that): oversized requests, answers without an id, a reader that dies. The
peer side: send drops counted, and a worker whose routing id another socket took.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio

from client_sdk import errors
from client_sdk.client import AsyncClient
from client_sdk.mesh import LocalMesh
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.peer import MeshPeer
from flowmesh.transport import connect_dealer
from tests.mesh.conftest import FAST, deploy, mlp_spec, reference

MiB = 1 << 20
WIDTH = 64
ROW_BYTES = WIDTH * 4  # one float32 input row of the test model
SPEC = mlp_spec("sdk-mlp", width=WIDTH, depth=2, seed=3)


@pytest.fixture(scope="module")
def small_mesh() -> Iterator[LocalMesh]:
    """One worker behind a broker that takes messages of up to 1 MiB, with the model deployed."""
    with LocalMesh(
        cpu_workers=1, memory_budget="8MiB", broker_args=["--max-message", "1MiB"], **FAST
    ) as m:
        with m.client(timeout=30) as c:
            deploy(c, SPEC)
        yield m


@pytest.fixture(scope="module")
def ref() -> torch.nn.Module:
    return reference(SPEC)


def rows(nbytes: int) -> torch.Tensor:
    return torch.randn(nbytes // ROW_BYTES, WIDTH)


async def failure_of(task: asyncio.Task[Any], what: str, timeout: float) -> BaseException:
    """The exception `task` ends with, within `timeout` seconds."""
    try:
        await asyncio.wait_for(asyncio.shield(task), timeout)
    except TimeoutError:
        task.cancel()
        pytest.fail(f"{what}: still waiting after {timeout:.0f} s")
    except Exception as exc:
        return exc
    pytest.fail(f"{what}: succeeded, expected an error")


async def polled(probe: Any, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------------------- oversized requests


async def test_request_over_the_clients_limit_fails_before_it_is_sent(
    small_mesh: LocalMesh, ref: torch.nn.Module
) -> None:
    # 3 MiB is over twice the broker's limit: sent, it would be dropped with the connection and
    # the call would only end at its timeout (Timeout, not TooLarge).
    limits = p.Limits(max_message_bytes=MiB)
    async with AsyncClient(small_mesh.frontend, timeout=5, limits=limits) as client:
        task = asyncio.create_task(client.infer(SPEC.name, rows(3 * MiB)))
        exc = await failure_of(task, "an infer over the client's limit", 20)
        assert isinstance(exc, errors.TooLarge), repr(exc)
        assert isinstance(exc, errors.ProtocolError)  # what oversized messages raised before
        assert exc.code == Code.TOO_LARGE
        assert "not sent" in exc.reason and str(MiB) in exc.reason, exc.reason
        x = torch.randn(2, WIDTH)
        torch.testing.assert_close(await client.infer(SPEC.name, x), ref(x))


async def test_request_over_the_brokers_limit_is_answered_too_large(
    small_mesh: LocalMesh, ref: torch.nn.Module
) -> None:
    async with AsyncClient(small_mesh.frontend, timeout=20) as client:
        x = torch.randn(2, WIDTH)
        # 1.5 MiB: under the client's limit, over the broker's (but under its socket's cap).
        big = asyncio.create_task(client.infer(SPEC.name, rows(3 * MiB // 2)))
        small = asyncio.create_task(client.infer(SPEC.name, x))
        exc = await failure_of(big, "an infer over the broker's limit", 15)
        assert isinstance(exc, errors.TooLarge), repr(exc)
        torch.testing.assert_close(await asyncio.wait_for(small, 15), ref(x))


async def test_error_without_an_id_fails_the_call_it_answers(
    small_mesh: LocalMesh, ref: torch.nn.Module
) -> None:
    # A header over the broker's 1 MiB header limit is refused unread, so its answer has no id.
    # The client lets it through (its own header limit is raised) to get exactly that answer.
    limits = p.Limits(max_header_bytes=4 * MiB)
    async with AsyncClient(small_mesh.frontend, timeout=20, limits=limits) as client:
        x = torch.randn(2, WIDTH)
        huge = asyncio.create_task(
            client.deploy(
                "sdk-huge",
                "flowmesh.examples:mlp",
                kwargs={"blob": "x" * (3 * MiB // 2)},
                seed=0,
                timeout=10,
            )
        )
        small = asyncio.create_task(client.infer(SPEC.name, x))
        exc = await failure_of(huge, "a deploy whose header is over the broker's limit", 15)
        assert isinstance(exc, errors.TooLarge), repr(exc)
        assert "header" in exc.reason, exc.reason
        torch.testing.assert_close(await asyncio.wait_for(small, 15), ref(x))


# ---------------------------------------------------------------------------- the reader dies


async def test_reader_death_fails_calls_in_flight_at_once_and_the_next_call_reconnects(
    small_mesh: LocalMesh, ref: torch.nn.Module
) -> None:
    async with AsyncClient(small_mesh.frontend, timeout=60) as client:
        await client.status()
        # Over twice the broker's limit: its socket drops the connection, so no answer comes,
        # ever; the call is in flight until something ends it.
        stuck = asyncio.create_task(client.infer(SPEC.name, rows(3 * MiB)))
        await polled(lambda: client._pending, "the infer to be in flight", 10)
        sock = client._sock
        assert sock is not None
        sock.close(linger=0)  # under the reader: its recv ends
        exc = await failure_of(stuck, "a call in flight when the reader died", 10)
        assert isinstance(exc, errors.Unavailable), repr(exc)
        assert "reader stopped" in exc.reason and "socket closed: True" in exc.reason, exc.reason
        # The next call goes out on a fresh socket.
        x = torch.randn(2, WIDTH)
        torch.testing.assert_close(await client.infer(SPEC.name, x, timeout=10), ref(x))
        assert client._sock is not None and client._sock is not sock


# ---------------------------------------------------------------------------- mesh peers


class _Peer(MeshPeer):
    role = "test-peer"

    def registration(self) -> p.Register:
        return p.Register(id=1, role="worker", name=self.name, pid=os.getpid(), budget_bytes=1)


async def test_peer_counts_dropped_sends_and_never_raises() -> None:
    peer = _Peer("drops-0", "tcp://127.0.0.1:1")
    ctx = zmq.asyncio.Context()
    # Nobody listens there: one message fits the queue (high-water mark 1), the rest are dropped.
    peer.sock = connect_dealer(ctx, peer.broker, identity=peer.name, hwm=1)
    try:
        sent = [peer.send(p.Heartbeat(stats={})) for _ in range(20)]
        assert sent[0] and not all(sent), sent
        assert peer.dropped_sends == sent.count(False)
        peer.sock.close(linger=0)
        assert peer.send(p.Heartbeat(stats={})) is False  # a closed socket: counted, no raise
        peer.sock = None
        assert peer.send(p.Heartbeat(stats={})) is False  # between sockets
        assert peer.dropped_sends == sent.count(False) + 2
        assert peer.peer_stats()["dropped_sends"] == peer.dropped_sends
    finally:
        if peer.sock is not None:
            peer.sock.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("thief_talks", [False, True], ids=["broker-forgets", "broker-keeps"])
def test_worker_whose_routing_id_is_taken_comes_back(tmp_path: Path, thief_talks: bool) -> None:
    """A raw socket takes worker-0's routing id (ROUTER_HANDOVER cuts the worker off).

    Silent after one message, the thief lets the broker declare worker-0 lost (usually before
    the worker reconnects), so the worker comes back afresh. Heartbeating as worker-0 until the
    worker has registered again, it keeps the broker from losing worker-0, so the worker comes
    back to its state kept, and must keep the stages the broker counts on.
    """
    spec = mlp_spec("sdk-handover", width=WIDTH, depth=2, seed=5)
    model = reference(spec)
    x = torch.randn(2, WIDTH)
    heartbeat = p.encode(p.Heartbeat(stats={}))
    with (
        LocalMesh(cpu_workers=1, memory_budget="8MiB", run_dir=tmp_path, **FAST) as mesh,
        mesh.client(timeout=20) as c,
    ):
        deploy(c, spec)
        torch.testing.assert_close(c.infer(spec.name, x), model(x))
        ctx = zmq.Context()
        thief = ctx.socket(zmq.DEALER)
        thief.setsockopt(zmq.LINGER, 0)
        thief.setsockopt(zmq.ROUTING_ID, b"worker-0")
        try:
            thief.connect(mesh.backend)
            thief.send_multipart(heartbeat)
            # The broker's mail for worker-0 now comes here: the id has been handed over.
            assert thief.poll(10_000), "the broker never wrote to the socket that took the id"
            if thief_talks:

                def registered_again() -> dict[str, Any] | None:
                    thief.send_multipart(heartbeat)
                    (worker,) = c.status(timeout=2)["workers"]
                    return worker if worker["registrations"] >= 2 else None

                mesh.wait_until(registered_again, "worker-0 to register again, kept", 30)

            def serving() -> tuple[Any, dict[str, Any]] | None:
                try:
                    return c.infer_with_info(spec.name, x, timeout=2)
                except FlowmeshError:
                    return None

            out, info = mesh.wait_until(
                serving, "worker-0 to come back and serve the model placed on it", 30
            )
            torch.testing.assert_close(out, model(x))
            assert info["workers"] == ["worker-0"], info
            (worker,) = c.status()["workers"]
            assert worker["name"] == "worker-0" and worker["ready"], worker
            assert worker["stats"]["reconnects"] >= 1, worker["stats"]
        finally:
            thief.close(linger=0)
            ctx.term()
