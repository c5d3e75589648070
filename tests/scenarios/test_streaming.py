"""A model larger than the only worker's budget, served by streaming its stages through that
one device (README "Serving a model larger than a device"), on an in-process mesh
(tests/support/inproc.py): exact against the model's own forward, with several requests in
flight."""

from __future__ import annotations

import asyncio

import torch

from flowmesh.testing import assert_forward_close
from tests.support.inproc import InProcMesh
from tests.support.mesh import deploy, fresh_stats, mesh_options, mlp_spec, reference

BUDGET = 1200 * 1024  # two of the four stages below (each two 256 x 256 Linears, 514 KiB)

pytestmark = mesh_options(cpu_workers=1, memory_budget=f"{BUDGET}B")


def test_a_model_over_the_one_workers_budget_is_served_exactly_by_streaming(
    mesh: InProcMesh,
) -> None:
    spec = mlp_spec("huge", width=256, depth=7, seed=3)  # 8 Linears: 2.0 MiB
    ref = reference(spec)
    with mesh.client() as c:
        row = deploy(c, spec, stages=4)
        assert row.bytes > BUDGET
        (rep,) = row.replicas
        worker = rep.workers[0]
        assert rep.workers == [worker] * 4
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(1 + k % 3, 256, generator=gen) for k in range(12)]

    async def in_flight() -> list[torch.Tensor]:
        async with mesh.async_client(timeout=120) as client:
            return await asyncio.gather(*(client.infer(spec.name, x) for x in xs))

    outs = asyncio.run(in_flight())
    for x, out in zip(xs, outs, strict=True):
        assert_forward_close(out, ref(x))
    with mesh.client() as c:
        stats = fresh_stats(c, worker)
    # Every pass copied stages in, each the next one while the one before computed, and the
    # device never held more than its budget.
    assert stats.prefetches > 0 and stats.evictions_chosen > 0, stats
    assert 0 < stats.stage_bytes_peak <= BUDGET, stats
