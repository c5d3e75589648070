"""`--cpus`: a pinned process runs every one of its threads on the CPUs named, and the broker
and the worker take the option."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from broker import __main__ as broker_main
from flowmesh.affinity import parse_cpus
from gpu_worker import __main__ as worker_main

ROOT = Path(__file__).resolve().parents[2]


def test_parse_cpus_reads_taskset_lists_and_refuses_the_rest() -> None:
    assert parse_cpus("0-3,6") == {0, 1, 2, 3, 6}
    assert parse_cpus("5") == {5}
    for bad in ("", "a", "3-1", "1-", "-2", "1,,x"):
        with pytest.raises(ValueError, match="--cpus"):
            parse_cpus(bad)


# A process of its own, as the broker and a worker are at start (`--cpus` pins its whole
# process, and this one runs the tests): threads started before the pin as theirs are by then
# (ZeroMQ's I/O and reaper threads, a Python thread: torch's pool threads are threads alike),
# and one started after it.
CHILD = """
import json, sys, threading
from pathlib import Path

import zmq

from flowmesh.affinity import pin_process

ctx = zmq.Context(io_threads=2)
sock = ctx.socket(zmq.DEALER)
stop = threading.Event()
before = threading.Thread(target=stop.wait, daemon=True)
before.start()
pin_process(sys.argv[1])
after = threading.Thread(target=stop.wait, daemon=True)
after.start()
out = {}
for task in Path("/proc/self/task").iterdir():
    for line in (task / "status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            out[task.name] = line.split(":", 1)[1].strip()
print(json.dumps(out))
stop.set()
sock.close(0)
ctx.term()
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_every_thread_of_a_pinned_process_runs_on_the_cpus_named() -> None:
    cpu = str(max(os.sched_getaffinity(0)))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, cpu], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    threads = json.loads(done.stdout)
    # The main thread, ZeroMQ's two I/O threads and its reaper, the two Python threads.
    assert len(threads) >= 5, threads
    assert set(threads.values()) == {cpu}, threads


@pytest.mark.parametrize("entry", [broker_main, worker_main])
def test_the_broker_and_the_worker_take_cpus(entry: Any) -> None:
    """Both pin at start (`main` calls `pin_process` first) from `--cpus`; a CPU the process
    may not use is refused with the reason."""
    assert entry.parser().parse_args(["--cpus", "0-1,3"]).cpus == "0-1,3"
    with pytest.raises(SystemExit, match="not one this process may use"):
        entry.main(["--cpus", str(max(os.sched_getaffinity(0)) + 1)])
