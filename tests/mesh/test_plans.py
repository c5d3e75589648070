"""`flowmesh plan` against the partitioner of a real mesh (the plans' other paths run in process:
tests/scenarios/test_plans.py)."""

from __future__ import annotations

import subprocess
import sys

from client_sdk.mesh import LocalMesh


def flowmesh_cli(mesh: LocalMesh, *args: str) -> str:
    run = subprocess.run(
        [sys.executable, "-m", "client_sdk.cli", *args, "--broker", mesh.frontend],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_flowmesh_plan_shows_plans_from_the_running_service(mesh: LocalMesh) -> None:
    out = flowmesh_cli(
        mesh,
        "plan",
        "flowmesh.examples:hf_opt",
        "--stages",
        "3",
        "--kwargs",
        '{"num_hidden_layers": 4, "hidden_size": 64}',
    )
    lines = out.splitlines()
    assert lines[0].split() == ["stage", "blocks", "names", "bytes", "share"]
    assert [ln.split()[0] for ln in lines[1:4]] == ["0", "1", "2"]
    assert "3 stages over 6 blocks" in lines[-1]  # embed, 4 decoder layers, head
    out = flowmesh_cli(mesh, "plan", "flowmesh.examples:small_resnet", "--stages", "2", "--measure")
    assert "fwd time" in out.splitlines()[0] and "2 stages over" in out
    out = flowmesh_cli(
        mesh,
        "plan",
        "flowmesh.examples:tiny_gpt",
        "--target",
        "8MiB",
        "--batch",
        "4",
        "--optimizer",
        "adamw",
    )
    assert out.splitlines()[0].split()[:5] == ["chunk", "blocks", "names", "bytes", "footprint"]
    assert "training footprint" in out.splitlines()[-1]
