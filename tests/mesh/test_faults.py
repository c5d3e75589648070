"""Faults on a real mesh: a worker killed mid-traffic, and malformed traffic from raw sockets."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import msgpack
import pytest
import torch
import zmq

from client_sdk import errors
from client_sdk.client import AsyncClient
from client_sdk.mesh import LocalMesh
from flowmesh import protocol as p
from flowmesh.errors import Code
from flowmesh.testing import assert_forward_close
from tests.support.mesh import FAST, deploy, mlp_spec, reference
from tests.support.waiting import until


def test_worker_killed_during_traffic(tmp_path) -> None:  # type: ignore[no-untyped-def]
    specs = [mlp_spec(f"kill-{i}", width=768, depth=4, seed=40 + i) for i in range(3)]
    with LocalMesh(cpu_workers=3, memory_budget="16MiB", run_dir=tmp_path, **FAST) as mesh:
        with mesh.client() as c:
            for s in specs:
                deploy(c, s, replicas=2)
        refs = {s.name: reference(s) for s in specs}
        outcomes: list[str] = []
        sent = [0]
        started, killed = asyncio.Event(), asyncio.Event()

        async def traffic(k: int) -> None:
            # Until the kill and ten requests beyond it, whatever the machine's speed.
            async with AsyncClient(mesh.frontend, timeout=30) as client:
                j, after = 0, 0
                while after < 10:
                    after += killed.is_set()
                    spec = specs[(k + j) % 3]
                    j += 1
                    x = torch.randn(1, 768)
                    sent[0] += 1
                    try:
                        out = await client.infer(spec.name, x)
                        assert_forward_close(out, refs[spec.name](x))
                        outcomes.append("ok")
                    except errors.WorkerLost as exc:
                        assert "worker-1" in exc.reason
                        outcomes.append("lost")
                    if len(outcomes) >= 20:
                        started.set()

        async def killer() -> None:
            # Kill worker-1 while it holds requests: frozen (SIGSTOP) it cannot finish them, and
            # two status replies in a row showing them in flight rule out a result on its way.
            proc = mesh.child("worker-1").proc
            await asyncio.wait_for(started.wait(), 60)
            async with AsyncClient(mesh.frontend, timeout=30) as client:

                async def busy() -> bool:
                    st = await client.status()
                    return any(w.name == "worker-1" and w.inflight for w in st.workers)

                for _ in range(1000):
                    # Running, until the broker has sent it work; then frozen with it, maybe.
                    await until(busy, "worker-1 to hold requests in flight", 30)
                    proc.send_signal(signal.SIGSTOP)
                    if await busy() and await busy():
                        proc.kill()
                        killed.set()
                        return
                    proc.send_signal(signal.SIGCONT)
            proc.kill()
            killed.set()
            raise AssertionError("worker-1 never held a request in flight when looked at")

        async def main() -> None:
            await asyncio.gather(killer(), *(traffic(k) for k in range(4)))

        asyncio.run(main())
        # Every request got an answer (result or WorkerLost): a request that timed out would
        # have raised Timeout out of `traffic`, and none vanished.
        assert len(outcomes) == sent[0] and set(outcomes) <= {"ok", "lost"}
        with mesh.client() as c:
            st = c.status()
            assert sorted(w.name for w in st.workers) == ["worker-0", "worker-2"]
            # Requests were in flight on the killed worker: retried elsewhere or answered lost.
            assert st.totals.retried + outcomes.count("lost") > 0, st

            # Replicas lost with the worker are re-created on the survivors.
            def repaired() -> list | None:
                models = c.status().models
                return (
                    models
                    if all(sum(r.live for r in m.replicas) == 2 for m in models)
                    else None
                )

            mesh.wait_until(repaired, "lost replicas to be re-created", timeout=30)
            for s in specs:  # the survivors still serve every model
                x = torch.randn(2, 768)
                assert_forward_close(c.infer(s.name, x), refs[s.name](x))


@pytest.fixture(scope="module")
def small_limit_mesh() -> Iterator[LocalMesh]:
    with LocalMesh(
        cpu_workers=1, memory_budget="8MiB", broker_args=["--max-message", "1MiB"], **FAST
    ) as m:
        yield m


def raw_exchange(endpoint: str, frames: list[bytes]) -> p.Message:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart(frames)
        assert sock.poll(10_000), f"no answer to {frames[:1]!r}"
        return p.decode(sock.recv_multipart())
    finally:
        sock.close()


def head(**fields: object) -> bytes:
    return msgpack.packb({"v": p.PROTOCOL_VERSION, **fields})


MALFORMED = [
    ("garbage", [b"\xc1\x00\xffnot msgpack"], Code.BAD_MESSAGE),
    ("truncated", [msgpack.packb({"v": 1, "t": "status", "id": 7})[:-3]], Code.BAD_MESSAGE),
    (
        "frame-count",
        [head(t="infer", id=8, model="m", tensors=[["x", "float32", [4]]])],
        Code.BAD_FRAMES,
    ),
    (
        "bytes-mismatch",
        [head(t="infer", id=9, model="m", tensors=[["x", "float32", [4]]]), b"\x00" * 15],
        Code.BAD_TENSOR,
    ),
    ("unknown-type", [head(t="self_destruct", id=10)], Code.UNKNOWN_TYPE),
    (
        "oversized",
        [
            head(t="infer", id=11, model="m", tensors=[["x", "uint8", [1_500_000]]]),
            b"\x00" * 1_500_000,
        ],
        Code.TOO_LARGE,
    ),
    ("old-version", [msgpack.packb({"v": 0, "t": "status", "id": 12})], Code.VERSION),
]


def test_malformed_messages_are_answered_while_a_client_keeps_working(
    small_limit_mesh: LocalMesh,
) -> None:
    mesh = small_limit_mesh
    spec = mlp_spec("steady", width=64, depth=2, seed=9)
    ref = reference(spec)
    with mesh.client() as c:
        deploy(c, spec)

    async def healthy(stop: asyncio.Event) -> int:
        n = 0
        async with AsyncClient(mesh.frontend, timeout=20) as client:
            while not stop.is_set() or n < 5:
                x = torch.randn(1, 64)
                assert_forward_close(await client.infer("steady", x), ref(x))
                n += 1
        return n

    async def attack(stop: asyncio.Event) -> list[tuple[str, str]]:
        seen = []
        for name, frames, code in MALFORMED:
            for endpoint in (mesh.frontend, mesh.backend):
                reply = await asyncio.to_thread(raw_exchange, endpoint, frames)
                assert isinstance(reply, p.Error), (name, reply)
                assert reply.code == code and reply.reason, (name, endpoint, reply)
                seen.append((name, reply.code))
        stop.set()
        return seen

    async def main() -> tuple[int, list[tuple[str, str]]]:
        stop = asyncio.Event()
        n, seen = await asyncio.gather(healthy(stop), attack(stop))
        return n, seen

    n, seen = asyncio.run(main())
    assert n >= 5 and len(seen) == 2 * len(MALFORMED)
    # A well-formed message from a peer that never registered is told to register.
    reply = raw_exchange(mesh.backend, p.encode(p.Heartbeat()))
    assert isinstance(reply, p.Disconnect)
    with mesh.client() as c:
        x = torch.randn(3, 64)
        assert_forward_close(c.infer("steady", x), ref(x))
        assert len(c.status().workers) == 1
