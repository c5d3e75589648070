"""The CLI and the SDK start without torch: the commands that carry no tensors (`status`,
`deploy`, `generate`, ...) never import it, its import being most of a command's start-up time,
and `import client_sdk` leaves it out until a caller brings tensors (`client_sdk.connection
.is_tensor`). Checked in a fresh interpreter, as a user's command starts."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import contextlib, io, sys
import client_sdk
from client_sdk import cli
parser = cli.build_parser()
for argv in (["deploy", "m", "flowmesh.examples:mlp"], ["generate", "m", "hi"], ["demo"]):
    parser.parse_args(argv)
with contextlib.redirect_stderr(io.StringIO()):  # no broker there: the command fails, fast
    try:
        code = cli.main(["status", "--broker", "tcp://127.0.0.1:9", "--timeout", "0.2"])
    except SystemExit as exc:  # exits with its one-line reason
        code = exc.code
heavy = ("torch", "client_sdk.demo", "client_sdk.mesh")
print(bool(code), sorted(m for m in heavy if m in sys.modules))
"""


def test_the_cli_and_the_sdk_start_without_torch() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True []", done.stdout
