"""Calls that cannot be answered fail at once, and a peer cut off from the broker comes back.

The SDK side on a real mesh whose broker accepts at most 1 MiB per message (its socket drops the
connection beyond twice that): oversized requests among many small ones, answers without an id,
a reader that dies. The peer side: send drops counted. (A socket claiming a worker's routing id,
a second process under its name, a worker restarted: tests/mesh/test_identity.py.)
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio

from client_sdk import errors
from client_sdk.client import AsyncClient
from client_sdk.mesh import LocalMesh
from flowmesh import protocol as p
from flowmesh.errors import Code
from flowmesh.peer import MeshPeer
from flowmesh.transport import connect_dealer
from tests.support.mesh import FAST, deploy, mlp_spec, reference
from tests.support.waiting import until

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


async def test_calls_over_the_brokers_limit_fail_alone_among_a_hundred(
    small_mesh: LocalMesh, ref: torch.nn.Module
) -> None:
    """Issue 20: an infer over twice the broker's limit (its socket's cap) dropped the
    connection, was sent again with every call in flight and dropped the new one: 80 of 100
    small calls in flight failed with Unavailable. The client learns the broker's limit as it
    connects and refuses such calls unsent, so the connection is never lost: neither for calls
    made before the limit is known (they wait for it) nor after."""
    async with AsyncClient(small_mesh.frontend, timeout=30) as client:
        for when in ("as the client connects", "once the limit is known"):
            xs = [torch.randn(2, WIDTH) for _ in range(100)]
            small = [asyncio.create_task(client.infer(SPEC.name, x)) for x in xs[:50]]
            # Under the client's own limit; over the broker's 1 MiB, and over twice that.
            big = [asyncio.create_task(client.infer(SPEC.name, rows(n))) for n in (3 * MiB, MiB)]
            small += [asyncio.create_task(client.infer(SPEC.name, x)) for x in xs[50:]]
            outs = await asyncio.wait_for(asyncio.gather(*small, return_exceptions=True), 60)
            failed = [repr(o) for o in outs if isinstance(o, BaseException)]
            assert not failed, f"{when}: {len(failed)} of 100 small calls failed: {failed[:3]}"
            for x, out in zip(xs, outs, strict=True):
                torch.testing.assert_close(out, ref(x))
            for task in big:
                exc = await failure_of(task, f"an infer over the broker's limit {when}", 15)
                assert isinstance(exc, errors.TooLarge), repr(exc)
                assert "not sent" in exc.reason and f"limit of {MiB} of the broker" in exc.reason
            # No reconnect storm: the connection was never lost, nothing was sent twice.
            assert (client.connection._link, client.resent) == (0, 0), when
        assert client.broker_limits is not None
        assert client.broker_limits.max_message_bytes == MiB


async def test_error_without_an_id_fails_the_call_it_answers(
    small_mesh: LocalMesh, ref: torch.nn.Module
) -> None:
    # A header over the broker's 1 MiB header limit is refused unread, so its answer has no id.
    # The client lets it through (its own header limit is raised, and it forgets the broker's,
    # as with a broker that states none) to get exactly that answer.
    limits = p.Limits(max_header_bytes=4 * MiB)
    async with AsyncClient(small_mesh.frontend, timeout=20, limits=limits) as client:
        await client.status()
        client.connection.broker_limits = None
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
        # Its worker stopped, the call is in flight until something ends it.
        worker = small_mesh.child("worker-0").proc
        worker.send_signal(signal.SIGSTOP)
        try:
            stuck = asyncio.create_task(client.infer(SPEC.name, torch.randn(2, WIDTH)))
            await until(lambda: client.connection._pending, "the infer to be in flight", 10)
            sock = client.connection._sock
            assert sock is not None
            sock.close(linger=0)  # under the reader: its recv ends
            exc = await failure_of(stuck, "a call in flight when the reader died", 10)
        finally:
            worker.send_signal(signal.SIGCONT)
        assert isinstance(exc, errors.Unavailable), repr(exc)
        assert "reader stopped" in exc.reason and "socket closed: True" in exc.reason, exc.reason
        # The next call goes out on a fresh socket.
        x = torch.randn(2, WIDTH)
        torch.testing.assert_close(await client.infer(SPEC.name, x, timeout=10), ref(x))
        assert client.connection._sock is not None and client.connection._sock is not sock


# ---------------------------------------------------------------------------- mesh peers


class _Peer(MeshPeer):
    role = "test-peer"
    stats_type = p.WorkerStats

    def registration(self) -> p.Register:
        return p.Register(id=1, role="worker", name=self.name, pid=os.getpid(), budget_bytes=1)


async def test_peer_counts_dropped_sends_and_never_raises() -> None:
    peer = _Peer("drops-0", "tcp://127.0.0.1:1")
    ctx = zmq.asyncio.Context()
    # Nobody listens there: one message fits the queue (high-water mark 1), the rest are dropped.
    peer.sock = connect_dealer(ctx, peer.broker, identity=peer.name, hwm=1)
    try:
        sent = [peer.send(p.Heartbeat()) for _ in range(20)]
        assert sent[0] and not all(sent), sent
        assert peer.dropped_sends == sent.count(False)
        peer.sock.close(linger=0)
        assert peer.send(p.Heartbeat()) is False  # a closed socket: counted, no raise
        peer.sock = None
        assert peer.send(p.Heartbeat()) is False  # between sockets
        assert peer.dropped_sends == sent.count(False) + 2
        assert peer.peer_stats()["dropped_sends"] == peer.dropped_sends
    finally:
        if peer.sock is not None:
            peer.sock.close(linger=0)
        ctx.term()


def test_a_program_that_fails_with_its_client_open_still_exits(small_mesh: LocalMesh) -> None:
    """`asyncio.run` ending in an error with an `AsyncClient` never closed cancels the client's
    tasks. Its handshake watcher, cancelled first, used to close its end of the socket monitor
    and the socket's own stop then blocked for ever on a send to that closed end: the program
    hung instead of exiting with its error."""
    import subprocess
    import sys
    from pathlib import Path

    program = f"""
import asyncio
from client_sdk.client import AsyncClient

async def main():
    c = AsyncClient({small_mesh.frontend!r}, timeout=30)
    await c.__aenter__()
    await c.status()
    raise RuntimeError("the program fails")

try:
    asyncio.run(main())
except RuntimeError as exc:
    print("exited:", exc)
"""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", program], cwd=root, env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 0 and "exited: the program fails" in out.stdout, out.stderr[-2000:]
