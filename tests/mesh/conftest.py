"""Real meshes for end-to-end tests: broker, partitioner and workers as processes on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from client_sdk.mesh import LocalMesh
from flowmesh.build import build_seeded
from flowmesh.spec import ModelSpec

# Fast heartbeats so that a dead worker is noticed within a second.
FAST = {"heartbeat_s": 0.2, "liveness": 3, "threads_per_worker": 1}


@pytest.fixture(scope="module")
def mesh() -> Iterator[LocalMesh]:
    """Two CPU stand-in workers of 8 MiB each, shared by a test module."""
    with LocalMesh(cpu_workers=2, memory_budget="8MiB", **FAST) as m:
        yield m


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # Workers run torch on one thread; references computed here do the same, so unbatched
    # results can be compared bit for bit.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def mlp_spec(name: str, width: int = 256, depth: int = 3, seed: int = 0) -> ModelSpec:
    return ModelSpec(
        name=name,
        factory="flowmesh.examples:mlp",
        kwargs={"width": width, "depth": depth},
        seed=seed,
    )


def reference(spec: ModelSpec) -> torch.nn.Module:
    return build_seeded(spec)


def deploy(client, spec: ModelSpec, **kw) -> dict:  # type: ignore[no-untyped-def]
    return client.deploy(
        spec.name,
        spec.factory,
        kwargs=spec.kwargs,
        seed=spec.seed,
        weights=spec.weights,
        max_batch_size=spec.max_batch_size,
        **kw,
    )
