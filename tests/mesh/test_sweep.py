"""The sweep command (`flowmesh sweep CONFIG.toml`) as a subprocess against a real mesh (broker,
partitioner, one CPU worker). The SDK's sweeps are tests/scenarios/test_sweep.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from safetensors.torch import save_file

from client_sdk.mesh import LocalMesh
from tests.support.mesh import mesh_options
from tests.support.training import teacher

ROOT = Path(__file__).resolve().parents[2]
MLP = {"width": 16, "depth": 2, "in_features": 8, "out_features": 4}
# From hopeless (1e-5: nothing moves in a few steps) to diverging (1.0): some trials are clearly
# worse than others at the first rung, so successive halving must prune some.
LR = {"type": "float", "low": 1e-5, "high": 1.0, "log": True}
STEPS, EVERY = 12, 3


pytestmark = mesh_options(cpu_workers=1, train_bytes="256KiB")


SWEEP_TOML = """
name = "cli-sweep"
factory = "flowmesh.examples:mlp"
trials = 4
steps = 6
eval_every = 3
concurrency = 2
pruner = "successive_halving"
reduction_factor = 2
batch = 16
out = "results"

[kwargs]
width = 16
depth = 2
in_features = 8
out_features = 4

[optimizer]
name = "adam"

[data]
file = "data.safetensors"

[space.lr]
type = "float"
low = 1e-5
high = 1.0
log = true

[space.optimizer]
type = "categorical"
choices = ["adam", "sgd"]
"""


def flowmesh_sweep(mesh: LocalMesh, config: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "client_sdk.cli", "sweep", "--broker", mesh.frontend, str(config)]
    env = {**os.environ, "COLUMNS": "120"}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)


def test_sweep_command_on_a_toml(mesh: LocalMesh, tmp_path: Path) -> None:
    data = teacher()
    save_file(
        {"inputs": data.inputs[""], "targets": data.targets}, str(tmp_path / "data.safetensors")
    )
    config = tmp_path / "sweep.toml"
    config.write_text(SWEEP_TOML)
    run = flowmesh_sweep(mesh, config)
    assert run.returncode == 0, run.stderr
    assert "sweep cli-sweep: 4 trials" in run.stdout and "best: trial" in run.stdout, run.stdout
    assert "COMPLETE" in run.stdout and "trial" in run.stderr  # the results and the live table
    saved = json.loads((tmp_path / "results" / "trials.json").read_text())
    assert len(saved["trials"]) == 4
    assert {t["state"] for t in saved["trials"]} <= {"COMPLETE", "PRUNED"}
    assert {t["params"]["optimizer"] for t in saved["trials"]} <= {"adam", "sgd"}
    assert (tmp_path / "results" / "curves.png").stat().st_size > 0

    config.write_text(SWEEP_TOML.replace("eval_every", "eval_evry"))
    bad = flowmesh_sweep(mesh, config)
    assert bad.returncode != 0 and "unknown keys eval_evry" in bad.stderr, bad.stderr


def test_a_killed_drivers_job_is_closed_once_idle(mesh: LocalMesh, tmp_path: Path) -> None:
    """A `flowmesh sweep` on no shared storage SIGKILLed mid-trial: nobody would ever close its
    trial's job. Opened with the TOML's `idle_close`, the broker closes it once idle that long:
    its memory goes back, and its name can be opened again."""
    import signal

    from tests.support.waiting import until_blocking

    data = teacher()
    save_file(
        {"inputs": data.inputs[""], "targets": data.targets}, str(tmp_path / "data.safetensors")
    )
    config = tmp_path / "sweep.toml"
    toml = SWEEP_TOML.replace('name = "cli-sweep"', 'name = "killed"\nidle_close = 1.5')
    toml = toml.replace("steps = 6", "steps = 100000").replace("trials = 4", "trials = 1")
    config.write_text(toml)
    cmd = [sys.executable, "-m", "client_sdk.cli", "sweep", "--broker", mesh.frontend, "--quiet"]
    driver = subprocess.Popen([*cmd, str(config)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    with mesh.client(timeout=30) as c:
        before = c.status().totals.train_idle_closed

        def training() -> bool:
            assert driver.poll() is None, driver.communicate()[1]
            return any(j.name == "killed-t0" and j.step > 0 for j in c.jobs())

        until_blocking(training, "the driver's trial to train", timeout=60, poll=0.1)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
        until_blocking(lambda: c.jobs() == [], "the broker to close the idle job", timeout=30)
        assert c.status().totals.train_idle_closed == before + 1
        job = c.train_open(
            "killed-t0", "flowmesh.examples:mlp", kwargs=MLP, seed=0,
            optimizer={"name": "adam"}, batch_size=16,
        )  # fmt: skip
        job.close()
