"""The command line's answers to requests the mesh cannot take, through a real mesh of one CPU
worker without training bytes:
- a sweep on a mesh that takes no training jobs is refused at once with the answer `flowmesh
  train` gets, by the SDK and by `flowmesh sweep --quiet`, and writes nothing;
- `flowmesh deploy` without weights says which seed the model is initialised from.
Requests checked against what the model can take run in process
(tests/scenarios/test_request_checks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from client_sdk.client import AsyncClient
from client_sdk.errors import Unavailable
from client_sdk.mesh import LocalMesh
from client_sdk.train_data import Dataset
from tests.support.cli import flowmesh
from tests.support.mesh import mesh_options

# What these commands meet needs no second worker: one starts sooner.
pytestmark = mesh_options(cpu_workers=1)


def _teacher(rows: int = 64) -> Dataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 8, generator=g)
    return Dataset({"": x}, (x @ torch.randn(8, 4, generator=g)).argmax(1), "teacher")


SWEEP_TOML = """
name = "no-training"
factory = "flowmesh.examples:mlp"
trials = 4
steps = 4
eval_every = 2
out = "results"

[kwargs]
width = 16
depth = 2
in_features = 8
out_features = 4

[space.lr]
type = "float"
low = 1e-4
high = 1e-1
log = true
"""


async def test_a_sweep_on_a_mesh_that_cannot_train_is_refused_at_once(
    mesh: LocalMesh, tmp_path: Path
) -> None:
    train = flowmesh("train", "flowmesh.examples:mlp", "--steps", "1", "--broker", mesh.frontend)
    assert train.returncode == 1
    refusal = train.stderr.strip().removeprefix("flowmesh train: ")
    assert "no ready worker takes training jobs (start workers with --train-bytes)" in refusal

    async with AsyncClient(mesh.frontend) as c:
        with pytest.raises(Unavailable) as info:
            await c.sweep(
                name="sdk",
                factory="flowmesh.examples:mlp",
                kwargs={"width": 16, "depth": 2, "in_features": 8, "out_features": 4},
                space={"lr": {"type": "float", "low": 1e-4, "high": 0.1, "log": True}},
                data=_teacher(),
                trials=6,
                steps=4,
                eval_every=2,
                out_dir=tmp_path / "sdk",
                show=False,
            )
        assert str(info.value) == refusal
        assert not (tmp_path / "sdk").exists()

    config = tmp_path / "sweep.toml"
    config.write_text(SWEEP_TOML)
    run = flowmesh("sweep", "--quiet", "--broker", mesh.frontend, str(config))
    assert run.returncode == 1
    assert run.stderr.strip() == f"flowmesh sweep: {refusal}", run.stderr
    assert run.stdout == "" and not (tmp_path / "results").exists()


def test_deploy_without_weights_says_the_seed_it_is_initialised_from(mesh: LocalMesh) -> None:
    for extra, seed in (([], 0), (["--seed", "5"], 5)):
        done = flowmesh(
            "deploy", "seeded", "flowmesh.examples:mlp", "--kwargs", '{"width": 32}', *extra,
            "--broker", mesh.frontend,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[-1] == (
            f"seeded: no weights given: initialised from seed {seed}"
        ), done.stdout
        assert flowmesh("undeploy", "seeded", "--broker", mesh.frontend).returncode == 0
