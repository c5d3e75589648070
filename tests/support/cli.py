"""The `flowmesh` command run as a user runs it: a process of its own, in the repository root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
COMMAND = [sys.executable, "-m", "client_sdk.cli"]


def flowmesh(*args: str, timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess[str]:
    """`flowmesh ARGS...`, its stdout and stderr captured as text (unless `stdout=` says
    otherwise), at 120 columns unless `env` sets COLUMNS."""
    env = {**os.environ, "COLUMNS": "120", **kw.pop("env", {})}
    if "stdout" not in kw:
        kw["capture_output"] = True
    else:
        kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.run([*COMMAND, *args], cwd=ROOT, text=True, timeout=timeout, env=env, **kw)
