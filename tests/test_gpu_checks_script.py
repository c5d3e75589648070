"""`scripts/gpu_checks.sh`, the one command a session lent a GPU runs, kept working without one.

A GPU machine is lent to few sessions, for minutes: a benchmark flag renamed since the script was
written would spend that time on a usage error. `--cpu` runs the same steps, small, on CPU
stand-ins, with the same plumbing (time limits, one log, the benchmarks' JSON in one archive).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_checks.sh"


def run_script(*args: str, out: Path) -> subprocess.CompletedProcess[str]:
    # The script's meshes are its own, keyless: not the session's keys (FLOWMESH_TEST_KEYS=1
    # puts the operator key in FLOWMESH_KEYS, which its clients would then offer).
    env = {k: v for k, v in os.environ.items() if k != "FLOWMESH_KEYS"}
    env["PYTHON"] = sys.executable
    return subprocess.run(
        ["bash", str(SCRIPT), *args, str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_every_step_of_the_gpu_checks_runs_on_cpu_stand_ins(tmp_path: Path) -> None:
    done = run_script("--cpu", out=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_checks.log", "gpu_checks.tar.gz"]
    log = (tmp_path / "gpu_checks.log").read_text()
    steps = ("cuda-tests", "swap", "coldstart", "training", "colocated", "generate", "pipeline")
    for step in steps:
        assert f"=== {step}: exit status 0" in log, log[-3000:]
    with tarfile.open(tmp_path / "gpu_checks.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {
        "swap-cpu.json",
        "coldstart.json",
        "training.json",
        "bench_colocated.json",
        "generate.json",
        "pipeline_training.json",
    } <= names


def test_without_a_gpu_the_checks_stop_at_once_and_say_why(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU machine runs the checks for real")
    done = run_script(out=tmp_path)
    assert done.returncode == 2
    assert "no CUDA device" in done.stdout
    # The one GPU-only flag that --cpu cannot run: it exists, and says why it cannot.
    colocated = subprocess.run(
        [sys.executable, "scripts/bench_colocated.py", "--gpu", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert colocated.returncode == 2
    assert "--gpu: this torch sees no CUDA device" in colocated.stderr
