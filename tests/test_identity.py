"""Who a peer is, without keys: the ROUTER names connections and none can take another's; a
registration refused for its name stops the peer; default worker names do not collide; a
keyless socket is bound where other hosts reach it only when asked to (`--insecure 1`).

In-process, on loopback sockets; the registry's side is in tests/broker/test_registry.py and
the mesh's in tests/mesh/test_identity.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
from typing import Any

import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from client_sdk.cli import build_parser, up_mesh
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.exposure import check_keyless_bind, reachable_from_other_hosts
from flowmesh.peer import MeshPeer
from flowmesh.transport import bind_router, connect_dealer
from gpu_worker.__main__ import default_name
from tests.support.waiting import until

TAKEN = "name 'w0' is held by a live worker of another process (pid 1, heard from 0.1 s ago)"


# ---------------------------------------------------------------------------- routing ids


def test_a_socket_claiming_a_live_peer_s_routing_id_gets_nothing_and_is_not_read() -> None:
    ctx = zmq.asyncio.Context()
    router, ep = bind_router(ctx, "tcp://127.0.0.1:0")
    monitor = zmq.Socket.shadow(router.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED).underlying)
    honest = connect_dealer(ctx, ep)
    thief = zmq.Context.instance().socket(zmq.DEALER)
    r, h = zmq.Socket.shadow(router.underlying), zmq.Socket.shadow(honest.underlying)

    def handshakes(n: int) -> None:
        for _ in range(n):
            assert monitor.poll(5000), "a connection's handshake never finished"
            recv_monitor_message(monitor)

    try:
        h.send(b"hello")
        handshakes(1)
        assert r.poll(5000), "the router never heard the honest peer"
        addr, body = r.recv_multipart()
        assert body == b"hello" and addr[:1] == b"\0", addr  # a routing id the ROUTER chose
        thief.setsockopt(zmq.LINGER, 0)
        thief.setsockopt(zmq.ROUTING_ID, addr)
        thief.connect(ep)
        thief.send(b"forged")
        handshakes(1)  # the thief is attached (with ROUTER_HANDOVER, it would now hold the id)
        h.send(b"again")
        assert r.poll(5000)
        assert r.recv_multipart() == [addr, b"again"]
        for i in range(20):
            r.send_multipart([addr, b"mail %d" % i])
        got = []
        while len(got) < 20 and h.poll(5000):
            got.append(h.recv())
        assert got == [b"mail %d" % i for i in range(20)]
        assert not thief.poll(200), "the socket that claimed the id got mail"
        assert not r.poll(200), "the router read the socket that claimed the id"
    finally:
        thief.close(linger=0)
        honest.close(linger=0)
        router.disable_monitor()
        monitor.close(linger=0)
        router.close(linger=0)
        ctx.term()


FIRST_ID = """
import zmq, zmq.asyncio
from flowmesh.transport import bind_router
ctx = zmq.asyncio.Context()
router, ep = bind_router(ctx, "tcp://127.0.0.1:0")
r = zmq.Socket.shadow(router.underlying)
d = zmq.Context.instance().socket(zmq.DEALER)
d.connect(ep)
d.send(b"x")
assert r.poll(10000)
print(r.recv_multipart()[0].hex())
"""


def test_the_routing_ids_a_router_gives_differ_between_processes() -> None:
    """Unseeded, libzmq gives every process's first peer the same id, which a stranger could
    connect under first; libzmq aborts the process when the two ids meet."""
    ids = [
        subprocess.run(
            [sys.executable, "-c", FIRST_ID], capture_output=True, text=True, timeout=60, check=True
        ).stdout.strip()
        for _ in range(2)
    ]
    assert ids[0] != ids[1] and all(len(i) == 10 for i in ids), ids


# ---------------------------------------------------------------------------- the peer


class _Peer(MeshPeer):
    role = "test-peer"
    stats_type = p.WorkerStats

    def registration(self) -> p.Register:
        return p.Register(
            id=1,
            role="worker",
            name=self.name,
            pid=os.getpid(),
            budget_bytes=1,
            info=p.PeerInfo(threads=3),
        )


async def fake_broker(
    router: zmq.asyncio.Socket, answer: Any, seen: list[tuple[bytes, p.Register]]
) -> None:
    """Answers each registration with `answer(n)` (n: registrations so far), keeps them."""
    while True:
        addr, *frames = await router.recv_multipart()
        msg = p.decode(frames)
        if isinstance(msg, p.Register):
            seen.append((addr, msg))
            await router.send_multipart([addr, *p.encode(answer(len(seen), msg))])


def refuse(n: int, msg: p.Register) -> p.Message:
    return p.Error(id=msg.id, code=str(Code.NAME_TAKEN), reason=TAKEN)


def ack(n: int, msg: p.Register) -> p.Message:
    return p.RegisterAck(id=msg.id, heartbeat_s=0.2, liveness=10)


async def test_a_peer_whose_name_stays_taken_stops_with_the_broker_s_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ctx = zmq.asyncio.Context()
    router, ep = bind_router(ctx, "tcp://127.0.0.1:0")
    seen: list[tuple[bytes, p.Register]] = []
    broker = asyncio.create_task(fake_broker(router, refuse, seen))
    peer = _Peer("w0", ep, register_timeout_s=0.6)
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(FlowmeshError) as stopped:
            await asyncio.wait_for(peer._connection(ctx), 30)
        assert (stopped.value.code, stopped.value.reason) == (Code.NAME_TAKEN, TAKEN)
        assert f"the broker refused our name: {TAKEN}; stopping" in caplog.text
        # Tried again on the one socket meanwhile (its predecessor may have been on its way
        # out), each time as this process: no routing id of its own, the same secret.
        assert len(seen) >= 2 and len({addr for addr, _ in seen}) == 1, seen
        assert all(addr[:1] == b"\0" for addr, _ in seen)
        assert {m.info.session for _, m in seen} == {peer.session}
        assert all(m.info.threads == 3 for _, m in seen) and len(peer.session) == 32
    finally:
        broker.cancel()
        await asyncio.gather(broker, return_exceptions=True)
        router.close(linger=0)
        ctx.term()


async def test_a_peer_refused_while_its_predecessor_is_still_known_gets_in_after() -> None:
    ctx = zmq.asyncio.Context()
    router, ep = bind_router(ctx, "tcp://127.0.0.1:0")
    seen: list[tuple[bytes, p.Register]] = []
    broker = asyncio.create_task(
        fake_broker(router, lambda n, m: refuse(n, m) if n <= 2 else ack(n, m), seen)
    )
    peer = _Peer("w0", ep, register_timeout_s=10)
    connection = asyncio.create_task(peer._connection(ctx))
    try:
        await until(lambda: peer.registrations or connection.done(), "a registration", 30)
        assert not connection.done(), connection
        assert len(seen) == 3 and peer.heartbeat_s == 0.2
        assert len({addr for addr, _ in seen}) == 1  # each answered: no fresh socket needed
    finally:
        peer.stop()
        await asyncio.wait_for(connection, 10)
        broker.cancel()
        await asyncio.gather(broker, return_exceptions=True)
        router.close(linger=0)
        ctx.term()


# ---------------------------------------------------------------------------- names


def test_default_worker_names_differ_between_cpu_stand_ins_of_one_host() -> None:
    assert default_name("cpu", keyed=False, host="vm", pid=41) == "vm-cpu-41"
    assert default_name("cpu", keyed=False, host="vm", pid=42) == "vm-cpu-42"
    assert default_name("cpu", keyed=False) == f"{socket.gethostname()}-cpu-{os.getpid()}"
    assert default_name("cuda:3", keyed=False, host="vm", pid=41) == "vm-cuda3"
    # With keys the name is the key's (DIR/<name>.key_secret): a second process under it is
    # refused by the broker, with a reason, rather than named apart.
    assert default_name("cpu", keyed=True, host="vm", pid=41) == "vm-cpu"


# ---------------------------------------------------------------------------- exposure


@pytest.mark.parametrize(
    ("endpoint", "reachable"),
    [
        ("tcp://127.0.0.1:5555", False),
        ("tcp://127.3.2.1:0", False),
        ("tcp://localhost:5555", False),
        ("tcp://[::1]:5555", False),
        ("ipc:///tmp/flowmesh.sock", False),
        ("inproc://x", False),
        ("tcp://0.0.0.0:5555", True),
        ("tcp://*:5555", True),
        ("tcp://10.0.0.7:5555", True),
        ("tcp://[::]:5555", True),
        ("tcp://eth0:5555", True),
        ("tcp://gpu-host:5555", True),
    ],
)
def test_what_other_hosts_may_reach(endpoint: str, reachable: bool) -> None:
    assert reachable_from_other_hosts(endpoint) is reachable


def test_a_keyless_bind_other_hosts_reach_is_refused_unless_insecure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = logging.getLogger("test.exposure")
    with pytest.raises(SystemExit) as stop:
        check_keyless_bind(
            "--backend", "tcp://0.0.0.0:5556", "do x", keyed=False, insecure=False, log=log
        )
    said = str(stop.value)
    assert said.startswith("--backend tcp://0.0.0.0:5556: not a loopback address, and no --keys")
    assert "could do x" in said and "--insecure 1" in said
    with caplog.at_level(logging.WARNING):
        check_keyless_bind(
            "--backend", "tcp://0.0.0.0:5556", "do x", keyed=True, insecure=False, log=log
        )
        check_keyless_bind(
            "--backend", "tcp://127.0.0.1:5556", "do x", keyed=False, insecure=False, log=log
        )
        assert caplog.text == ""
        check_keyless_bind(
            "--backend", "tcp://0.0.0.0:5556", "do x", keyed=False, insecure=True, log=log
        )
    assert "INSECURE: --backend tcp://0.0.0.0:5556 is bound without keys" in caplog.text
    assert "anyone who reaches it can do x" in caplog.text


def test_the_broker_refuses_a_keyless_non_loopback_bind() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "broker",
            "--frontend",
            "tcp://0.0.0.0:0",
            "--backend",
            "tcp://127.0.0.1:0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, out
    assert (
        out.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "--frontend tcp://0.0.0.0:0: not a loopback address, and no --keys: anyone who reaches "
            "it could deploy, undeploy and train models and read every answer."
        )
    ), out.stderr


def test_a_worker_refuses_a_keyless_peer_endpoint_other_hosts_reach(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flowmesh import logs
    from gpu_worker import __main__ as worker

    monkeypatch.setattr(logs, "setup", lambda *a, **kw: logging.getLogger("worker"))

    def past_the_check(*a: Any, **kw: Any) -> None:
        raise AssertionError("the worker went on to open its device")

    monkeypatch.setattr(worker, "open_device", past_the_check)
    argv = ["--device", "cpu", "--memory-budget", "1MiB", "--peer-endpoint", "tcp://0.0.0.0:0"]
    with pytest.raises(SystemExit) as stop:
        worker.main(argv)
    assert str(stop.value).startswith("--peer-endpoint tcp://0.0.0.0:0: not a loopback address")


def test_flowmesh_up_passes_insecure_to_the_broker() -> None:
    args = build_parser().parse_args(["up", "--listen", "0.0.0.0:7000", "--insecure"])
    assert up_mesh(args, gpus=[]).broker_args[-2:] == ["--insecure", "1"]
    plain = build_parser().parse_args(["up", "--listen", "0.0.0.0:7000"])
    assert "--insecure" not in up_mesh(plain, gpus=[]).broker_args
