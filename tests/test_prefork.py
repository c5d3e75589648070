"""The suite's fork server (tests/support/prefork.py) gives a child what an exec would: its
arguments, environment, PYTHONPATH, working directory, session and log, and its exit status."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import prefork

PROBE = """
import json, os, sys, time
print(json.dumps({
    "argv": sys.argv[1:],
    "name": __name__,
    "env": os.environ.get("PROBE_VALUE"),
    "cwd": os.getcwd(),
    "sid": os.getsid(0) == os.getpid(),
    "parent": os.environ.get("FLOWMESH_PARENT_PID") == str(os.getppid()),
}), flush=True)
if sys.argv[1:] == ["sleep"]:
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "prefork_probe.py").write_text(PROBE)
    return lib


def spawn(probe: Path, tmp_path: Path, *args: str) -> tuple[prefork.Forked, Path]:
    env = {
        **os.environ,
        "PROBE_VALUE": "seen",
        "PYTHONPATH": f"{probe}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    log = tmp_path / f"probe-{'-'.join(args)}.log"
    return prefork._server.spawn("prefork_probe", list(args), env, log), log


def test_a_forked_child_runs_its_module_with_its_own_arguments_environment_and_status(
    probe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    child, log = spawn(probe, tmp_path, "3")
    assert child.wait(60) == 3
    seen = json.loads(log.read_text())
    assert seen == {
        "argv": ["3"],
        "name": "__main__",
        "env": "seen",
        "cwd": str(tmp_path),
        "sid": True,
        "parent": True,
    }


def test_a_signalled_child_reports_the_signal_as_popen_does(probe: Path, tmp_path: Path) -> None:
    child, _ = spawn(probe, tmp_path, "sleep")
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    child.send_signal(signal.SIGKILL)
    assert child.wait(30) == -signal.SIGKILL
    child.kill()  # once it has exited: nothing to signal, no error
    assert child.poll() == -signal.SIGKILL


def test_the_mesh_launcher_forks_only_the_heavy_modules(tmp_path: Path) -> None:
    broker = prefork.launcher("json.tool", ["--help"], dict(os.environ), tmp_path / "b.log")
    assert isinstance(broker, subprocess.Popen)
    assert broker.wait(30) == 0
    assert sys.executable in broker.args
