"""The demo's training part on a real mesh, shortened: three jobs whose footprints exceed a
worker's training bytes, stepped concurrently while nothing else runs, against plain PyTorch.

The whole demo (`flowmesh demo`) takes about a minute on two cores; this runs its training code
for a few steps, so that a change that breaks it fails the suite.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from client_sdk import demo
from client_sdk.mesh import LocalMesh
from flowmesh.spec import ModelSpec
from flowmesh.testing import assert_forward_close
from flowmesh.units import parse_size
from tests.mesh.conftest import FAST

STEPS = 4


def test_demo_training_matches_plain_pytorch(capsys: pytest.CaptureFixture[str]) -> None:
    specs = {
        name: ModelSpec(name=name, factory=f, kwargs=kw, seed=100 + i)
        for i, (name, f, kw, _) in enumerate(demo.TRAIN_JOBS)
    }
    optimizers = {name: opt for name, _, _, opt in demo.TRAIN_JOBS}
    text = demo.corpus()
    data = {
        n: demo.train_batches(s, text, 200 + i, STEPS) for i, (n, s) in enumerate(specs.items())
    }
    with LocalMesh(
        cpu_workers=2, memory_budget="8MiB", train_bytes=demo.TRAIN_BYTES, **FAST
    ) as mesh:
        trained = asyncio.run(demo.train_all(mesh.frontend, specs, optimizers, data))
        status = asyncio.run(demo.fetch_status(mesh.frontend, after_s=1.0))
    expected = {n: demo.plain_losses(s, optimizers[n], data[n]) for n, s in specs.items()}
    for name, t in trained.items():
        assert t.errors == [] and t.steps == list(range(1, STEPS + 1)), name
        assert_forward_close(
            torch.tensor(t.losses), torch.tensor(expected[name]), f"job {name} losses"
        )
    budget = parse_size(demo.TRAIN_BYTES)
    by_worker: dict[str, int] = {}
    for t in trained.values():
        by_worker[t.worker] = by_worker.get(t.worker, 0) + t.footprint
    # The point of the demo: one worker holds jobs that do not fit its training bytes together.
    assert max(by_worker.values()) > budget, by_worker
    assert demo.report_training(status, specs, optimizers, trained, expected, 0.0) == 0
    assert "OK: every job's losses match plain PyTorch" in capsys.readouterr().out
