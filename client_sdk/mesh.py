"""The embedded mesh: broker, partitioner and workers as child processes on this machine.

`flowmesh up`, the demo and the tests all start the mesh through `LocalMesh`. It binds the broker
on free loopback ports, waits (with a timeout, failing early if a child dies) until every worker
and the partitioner are ready, and stops every child on exit — SIGTERM first, SIGKILL if one
lingers. The children's logs go to the run directory, a fresh temporary one unless `run_dir` is
given: removed at exit, but kept (and where, said on stderr) when the start failed, an exception
left the mesh, or the caller asked (`keep_logs`: something failed that only it can tell).

`keys`: CURVE on every socket (`flowmesh.auth`). True makes a fresh key directory in the run
directory; a path uses that one (made with `flowmesh keys init`). Either way the mesh adds the
keys its own processes need (worker-i, partitioner-0, and `local-operator` for its own clients).

`http_port`: the HTTP gateway (`python -m gateway`, OpenAI and KServe v2 routes) as one more
child, started once the workers are ready, a client of the broker under the mesh's operator key;
`http_url` is where it answers. It binds `http_host` (127.0.0.1; another address needs API keys,
or `--insecure-open` in `gateway_args`). It stops first, with the others.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from client_sdk.client import Client
from flowmesh.auth import ensure_key, init_keys
from flowmesh.errors import Code, FlowmeshError
from flowmesh.lifecycle import PARENT_ENV
from flowmesh.reports import BrokerStatus

# The key the mesh's own clients (readiness, `client()`) use when keys are on.
LOCAL_OPERATOR = "local-operator"


# How a mesh starts a child: `(module, args, env, log file)` to a running process, a
# `subprocess.Popen` or anything with its `pid`, `returncode`, `poll`, `wait`, `send_signal` and
# `kill`. Every mesh execs `python -m MODULE` (`popen_launcher`) unless `set_launcher` says
# otherwise: the test suite forks its heavier children from one process instead
# (tests/support/prefork.py), so that each does not import torch again.
Launcher = Callable[[str, list[str], dict[str, str], Path], Any]


def popen_launcher(module: str, args: list[str], env: dict[str, str], log: Path) -> Any:
    with open(log, "wb") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )  # Ctrl-C reaches us, we stop them


_launcher: list[Launcher] = [popen_launcher]


def set_launcher(launcher: Launcher) -> None:
    """How every mesh of this process starts its children from now on."""
    _launcher[0] = launcher


@dataclass
class Child:
    name: str
    proc: Any  # subprocess.Popen[bytes], or another `Launcher`'s process
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


def _repeated(flag: str, values: list[str | Path] | None) -> list[str]:
    return [a for v in values or () for a in (flag, str(v))]


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
    # Directories whose files clients may name: workers and the partitioner read weights, Hugging
    # Face directories and checkpoints to resume under `data_roots`; workers save checkpoints
    # under `checkpoint_roots` (and resume from them). None: the processes' working directory.
    data_roots: list[str | Path] | None = None
    checkpoint_roots: list[str | Path] | None = None
    worker_args: list[str] = field(default_factory=list)
    partitioner_args: list[str] = field(default_factory=list)
    # Prometheus /metrics (`--metrics-port`): the broker on this port, the partitioner on the
    # next, worker i on port + 2 + i (`metrics_ports()`); 0: off.
    metrics_port: int = 0
    # CURVE keys: True (a fresh key directory), a key directory, or None (off).
    keys: bool | str | Path | None = None
    # The HTTP gateway's port (0: no gateway) and more of its options (`--config FILE`, ...).
    http_port: int = 0
    http_host: str = "127.0.0.1"
    gateway_args: list[str] = field(default_factory=list)
    run_dir: Path | None = None
    ready_timeout_s: float = 60.0
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.children: list[Child] = []
        self.frontend = ""
        self.backend = ""
        self.http_url = ""
        # The run directory made here (no `run_dir` given): removed at stop unless kept.
        self._tmp: Path | None = None
        self._keep = False
        self.key_dir: Path | None = None
        # The secret file of the mesh's own operator key (None when keys are off).
        self.client_keys: Path | None = None

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> LocalMesh:
        try:
            self.start()
        except BaseException:
            self.keep_logs()
            self.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is not None:
            self.keep_logs()
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
        child = Child(name, _launcher[0](module, args, env, log), log)
        self.children.append(child)
        return child

    def start(self) -> None:
        if self.run_dir is None:
            self._tmp = self.run_dir = Path(tempfile.mkdtemp(prefix="flowmesh-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ready = self.run_dir / "broker.json"
        ready.unlink(missing_ok=True)
        self._setup_keys()
        self._broker_argv = [
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
            *self._metrics_args("broker"),
            *self._key_args(),
            *self.broker_args,
        ]
        broker = self._spawn("broker", "broker", self._broker_argv)
        endpoints = self.wait_until(
            lambda: json.loads(ready.read_text()) if ready.exists() else None,
            "the broker to bind its sockets",
            watch=[broker],
        )
        self.frontend, self.backend = endpoints["frontend"], endpoints["backend"]
        if self.partitioner:
            self._spawn(
                "partitioner",
                "partitioner",
                [
                    "--broker",
                    self.backend,
                    "--name",
                    "partitioner-0",
                    *_repeated("--data-root", self.data_roots),
                    *self._metrics_args("partitioner"),
                    *self._key_args("partitioner-0", "partitioner"),
                    *self.partitioner_args,
                ],
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
                *_repeated("--data-root", self.data_roots),
                *_repeated("--checkpoint-root", self.checkpoint_roots),
                *self._metrics_args(f"worker-{i}"),
                *self._key_args(f"worker-{i}", "worker"),
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
        if self.http_port:
            self._start_gateway()

    def _start_gateway(self) -> None:
        """The gateway, once the mesh is ready (so that its readiness probe says ready at
        once); returns when it answers /v2/health/live."""
        import urllib.request

        args = ["--broker", self.frontend, "--host", self.http_host, "--port", str(self.http_port)]
        args += self.gateway_args
        if self.client_keys is not None:
            # Its own CURVE key: the mesh's operator one (API keys, if any, say who calls it);
            # an api_keys.json in the key directory is found next to it.
            args += ["--keys", str(self.client_keys)]
        gateway = self._spawn("gateway", "gateway", args)
        url = f"http://{reachable(self.http_host)}:{self.http_port}"

        def live() -> bool | None:
            with urllib.request.urlopen(f"{url}/v2/health/live", timeout=2.0) as answer:
                return True if answer.status == 200 else None

        self.wait_until(
            live, f"the HTTP gateway to answer on port {self.http_port}", watch=[gateway]
        )
        self.http_url = url

    def _devices(self) -> list[tuple[str, str | None]]:
        if self.gpus:
            return [(f"cuda:{i}", self.gpu_budget) for i in self.gpus]
        return [("cpu", self.memory_budget) for _ in range(self.cpu_workers)]

    def _setup_keys(self) -> None:
        if not self.keys:
            return
        assert self.run_dir is not None
        if self.keys is True:
            self.key_dir = self.run_dir / "keys"
            if not (self.key_dir / "broker.key_secret").exists():
                init_keys(self.key_dir)
        else:
            self.key_dir = Path(self.keys).expanduser()
        self.client_keys = ensure_key(self.key_dir, LOCAL_OPERATOR, "operator")

    def _key_args(self, name: str | None = None, role: str = "") -> list[str]:
        """`--keys DIR` for the broker (no `name`) or the peer `name`, whose key is made if
        missing."""
        if self.key_dir is None:
            return []
        if name is not None:
            ensure_key(self.key_dir, name, role)
        return ["--keys", str(self.key_dir)]

    def metrics_ports(self) -> dict[str, int]:
        """Each process's /metrics port, by child name ({} when metrics are off)."""
        if not self.metrics_port:
            return {}
        names = ["broker", "partitioner", *(f"worker-{i}" for i in range(self.n_workers))]
        return {name: self.metrics_port + k for k, name in enumerate(names)}

    def _metrics_args(self, name: str) -> list[str]:
        port = self.metrics_ports().get(name)
        return ["--metrics-port", str(port)] if port else []

    @property
    def n_workers(self) -> int:
        return len(self._devices())

    def wait_ready(self, timeout: float | None = None) -> BrokerStatus:
        """Until the broker reports every worker (and the partitioner) ready."""
        with Client(self.frontend, timeout=5.0, keys=self.client_keys or False) as client:

            def probe() -> BrokerStatus | None:
                try:
                    st = client.status(timeout=2.0)
                except FlowmeshError:
                    return None
                workers = [w for w in st.workers if w.ready]
                parts = [w for w in st.partitioners if w.ready]
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

    def client(self, timeout: float = 60.0, keys: Any = None) -> Client:
        """A client of the mesh; with keys on, under the mesh's operator key unless `keys`
        names another."""
        return Client(self.frontend, timeout=timeout, keys=keys or self.client_keys or False)

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        child = self.child(name)
        child.proc.send_signal(sig)
        child.proc.wait(10)

    def restart_broker(
        self, sig: int = signal.SIGKILL, wait: bool = True, timeout: float | None = None
    ) -> None:
        """Kill the broker (SIGKILL: no goodbye) and start it again with the same arguments on
        the endpoints it had bound, as a supervisor would; the workers and the partitioner stay
        up. Returns once it has bound them again; with `wait`, once every worker and the
        partitioner have registered with it again. Its earlier logs stay as broker.N.log."""
        assert self.run_dir is not None
        old = self.child("broker")
        if old.proc.poll() is None:
            old.proc.send_signal(sig)
            old.proc.wait(10)
        lives = len(list(self.run_dir.glob("broker.*.log")))
        old.log.rename(self.run_dir / f"broker.{lives + 1}.log")
        self.children.remove(old)
        ready = self.run_dir / "broker.json"
        ready.unlink(missing_ok=True)
        argv = list(self._broker_argv)
        argv[argv.index("--frontend") + 1] = self.frontend
        argv[argv.index("--backend") + 1] = self.backend
        broker = self._spawn("broker", "broker", argv)
        self.children.remove(broker)
        self.children.insert(0, broker)  # stopped last, as at start
        self.wait_until(
            lambda: json.loads(ready.read_text()) if ready.exists() else None,
            "the restarted broker to bind its sockets",
            timeout,
            watch=[broker],
        )
        if wait:
            self.wait_ready(timeout)

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
            if self._keep:
                print(f"flowmesh: the mesh's logs are kept in {self._tmp}", file=sys.stderr)
            else:
                shutil.rmtree(self._tmp, ignore_errors=True)
                self.run_dir = None
            self._tmp = None

    def keep_logs(self) -> Path | None:
        """Keep the run directory, the children's logs among it, once the mesh stops (a
        failure's evidence; `stop` says where). A mesh that fails to start, or is left by an
        exception, keeps it anyway."""
        self._keep = True
        return self.run_dir


def reachable(host: str) -> str:
    """An address that reaches a server bound on `host`: loopback for the wildcard ones."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host in ("::", "[::]"):
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
