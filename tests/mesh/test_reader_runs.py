"""A worker computes a quick model's run on the thread that read it from the broker and answers
it from there (no hand-off to a compute lane, no trip through the event loop); a slow model's
runs go to the compute lanes; a model error on the reader thread is answered as one, and the
worker goes on serving."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from client_sdk import errors
from client_sdk.mesh import LocalMesh
from flowmesh import protocol as p
from flowmesh.modelio.build import build_seeded
from flowmesh.spec import ModelSpec
from flowmesh.testing import assert_forward_close
from tests.support.mesh import deploy, fresh_stats, mesh_options, mlp_spec, reference
from tests.support.train_models import MARK

ALLOW = ["flowmesh.examples", "torch.nn", "tests.support.train_models"]


pytestmark = mesh_options(cpu_workers=1, allow=ALLOW)


def own_reference(spec: ModelSpec) -> Any:
    model = build_seeded(spec, tuple(ALLOW))

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return model(x)

    return forward


def counts(before: p.WorkerStats, after: p.WorkerStats) -> dict[str, int]:
    names = ("runs", "reader_runs", "lane_answers")
    return {k: getattr(after, k) - getattr(before, k) for k in names}


def test_a_quick_models_runs_are_computed_and_answered_on_the_reader_thread(
    mesh: LocalMesh,
) -> None:
    spec = mlp_spec("quick", width=32, depth=2, seed=5)
    ref = reference(spec)
    with mesh.client() as c:
        deploy(c, spec)
        for _ in range(10):  # loaded, and its runs measured (a first run is never quick)
            c.infer(spec.name, torch.randn(1, 32))
        before = fresh_stats(c, "worker-0")
        for _ in range(20):
            x = torch.randn(2, 32)
            assert_forward_close(c.infer(spec.name, x), ref(x))
        got = counts(before, fresh_stats(c, "worker-0"))
    # Each answer went out from the thread that computed it; a run that followed a message
    # the loop still had to handle (a heartbeat, say) took the lanes, to keep the order.
    assert got["runs"] == 20 and got["reader_runs"] + got["lane_answers"] == 20, got
    assert got["reader_runs"] >= 1, got


def test_a_slow_models_runs_go_to_the_compute_lanes(mesh: LocalMesh) -> None:
    spec = ModelSpec(name="slow", factory="tests.support.train_models:slow_mlp", seed=1)
    ref = own_reference(spec)
    with mesh.client() as c:
        deploy(c, spec)
        c.infer(spec.name, torch.randn(1, 8))
        before = fresh_stats(c, "worker-0")
        for _ in range(5):
            x = torch.randn(2, 8)
            assert_forward_close(c.infer(spec.name, x), ref(x))
        got = counts(before, fresh_stats(c, "worker-0"))
    assert got == {"runs": 5, "reader_runs": 0, "lane_answers": 5}, got


def test_a_model_error_on_the_reader_thread_is_answered_and_serving_goes_on(
    mesh: LocalMesh,
) -> None:
    spec = ModelSpec(name="boom", factory="tests.support.train_models:boom_mlp", seed=2)
    ref = own_reference(spec)
    with mesh.client() as c:
        deploy(c, spec)
        for _ in range(10):
            c.infer(spec.name, torch.randn(1, 8))
        before = fresh_stats(c, "worker-0")
        for _ in range(10):
            with pytest.raises(errors.ModelError, match="boom: the model's own code failed"):
                c.infer(spec.name, torch.full((1, 8), MARK))
        x = torch.randn(3, 8)
        assert_forward_close(c.infer(spec.name, x), ref(x))
        got = counts(before, fresh_stats(c, "worker-0"))
    # An error on a lane is answered by the loop; one on the reader thread from there.
    assert got["runs"] == 11 and got["reader_runs"] >= 1, got
