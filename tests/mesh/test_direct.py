"""A model cut into stages over several workers, on real processes: killing a worker on the path
fails or retries the requests it held, never hangs them; under CURVE keys a worker's peer socket
takes activations from the named key only. The direct runs themselves run in process
(tests/scenarios/test_direct.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal

import torch
import zmq

from client_sdk import errors
from client_sdk.client import AsyncClient
from client_sdk.mesh import LocalMesh, wait_until
from flowmesh import protocol as p
from flowmesh.auth import curve_client, load_keys, read_cert
from flowmesh.testing import assert_forward_close
from tests.support.mesh import FAST, deploy, fresh_stats, mlp_spec, reference


def test_a_worker_killed_on_the_path_fails_or_retries_never_hangs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = mlp_spec("path", width=256, depth=6, seed=22)
    ref = reference(spec)
    with LocalMesh(cpu_workers=4, memory_budget="8MiB", run_dir=tmp_path, **FAST) as mesh:
        with mesh.client() as c:
            st = deploy(c, spec, stages=3, replicas=1)
        middle = st.replicas[0].workers[1]
        outcomes: list[str] = []

        async def traffic() -> None:
            async with AsyncClient(mesh.frontend, timeout=60) as client:
                ten_answered = asyncio.Event()  # the kill lands once traffic flows

                async def one(k: int) -> None:
                    x = torch.randn(1 + k % 4, 256)
                    try:
                        out = await client.infer("path", x)
                    except (errors.WorkerLost, errors.Unavailable, errors.Timeout) as exc:
                        outcomes.append(type(exc).__name__)
                        return
                    assert_forward_close(out, ref(x))
                    outcomes.append("ok")
                    if len(outcomes) >= 10:
                        ten_answered.set()

                async def kill_soon() -> None:
                    await asyncio.wait_for(ten_answered.wait(), 60)
                    mesh.child(middle).proc.send_signal(signal.SIGKILL)

                killer = asyncio.create_task(kill_soon())
                for w in range(6):  # waves one after another: the kill lands mid-traffic
                    await asyncio.wait_for(asyncio.gather(*(one(8 * w + k) for k in range(8))), 60)
                await killer

        asyncio.run(traffic())
        assert len(outcomes) == 48  # every request answered
        assert outcomes.count("ok") >= 10
        # Served again afterwards, on a replica re-created over the workers left (once the
        # broker has noticed the death: a request before that is answered WorkerLost).
        with mesh.client() as c:

            def replaced() -> bool | None:
                (model,) = [m for m in c.status().models if m.name == "path"]
                new = any(r.live and middle not in r.workers for r in model.replicas)
                return new or None

            wait_until(replaced, "the replica re-created without the killed worker", 30)
            x = torch.randn(2, 256)
            out = c.infer("path", x, timeout=60)
            assert_forward_close(out, ref(x))


def test_under_curve_keys_activations_go_worker_to_worker_from_the_named_key_only(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    spec = mlp_spec("sealed", width=64, depth=6, seed=23)
    ref = reference(spec)
    mesh = LocalMesh(cpu_workers=3, memory_budget="8MiB", run_dir=tmp_path, keys=True, **FAST)
    with mesh, mesh.client() as c:
        st = deploy(c, spec, stages=3, replicas=1)
        path = st.replicas[0].workers
        for rows in (1, 4, 2, 3):
            x = torch.randn(rows, 64)
            assert_forward_close(c.infer("sealed", x), ref(x))
        totals = c.status().totals
        assert totals.direct_batches == 4 and totals.activation_bytes_relayed == 0
        last = path[-1]
        before = fresh_stats(c, last)
        assert before.hops_in >= 4 and before.peer_refused == 0

        # A key of this mesh (the operator's) that no run names, at the last worker's peer
        # socket with a well-formed Hop: ZAP refuses the connection, nothing reaches the worker.
        (row,) = [w for w in c.status().workers if w.name == last]
        assert mesh.key_dir is not None and mesh.client_keys is not None
        server, _, _ = read_cert(mesh.key_dir / f"{last}.key")
        keys = load_keys(mesh.client_keys)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        curve_client(sock, dataclasses.replace(keys, server_public=server))
        sock.connect(row.peer_endpoint)
        try:
            sock.send_multipart(
                p.encode(p.Hop(id=1, ticket=1, model="sealed", stage=2, chunk=0)), zmq.NOBLOCK
            )
            wait_until(
                lambda: fresh_stats(c, last).peer_refused or None,
                "the worker to refuse the operator's key on its peer socket",
                timeout=20,
            )
        finally:
            sock.close(0)
            ctx.term()
        assert fresh_stats(c, last).hops_in == before.hops_in
        x = torch.randn(2, 64)  # the workers' own connections are untouched
        assert_forward_close(c.infer("sealed", x), ref(x))
