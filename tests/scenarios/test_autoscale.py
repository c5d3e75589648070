"""Autoscaling on an in-process mesh (tests/support/inproc.py): a burst on a model deployed with
one replica adds a second on the other worker (outputs still those of the direct forward); once
the burst is over and the model cooled (`BrokerConfig.scale_down_after_s`, 60 s by default), it
shrinks back to one.

The burst's arrival rate stays in the model's load for the rate window (`rate_window_s`, 30 s by
default: about a minute before a burst like this one reads as cooled); 2 s here, so that the
shrink comes seconds after the burst, by the same rule."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import torch

from client_sdk.client import AsyncClient
from flowmesh.reports import ModelRow
from flowmesh.testing import assert_forward_close
from tests.support.inproc import InProcMesh
from tests.support.mesh import deploy, mlp_spec, reference


def row(c: Any, name: str) -> ModelRow:
    (model,) = [m for m in c.status().models if m.name == name]
    return model


def test_a_burst_adds_a_replica_and_it_shrinks_back_after() -> None:
    # Unbatched: one replica serves one request per run, so a burst outruns it.
    spec = msgspec.structs.replace(mlp_spec("hot", width=512, depth=4, seed=3), max_batch_size=1)
    ref = reference(spec)
    timers = {"scale_up_after_s": 2.0, "scale_down_after_s": 5.0, "scale_cooldown_s": 3.0}
    with (
        InProcMesh(
            cpu_workers=2,
            memory_budget="32MiB",
            broker={"autoscale": True, "rate_window_s": 2.0, **timers},
        ) as mesh,
        mesh.client() as c,
    ):
        deploy(c, spec, replicas=1)
        first = row(c, "hot")
        assert (first.replicas_live, first.replicas_desired) == (1, 1)

        served_by: set[str] = set()
        stop = time.monotonic() + 90

        kept: list[tuple[torch.Tensor, Any]] = []

        async def one(client: AsyncClient, k: int) -> None:
            # One of many requests in flight at once, again and again: a steady queue.
            n = 0
            while time.monotonic() < stop and len(served_by) < 2:
                x = torch.randn(1, 512, generator=torch.Generator().manual_seed(k * 9973 + n))
                out, info = await client.infer_with_info("hot", x)
                served_by.update(info["workers"])
                if n % 8 == 0:
                    kept.append((x, out))  # checked after the burst, off its hot path
                n += 1

        async def burst(k: int) -> None:
            async with mesh.async_client(timeout=120) as client:
                await asyncio.gather(*(one(client, 24 * k + i) for i in range(24)))

        async def main() -> None:
            await asyncio.gather(*(burst(k) for k in range(4)))

        asyncio.run(main())
        for x, out in kept:
            assert_forward_close(out, ref(x))
        grown = row(c, "hot")
        assert len(served_by) == 2, (served_by, grown)
        assert grown.scale_ups == 1 and grown.errors == 0, grown

        def shrunk() -> ModelRow | None:
            r = row(c, "hot")
            return r if r.scale_downs == 1 and len(r.replicas) == 1 else None

        after = mesh.wait_until(shrunk, "the second replica to be dropped", 180)
        assert (after.replicas_live, after.replicas_desired) == (1, 1), after
        assert after.scale_ups == 1 and after.errors == 0, after
        x = torch.randn(3, 512)
        assert_forward_close(c.infer("hot", x), ref(x))
