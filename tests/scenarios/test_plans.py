"""The partitioner as a service on an in-process mesh (tests/support/inproc.py): plans cached
by the broker, never blocking it; models deployed as several stages serve the whole model's
outputs. `flowmesh plan` against a real mesh is tests/mesh/test_plans.py."""

from __future__ import annotations

import asyncio

import torch

from flowmesh.spec import ModelSpec
from flowmesh.testing import assert_forward_close
from tests.support.inproc import InProcMesh
from tests.support.mesh import fresh_stats, reference


def test_plans_are_cached_by_spec(mesh: InProcMesh) -> None:
    with mesh.client() as c:
        names = [row.name for row in c.status().partitioners]

        def planned() -> int:
            # Plans the partitioners made, from heartbeats sent after every plan answered so far
            # (a plain status read may show figures a heartbeat old).
            return sum(fresh_stats(c, name).planned for name in names)

        kwargs = {"width": 96, "depth": 5}
        first = c.plan("flowmesh.examples:mlp", kwargs=kwargs, stages=2)
        before = planned()
        again = c.plan("flowmesh.examples:mlp", kwargs=kwargs, stages=2)
        assert again == first
        assert planned() == before, "the same spec was planned again, not served from the cache"
        # The count does move when a plan is made: another spec goes to a partitioner.
        other = c.plan("flowmesh.examples:mlp", kwargs=kwargs, stages=3)
        assert len(other["ranges"]) == 3
        assert planned() == before + 1


def test_a_slow_plan_does_not_block_the_broker(mesh: InProcMesh) -> None:
    async def main() -> None:
        async with mesh.async_client(timeout=120) as client:
            slow = asyncio.create_task(
                client.plan(
                    "flowmesh.examples:hf_gpt2",
                    kwargs={"n_layer": 6, "n_embd": 128},
                    stages=2,
                    measure=True,
                )
            )
            # Status replies that show the plan in a partitioner's hands, received before the
            # plan itself: a broker that waited for the plan could answer none of them.
            during = 0
            while not slow.done():
                st = await client.status(timeout=30)
                if not slow.done() and any(row.inflight for row in st.partitioners):
                    during += 1
            plan = await slow
            assert len(plan["ranges"]) == 2 and plan["range_time_s"] is not None
            assert during >= 1, "no status was answered while the plan was being made"

    asyncio.run(main())


def test_hf_decoder_in_two_stages_serves_exact_logits(mesh: InProcMesh) -> None:
    spec = ModelSpec(
        name="opt-2",
        factory="flowmesh.examples:hf_opt",
        seed=7,
        stages=2,
        kwargs={"num_hidden_layers": 3, "hidden_size": 64, "vocab_size": 500},
    )
    with mesh.client() as c:
        info = c.deploy(spec.name, spec.factory, kwargs=spec.kwargs, seed=spec.seed, stages=2)
        assert [s.index for s in info.stages] == [0, 1]
        assert all(s.bytes > 0 for s in info.stages)
        (replica,) = info.replicas
        assert len(set(replica.workers)) == 2  # stages on distinct devices
        ids = torch.randint(0, 500, (2, 10))
        want = reference(spec)(input_ids=ids).logits
        assert_forward_close(c.infer("opt-2", ids), want)
        shown = next(m for m in c.status().models if m.name == "opt-2")
        assert [s.bytes for s in shown.stages] == [s.bytes for s in info.stages]


def test_a_model_larger_than_any_device_deploys_as_stages(mesh: InProcMesh) -> None:
    # 8 MiB per worker; this GPT is about 8.4 MiB: automatic planning cuts it in two.
    spec = ModelSpec(
        name="big-gpt",
        factory="flowmesh.examples:tiny_gpt",
        seed=8,
        kwargs={"vocab": 2048, "d_model": 192, "n_layers": 3, "n_heads": 4},
    )
    with mesh.client() as c:
        info = c.deploy(spec.name, spec.factory, kwargs=spec.kwargs, seed=spec.seed)
        budget = min(w.budget_bytes for w in c.status().workers)
        assert info.bytes > budget and len(info.stages) == 2
        assert all(s.bytes <= budget for s in info.stages)
        ids = torch.randint(0, 2048, (1, 16))
        assert_forward_close(c.infer("big-gpt", ids), reference(spec)(ids))
