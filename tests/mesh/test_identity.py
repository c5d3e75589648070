"""A live worker's identity cannot be taken; a second process under its name stops, saying why;
a restarted worker comes back under its name.

The impostors are raw DEALERs on the backend while a client infers and checks every answer: one
claims the routing id `worker-0` (the worker's own while peers chose their ids; with
ROUTER_HANDOVER on it took the worker's runs), the other registers as worker-0 from a socket of
its own with the pid and budget status shows (once enough to be taken for the worker registering
again). Both then spray forged results over the whole range of run ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq

from client_sdk.client import AsyncClient
from client_sdk.errors import ClientError
from client_sdk.mesh import LocalMesh
from flowmesh import protocol as p
from flowmesh.errors import FlowmeshError
from flowmesh.reports import BrokerStatus, WorkerRow
from flowmesh.testing import assert_forward_close, compare
from tests.support.mesh import FAST, deploy, mlp_spec, reference
from tests.support.waiting import until

WIDTH = 64
SPEC = mlp_spec("identity-mlp", width=WIDTH, depth=2, seed=7)
REQUESTS = 40
# Broker ids come from one counter from 1 (no state directory), drawn per request, run, load and
# plan ask, never by the clock: the forgery test, first on the module's mesh, sees run ids near
# 100 (40 requests, one deploy), well inside. Each request waits for a sweep of the whole range.
IDS = range(1, 600)


@pytest.fixture(scope="module")
def one_worker() -> Iterator[LocalMesh]:
    with LocalMesh(cpu_workers=1, memory_budget="8MiB", **FAST) as m:
        with m.client(timeout=30) as c:
            deploy(c, SPEC, replicas=1)
        yield m


@pytest.fixture(scope="module")
def ref() -> torch.nn.Module:
    return reference(SPEC)


def worker_row(client: Any) -> WorkerRow | None:
    rows = [w for w in client.status(timeout=10).workers if w.name == "worker-0"]
    return rows[0] if rows else None


def impostor(
    backend: str,
    routing_id: bytes | None,
    real: WorkerRow,
    stop: threading.Event,
    sweeps: list[int],
) -> Counter[str]:
    """Registers as worker-0, then forges answers until `stop`; what it received, by message
    type (errors by code). `sweeps[0]` counts its passes over the whole range of run ids. On a
    thread of its own, so that the client's loop is not slowed."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.connect(backend)
    got: Counter[str] = Counter()

    def put(msg: p.Message) -> None:
        with contextlib.suppress(zmq.Again):  # a full queue: that forgery is simply not sent
            sock.send_multipart(p.encode(msg), flags=zmq.NOBLOCK)

    def read() -> None:
        while sock.poll(0):
            msg = p.decode(sock.recv_multipart())
            got[msg.code if isinstance(msg, p.Error) else msg.TYPE] += 1

    try:
        reg = p.Register(
            id=1,
            role="worker",
            name="worker-0",
            pid=real.pid,
            kind="cpu",
            budget_bytes=real.budget_bytes,
        )
        put(reg)
        forged = torch.full((1, WIDTH), 1e6)
        while not stop.is_set():
            for rid in IDS:
                put(p.RunResult(id=rid, model=SPEC.name, stage=0, tensors=[{"": forged}], info={}))
                if rid % 100 == 0:
                    put(p.Heartbeat())
                    read()
                if stop.is_set():
                    break
            else:
                sweeps[0] += 1
        read()
        return got
    finally:
        sock.close()


def test_without_keys_no_forged_answer_reaches_a_client(
    one_worker: LocalMesh, ref: torch.nn.Module
) -> None:
    with one_worker.client(timeout=20) as c:
        real = worker_row(c)
    assert real is not None

    async def main() -> tuple[int, int, list[Counter[str]], BrokerStatus]:
        stop = threading.Event()
        sweeps = {rid: [0] for rid in (b"worker-0", None)}
        thieves = [
            asyncio.create_task(
                asyncio.to_thread(impostor, one_worker.backend, rid, real, stop, swept)
            )
            for rid, swept in sweeps.items()
        ]
        forged = failed = 0
        try:
            async with AsyncClient(one_worker.frontend, timeout=10) as client:
                for _ in range(REQUESTS):
                    x = torch.randn(1, WIDTH)
                    before = [swept[0] for swept in sweeps.values()]
                    try:
                        out = await client.infer(SPEC.name, x)
                    except ClientError:
                        failed += 1
                        continue
                    forged += compare(out, ref(x)).verdict == "wrong"
                    # Its run's id forged by each thief once more at least, before the next.
                    await until(
                        lambda b=before: all(
                            swept[0] > n for swept, n in zip(sweeps.values(), b, strict=True)
                        ),
                        "a sweep of forgeries by each thief",
                    )
                status = await client.status()
        finally:
            stop.set()
        return forged, failed, await asyncio.wait_for(asyncio.gather(*thieves), 30), status

    forged, failed, got, status = asyncio.run(main())
    assert (forged, failed) == (0, 0), f"{forged} forged answer(s) delivered, {failed} failed"
    for received in got:  # refused, and never sent a run of the worker's
        assert received["name_taken"] >= 1 and received["run"] == 0, received
    ((worker,),) = [status.workers]
    assert (worker.name, worker.pid, worker.registrations) == ("worker-0", real.pid, 1)
    assert status.totals.names_refused >= 2, status
    (model,) = [m for m in status.models if m.name == SPEC.name]
    assert model.errors == 0, model
    assert [ch.name for ch in one_worker.children if ch.proc.poll() is not None] == []


def spawn_worker(mesh: LocalMesh, name: str) -> str:
    """A worker process under `name` beside the mesh (with the mesh's keys, if any); its child
    name."""
    child = f"extra-{name}-{len(mesh.children)}"
    mesh._spawn(
        child,
        "gpu_worker",
        [
            *("--broker", mesh.backend, "--device", "cpu", "--memory-budget", "8MiB"),
            *("--name", name, "--threads", "1", *mesh._key_args(name, "worker")),
        ],
    )
    return child


def test_a_second_process_under_a_live_worker_s_name_stops_and_a_restarted_one_comes_back(
    one_worker: LocalMesh, ref: torch.nn.Module
) -> None:
    x = torch.randn(2, WIDTH)
    with one_worker.client(timeout=20) as c:
        before = worker_row(c)
        assert before is not None
        twin = one_worker.child(spawn_worker(one_worker, "worker-0"))
        assert twin.proc.wait(120) == 1, twin.tail()
        said = (
            "the broker refused our name: name 'worker-0' is held by a live worker of another "
            f"process (pid {before.pid}, "
        )
        assert said in twin.tail(100), twin.tail()
        after = worker_row(c)
        assert after is not None and (after.pid, after.registrations) == (
            before.pid,
            before.registrations,
        ), (before, after)
        assert_forward_close(c.infer(SPEC.name, x), ref(x))

        # Restarted: its predecessor's connection is gone, so the name is free again.
        one_worker.kill("worker-0")
        again = one_worker.child(spawn_worker(one_worker, "worker-0"))

        def serving() -> Any:
            row = worker_row(c)
            if row is None or row.pid == before.pid or not row.ready:
                return None
            try:
                return c.infer_with_info(SPEC.name, x, timeout=5)
            except FlowmeshError:
                return None

        out, info = one_worker.wait_until(
            serving, "worker-0, restarted, to register and serve", 90, watch=[again]
        )
        assert_forward_close(out, ref(x))
        assert info["workers"] == ["worker-0"], info
        row = worker_row(c)
        assert row is not None and row.pid == again.proc.pid, row
