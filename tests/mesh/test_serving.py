"""Serving on a real mesh, where the sockets and threads are the subject: which thread sends a
run's result, calls and answers in bundles. The rest of serving runs in process
(tests/scenarios/test_serving.py)."""

from __future__ import annotations

import asyncio

import msgspec
import torch

from client_sdk import errors
from client_sdk.client import AsyncClient
from client_sdk.mesh import LocalMesh
from flowmesh.testing import assert_forward_close
from tests.support.mesh import (
    deploy,
    fresh_stats,
    mlp_spec,
    reference,
)


def test_run_results_go_out_from_the_thread_that_computed_them(mesh: LocalMesh) -> None:
    """A run's result is sent by the thread that computed it (the worker's reader thread for a
    quick run, else a compute lane), not after a hand-off back to the worker's event loop (a
    thread wake-up on every request's path). tests/mesh/test_reader_runs.py has which is which."""
    spec = mlp_spec("lane-answers", width=32, depth=2, seed=5)
    ref = reference(spec)
    with mesh.client() as c:
        deploy(c, spec, replicas=1)
        (row,) = [m for m in c.status().models if m.name == spec.name]
        worker = row.replicas[0].workers[0]
        c.infer(spec.name, torch.randn(1, 32))  # loaded before the count starts
        before = fresh_stats(c, worker)
        for _ in range(5):
            x = torch.randn(2, 32)
            assert_forward_close(c.infer(spec.name, x), ref(x))
        after = fresh_stats(c, worker)
    assert after.runs - before.runs == 5
    answered = (after.lane_answers + after.reader_runs) - (
        before.lane_answers + before.reader_runs
    )
    assert answered == 5


def test_calls_made_together_travel_in_bundles_each_answered_as_its_own(mesh: LocalMesh) -> None:
    """Calls made in one loop turn go to the broker in bundles, and the answers of one grouped
    run come back in one: each call still gets its own answer, or its own error, exact."""
    spec = msgspec.structs.replace(
        mlp_spec("bundled", width=64, depth=2, seed=41), max_batch_size=1
    )
    ref = reference(spec)
    with mesh.client() as c:
        deploy(c, spec, replicas=1)
    xs = [torch.randn(1, 64, generator=torch.Generator().manual_seed(k)) for k in range(40)]

    async def together() -> tuple[list[object], int, int]:
        async with AsyncClient(mesh.frontend, timeout=60) as client:
            # Once the broker has stated its limits: until then every call waits for them.
            await client.status()
            calls = [client.infer(spec.name, x) for x in xs]
            calls.insert(10, client.infer("ghost", xs[0]))
            calls.insert(20, client.infer(spec.name, torch.randn(1, 65)))
            outs = await asyncio.gather(*calls, return_exceptions=True)
            return outs, client.bundled_calls, client.bundled_answers

    outs, bundled_calls, bundled_answers = asyncio.run(together())
    assert isinstance(outs[10], errors.ModelNotFound), outs[10]
    assert isinstance(outs[20], errors.BadRequest), outs[20]
    for x, out in zip(xs, outs[:10] + outs[11:20] + outs[21:], strict=True):
        assert isinstance(out, torch.Tensor), out
        assert_forward_close(out, ref(x))
    assert bundled_calls == 42  # every call of the turn, in one bundle
    assert bundled_answers >= 2  # the answers of a grouped run, at least once
