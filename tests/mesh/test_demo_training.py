"""The demo's training part on a real mesh, shortened: three jobs whose footprints exceed a
worker's training bytes, stepped concurrently against plain PyTorch, while the demo's sweep (Optuna
with successive halving, on next-byte prediction over standard-library source) runs beside them.

The whole demo (`flowmesh demo`) takes about a minute on two cores; this runs its training code
for a few steps, so that a change that breaks it fails the suite.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch

from client_sdk import cli, demo, train_data
from client_sdk.mesh import LocalMesh
from flowmesh.errors import FlowmeshError
from flowmesh.modelio.build import build_seeded
from flowmesh.spec import ModelSpec
from flowmesh.testing import assert_forward_close
from flowmesh.units import parse_size
from tests.support.mesh import FAST
from tests.support.reports import broker_status

STEPS = 4
SWEEP_TRIALS, SWEEP_STEPS, SWEEP_EVAL_EVERY = 4, 6, 2


def test_demo_training_matches_plain_pytorch(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
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

        async def train_and_sweep() -> tuple[dict[str, demo.Trained], demo.SweepResult]:
            opened = asyncio.Event()  # as the demo does: the sweep starts once the jobs are open
            return await asyncio.gather(
                demo.train_all(mesh.frontend, specs, optimizers, data, opened),
                demo.sweep_after(
                    opened,
                    demo.run_sweep(
                        mesh.frontend,
                        text,
                        tmp_path / demo.SWEEP_NAME,
                        trials=SWEEP_TRIALS,
                        steps=SWEEP_STEPS,
                        eval_every=SWEEP_EVAL_EVERY,
                    ),
                ),
            )

        trained, swept = asyncio.run(train_and_sweep())
        status = asyncio.run(demo.fetch_status(mesh.frontend, after_s=1.0))
    expected = {n: demo.plain_losses(s, optimizers[n], data[n]) for n, s in specs.items()}
    for name, t in trained.items():
        assert t.errors == [] and t.steps == list(range(1, STEPS + 1)), name
        # Each sub-model's policy in the last step ("auto" has measured each by then).
        assert len(t.activations) == t.sub_models and t.activations[-1] == "none", t
        assert set(t.activations[:-1]) <= {"recompute", "keep", "selective"}, t
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
    out = capsys.readouterr().out
    assert "OK: every job's losses match plain PyTorch" in out
    assert "activations" in out
    assert demo.policies(["keep", "recompute", "keep", "none"]) == "2 keep, 1 recompute"

    # The sweep: every trial ran as a job (none failed), at least one completed, and the pruner
    # was asked at every evaluation before a trial's last step; its table, trials.json and
    # curves.png sit in the study's directory.
    states = [t.state for t in swept.trials]
    assert len(states) == SWEEP_TRIALS and "FAIL" not in states, [t.reason for t in swept.trials]
    assert "COMPLETE" in states and swept.best is not None
    assert demo.pruner_consulted(swept, SWEEP_STEPS) >= SWEEP_TRIALS
    for t in swept.trials:
        assert t.state in ("COMPLETE", "PRUNED"), (t.number, t.state, t.reason)
        assert t.evals and t.curve and len(t.curve) == t.step
        if t.state == "COMPLETE":
            assert t.step == SWEEP_STEPS and t.evals[-1][0] == SWEEP_STEPS
        else:  # pruned at an evaluation: its job stopped there
            assert t.step < SWEEP_STEPS and t.evals[-1][0] == t.step
    assert swept.png_path == tmp_path / demo.SWEEP_NAME / "curves.png"
    assert swept.png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / demo.SWEEP_NAME / "trials.json").read_text())
    assert [t["state"] for t in saved["trials"]] == states
    assert demo.report_sweep(swept, SWEEP_STEPS) == 0
    out = capsys.readouterr().out
    assert f"sweep {demo.SWEEP_NAME} ({SWEEP_TRIALS} trials" in out and "OK: the sweep" in out


def test_sweep_example_uses_real_offline_data() -> None:
    """scripts/sweep_example.toml trains on a text file of this repository (next-byte
    prediction): real text, no download, shaped for its model."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "sweep_example.toml"
    cfg = cli.load_sweep_config(str(path))
    assert "file" in cfg["data"], "the example sweep must read real data, not synthetic rows"
    data = train_data.from_file(str(path.parent / cfg["data"]["file"]))
    assert data.rows >= 200
    (ids,) = data.inputs.values()
    assert ids.dtype == torch.int64 and data.targets.shape == ids.shape
    # Real text: mostly printable ASCII, and the targets are the inputs shifted by one byte.
    printable = ((ids >= 32) & (ids < 127)) | (ids == 10)
    assert printable.float().mean() > 0.95
    assert torch.equal(ids[:, 1:], data.targets[:, :-1])  # bit-exact: bytes moved, no maths
    model = build_seeded(
        ModelSpec(name="probe", factory=cfg["factory"], kwargs={**cfg["kwargs"], "d_model": 16})
    )
    with torch.no_grad():
        logits = model(ids[:2])
    assert logits.shape == (*ids[:2].shape, 256)


def test_a_job_that_timed_out_is_reported_as_a_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 20: steps that never came back were shown as `wrong (inf)` against PyTorch."""
    spec = ModelSpec(name="j", factory="flowmesh.examples:mlp", kwargs={"width": 8})
    opt = {"name": "sgd", "lr": 0.1}
    stuck = demo.Trained(
        worker="worker-1",
        sub_models=2,
        footprint=1 << 20,
        losses=[2.5],
        steps=[1],
        seconds=300.0,
        errors=["Timeout: [timeout] no answer within 300.0 s"] * 2,
        timed_out=2,
    )
    code = demo.report_training(
        broker_status(), {"j": spec}, {"j": opt}, {"j": stuck}, {"j": [2.5, 2.4, 2.3]}, 0.0
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "timed out (2 of 3 steps)" in out and "inf" not in out
    assert "FAILED: training jobs 1 timed out" in out


def test_a_mesh_keeps_its_logs_when_something_failed_and_says_where(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A mesh left normally removes its run directory; one whose start failed, or that a caller
    found failing (`keep_logs`), keeps it with every process's log, and says where on stderr."""
    bare = {"cpu_workers": 0, "partitioner": False}
    with LocalMesh(**bare) as mesh:
        gone = mesh.run_dir
    assert gone is not None and not gone.exists()

    kept = []
    with LocalMesh(**bare) as mesh:
        kept.append(mesh.keep_logs())
    failing = LocalMesh(**bare, broker_args=["--no-such-option"])
    with pytest.raises(FlowmeshError, match="exited"), failing:
        pass
    kept.append(failing.run_dir)
    err = capfd.readouterr().err
    try:
        for run in kept:
            assert run is not None and (run / "broker.log").exists()
            assert f"logs are kept in {run}" in err
        assert "--no-such-option" in (kept[1] / "broker.log").read_text()
    finally:
        for run in kept:
            if run is not None:
                shutil.rmtree(run, ignore_errors=True)
