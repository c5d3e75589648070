"""Several sweep drivers on one study (`flowmesh sweep --storage URL`) over one real mesh, or one
each on two meshes: each driver a `flowmesh sweep` process, the study in SQLite or in a real
PostgreSQL server the test starts itself (pgserver's embedded server). No trial runs twice:
every trial number is taken once from the storage, and its mesh job (`<name>-t<number>`)
belongs to one driver's results.
A driver SIGKILLed mid-trial leaves that trial RUNNING; the survivor fails it when its
heartbeat is stale, closes the mesh job the dead driver left open and runs its retry (same
parameters, new number)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from safetensors.torch import save_file

from client_sdk.mesh import LocalMesh
from client_sdk.sweep import _finished, open_storage
from tests.support.mesh import FAST, mesh_options, roots_at
from tests.support.training import teacher
from tests.support.waiting import until, until_blocking

ROOT = Path(__file__).resolve().parents[2]
pytestmark = mesh_options(cpu_workers=1, train_bytes="256KiB")
TRIALS = 6

TOML = """
name = "shared"
factory = "flowmesh.examples:mlp"
trials = {trials}
steps = {steps}
eval_every = 3
concurrency = 1
pruner = "none"
batch = 16
out = "{out}"

[kwargs]
width = 16
depth = 2
in_features = 8
out_features = 4

[data]
file = "data.safetensors"

[space.lr]
type = "float"
low = 1e-4
high = 0.1
log = true
"""


@pytest.fixture(params=["sqlite", "postgresql"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'study.db'}"
        return
    pgserver = pytest.importorskip("pgserver")
    pytest.importorskip("psycopg")
    server = pgserver.get_server(tmp_path / "pg", cleanup_mode="delete")
    try:
        yield server.get_uri().replace("postgresql://", "postgresql+psycopg://", 1)
    finally:
        server.cleanup()


def driver(
    mesh: LocalMesh, tmp_path: Path, storage: str, tag: str, steps: int
) -> subprocess.Popen[str]:
    if not (tmp_path / "data.safetensors").exists():
        data = teacher()
        save_file(
            {"inputs": data.inputs[""], "targets": data.targets}, str(tmp_path / "data.safetensors")
        )
    config = tmp_path / f"{tag}.toml"
    config.write_text(TOML.format(trials=TRIALS, steps=steps, out=f"out-{tag}"))
    cmd = [sys.executable, "-m", "client_sdk.cli", "sweep", "--broker", mesh.frontend]
    cmd += ["--storage", storage, "--heartbeat", "1", "--grace", "3", "--quiet", str(config)]
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ
    )


def finish(proc: subprocess.Popen[str]) -> str:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    return out


def saved_numbers(tmp_path: Path, tag: str) -> list[int]:
    import json

    saved = json.loads((tmp_path / f"out-{tag}" / "trials.json").read_text())
    return [t["number"] for t in saved["trials"]]


def study(storage: str) -> optuna.Study:
    return optuna.load_study(study_name="shared", storage=storage)


def test_two_drivers_complete_the_study_between_them(
    mesh: LocalMesh, tmp_path: Path, storage: str
) -> None:
    a, b = (driver(mesh, tmp_path, storage, tag, steps=6) for tag in "ab")
    finish(a), finish(b)
    ran_a, ran_b = saved_numbers(tmp_path, "a"), saved_numbers(tmp_path, "b")
    trials = study(storage).get_trials()
    # No trial run twice: each number in one driver's results once, and they are the study's.
    assert not set(ran_a) & set(ran_b) and len(set(ran_a)) == len(ran_a), (ran_a, ran_b)
    assert sorted(ran_a + ran_b) == [t.number for t in trials]
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    # Both drivers asked when one slot was left at most once each: N, or one over.
    assert TRIALS <= _finished(trials) <= TRIALS + 1, len(trials)


def test_drivers_on_two_meshes_share_one_study(
    mesh: LocalMesh, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A sweep that outgrows one mesh: a second mesh, its own broker and worker, and a driver
    on each, one study in one storage between them."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    with LocalMesh(
        cpu_workers=1,
        memory_budget="8MiB",
        train_bytes="256KiB",
        **roots_at(tmp_path_factory.getbasetemp()),
        **FAST,
    ) as other:
        with mesh.client() as c:
            before = c.status().totals.train_steps  # the module's earlier tests'
        a, b = (driver(m, tmp_path, storage, t, steps=6) for m, t in ((mesh, "a"), (other, "b")))
        finish(a), finish(b)
        ran_a, ran_b = saved_numbers(tmp_path, "a"), saved_numbers(tmp_path, "b")
        trials = study(storage).get_trials()
        assert ran_a and ran_b, (ran_a, ran_b)  # both meshes trained some
        assert not set(ran_a) & set(ran_b) and len(set(ran_a)) == len(ran_a), (ran_a, ran_b)
        assert sorted(ran_a + ran_b) == [t.number for t in trials]
        assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
        assert TRIALS <= _finished(trials) <= TRIALS + 1, len(trials)
        # Each driver's trials trained on its own mesh: 6 steps each.
        for on, ran, earlier in ((mesh, ran_a, before), (other, ran_b, 0)):
            with on.client() as c:
                assert c.status().totals.train_steps - earlier == 6 * len(ran)


def test_a_killed_drivers_trial_is_retried_by_the_other(
    mesh: LocalMesh, tmp_path: Path, storage: str
) -> None:
    # Long trials for the victim, so that it is killed mid-trial.
    victim = driver(mesh, tmp_path, storage, "victim", steps=3000)
    running: list[optuna.trial.FrozenTrial] = []

    def started() -> bool:
        nonlocal running
        assert victim.poll() is None, victim.communicate()[1]
        try:
            running = study(storage).get_trials(states=(optuna.trial.TrialState.RUNNING,))
        except KeyError:  # the study not created yet
            return False
        return bool(running)

    until_blocking(started, "the victim to start a trial", timeout=90, poll=0.2)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    finish(driver(mesh, tmp_path, storage, "survivor", steps=6))

    trials = study(storage).get_trials()
    dead = next(t for t in trials if t.number == running[0].number)
    assert dead.state == optuna.trial.TrialState.FAIL
    retries = [
        t
        for t in trials
        if optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(t) == dead.number
    ]
    # The retry keeps the parameters the dead trial had drawn (none if it was killed inside
    # `study.ask`, before they were written: then its retry draws its own).
    assert len(retries) == 1 and dead.params.items() <= retries[0].params.items()
    assert retries[0].state == optuna.trial.TrialState.COMPLETE
    ran = saved_numbers(tmp_path, "survivor")
    assert retries[0].number in ran and dead.number not in ran
    assert _finished(trials) == TRIALS
    assert sorted(ran) == [t.number for t in trials if t.number != dead.number]
    # The dead driver's mesh job, left open when it died, was closed by the survivor: its memory
    # is the mesh's again (and a later sweep of the same name can open that job name).
    with mesh.client(timeout=30) as c:
        assert [j.name for j in c.jobs()] == []


def test_a_trial_whose_driver_died_before_its_first_heartbeat_is_retried(
    mesh: LocalMesh, tmp_path: Path
) -> None:
    # A driver killed between asking a trial and recording its first heartbeat: RUNNING, with no
    # heartbeat for Optuna's staleness test to find. The other driver must not wait on it forever.
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    made = optuna.create_study(storage=open_storage(storage), study_name="shared")
    orphan = made.ask({"lr": optuna.distributions.FloatDistribution(1e-4, 0.1, log=True)})
    finish(driver(mesh, tmp_path, storage, "survivor", steps=6))
    trials = study(storage).get_trials()
    assert next(t for t in trials if t.number == orphan.number).state.name == "FAIL"
    retry = optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number
    assert [t.params for t in trials if retry(t) == orphan.number] == [orphan.params]
    assert _finished(trials) == TRIALS


async def test_a_failed_heartbeat_does_not_make_a_live_trial_look_dead(
    mesh: LocalMesh, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One heartbeat of driver A fails (its database dropped the connection); its beats go on,
    so driver B, waiting for A's trial, never takes it for dead: the trial runs once, in A."""
    import sqlalchemy.exc

    from client_sdk import sweep as sweeping
    from client_sdk.client import AsyncClient

    url = f"sqlite:///{tmp_path / 'study.db'}"
    beats: list[str] = []
    real_open = sweeping.open_storage

    def open_flaky(url: str, **kw: Any) -> optuna.storages.BaseStorage:
        store = real_open(url, **kw)
        if beats:  # B's: as it is
            return store
        real_beat = store.record_heartbeat  # type: ignore[attr-defined]

        def beat(trial_id: int) -> None:
            beats.append("tried")
            if len(beats) == 2:  # the first periodic beat, after the one at `ask`
                raise sqlalchemy.exc.OperationalError("UPDATE", {}, Exception("connection lost"))
            real_beat(trial_id)

        store.record_heartbeat = beat  # type: ignore[attr-defined]
        return store

    monkeypatch.setattr(sweeping, "open_storage", open_flaky)
    data = teacher()
    kw = dict(
        factory="flowmesh.examples:mlp",
        kwargs={"width": 16, "depth": 2, "in_features": 8, "out_features": 4},
        space={"lr": {"type": "float", "low": 1e-4, "high": 0.1, "log": True}},
        data=data,
        trials=1,
        pruner="none",
        concurrency=1,
        show=False,
        storage=url,
        heartbeat_interval=1,
        grace_period=3,
        timeout=60,
    )

    async def run(steps: int, after: Callable[[], bool] | None = None) -> sweeping.SweepResult:
        if after is not None:
            await until(after, "A's trial to start", timeout=60)
        async with AsyncClient(mesh.frontend, timeout=60) as c:
            return await sweeping.sweep_async(  # type: ignore[arg-type]
                c, name="flaky", steps=steps, eval_every=steps, **kw
            )

    def a_running() -> bool:
        return len(beats) >= 1

    # A's one trial lasts several grace periods (B, with nothing to ask, watches it meanwhile).
    with pytest.warns(UserWarning, match="heartbeat failed"):
        a, b = await asyncio.gather(run(1500), run(6, after=a_running))
    trials = optuna.load_study(study_name="flaky", storage=url).get_trials()
    assert [(t.number, t.state.name) for t in trials] == [(0, "COMPLETE")]
    assert [(r.number, r.state) for r in a.trials] == [(0, "COMPLETE")] and b.trials == []
    assert len(beats) > 3  # beating went on after the failed one
