"""A model cut into stages over several workers, its activations going worker to worker.

Real processes on loopback: the broker announces each batch to every stage's worker, the
activations travel between the workers' peer sockets in micro-batches, and the broker forwards
none of them (it counts what it relays). Killing a worker on the path fails or retries the
requests it held, never hangs them.
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
from flowmesh.modelio.build import build_seeded
from flowmesh.spec import ModelSpec
from flowmesh.testing import assert_forward_close
from tests.support.mesh import FAST, deploy, fresh_stats, mlp_spec, reference


def test_four_stages_over_four_workers_pass_activations_directly(tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = mlp_spec("deep", width=256, depth=8, seed=21)
    ref = reference(spec)
    # Micro-batches of 2 rows and more: a batch of 8 rows flows through in 4 pieces.
    broker = ["--micro-batch-rows", "2"]
    mesh = LocalMesh(
        cpu_workers=4, memory_budget="8MiB", run_dir=tmp_path, broker_args=broker, **FAST
    )
    with mesh, mesh.client() as c:
        st = deploy(c, spec, stages=4, replicas=1)
        path = st["replicas"][0]["workers"]
        assert len(set(path)) == 4

        async def traffic() -> list[tuple[torch.Tensor, torch.Tensor]]:
            async with AsyncClient(mesh.frontend, timeout=60) as client:
                xs = [torch.randn(rows, 256) for rows in (1, 8, 3, 2, 5, 1, 4, 7)]
                outs = await asyncio.gather(*(client.infer("deep", x) for x in xs))
                return list(zip(xs, outs, strict=True))

        for x, out in asyncio.run(traffic()):
            assert_forward_close(out, ref(x))
        totals = c.status()
        assert totals["direct_batches"] >= 1
        assert totals["activation_bytes_relayed"] == 0  # not one activation byte via us
        # Each later stage took micro-batches from its predecessor over its peer socket.
        hops = {w: fresh_stats(c, w)["hops_in"] for w in path}
        assert hops[path[0]] == 0
        assert all(hops[w] >= totals["direct_batches"] for w in path[1:]), hops
        assert max(hops.values()) > totals["direct_batches"]  # a batch went in pieces


def test_a_worker_killed_on_the_path_fails_or_retries_never_hangs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = mlp_spec("path", width=256, depth=6, seed=22)
    ref = reference(spec)
    with LocalMesh(cpu_workers=4, memory_budget="8MiB", run_dir=tmp_path, **FAST) as mesh:
        with mesh.client() as c:
            st = deploy(c, spec, stages=3, replicas=1)
        middle = st["replicas"][0]["workers"][1]
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
                (model,) = [m for m in c.status()["models"] if m["name"] == "path"]
                new = any(r["live"] and middle not in r["workers"] for r in model["replicas"])
                return new or None

            wait_until(replaced, "the replica re-created without the killed worker", 30)
            x = torch.randn(2, 256)
            out = c.infer("path", x, timeout=60)
            assert_forward_close(out, ref(x))


def test_a_failure_in_the_middle_stage_fails_that_request_alone_and_nothing_waits(
    tmp_path,
) -> None:  # type: ignore[no-untyped-def]
    spec = ModelSpec(name="late", factory="tests.support.train_models:late_boom_mlp", seed=4)
    model = build_seeded(spec, ("tests.support.train_models",)).eval()

    def ref(x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return model(x)

    broker = ["--micro-batch-rows", "1"]  # batches flow through in pieces as well
    mesh = LocalMesh(
        cpu_workers=3,
        memory_budget="8MiB",
        run_dir=tmp_path,
        allow=["flowmesh.examples", "tests.support.train_models"],
        broker_args=broker,
        **FAST,
    )
    with mesh, mesh.client() as c:
        st = deploy(c, spec, stages=3, replicas=1)
        path = st["replicas"][0]["workers"]
        assert len(set(path)) == 3

        async def traffic() -> list[object]:
            async with AsyncClient(mesh.frontend, timeout=60) as client:
                xs = [torch.randn(2, 8) for _ in range(6)]
                xs[2][1, 3] = float("nan")  # its batch fails at stage 1 of 3
                outs = await asyncio.gather(
                    *(client.infer("late", x) for x in xs), return_exceptions=True
                )
                return list(zip(xs, outs, strict=True))

        results = asyncio.run(traffic())
        for k, (x, out) in enumerate(results):
            if k == 2:
                assert isinstance(out, errors.ModelError), out
                assert "NaN reached the middle" in out.reason
            else:
                assert not isinstance(out, BaseException), out
                assert_forward_close(out, ref(x))
        # The stage after the failure was told to forget the run: nothing left waiting anywhere.
        pending = {w: fresh_stats(c, w)["direct_pending"] for w in path}
        assert pending == dict.fromkeys(path, 0), pending
        assert c.status()["activation_bytes_relayed"] == 0


def test_under_curve_keys_activations_go_worker_to_worker_from_the_named_key_only(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    spec = mlp_spec("sealed", width=64, depth=6, seed=23)
    ref = reference(spec)
    mesh = LocalMesh(cpu_workers=3, memory_budget="8MiB", run_dir=tmp_path, keys=True, **FAST)
    with mesh, mesh.client() as c:
        st = deploy(c, spec, stages=3, replicas=1)
        path = st["replicas"][0]["workers"]
        for rows in (1, 4, 2, 3):
            x = torch.randn(rows, 64)
            assert_forward_close(c.infer("sealed", x), ref(x))
        totals = c.status()
        assert totals["direct_batches"] == 4 and totals["activation_bytes_relayed"] == 0
        last = path[-1]
        before = fresh_stats(c, last)
        assert before["hops_in"] >= 4 and before["peer_refused"] == 0

        # A key of this mesh (the operator's) that no run names, at the last worker's peer
        # socket with a well-formed Hop: ZAP refuses the connection, nothing reaches the worker.
        (row,) = [w for w in c.status()["workers"] if w["name"] == last]
        assert mesh.key_dir is not None and mesh.client_keys is not None
        server, _, _ = read_cert(mesh.key_dir / f"{last}.key")
        keys = load_keys(mesh.client_keys)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        curve_client(sock, dataclasses.replace(keys, server_public=server))
        sock.connect(row["peer_endpoint"])
        try:
            sock.send_multipart(
                p.encode(p.Hop(id=1, ticket=1, model="sealed", stage=2, chunk=0)), zmq.NOBLOCK
            )
            wait_until(
                lambda: fresh_stats(c, last)["peer_refused"] or None,
                "the worker to refuse the operator's key on its peer socket",
                timeout=20,
            )
        finally:
            sock.close(0)
            ctx.term()
        assert fresh_stats(c, last)["hops_in"] == before["hops_in"]
        x = torch.randn(2, 64)  # the workers' own connections are untouched
        assert_forward_close(c.infer("sealed", x), ref(x))
