"""`flowmesh plan` against the partitioner of a real mesh (the plans' other paths run in process:
tests/scenarios/test_plans.py)."""

from __future__ import annotations

import subprocess
import sys

from client_sdk.mesh import LocalMesh
from tests.support.mesh import mesh_options

# `flowmesh plan` asks the broker, which asks the partitioner: no worker takes part.
pytestmark = mesh_options(cpu_workers=0)


def flowmesh_cli(mesh: LocalMesh, *args: str) -> subprocess.Popen[str]:
    """`flowmesh ARGS... --broker` the mesh, started: the commands run side by side, each
    spending most of its time importing (`outputs` collects them)."""
    return subprocess.Popen(
        [sys.executable, "-m", "client_sdk.cli", *args, "--broker", mesh.frontend],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def outputs(*runs: subprocess.Popen[str]) -> list[str]:
    """Each command's stdout, once every one exited 0 (none is left running)."""
    done: list[tuple[str, str]] = []
    try:
        for run in runs:
            done.append(run.communicate(timeout=120))
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait()
    for run, (_, err) in zip(runs, done, strict=True):
        assert run.returncode == 0, err
    return [out for out, _ in done]


def test_flowmesh_plan_shows_plans_from_the_running_service(mesh: LocalMesh) -> None:
    stages, measured, chunks = outputs(
        flowmesh_cli(
            mesh,
            "plan",
            "flowmesh.examples:hf_opt",
            "--stages",
            "3",
            "--kwargs",
            '{"num_hidden_layers": 4, "hidden_size": 64}',
        ),
        flowmesh_cli(mesh, "plan", "flowmesh.examples:small_resnet", "--stages", "2", "--measure"),
        flowmesh_cli(
            mesh,
            "plan",
            "flowmesh.examples:tiny_gpt",
            "--target",
            "8MiB",
            "--batch",
            "4",
            "--optimizer",
            "adamw",
        ),
    )
    lines = stages.splitlines()
    assert lines[0].split() == ["stage", "blocks", "names", "bytes", "share"]
    assert [ln.split()[0] for ln in lines[1:4]] == ["0", "1", "2"]
    assert "3 stages over 6 blocks" in lines[-1]  # embed, 4 decoder layers, head
    assert "fwd time" in measured.splitlines()[0] and "2 stages over" in measured
    assert chunks.splitlines()[0].split()[:5] == ["chunk", "blocks", "names", "bytes", "footprint"]
    assert "training footprint" in chunks.splitlines()[-1]
