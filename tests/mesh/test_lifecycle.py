"""Process lifecycle: children never outlive a launcher that was killed outright."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from client_sdk.mesh import wait_until

LAUNCHER = """
import json, threading
from client_sdk.mesh import LocalMesh
mesh = LocalMesh(cpu_workers=1, memory_budget="8MiB", heartbeat_s=0.2)
mesh.start()
print(json.dumps([c.proc.pid for c in mesh.children]), flush=True)
threading.Event().wait()  # until killed
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has exited; only its parent has not reaped it


def test_children_stop_when_the_launcher_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "launch.py"
    script.write_text(LAUNCHER)
    launcher = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout is not None
        pids = json.loads(launcher.stdout.readline())
        assert len(pids) == 3 and all(alive(p) for p in pids)  # broker, partitioner, worker
    finally:
        launcher.kill()
        launcher.wait(10)
    wait_until(
        lambda: True if not any(alive(p) for p in pids) else None,
        "the broker, partitioner and worker to stop after their launcher died",
        20,
    )
