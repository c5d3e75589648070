"""Real meshes for end-to-end tests: broker, partitioner and workers as processes on loopback.

`FLOWMESH_TEST_KEYS=1` runs them with CURVE keys on: every `LocalMesh` of the session (the shared
fixtures' and those tests build) takes one session key directory, and plain SDK clients its
operator key (FLOWMESH_KEYS). tests/mesh/conftest.py registers the fixtures defined here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from client_sdk.mesh import LOCAL_OPERATOR, LocalMesh, wait_until
from flowmesh import protocol as p
from flowmesh.auth import ensure_key, init_keys
from flowmesh.modelio.build import build_seeded
from flowmesh.spec import ModelSpec

# Fast heartbeats, so that a dead worker is noticed within two seconds; ten missed beats, not
# three, before a peer counts as dead: on a loaded 2-core machine a process can go unscheduled
# for over half a second, and a live worker declared lost fails the test for nothing.
FAST = {"heartbeat_s": 0.2, "liveness": 10, "threads_per_worker": 1}

TEST_KEYS = os.environ.get("FLOWMESH_TEST_KEYS") == "1"
# Whether `_test_keys` is on: tests/mesh/ and tests/gateway/ each register it, and in one session
# the second must not make a second key directory (its FLOWMESH_KEYS would name a key the
# first's meshes do not know).
_KEYED: list[bool] = []


@pytest.fixture(scope="session", autouse=True)
def _test_keys(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """With FLOWMESH_TEST_KEYS=1, keys on for every mesh of the session (see the module)."""
    if not TEST_KEYS or _KEYED:
        yield
        return
    key_dir = tmp_path_factory.mktemp("flowmesh-keys") / "keys"
    init_keys(key_dir)
    operator = ensure_key(key_dir, LOCAL_OPERATOR, "operator")
    post_init = LocalMesh.__post_init__

    def keyed_post_init(self: LocalMesh) -> None:
        post_init(self)
        if self.keys is None:  # a test asking for keys=True gets its own directory
            self.keys = key_dir

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LocalMesh, "__post_init__", keyed_post_init)
        mp.setenv("FLOWMESH_KEYS", str(operator))
        _KEYED.append(True)
        try:
            yield
        finally:
            _KEYED.clear()


def roots_at(path: Path | str) -> dict[str, list[str]]:
    """LocalMesh arguments for tests' files: its workers and partitioner read clients' files,
    and save checkpoints, under `path` (`flowmesh.roots`)."""
    return {"data_roots": [str(path)], "checkpoint_roots": [str(path)]}


@pytest.fixture(scope="module")
def mesh(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalMesh]:
    """A real mesh shared by a test module (keys on with FLOWMESH_TEST_KEYS=1): by default two
    CPU stand-in workers of 8 MiB each with FAST heartbeats, reading clients' files under the
    session's tmp directories.

    A module changes or adds `LocalMesh` arguments with `pytestmark = mesh_options(...)`; an
    argument given as a callable is called as the mesh starts (a free port taken then, not
    when the module is imported)."""
    options: dict[str, Any] = {
        "cpu_workers": 2,
        "memory_budget": "8MiB",
        **roots_at(tmp_path_factory.getbasetemp()),
        **FAST,
    }
    marker = request.node.get_closest_marker("mesh_options")
    if marker is not None:
        options.update(marker.kwargs)
    options = {k: v() if callable(v) else v for k, v in options.items()}
    with LocalMesh(**options) as m:
        yield m


def mesh_options(**options: Any) -> pytest.MarkDecorator:
    """The `LocalMesh` arguments of a module's `mesh` fixture (see `mesh`); the marker is
    declared in pyproject.toml."""
    return pytest.mark.mesh_options(**options)


def mlp_spec(name: str, width: int = 256, depth: int = 3, seed: int = 0) -> ModelSpec:
    return ModelSpec(
        name=name,
        factory="flowmesh.examples:mlp",
        kwargs={"width": width, "depth": depth},
        seed=seed,
    )


def reference(spec: ModelSpec) -> Callable[..., Any]:
    """The whole model's direct forward, in this process (compare with assert_forward_close)."""
    model = build_seeded(spec)

    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.inference_mode():
            return model(*args, **kwargs)

    return forward


def deploy(client, spec: ModelSpec, **kw) -> p.ModelRow:  # type: ignore[no-untyped-def]
    return client.deploy(
        spec.name,
        spec.factory,
        kwargs=spec.kwargs,
        seed=spec.seed,
        weights=spec.weights,
        max_batch_size=spec.max_batch_size,
        **kw,
    )


def fresh_stats(client: Any, name: str, timeout: float = 10.0) -> Any:
    """Peer `name`'s heartbeat stats from a message the broker received after this call began.

    Heartbeat stats lag by up to a heartbeat; this waits for the broker to hear from the peer
    again (`uptime_s - last_seen_s` is the broker-clock time it last did), twice: the first
    message heard may be one the peer still owed (a residency report after a load, late on a
    loaded machine: seen once in tests/mesh/test_serving.py), which carries no stats; a second
    owed one would have to come later still, so the second is all but surely a heartbeat. Call
    it once the traffic it should reflect has been answered.
    """

    def heard_after(asked: float) -> Callable[[], p.WorkerStats | p.PartitionerStats | None]:
        def probe() -> p.WorkerStats | p.PartitionerStats | None:
            st = client.status()
            (row,) = [r for r in (*st.workers, *st.partitioners) if r.name == name]
            # Both figures are rounded to the millisecond: 2 ms keeps the comparison strict.
            return row.stats if st.uptime_s - row.last_seen_s > asked + 0.002 else None

        return probe

    for _ in range(2):
        stats = wait_until(
            heard_after(client.status().uptime_s), f"a heartbeat from {name}", timeout
        )
    return stats


class ResidencySampler:
    """Samples, while traffic runs, what each worker reports holding in its device arena.

    The arena is exactly the budget, so the worker's own `resident_bytes` and `peak_bytes` can
    never exceed it; the sum of the sizes of the stages it reports resident can, if a stage
    kept counting as resident after its bytes went to another.
    """

    def __init__(self) -> None:
        self.samples = 0
        self.largest: dict[str, int] = {}
        self.over: list[str] = []
        self.seen_resident: set[str] = set()

    def take(self, status: p.BrokerStatus) -> None:
        self.samples += 1
        for w in status.workers:
            stages = w.stats.resident_stages
            held = sum(stages.values())
            self.seen_resident |= set(stages)
            self.largest[w.name] = max(self.largest.get(w.name, 0), held)
            if held > w.budget_bytes:
                self.over.append(f"{w.name}: {held} > {w.budget_bytes} in {stages}")

    def check(self, final: dict[str, p.WorkerStats], budgets: dict[str, int]) -> None:
        """Nothing sampled over budget, nor the worker's own high-water mark of stage bytes
        (taken at every load, between samples too) in the fresh `final` stats."""
        assert self.samples > 0 and self.seen_resident, "no sample saw a resident stage"
        assert not self.over, self.over
        for name, stats in final.items():
            assert 0 < stats.stage_bytes_peak <= budgets[name], (name, stats)
