"""A model cut into stages over several workers, its activations going worker to worker, in
process (tests/support/inproc.py): the broker announces each batch to every stage's worker, the
activations go from each worker's core to the next one's in micro-batches (as Hops, through the
codec), and the broker forwards none of them (it counts what it relays). Killing a worker on the
path, and the peer sockets under CURVE keys, are tests/mesh/test_direct.py.
"""

from __future__ import annotations

import asyncio

import torch

from client_sdk import errors
from flowmesh.modelio.build import build_seeded
from flowmesh.spec import ModelSpec
from flowmesh.testing import assert_forward_close
from tests.support.inproc import InProcMesh
from tests.support.mesh import deploy, fresh_stats, mlp_spec, reference


def test_four_stages_over_four_workers_pass_activations_directly() -> None:
    spec = mlp_spec("deep", width=256, depth=8, seed=21)
    ref = reference(spec)
    # Micro-batches of 2 rows and more: a batch of 8 rows flows through in 4 pieces.
    mesh = InProcMesh(cpu_workers=4, memory_budget="8MiB", broker={"micro_batch_rows": 2})
    with mesh, mesh.client() as c:
        st = deploy(c, spec, stages=4, replicas=1)
        path = st.replicas[0].workers
        assert len(set(path)) == 4

        async def traffic() -> list[tuple[torch.Tensor, torch.Tensor]]:
            async with mesh.async_client(timeout=60) as client:
                xs = [torch.randn(rows, 256) for rows in (1, 8, 3, 2, 5, 1, 4, 7)]
                outs = await asyncio.gather(*(client.infer("deep", x) for x in xs))
                return list(zip(xs, outs, strict=True))

        for x, out in asyncio.run(traffic()):
            assert_forward_close(out, ref(x))
        totals = c.status().totals
        assert totals.direct_batches >= 1
        assert totals.activation_bytes_relayed == 0  # not one activation byte via us
        # Each later stage took micro-batches from its predecessor (its peer socket, in process).
        hops = {w: fresh_stats(c, w).hops_in for w in path}
        assert hops[path[0]] == 0
        assert all(hops[w] >= totals.direct_batches for w in path[1:]), hops
        assert max(hops.values()) > totals.direct_batches  # a batch went in pieces


def test_a_failure_in_the_middle_stage_fails_that_request_alone_and_nothing_waits() -> None:
    spec = ModelSpec(name="late", factory="tests.support.train_models:late_boom_mlp", seed=4)
    model = build_seeded(spec, ("tests.support.train_models",)).eval()

    def ref(x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return model(x)

    mesh = InProcMesh(
        cpu_workers=3,
        memory_budget="8MiB",
        allow=["flowmesh.examples", "tests.support.train_models"],
        broker={"micro_batch_rows": 1},  # batches flow through in pieces as well
    )
    with mesh, mesh.client() as c:
        st = deploy(c, spec, stages=3, replicas=1)
        path = st.replicas[0].workers
        assert len(set(path)) == 3

        async def traffic() -> list[object]:
            async with mesh.async_client(timeout=60) as client:
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
        pending = {w: fresh_stats(c, w).direct_pending for w in path}
        assert pending == dict.fromkeys(path, 0), pending
        assert c.status().totals.activation_bytes_relayed == 0
