"""Sweeps through an in-process mesh (tests/support/inproc.py, one CPU worker): Optuna's
ask-and-tell and its successive-halving pruner over training jobs, through the SDK
(`AsyncClient.sweep`). The command (`flowmesh sweep CONFIG.toml`) is tests/mesh/test_sweep.py."""

from __future__ import annotations

import json
from pathlib import Path

import optuna

from client_sdk.sweep import TrialRecord, split_params
from tests.support.inproc import InProcMesh
from tests.support.mesh import mesh_options
from tests.support.training import teacher

ROOT = Path(__file__).resolve().parents[2]
MLP = {"width": 16, "depth": 2, "in_features": 8, "out_features": 4}
# From hopeless (1e-5: nothing moves in a few steps) to diverging (1.0): some trials are clearly
# worse than others at the first rung, so successive halving must prune some.
LR = {"type": "float", "low": 1e-5, "high": 1.0, "log": True}
STEPS, EVERY = 12, 3


pytestmark = mesh_options(cpu_workers=1, train_bytes="256KiB")


def test_split_params_routes_optimizer_keys_and_factory_kwargs() -> None:
    params = {"lr": 0.1, "optimizer": "sgd", "optim.nesterov": True, "momentum": 0.9, "width": 8}
    kw, opt = split_params(params, {"depth": 2}, {"name": "adamw", "lr": 1e-3})
    assert kw == {"depth": 2, "width": 8}
    assert opt == {"name": "sgd", "lr": 0.1, "nesterov": True, "momentum": 0.9}
    _, opt = split_params({"momentum": 0.9}, {}, {"name": "adam"})
    assert opt == {"name": "adam"}  # momentum is SGD's only


async def test_sweep_prunes_closes_pruned_jobs_and_saves_curves(
    mesh: InProcMesh, tmp_path: Path
) -> None:
    listed: dict[int, list[str]] = {}
    async with mesh.async_client() as c:

        async def after(rec: TrialRecord) -> None:
            listed[rec.number] = [j.name for j in await c.jobs()]

        result = await c.sweep(
            name="sw",
            factory="flowmesh.examples:mlp",
            space={"lr": LR},
            data=teacher(),
            trials=6,
            steps=STEPS,
            eval_every=EVERY,
            pruner="successive_halving",
            reduction_factor=2,
            concurrency=2,
            kwargs=MLP,
            optimizer={"name": "adam"},
            batch=16,
            out_dir=tmp_path / "out",
            show=False,
            on_trial_end=after,
        )
        assert await c.jobs() == []

    trials = result.trials
    assert [t.number for t in trials] == list(range(6))
    assert {t.state for t in trials} <= {"COMPLETE", "PRUNED"}, [
        (t.state, t.reason) for t in trials
    ]
    pruned = [t for t in trials if t.state == "PRUNED"]
    assert pruned and result.completed, result.table()
    for t in pruned:
        assert t.step < STEPS and t.job not in listed[t.number], (t, listed)
    for t in result.completed:
        assert t.step == STEPS and len(t.curve) == STEPS
        assert [s for s, _ in t.evals] == list(range(EVERY, STEPS + 1, EVERY))
        assert t.value == t.evals[-1][1]
    # Optuna's view agrees with the records: states, and the best value over completed trials.
    frozen = {f.number: f for f in result.study.trials}
    assert all(frozen[t.number].state.name == t.state for t in trials)
    best = result.best
    assert best is not None and best.value == min(t.value for t in result.completed)  # type: ignore[type-var]
    assert result.study.best_value == best.value
    assert frozen[best.number].state == optuna.trial.TrialState.COMPLETE

    assert result.png_path is not None and result.png_path.read_bytes()[:4] == b"\x89PNG"
    saved = json.loads(result.json_path.read_text())  # type: ignore[union-attr]
    assert saved["best"] == {"number": best.number, "value": best.value}
    for t, s in zip(trials, saved["trials"], strict=True):
        assert (s["number"], s["state"], s["params"]) == (t.number, t.state, t.params)
        assert s["curve"] == t.curve and [tuple(e) for e in s["evals"]] == t.evals

