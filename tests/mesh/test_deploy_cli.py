"""`flowmesh deploy` as a user runs it: a subprocess against a real mesh, with its progress bar
of the weights read (workers report what they are reading with their heartbeats)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from safetensors.torch import save_file

from client_sdk.cli import DeployWatch
from client_sdk.mesh import LocalMesh
from flowmesh.build import build_seeded
from tests.mesh.conftest import FAST, fresh_stats, mlp_spec, roots_at

ROOT = Path(__file__).resolve().parents[2]


def test_deploy_shows_the_weights_read_and_the_workers_report_reading(tmp_path: Path) -> None:
    spec = mlp_spec("weighty", width=512, depth=6, seed=3)
    path = tmp_path / "weighty.safetensors"
    save_file(build_seeded(spec).state_dict(), str(path))
    with LocalMesh(
        cpu_workers=2, memory_budget="16MiB", run_dir=tmp_path, **roots_at(tmp_path), **FAST
    ) as mesh:
        cmd = [
            sys.executable, "-m", "client_sdk.cli", "deploy", "weighty", spec.factory,
            "--kwargs", '{"width": 512, "depth": 6}', "--weights", str(path), "--stages", "2",
            "--replicas", "1", "--progress", "--broker", mesh.frontend,
        ]  # fmt: skip
        env = {**os.environ, "COLUMNS": "120"}
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("deployed weighty:"), done.stdout
        assert "reading weights" in done.stderr and "weights read in" in done.stderr
        with mesh.client() as c:
            for w in c.status()["workers"]:
                assert fresh_stats(c, w["name"])["preparing"] == {}  # nothing left half-read


def test_deploy_watch_adds_up_the_stages_each_worker_reads() -> None:
    watch = DeployWatch("m")

    def status(**per_worker: dict[str, list[int]]) -> dict:
        return {"workers": [{"name": w, "stats": {"preparing": p}} for w, p in per_worker.items()]}

    assert watch.update(status(a={"m/0": [0, 100]}, b={"other/0": [5, 9]})) == (0, 100)
    assert watch.update(status(a={"m/0": [40, 100]}, b={"m/1": [10, 50]})) == (50, 150)
    # Stage 0 is no longer reported: it has been read whole.
    assert watch.update(status(a={}, b={"m/1": [30, 50]})) == (130, 150)
    assert watch.update(status(a={}, b={})) == (150, 150)
