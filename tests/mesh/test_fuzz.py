"""Hostile traffic never stops a process; a process that stops on an internal error says so.

The fuzz generator is scripts/fuzz.py's (the script runs the same thing at any count): seeded
malformed, truncated, oversized, bit-flipped and wrongly typed messages at both broker ports,
each answer checked against what the decoder predicts, while a healthy client checks its own.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import zmq

from client_sdk.mesh import LocalMesh, wait_until
from flowmesh import protocol as p
from tests.support.mesh import FAST

ROOT = Path(__file__).resolve().parents[2]
MAX_MESSAGE = 64 * 1024  # small, so that oversized messages are cheap to send
FUZZ_COUNT = 3000


def load_fuzz() -> ModuleType:
    # scripts/ is not a package: load the script's module from its file.
    spec = importlib.util.spec_from_file_location("flowmesh_fuzz_script", ROOT / "scripts/fuzz.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fuzz_mesh() -> Iterator[LocalMesh]:
    with LocalMesh(
        cpu_workers=1,
        memory_budget="8MiB",
        broker_args=["--max-message", str(MAX_MESSAGE)],
        **FAST,
    ) as m:
        yield m


def test_fuzz_at_both_ports_while_a_healthy_client_is_served(fuzz_mesh: LocalMesh) -> None:
    fuzz = load_fuzz()
    mesh = fuzz_mesh
    with mesh.client() as c:
        spec = fuzz.healthy_spec(64)
        c.deploy(spec.name, spec.factory, kwargs=spec.kwargs, seed=spec.seed)
        before = {w.name: w.pid for w in c.status().workers}
    limits = p.Limits(max_message_bytes=MAX_MESSAGE)

    report = asyncio.run(fuzz.fuzz(mesh.frontend, mesh.backend, FUZZ_COUNT, seed=0, limits=limits))

    exited = {c.name: c.proc.returncode for c in mesh.children if c.proc.poll() is not None}
    assert not exited, f"children exited during the fuzz: {exited}"
    assert report.total == FUZZ_COUNT
    assert not report.missing, report.missing[:10]
    assert not report.wrong, report.wrong[:10]
    assert not report.decoder_crashes, report.decoder_crashes[:10]
    assert not report.healthy_errors, report.healthy_errors[:5]
    assert report.healthy_ok >= 5
    kinds = {key.split("/")[1] for key in report.sent}
    assert kinds == set(fuzz.KINDS), kinds
    codes = {key.split("/")[1] for key in report.answers}
    assert {"bad_message", "bad_frames", "bad_tensor", "too_large", "unknown_type"} <= codes
    log = mesh.child("broker").log.read_text(errors="replace")
    assert "Traceback" not in log, log[log.index("Traceback") - 500 :][:3000]
    with mesh.client() as c:
        st = c.status()
        assert {w.name: w.pid for w in st.workers} == before
        assert all(w.ready for w in st.workers)

    # A stop that was asked for is a success: exit status 0 for every process.
    for child in reversed(mesh.children):
        child.proc.send_signal(signal.SIGTERM)
        assert child.proc.wait(20) == 0, f"{child.name} exited {child.proc.returncode}"


# Each injects an internal failure into a real process; it must stop with a non-zero status
# (so that systemd's Restart=on-failure restarts it), where it used to exit 0. The reader's
# failure is injected below the message handling, which no message can reach any more.
FAILING_READER = (
    "import flowmesh.transport as transport\n"
    "async def handle_one(*args, **kw): raise RuntimeError('injected reader failure')\n"
    "transport.handle_one = handle_one\n"
)
BROKER = "['--frontend', 'tcp://127.0.0.1:0', '--backend', 'tcp://127.0.0.1:0', "
INJECT = {
    "broker-tick": (
        "import broker.core as core\n"
        "def tick(self, now): raise RuntimeError('injected tick failure')\n"
        "core.BrokerCore.tick = tick\n"
        "from broker.__main__ import main\n"
        f"main({BROKER}'--heartbeat', '0.05'])\n"
    ),
    "broker-reader": (
        f"{FAILING_READER}from broker.__main__ import main\n"
        f"main({BROKER}'--ready-file', {{ready!r}}])\n"
    ),
    "partitioner-reader": (
        f"{FAILING_READER}from partitioner.__main__ import main\n"
        "main(['--broker', {endpoint!r}])\n"
    ),
    "worker-reader": (
        f"{FAILING_READER}from gpu_worker.__main__ import main\n"
        "main(['--broker', {endpoint!r}, '--device', 'cpu', '--memory-budget', '4MiB'])\n"
    ),
}


def _poke_broker(ready: Path) -> None:
    """Send the broker one message (its reader fails on it)."""
    endpoints = wait_until(
        lambda: json.loads(ready.read_text()) if ready.exists() else None,
        "the broker to bind its sockets",
        30,
    )
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 5000)  # the message must go out, though no answer will come
    sock.connect(endpoints["frontend"])
    sock.send_multipart(p.encode(p.Status(id=1)))
    sock.close()


def _play_broker(router: zmq.Socket) -> None:
    """Answer the peer's registration (its reader fails on the answer)."""
    assert router.poll(30_000), "no registration from the peer within 30 s"
    ident, *frames = router.recv_multipart()
    reg = p.decode(frames)
    assert isinstance(reg, p.Register), reg
    ack = p.RegisterAck(id=reg.id, heartbeat_s=0.2, liveness=3)
    router.send_multipart([ident, *p.encode(ack)])


@pytest.mark.parametrize("where", list(INJECT))
def test_a_process_that_stops_on_an_internal_error_exits_non_zero(
    where: str, tmp_path: Path
) -> None:
    ready = tmp_path / "broker.json"
    log = tmp_path / "out.log"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    code = INJECT[where].format(ready=str(ready), endpoint=f"tcp://127.0.0.1:{port}")
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-c", code], cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT
        )
    try:
        if where == "broker-reader":
            _poke_broker(ready)
        elif where.endswith("-reader"):
            _play_broker(router)
        status = proc.wait(60)
    finally:
        router.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    out = log.read_text(errors="replace")
    assert status == 1, f"{where} exited {status}; its output:\n{out[-3000:]}"
    assert "stopping on error" in out and "injected" in out, out[-3000:]
