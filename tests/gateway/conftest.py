"""A real gateway for the tests here: `python -m gateway` (or `flowmesh gateway`) as its own
process on a free loopback port, in front of a module's real mesh (`start_gateway`). Keys on
with FLOWMESH_TEST_KEYS=1, as for tests/mesh/ (the gateway takes the session's operator key
from FLOWMESH_KEYS)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest

from tests.support import prefork
from tests.support.mesh import _test_keys
from tests.support.ports import free_port
from tests.support.waiting import until_blocking

__all__ = ["_test_keys"]  # registered for tests/gateway/

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def _gateway(broker: str, log: Path, cli: bool, args: Sequence[str]) -> Iterator[str]:
    port = free_port()
    argv = ["--broker", broker, "--port", str(port), *args]
    if cli:  # the same through `flowmesh gateway` (its CLI hook), exec'd as users run it
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "client_sdk.cli", "gateway", *argv],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
    else:  # `python -m gateway`, forked (tests/support/prefork.py)
        proc = prefork.spawn("gateway", argv, log, ROOT)
    url = f"http://127.0.0.1:{port}"
    try:

        def live() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"the gateway exited {proc.returncode}: {log.read_text()}")
            with contextlib.suppress(httpx.TransportError):
                return httpx.get(f"{url}/v2/health/live", timeout=5).status_code == 200
            return False

        until_blocking(live, f"the gateway at {url} to answer", poll=0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def nobody() -> str:
    """A broker address nothing listens on (a port bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="session")
def start_gateway(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[..., AbstractContextManager[str]]:
    """`with start_gateway(mesh.frontend) as url:` a gateway process serving at `url`
    (`cli=True`: started as `flowmesh gateway`; `args`: more of its options)."""

    def start(
        broker: str, cli: bool = False, args: Sequence[str] = ()
    ) -> AbstractContextManager[str]:
        return _gateway(broker, tmp_path_factory.mktemp("gateway") / "gateway.log", cli, args)

    return start
