"""`flowmesh train` end to end: the command as a subprocess against a real mesh. Its per-step
losses must equal a plain PyTorch loop on the same (built-in synthetic, or file) dataset, its
checkpoint must hold the step count, and the progress bar must show steps/s and the loss."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from client_sdk import errors, train_data
from client_sdk.mesh import LocalMesh
from flowmesh.modelio.build import build_seeded
from flowmesh.reference import train
from flowmesh.spec import ModelSpec
from tests.support.mesh import mesh_options

ROOT = Path(__file__).resolve().parents[2]
MLP = {"width": 32, "depth": 3, "in_features": 8, "out_features": 5}
STEPS, BATCH = 12, 8


pytestmark = mesh_options(cpu_workers=1, train_bytes="96KiB")


def flowmesh(mesh: LocalMesh, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "client_sdk.cli", "train", "--broker", mesh.frontend, *args]
    env = {**os.environ, "COLUMNS": "120"}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)


def plain(spec: ModelSpec, batches: list[tuple[Any, torch.Tensor]]) -> list[float]:
    return train(build_seeded(spec), {"name": "adamw", "lr": 0.01}, batches)


def test_train_on_the_synthetic_dataset_with_progress_and_save(
    mesh: LocalMesh, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    args = ["flowmesh.examples:mlp", "--kwargs", json.dumps(MLP), "--steps", str(STEPS)]
    args += ["--batch", str(BATCH), "--lr", "0.01", "--seed", "3", "--samples", "32"]
    args += ["--chunk-bytes", "32KiB", "--save", str(ckpt), "--json", "--name", "cli-job"]
    run = flowmesh(mesh, *args)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    spec = ModelSpec(name="cli-job", factory="flowmesh.examples:mlp", kwargs=MLP, seed=3)
    data = train_data.synthetic(
        spec, loss="cross_entropy", samples=32, seq=16, seed=0, allow=("flowmesh.examples",)
    )
    expected = plain(spec, train_data.batches(data, BATCH, STEPS))
    torch.testing.assert_close(out["losses"], expected, rtol=1e-5, atol=1e-6)
    assert out["steps"] == STEPS and out["steps_per_s"] > 0 and out["worker"] == "worker-0"
    assert out["saved"] == {"path": str(ckpt), "step": STEPS}
    assert (ckpt / "state.safetensors").exists() and (ckpt / "job.json").exists()
    # The progress bar (stderr): the steps done, a rate and the last loss.
    assert f"{STEPS}/{STEPS}" in run.stderr and "steps/s" in run.stderr, run.stderr
    assert f"loss {expected[-1]:.4f}" in run.stderr, run.stderr


def test_train_on_a_safetensors_file_then_a_bad_file(mesh: LocalMesh, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(20, 8, generator=g), torch.randint(0, 5, (20,), generator=g)
    path = tmp_path / "data.safetensors"
    save_file({"inputs": x, "targets": y}, str(path))
    args = ["flowmesh.examples:mlp", "--kwargs", json.dumps(MLP), "--steps", "5"]
    args += ["--batch", str(BATCH), "--lr", "0.01", "--seed", "3", "--data", str(path)]
    run = flowmesh(mesh, *args)
    assert run.returncode == 0, run.stderr
    assert "trained" in run.stdout and "5 steps" in run.stdout, run.stdout
    spec = ModelSpec(name="f", factory="flowmesh.examples:mlp", kwargs=MLP, seed=3)
    rows = [torch.arange(i * BATCH, (i + 1) * BATCH) % 20 for i in range(5)]
    expected = plain(spec, [(x[r], y[r]) for r in rows])
    assert f"-> {expected[-1]:.4f}" in run.stdout, run.stdout

    save_file({"inputs": x}, str(tmp_path / "bad.safetensors"))
    bad = flowmesh(mesh, *args[:-1], str(tmp_path / "bad.safetensors"))
    assert bad.returncode == 1 and "no 'targets' tensor" in bad.stderr, bad.stderr


OPEN: dict[str, Any] = {"optimizer": {"name": "sgd", "lr": 0.1}, "batch_size": BATCH}


def test_a_job_its_program_left_open_is_closed_by_name(mesh: LocalMesh) -> None:
    # A program that raised before its close: the job held its memory and its name, and no
    # public call could close it (only idle_close, if it was opened with one).
    with mesh.client() as c:
        c.train_open("left-open", "flowmesh.examples:mlp", kwargs=MLP, **OPEN)
    with mesh.client() as c:
        assert [j.name for j in c.jobs()] == ["left-open"]
    cmd = ["jobs", "--close", "left-open", "--broker", mesh.frontend]
    run = subprocess.run(
        [sys.executable, "-m", "client_sdk.cli", *cmd],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0 and run.stdout.strip() == "training job 'left-open' closed"
    with mesh.client() as c:
        assert c.jobs() == []
        # Its name is free again; a job closed already is answered closed (a close in a
        # finally hides nothing), a name never opened is refused, naming it.
        c.train_open("left-open", "flowmesh.examples:mlp", kwargs=MLP, **OPEN).close()
        c.train_close("left-open")
        with pytest.raises(errors.ModelNotFound, match="never-opened"):
            c.train_close("never-opened")
