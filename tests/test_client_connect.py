"""The SDK with no broker fails within its connect timeout, naming the address; every call waits
for the client's timeout unless given its own; a broker that comes up later is still reached.

Issue 22: `Client(addr).status()` with nothing listening waited the full 60 s and raised
`Timeout ... no answer from the broker` with no hint, and `Client(addr, timeout=2).status()`
waited 11 s, as `status()` and `jobs()` had a 10 s default of their own. The first tests need no
broker (nothing listens on the port); the last starts a real one, alone, on a port the client
was made for before it was up.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys

import pytest
import torch

from client_sdk import errors
from client_sdk.client import AsyncClient, Client
from client_sdk.connection import CONNECT_TIMEOUT_S
from client_sdk.mesh import LocalMesh
from flowmesh.errors import Code

HINT = "(is 'flowmesh up' running?)"
# Far longer than any wait here: a call that reaches it has not failed fast.
LONG = 600.0
# What a wait for a fast failure may take on a loaded machine, and still be far below LONG.
BOUND = 60.0


def free_address() -> str:
    """A loopback address nothing listens on (the port of a socket bound and closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


def assert_no_broker(exc: BaseException, address: str, wait: float) -> None:
    assert isinstance(exc, errors.Unavailable), repr(exc)
    assert exc.code == Code.UNAVAILABLE
    assert f"no broker answers at {address} within {wait:.1f} s" in exc.reason, exc.reason
    assert HINT in exc.reason, exc.reason


async def test_no_broker_fails_within_the_connect_timeout_naming_the_address() -> None:
    address = free_address()
    async with AsyncClient(address, timeout=LONG, connect_timeout=1.0) as client:
        for call in (client.status(), client.infer("m", torch.ones(1, 4))):
            with pytest.raises(errors.ClientError) as info:
                await asyncio.wait_for(call, BOUND)
            assert_no_broker(info.value, address, 1.0)


async def test_the_connect_timeout_is_never_longer_than_the_calls_own() -> None:
    address = free_address()
    async with AsyncClient(address, timeout=LONG, connect_timeout=LONG) as client:
        with pytest.raises(errors.ClientError) as info:
            await asyncio.wait_for(client.status(timeout=0.5), BOUND)
        assert_no_broker(info.value, address, 0.5)


async def test_no_connect_timeout_leaves_each_call_its_own() -> None:
    """`connect_timeout=None`: the call's own timeout ends it, as before there was one."""
    address = free_address()
    async with AsyncClient(address, timeout=LONG, connect_timeout=None) as client:
        with pytest.raises(errors.Timeout, match=r"within 0\.5 s \(not sent"):
            await asyncio.wait_for(client.status(timeout=0.5), BOUND)


async def test_the_blocking_client_fails_within_the_default_connect_timeout() -> None:
    address = free_address()
    with Client(address, timeout=LONG) as client, pytest.raises(errors.ClientError) as info:
        await asyncio.wait_for(asyncio.to_thread(client.status), BOUND)
    assert_no_broker(info.value, address, CONNECT_TIMEOUT_S)


@pytest.mark.parametrize("address", ["127.0.0.1:5555", "bogus", "tcp://"])
async def test_an_address_zeromq_does_not_take_is_a_bad_request_and_the_client_closes(
    address: str,
) -> None:
    # (`up --listen` takes HOST:PORT, `--broker` tcp://HOST:PORT: an easy slip.) The socket
    # left open used to hold the client's close for good, and the call for its timeout.
    def use() -> None:
        client = Client(address, timeout=LONG)
        try:
            with pytest.raises(errors.BadRequest) as info:
                client.status()
            assert info.value.code == Code.BAD_REQUEST
            assert info.value.reason.startswith(f"cannot connect to {address!r}: ")
            assert info.value.reason.endswith("(a broker's address is tcp://HOST:PORT)")
        finally:
            client.close()

    await asyncio.wait_for(asyncio.to_thread(use), BOUND)


def test_a_refused_address_never_blocks_the_process_however_often_it_is_tried() -> None:
    # The socket's monitor was once stopped after its PAIR reader was closed: stopping it sends a
    # last event to that PAIR, which then blocks for ever, holding the GIL (so no timeout in the
    # process could end it; CI hung silently). Most first tries hung; a child, so that a hang
    # fails this test instead of stopping the suite.
    code = (
        "import zmq, zmq.asyncio\n"
        "from flowmesh.auth import handshake_events\n"
        "from flowmesh.transport import connect_dealer\n"
        "ctx = zmq.asyncio.Context()\n"
        "for address in ['tcp://', 'bogus', '127.0.0.1:5555'] * 100:\n"
        "    try:\n"
        "        connect_dealer(ctx, address, monitor=handshake_events(link=True))\n"
        "    except zmq.ZMQError:\n"
        "        pass\n"
        "    else:\n"
        "        raise SystemExit(f'{address!r} was taken')\n"
        "ctx.term()\n"
        "print('300 refused')\n"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=BOUND
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"300 refused connects did not end within {BOUND:.0f} s")
    assert (done.returncode, done.stdout) == (0, "300 refused\n"), done.stderr


def test_a_broker_started_later_is_reached_and_the_clients_timeout_governs_status() -> None:
    """Two clients are made before the broker is up, and the first call of one fails: the
    connect timeout counts from each call, not from the client's creation, and a failed first
    contact does not end the client; both reach the broker once it is up. Then, the broker
    stopped (SIGSTOP) after it answered, `status()` and `jobs()` end at the client's 2 s, not
    at a default of their own."""
    address = free_address()
    port = int(address.rsplit(":", 1)[1])
    with (
        Client(address, timeout=2, connect_timeout=1.0) as client,
        Client(address, timeout=2, connect_timeout=1.0) as early,
    ):
        with pytest.raises(errors.ClientError) as info:
            client.status()
        assert_no_broker(info.value, address, 1.0)
        with LocalMesh(cpu_workers=0, partitioner=False, frontend_port=port) as mesh:
            assert mesh.frontend == address
            assert client.status().workers == []
            assert early.status().workers == []
            broker = mesh.child("broker").proc
            broker.send_signal(signal.SIGSTOP)
            try:
                for call in (client.status, client.jobs):
                    with pytest.raises(errors.Timeout) as late:
                        call()
                    want = f"no answer from the broker at {address} within 2.0 s"
                    assert want in late.value.reason, late.value.reason
            finally:
                broker.send_signal(signal.SIGCONT)
