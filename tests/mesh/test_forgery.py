"""A registered impostor on the backend: it cannot answer other workers' runs or break status.

The impostor is a raw DEALER that registers as a worker under a fresh name (anyone who can reach
the backend port can, until keys are configured) and then sprays forged run results and errors
over the whole range of run ids while a healthy client infers and checks every answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time

import torch
import zmq

from client_sdk.client import AsyncClient
from client_sdk.mesh import LocalMesh
from flowmesh import protocol as p
from tests.support.mesh import FAST, deploy, mlp_spec, reference
from tests.support.waiting import until

REQUESTS = 40
# Broker ids come from one counter from 1 (no state directory), drawn per request, run, load and
# plan ask, never by the clock: this test's run ids stay near 100 (40 requests, one deploy), well
# inside. Each request waits for a sweep of the whole range (twice its size in forged messages).
IDS = range(1, 600)


def impostor(backend: str, model: str, stop: threading.Event, sweeps: list[int]) -> int:
    """Registers as worker 'impostor', then forges answers until `stop`; returns how many
    forged messages the broker refused (it answers each with an error). `sweeps[0]` counts
    its passes over the whole range of run ids. Runs on a thread of its own, so the client's
    event loop in the test is not slowed by it."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"impostor")
    sock.connect(backend)
    refused = 0

    def put(msg: p.Message) -> None:
        with contextlib.suppress(zmq.Again):  # a full queue: that forgery is simply not sent
            sock.send_multipart(p.encode(msg), flags=zmq.NOBLOCK)

    try:
        reg = p.Register(
            id=1, role="worker", name="impostor", pid=os.getpid(), kind="cpu", budget_bytes=1 << 20
        )
        put(reg)
        put(p.Heartbeat(stats=p.WorkerStats(peak_bytes=0)))
        # Stats that once broke every later status() call.
        put(p.Heartbeat(stats=p.WorkerStats(peak_bytes="lots")))  # type: ignore[arg-type]
        forged = torch.full((1, 64), 1e6)
        beat = time.monotonic()
        while not stop.is_set():
            for rid in IDS:
                put(p.RunResult(id=rid, model=model, stage=0, tensors=[{"": forged}], info={}))
                put(p.Error(id=rid, code="model_error", reason="forged"))
                if time.monotonic() - beat > 0.05:
                    beat = time.monotonic()
                    put(p.Heartbeat())
                    while sock.poll(0):
                        refused += isinstance(p.decode(sock.recv_multipart()), p.Error)
                if stop.is_set():
                    break
            else:
                sweeps[0] += 1
        return refused
    finally:
        sock.close()


def test_an_impostor_cannot_answer_runs_it_was_not_sent_or_break_status(tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = mlp_spec("guarded", width=64, depth=2, seed=3)
    ref = reference(spec)
    with LocalMesh(cpu_workers=1, memory_budget="8MiB", run_dir=tmp_path, **FAST) as mesh:
        with mesh.client() as c:
            deploy(c, spec, replicas=1)

        async def main() -> tuple[int, dict]:
            stop, sweeps = threading.Event(), [0]
            forger = asyncio.create_task(
                asyncio.to_thread(impostor, mesh.backend, spec.name, stop, sweeps)
            )
            try:
                async with AsyncClient(mesh.frontend, timeout=30) as client:
                    for _ in range(REQUESTS):
                        x = torch.randn(1, 64)
                        before = sweeps[0]
                        out = await client.infer(spec.name, x)
                        torch.testing.assert_close(out, ref(x))  # never the forged 1e6 rows
                        # Its run's id forged once more at least, before the next request.
                        await until(lambda b=before: sweeps[0] > b, "a sweep of forgeries")
                    status = await client.status()
            finally:
                stop.set()
            return await asyncio.wait_for(forger, 30), status

        refused, status = asyncio.run(main())
        assert refused > 0  # the broker saw and refused forgeries (not merely missed them)
        names = sorted(w.name for w in status.workers)
        assert names == ["impostor", "worker-0"], names
        model = status.models[0]
        assert model.completed == REQUESTS and model.errors == 0, model
        assert [ch.name for ch in mesh.children if ch.proc.poll() is not None] == []
