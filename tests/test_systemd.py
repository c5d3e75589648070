"""systemd: the units are valid, and the processes speak `Type=notify` as systemd hears it.

The notify tests play systemd's part: an AF_UNIX datagram socket named in $NOTIFY_SOCKET, with
$WATCHDOG_USEC set, that a real broker and worker report to (sd_notify(3)): READY=1 once serving
(broker: bound; worker: registered with the broker), WATCHDOG=1 every half watchdog period, and
STOPPING=1 on SIGTERM. Every datagram must come from the main process (the units say
NotifyAccess=main), which the socket's SCM_CREDENTIALS show.
"""

from __future__ import annotations

import configparser
import os
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flowmesh.lifecycle import PARENT_ENV
from flowmesh.sdnotify import notify, watchdog_interval

UNITS = Path(__file__).parents[1] / "scripts" / "systemd"
SERVICES = (
    "flowmesh-broker.service",
    "flowmesh-partitioner.service",
    "flowmesh-worker@.service",
    "flowmesh-gateway.service",
)
MODULE_SECTIONS = {
    "broker": "broker",
    "partitioner": "partitioner",
    "gpu_worker": "worker",
    "gateway": "gateway",
}
WATCHDOG_USEC = 200_000  # pings every 0.1 s
START_S = 90.0  # a loaded machine: imports (torch for the worker) take a while


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string((UNITS / name).read_text())
    return parser


# --- the unit files -------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    """`systemd-analyze verify`, with ExecStart's interpreter pointed at one that exists here
    (verify checks it is executable). It reports most mistakes (a misspelt key, a bad value) as
    warnings with exit status 0, so any output fails the test."""
    for name in SERVICES:
        text = (UNITS / name).read_text()
        assert "/opt/flowmesh/.venv/bin/python " in text
        (tmp_path / name).write_text(text.replace("/opt/flowmesh/.venv/bin/python", sys.executable))
    names = [*SERVICES, "flowmesh-worker@0.service"]
    done = subprocess.run(
        ["systemd-analyze", "verify", *(f"./{n}" for n in names)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""},
    )
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


@pytest.mark.parametrize("name", SERVICES)
def test_units_are_notify_services_whose_command_lines_parse(name: str) -> None:
    """Checked by hand against systemd.service(5) where systemd-analyze is absent: the settings
    the processes rely on, and an ExecStart whose flags the process accepts."""
    service = unit(name)["Service"]
    assert service["Type"] == "notify"
    assert service["NotifyAccess"] == "main"
    assert float(service["WatchdogSec"]) > 0
    assert service["Restart"] == "on-failure"  # exit status 1 = a task failed (lifecycle.py)
    argv = shlex.split(service["ExecStart"].replace("%i", "0").replace("%H", "host"))
    assert argv[:2] == ["/opt/flowmesh/.venv/bin/python", "-m"]
    module, flags = argv[2], argv[3:]
    assert flags[:2] == ["--config", "/etc/flowmesh/flowmesh.toml"]
    options = __import__(f"{module}.__main__", fromlist=["OPTIONS"]).OPTIONS
    assert options.section == MODULE_SECTIONS[module]
    flags[1] = str(UNITS / "flowmesh.toml")  # the example stands in for /etc's
    args = options.parse(flags)
    if module == "gpu_worker":
        assert (args.device, args.name) == ("cuda:0", "host-gpu0")
    if module == "gateway":  # the example's [gateway] table, and the default body limit
        assert (args.host, args.port, args.max_body) == ("127.0.0.1", 8000, 64 << 20)
        assert args.api_keys == "/etc/flowmesh/keys/api_keys.json"


# --- the notify protocol --------------------------------------------------------------------


class NotifySocket:
    """systemd's end of $NOTIFY_SOCKET: datagrams with their sender's pid."""

    def __init__(self, directory: Path) -> None:
        self.path = str(directory / "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(self.path)
        self.log: list[tuple[int, str]] = []

    def receive(self, timeout: float) -> tuple[int, str] | None:
        self.sock.settimeout(max(timeout, 1e-3))
        try:
            data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
        except TimeoutError:
            return None
        pid = -1
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = struct.unpack("iII", payload[:12])[0]
        self.log.append((pid, data.decode()))
        return pid, data.decode()

    def wait_for(self, state: str, timeout: float) -> list[str]:
        """Every datagram until one that is `state` (which ends the list)."""
        seen: list[str] = []
        deadline = time.monotonic() + timeout
        while (got := self.receive(deadline - time.monotonic())) is not None:
            seen.append(got[1])
            if got[1] == state:
                return seen
        raise AssertionError(f"no {state} within {timeout:.0f} s; got {seen}")

    def collect(self, seconds: float) -> list[str]:
        seen: list[str] = []
        deadline = time.monotonic() + seconds
        while (got := self.receive(deadline - time.monotonic())) is not None:
            seen.append(got[1])
        return seen

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory whose socket paths fit sun_path's 108 bytes (pytest's tmp_path may not)."""
    path = Path(tempfile.mkdtemp(prefix="fm-sd-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Process:
    def __init__(self, module: str, args: list[str], directory: Path, tag: str) -> None:
        (directory / tag).mkdir()
        self.notify = NotifySocket(directory / tag)
        self.log = directory / f"{tag}.log"
        env = {
            **os.environ,
            "NOTIFY_SOCKET": self.notify.path,
            "WATCHDOG_USEC": str(WATCHDOG_USEC),
            PARENT_ENV: str(os.getpid()),  # stops by itself should the test process die
        }
        env.pop("WATCHDOG_PID", None)
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, *args], env=env, stdout=out, stderr=out
            )

    def ready(self) -> list[str]:
        try:
            return self.notify.wait_for("READY=1", START_S)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.output()}") from None

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> int:
        """SIGTERM, as `systemctl stop` sends: STOPPING=1, then exit status 0."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.notify.wait_for("STOPPING=1", 30)
            return self.proc.wait(30)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.output()}") from None

    def check_senders(self) -> None:
        """NotifyAccess=main: systemd drops datagrams from any other process."""
        assert {pid for pid, _ in self.notify.log} == {self.proc.pid}, self.notify.log

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.notify.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def watchdog_pings(states: list[str]) -> int:
    return sum(state == "WATCHDOG=1" for state in states)


def test_broker_reports_ready_once_bound_pings_the_watchdog_and_stopping(short_dir: Path) -> None:
    ready_file = short_dir / "ready.json"
    broker = Process(
        "broker",
        [
            "--frontend",
            "tcp://127.0.0.1:0",
            "--backend",
            "tcp://127.0.0.1:0",
            "--ready-file",
            str(ready_file),
        ],
        short_dir,
        "broker",
    )
    try:
        before = broker.ready()
        assert before == ["READY=1"]  # nothing before it; the watchdog starts with serving
        assert ready_file.exists()  # READY=1 comes after the sockets are bound
        # Every 0.1 s for a 0.2 s watchdog: ~10 in a second; a loaded machine may drop some.
        assert watchdog_pings(broker.notify.collect(1.0)) >= 4
        assert broker.stop() == 0
        broker.check_senders()
    finally:
        broker.close()


def test_worker_is_ready_only_once_registered_and_pings_the_watchdog_before(
    short_dir: Path,
) -> None:
    backend = f"tcp://127.0.0.1:{free_port()}"
    worker = Process(
        "gpu_worker",
        ["--broker", backend, "--device", "cpu", "--memory-budget", "8MiB", "--threads", "1"],
        short_dir,
        "worker",
    )
    broker = None
    try:
        # No broker yet: the worker's loop runs (watchdog pings) but it is not ready.
        pinged = worker.notify.wait_for("WATCHDOG=1", START_S)
        pinged += worker.notify.collect(1.0)
        assert "READY=1" not in pinged, worker.output()
        assert watchdog_pings(pinged) >= 4
        broker = Process(
            "broker", ["--frontend", "tcp://127.0.0.1:0", "--backend", backend], short_dir, "broker"
        )
        broker.ready()
        worker.ready()  # registered with the broker that has just come up
        assert watchdog_pings(worker.notify.collect(0.5)) >= 2
        assert worker.stop() == 0
        worker.check_senders()
        assert broker.stop() == 0
        broker.check_senders()
    finally:
        worker.close()
        if broker is not None:
            broker.close()


def test_gateway_reports_ready_once_serving_pings_the_watchdog_and_stopping(
    short_dir: Path,
) -> None:
    """No broker behind it: the gateway serves (and is live) without one, as its unit needs."""
    import httpx

    port = free_port()
    gateway = Process(
        "gateway",
        ["--broker", f"tcp://127.0.0.1:{free_port()}", "--port", str(port)],
        short_dir,
        "gateway",
    )
    try:
        assert gateway.ready() == ["READY=1"]
        # READY=1 comes once the port answers.
        assert httpx.get(f"http://127.0.0.1:{port}/v2/health/live", timeout=10).status_code == 200
        assert watchdog_pings(gateway.notify.collect(1.0)) >= 4
        assert gateway.stop() == 0
        gateway.check_senders()
    finally:
        gateway.close()


# --- sdnotify.py on its own -----------------------------------------------------------------


def test_watchdog_interval_follows_sd_watchdog_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert watchdog_interval() is None
    for bad in ("", "0", "-5", "soon"):
        monkeypatch.setenv("WATCHDOG_USEC", bad)
        assert watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # a parent's, inherited
    assert watchdog_interval() is None


def test_notify_reaches_abstract_sockets_and_is_silent_without_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = f"flowmesh-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        notify("READY=1")
        assert sock.recv(4096) == b"READY=1"
    monkeypatch.delenv("NOTIFY_SOCKET")
    notify("READY=1")  # not under systemd: nothing, and no error
    monkeypatch.setenv("NOTIFY_SOCKET", "/nonexistent/notify")
    notify("READY=1")  # systemd gone: never an error in the service
