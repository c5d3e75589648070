"""The embedded mesh: broker, partitioner and workers as child processes on this machine.

`flowmesh up`, the demo and the tests all start the mesh through `LocalMesh`. It binds the broker
on free loopback ports, waits (with a timeout, failing early if a child dies) until every worker
and the partitioner are ready, and stops every child on exit — SIGTERM first, SIGKILL if one
lingers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from client_sdk.client import Client
from flowmesh.errors import Code, FlowmeshError
from flowmesh.lifecycle import PARENT_ENV


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def wait_until(probe: Any, what: str, timeout: float, watch: list[Child] | None = None) -> Any:
    """Poll `probe` until it returns something other than None; fail early if a watched child
    dies, and after `timeout` seconds with `what` in the message."""
    watch = watch or []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in watch:
            if child.proc.poll() is not None:
                raise FlowmeshError(
                    Code.UNAVAILABLE,
                    f"{child.name} exited with {child.proc.returncode} while "
                    f"waiting for {what}; its log:\n{child.tail()}",
                )
        with contextlib.suppress(ValueError, OSError):
            got = probe()
            if got is not None:
                return got
        time.sleep(0.05)
    logs = "\n".join(f"--- {c.name}\n{c.tail(10)}" for c in watch)
    raise FlowmeshError(Code.TIMEOUT, f"timed out waiting for {what}\n{logs}")


@dataclass
class LocalMesh:
    """Start with `with LocalMesh(cpu_workers=2, memory_budget="256MiB") as mesh: ...`."""

    cpu_workers: int = 2
    memory_budget: str = "512MiB"
    gpus: list[int] | None = None  # CUDA device indexes; None/[] = CPU stand-ins
    gpu_budget: str | None = None
    # Each worker's training bytes (`--train-bytes`, e.g. "4MiB"); 0: no training jobs.
    train_bytes: str | int = 0
    heartbeat_s: float = 1.0
    liveness: int = 3
    partitioner: bool = True
    threads_per_worker: int | None = None
    compute_lanes: int = 2
    host: str = "127.0.0.1"
    frontend_port: int = 0
    backend_port: int = 0
    # Modules allowed to provide model (and loss) factories, set once on the broker: the
    # partitioner and workers receive it at registration. None: the broker's default.
    allow: list[str] | None = None
    broker_args: list[str] = field(default_factory=list)
    worker_args: list[str] = field(default_factory=list)
    run_dir: Path | None = None
    ready_timeout_s: float = 60.0
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.children: list[Child] = []
        self.frontend = ""
        self.backend = ""
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> LocalMesh:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, module: str, args: list[str]) -> Child:
        assert self.run_dir is not None
        log = self.run_dir / f"{name}.log"
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            PARENT_ENV: str(os.getpid()),
            **self.env,
        }
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", module, *args],
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )  # Ctrl-C reaches us, we stop them
        child = Child(name, proc, log)
        self.children.append(child)
        return child

    def start(self) -> None:
        if self.run_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="flowmesh-")
            self.run_dir = Path(self._tmp.name)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ready = self.run_dir / "broker.json"
        ready.unlink(missing_ok=True)
        broker = self._spawn(
            "broker",
            "broker",
            [
                "--frontend",
                f"tcp://{self.host}:{self.frontend_port}",
                "--backend",
                f"tcp://{self.host}:{self.backend_port}",
                "--heartbeat",
                str(self.heartbeat_s),
                "--liveness",
                str(self.liveness),
                "--ready-file",
                str(ready),
                *[a for m in self.allow or () for a in ("--allow", m)],
                *self.broker_args,
            ],
        )
        endpoints = self.wait_until(
            lambda: json.loads(ready.read_text()) if ready.exists() else None,
            "the broker to bind its sockets",
            watch=[broker],
        )
        self.frontend, self.backend = endpoints["frontend"], endpoints["backend"]
        if self.partitioner:
            self._spawn(
                "partitioner", "partitioner", ["--broker", self.backend, "--name", "partitioner-0"]
            )
        for i, (device, budget) in enumerate(self._devices()):
            args = [
                "--broker",
                self.backend,
                "--device",
                device,
                "--name",
                f"worker-{i}",
                "--compute-lanes",
                str(self.compute_lanes),
                *self.worker_args,
            ]
            if budget:
                args += ["--memory-budget", budget]
            if self.train_bytes:
                args += ["--train-bytes", str(self.train_bytes)]
            if self.threads_per_worker:
                args += ["--threads", str(self.threads_per_worker)]
            self._spawn(f"worker-{i}", "gpu_worker", args)
        self.wait_ready()

    def _devices(self) -> list[tuple[str, str | None]]:
        if self.gpus:
            return [(f"cuda:{i}", self.gpu_budget) for i in self.gpus]
        return [("cpu", self.memory_budget) for _ in range(self.cpu_workers)]

    @property
    def n_workers(self) -> int:
        return len(self._devices())

    def wait_ready(self, timeout: float | None = None) -> dict[str, Any]:
        """Until the broker reports every worker (and the partitioner) ready."""
        with Client(self.frontend, timeout=5.0) as client:

            def probe() -> dict[str, Any] | None:
                try:
                    st = client.status(timeout=2.0)
                except FlowmeshError:
                    return None
                workers = [w for w in st["workers"] if w["ready"]]
                parts = [w for w in st["partitioners"] if w["ready"]]
                if len(workers) >= self.n_workers and (parts or not self.partitioner):
                    return st
                return None

            return self.wait_until(
                probe,
                f"{self.n_workers} worker(s) and the partitioner to register",
                timeout,
                watch=self.children,
            )

    def wait_until(
        self, probe: Any, what: str, timeout: float | None = None, watch: list[Child] | None = None
    ) -> Any:
        """Poll `probe` until it returns something other than None. Fails early if a watched
        child dies (by default those alive now), and after `timeout` seconds with `what` in the
        message."""
        if watch is None:
            watch = [c for c in self.children if c.proc.poll() is None]
        return wait_until(probe, what, timeout or self.ready_timeout_s, watch)

    def client(self, timeout: float = 60.0) -> Client:
        return Client(self.frontend, timeout=timeout)

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        child = self.child(name)
        child.proc.send_signal(sig)
        child.proc.wait(10)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every child (workers first, broker last), then SIGKILL stragglers."""
        for child in reversed(self.children):
            if child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in self.children:
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait(5)
        self.children.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
            self.run_dir = None
