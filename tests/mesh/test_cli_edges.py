"""The `flowmesh` command's edges, run as a user runs it against a real broker (alone: none of
these needs a worker): output into a pipe its reader closed, `status --watch` into a file, and a
second `flowmesh up` on a port the broker holds; then a whole `flowmesh up` with a config file
and a log directory of its own."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from client_sdk.mesh import LocalMesh
from tests.support.cli import COMMAND, ROOT, flowmesh
from tests.support.mesh import FAST


@pytest.fixture(scope="module")
def broker() -> Iterator[LocalMesh]:
    with LocalMesh(cpu_workers=0, partitioner=False, **FAST) as m:
        yield m


@pytest.mark.parametrize("unbuffered", ["1", ""])  # output written at each print, or at exit
def test_status_into_a_pipe_closed_early_exits_without_a_traceback(
    broker: LocalMesh, unbuffered: str
) -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte (`flowmesh status | head -0`)
    try:
        env = {"PYTHONUNBUFFERED": unbuffered}
        run = flowmesh("status", "--broker", broker.frontend, stdout=write, env=env)
    finally:
        os.close(write)
    assert run.stderr == "" and run.returncode == 1, run.stderr


def test_watch_into_a_file_prints_one_plain_snapshot_per_interval(broker: LocalMesh) -> None:
    run = flowmesh("status", "--broker", broker.frontend, "--watch", "0.05", "--count", "2")
    assert run.returncode == 0, run.stderr
    assert "\x1b" not in run.stdout  # no cursor movement, no colour
    snapshots = re.split(r"^-- \d{4}-\d\d-\d\d \d\d:\d\d:\d\d$", run.stdout, flags=re.M)[1:]
    assert len(snapshots) == 2, run.stdout
    for snap in snapshots:
        assert "broker up" in snap and "\nworkers\nworker " in snap and "\nmodel " in snap, snap


def test_a_second_up_on_a_busy_port_says_so_in_one_line(broker: LocalMesh) -> None:
    host, port = broker.frontend.removeprefix("tcp://").rsplit(":", 1)
    run = flowmesh("up", "--cpu-workers", "1", "--listen", f"{host}:{port}")
    assert run.returncode == 1 and run.stdout == "", run.stdout
    assert run.stderr == (
        f"flowmesh up: {host}:{port} is already in use: another 'flowmesh up' or broker is "
        f"listening there; stop it, or choose another port with --listen {host}:PORT\n"
    )


def test_up_hands_its_config_to_the_processes_and_keeps_the_logs_in_log_dir(
    tmp_path: Path,
) -> None:
    config = tmp_path / "flowmesh.toml"
    config.write_text('[worker]\nlog_level = "error"\n')  # a key `up` itself never sets
    logs = tmp_path / "logs"
    argv = ["up", "--cpu-workers", "1", "--memory-budget", "8MiB", "--listen", "127.0.0.1:0"]
    argv += ["--heartbeat", "0.2", "--config", str(config), "--log-dir", str(logs)]
    up = subprocess.Popen(
        [*COMMAND, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert up.stdout is not None
        said = up.stdout.readline()  # once the mesh is ready (or "" if `up` gave up)
        assert said.startswith("flowmesh up: broker tcp://127.0.0.1:"), said
        assert f"logs in {logs}." in said, said
        up.send_signal(signal.SIGINT)
        out, err = up.communicate(timeout=60)
    finally:
        if up.poll() is None:  # a failed assertion: stop it as Ctrl-C would, so that it cleans up
            up.send_signal(signal.SIGINT)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()
    assert up.returncode == 0 and out == "flowmesh stopped\n", (out, err)
    assert {p.name for p in logs.glob("*.log")} == {"broker.log", "partitioner.log", "worker-0.log"}
    assert " INFO " in (logs / "broker.log").read_text()  # the broker's table is empty
    worker = (logs / "worker-0.log").read_text()
    assert " INFO " not in worker and " WARNING " not in worker, worker


def test_up_with_http_port_runs_the_gateway_as_one_of_its_processes(tmp_path: Path) -> None:
    """`flowmesh up --http-port`: the gateway answers readiness and shows a deployed model, reads
    its `[gateway]` table of the config file, logs beside the others and stops with them."""
    import httpx

    from client_sdk.client import Client

    with socket.socket() as s:  # a free port, for the gateway to bind
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "flowmesh.toml"
    config.write_text("[gateway]\nmax_body = 1000\n")  # seen below: a larger body is refused
    logs = tmp_path / "logs"
    argv = ["up", "--cpu-workers", "1", "--memory-budget", "64MiB", "--listen", "127.0.0.1:0"]
    argv += ["--heartbeat", "0.2", "--http-port", str(port), "--config", str(config)]
    argv += ["--log-dir", str(logs)]
    # This mesh is keyless: not the session's keys (FLOWMESH_TEST_KEYS=1 puts the operator key
    # in FLOWMESH_KEYS, which its gateway and clients would then offer).
    env = {k: v for k, v in os.environ.items() if k != "FLOWMESH_KEYS"}
    up = subprocess.Popen(
        [*COMMAND, *argv],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        assert up.stdout is not None
        # Read aside: a line that never comes fails the test instead of blocking it for good.
        lines: queue.Queue[str] = queue.Queue()
        stdout = up.stdout
        threading.Thread(target=lambda: [lines.put(x) for x in stdout], daemon=True).start()
        said = lines.get(timeout=180)
        frontend = re.search(r"broker (tcp://\S+) ", said)
        assert frontend is not None, said
        said = lines.get(timeout=180)
        assert said.startswith(f"flowmesh up: HTTP gateway on port {port} "), said
        assert httpx.get(f"{url}/v2/health/ready", timeout=30).status_code == 200
        with Client(frontend.group(1), timeout=120, keys=False) as c:
            c.deploy("mlp", "flowmesh.examples:mlp", kwargs={"width": 8, "depth": 2}, seed=1)
        model = httpx.get(f"{url}/v2/models/mlp", timeout=30)
        assert model.status_code == 200, model.text
        assert model.json()["name"] == "mlp"
        big = httpx.post(f"{url}/v2/models/mlp/infer", content=b"x" * 2000, timeout=30)
        assert big.status_code == 413, big.text
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        out = "".join(iter(lambda: lines.get(timeout=10), "flowmesh stopped\n"))
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()
    assert out == "", out  # nothing between the gateway's line and "flowmesh stopped"
    assert "gateway.log" in {p.name for p in logs.glob("*.log")}
    with pytest.raises(httpx.TransportError):  # stopped with the mesh
        httpx.get(f"{url}/v2/health/live", timeout=5)
