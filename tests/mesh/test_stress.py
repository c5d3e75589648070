"""Concurrent, bursty, oversubscribed traffic on a real mesh: every request answered correctly.

Small models, so that the run is short, but the same pressure as the demo: the catalogue is
several times the device memory, one model is split in two stages, popularity is skewed and
arrivals come in bursts. Asserted: every answer matches its direct forward, models are loaded
again after being evicted, a burst of requests at one model is batched, and no worker ever
holds more stage bytes than its budget (sampled during the traffic, plus the worker's own
high-water mark).
Fragmentation retries and starvation reservations may happen too, but this traffic does not
force them: the broker's tests drive those paths exactly.

Three traces (arrival times, model choices, batch rows: one seed each) run one after the other on
one mesh with one catalogue, each judged by what changed during it.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from client_sdk.client import AsyncClient
from client_sdk.loadgen import Tally, arrival_times, run_trace, zipf_choices
from client_sdk.mesh import LocalMesh
from flowmesh.spec import ModelSpec
from flowmesh.testing import compare
from tests.support.mesh import FAST, ResidencySampler, fresh_stats, reference

CATALOGUE = [
    (
        "s-gpt2",
        "flowmesh.examples:tiny_gpt",
        {"vocab": 1024, "d_model": 192, "n_layers": 4, "n_heads": 4},
    ),  # > one device: 2 stages
    (
        "s-gpt1",
        "flowmesh.examples:tiny_gpt",
        {"vocab": 512, "d_model": 128, "n_layers": 3, "n_heads": 4},
    ),
    ("s-mlp1", "flowmesh.examples:mlp", {"width": 512, "depth": 4}),
    ("s-mlp2", "flowmesh.examples:mlp", {"width": 448, "depth": 5}),
    ("s-mlp3", "flowmesh.examples:mlp", {"width": 384, "depth": 6}),
    ("s-mlp4", "flowmesh.examples:mlp", {"width": 256, "depth": 3}),
]


@dataclass
class Stress:
    mesh: LocalMesh
    specs: dict[str, ModelSpec]
    refs: dict[str, Callable[[torch.Tensor], torch.Tensor]]


@pytest.fixture(scope="module")
def stress() -> Iterator[Stress]:
    """One mesh, the catalogue deployed once, for the three traces: a mesh's start and first
    deploys (every process building its first models) cost more than a trace, and what a trace
    checks is counted from its own start (`Counts`), not from the mesh's."""
    specs = {
        n: ModelSpec(name=n, factory=f, kwargs=kw, seed=10 + i)
        for i, (n, f, kw) in enumerate(CATALOGUE)
    }
    with LocalMesh(cpu_workers=2, memory_budget="5MiB", **FAST) as mesh:
        with mesh.client() as c:
            for s in specs.values():
                c.deploy(s.name, s.factory, kwargs=s.kwargs, seed=s.seed)
            st = c.status()
        total = sum(m.bytes for m in st.models)
        assert total >= 2.5 * sum(w.budget_bytes for w in st.workers)
        assert max(len(m.stages) for m in st.models) == 2
        yield Stress(mesh, specs, {n: reference(s) for n, s in specs.items()})


@dataclass
class Counts:
    """The status counters a trace is judged by, at one moment (the mesh is shared)."""

    loads: int
    evictions: int
    batches: int
    requests: int
    worker_evictions: int

    @classmethod
    def now(cls, c: Any) -> Counts:
        st = c.status()
        return cls(
            loads=sum(m.loads for m in st.models),
            evictions=sum(m.evictions for m in st.models),
            batches=sum(m.batches for m in st.models),
            requests=sum(m.requests for m in st.models),
            worker_evictions=sum(fresh_stats(c, w.name).evictions for w in st.workers),
        )


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_bursty_oversubscribed_traffic_is_all_served_correctly(stress: Stress, seed: int) -> None:
    mesh, specs, refs = stress.mesh, stress.specs, stress.refs
    rng = random.Random(seed)
    wrong: list[str] = []

    def make_input(model: str) -> torch.Tensor:
        spec = specs[model]
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        if "vocab" in spec.kwargs:
            return torch.randint(0, spec.kwargs["vocab"], (rng.choice((1, 2)), 12), generator=g)
        return torch.randn(rng.choice((1, 2)), spec.kwargs["width"], generator=g)

    def check(model: str, x: torch.Tensor, y: torch.Tensor) -> None:
        got = compare(y, refs[model](x))
        if got.verdict == "wrong":
            wrong.append(f"{model}: max abs diff {got.max_abs_diff:.3g}")

    with mesh.client() as c:
        before = Counts.now(c)
    n = 150
    trace = list(
        zip(
            arrival_times(n, rate=100.0, cv=3.0, rng=rng),
            zipf_choices(list(specs), n, 1.1, rng),
            strict=True,
        )
    )
    residency = ResidencySampler()

    async def traffic() -> dict[str, Tally]:
        done = asyncio.Event()

        async def sample() -> None:
            async with AsyncClient(mesh.frontend, timeout=30) as client:
                while not done.is_set():
                    residency.take(await client.status())

        sampler = asyncio.create_task(sample())
        try:
            tallies, _wall = await run_trace(
                mesh.frontend, trace, make_input, clients=6, timeout=30.0, check=check
            )
        finally:
            done.set()
            await sampler
        return tallies

    tallies = asyncio.run(traffic())

    # Requests that queue are batched: a burst at one model, all sent in one loop turn (the
    # trace's own queueing depends on the machine's speed, so its batching is not counted on).
    burst_model = "s-mlp1"
    burst = [make_input(burst_model) for _ in range(12)]

    async def at_once() -> list[Any]:
        async with AsyncClient(mesh.frontend, timeout=30) as client:
            return await asyncio.gather(*(client.infer(burst_model, x) for x in burst))

    def batches_of(c: Any) -> int:
        return next(m.batches for m in c.status().models if m.name == burst_model)

    with mesh.client() as c:
        burst_before = batches_of(c)
    for x, y in zip(burst, asyncio.run(at_once()), strict=True):
        check(burst_model, x, y)
    with mesh.client() as c:
        burst_batches = batches_of(c) - burst_before
    assert 1 <= burst_batches < len(burst), burst_batches

    with mesh.client() as c:
        st = c.status()
        final = {w.name: fresh_stats(c, w.name) for w in st.workers}
        after = Counts.now(c)
    errors = {m: t.errors for m, t in tallies.items() if t.errors}
    assert not errors, errors
    assert sum(t.row()["ok"] for t in tallies.values()) == n
    assert not wrong, wrong
    assert after.evictions > before.evictions
    assert after.loads > before.loads  # every model was loaded at deploy: these came back
    assert after.worker_evictions > before.worker_evictions  # on the workers, not on paper
    residency.check(final, {w.name: w.budget_bytes for w in st.workers})
