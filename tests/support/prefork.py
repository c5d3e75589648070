"""A fork server for the suite's meshes: the worker, partitioner and gateway processes a
`LocalMesh` starts, forked from one process that has imported torch and the services once.

Each of those processes spends some 2.5 s of CPU importing torch before it does anything; the
suite starts a few hundred of them on 2 cores. Forked from a server that paid for the imports
once, a child starts in milliseconds and is otherwise the process `python -m MODULE ARGS` would
be: its own pid, session, environment, working directory and log file, run from its module's
`__main__` with its arguments, talking over real sockets. The server forks before anything has
started a thread or a torch thread pool (it checks), so the children start as clean as an exec.

What it cannot be is an exec'd interpreter: options read as torch and numpy load (OMP_*
variables) come from the server's environment, the session's, and numpy's BLAS runs on one
thread (the server sets OPENBLAS_NUM_THREADS=1, or its pool would start a thread at import).
Tests of what an exec gives (installs, systemd units, `flowmesh up`, the CLI) start their
processes themselves, as users do; so does any `LocalMesh` in a process other than pytest's.
`FLOWMESH_TEST_PREFORK=0` turns the server off (every child exec'd, as before), e.g. for
coverage of the children.

The server speaks JSON lines over its stdin and stdout: `{"spawn": {...}}` answers the child's
pid, `{"poll": pid}` its exit status once it has one (reaped by the server, which is its parent).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from client_sdk.mesh import popen_launcher
from flowmesh.lifecycle import PARENT_ENV

# The modules whose processes are forked (the broker's imports are light: it is exec'd).
FORKED = ("gpu_worker", "partitioner", "gateway")
PRELOAD = (
    "gpu_worker.__main__",
    "partitioner.__main__",
    "gateway.__main__",
    "gateway.app",
    "gateway.guard",
    "uvicorn.config",
    "uvicorn.protocols.http.httptools_impl",
    "uvicorn.loops.uvloop",
    "uvicorn.lifespan.on",
    # What a worker or the partitioner imports once it reads a Hugging Face directory (the
    # architectures the suite's tiny language models use: tests/support/lm.py).
    "transformers",
    "transformers.masking_utils",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.mistral.modeling_mistral",
    "transformers.models.opt.modeling_opt",
)

SERVER = r"""
import json, os, runpy, signal, sys, threading, traceback

preload = sys.argv[1:]
for module in preload:
    __import__(module)
# Fork only from a single-threaded process: a thread (or a pool's) would be missing, with any
# lock it held, in every child.
assert threading.active_count() == 1, threading.enumerate()
assert len(os.listdir("/proc/self/task")) == 1, "a native thread started at import"

requests = os.fdopen(os.dup(0), "r")
answers = os.fdopen(os.dup(1), "w")
devnull = os.open(os.devnull, os.O_RDWR)
os.dup2(devnull, 0)
os.dup2(devnull, 1)
signal.signal(signal.SIGINT, signal.SIG_IGN)  # the test process stops us: stdin closes
exited = {}

def reap(*_):
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        exited[pid] = os.waitstatus_to_exitcode(status)

signal.signal(signal.SIGCHLD, reap)

def child(spec):
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()
        log = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(requests.fileno())
        os.close(answers.fileno())
        # PYTHONPATH is read as an interpreter starts: the child's own entries join sys.path
        # here, as they would have there.
        ours = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        theirs = spec["env"].get("PYTHONPATH", "").split(os.pathsep)
        sys.path[1:1] = [p for p in theirs if p and p not in ours]
        os.environ.clear()
        os.environ.update(spec["env"])
        os.chdir(spec["cwd"])
        import importlib
        importlib.invalidate_caches()
        sys.argv = [spec["module"], *spec["args"]]
        try:
            runpy.run_module(spec["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, int | None):
                print(exc.code, file=sys.stderr)
        import atexit
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)

for line in requests:
    ask = json.loads(line)
    if "spawn" in ask:
        spec = ask["spawn"]
        spec["env"][spec["parent_env"]] = str(os.getpid())
        pid = os.fork()
        if pid == 0:
            child(spec)
        answer = {"pid": pid}
    else:
        reap()
        answer = {"code": exited.get(ask["poll"])}
    answers.write(json.dumps(answer) + "\n")
    answers.flush()
"""


class ForkServer:
    """The server process, started on first use; its children are `Forked` processes."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD) -> None:
        self.preload = preload
        # The session's environment and directory as the suite starts, not those of whichever
        # test happens to fork first (a monkeypatched variable would reach every later child).
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1", "OPENBLAS_NUM_THREADS": "1"}
        self._cwd = os.getcwd()
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self._proc is None:
                self._proc = subprocess.Popen(
                    [sys.executable, "-c", SERVER, *self.preload],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    # numpy's OpenBLAS starts its thread pool as it loads: OPENBLAS_NUM_THREADS=1
                    # keeps it from starting a thread.
                    env=self._env,
                    cwd=self._cwd,
                    text=True,
                    start_new_session=True,
                )
                atexit.register(self.close)
            proc = self._proc
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(json.dumps(message) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server exited with {proc.wait()}")
        return json.loads(line)

    def spawn(
        self,
        module: str,
        args: list[str],
        env: dict[str, str],
        log: Path,
        cwd: Path | None = None,
    ) -> Forked:
        spec = {
            "module": module,
            "args": args,
            "env": env,
            "cwd": str(cwd or os.getcwd()),
            "log": str(log),
            "parent_env": PARENT_ENV,
        }
        return Forked(self, self._ask({"spawn": spec})["pid"], [module, *args])

    def poll(self, pid: int) -> int | None:
        return self._ask({"poll": pid})["code"]

    def close(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


class Forked:
    """A forked child, as much of `subprocess.Popen` as the tests and `LocalMesh` use."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self.server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.poll(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        # Not once it has exited: the server reaped it, so its pid may be another's by now.
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_server = ForkServer()


def launcher(module: str, args: list[str], env: dict[str, str], log: Path) -> Any:
    """`LocalMesh`'s launcher for the suite: the heavy modules forked, the others exec'd."""
    if module in FORKED:
        return _server.spawn(module, args, env, log)
    return popen_launcher(module, args, env, log)


def spawn(module: str, args: list[str], log: Path, cwd: Path) -> Any:
    """A process of `module` for a test that starts one itself: forked unless the server is
    off (`enabled`), in the test process's environment."""
    if enabled():
        return _server.spawn(module, args, dict(os.environ), log, cwd)
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args], cwd=cwd, stdout=out, stderr=subprocess.STDOUT
        )


def enabled() -> bool:
    return os.environ.get("FLOWMESH_TEST_PREFORK", "1") != "0"
