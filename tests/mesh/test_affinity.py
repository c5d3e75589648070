"""`--cpus`: a broker and a worker run every one of their threads on the CPUs named, and serve."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from client_sdk.mesh import LocalMesh
from flowmesh.affinity import parse_cpus
from tests.mesh.conftest import FAST


def thread_cpus(pid: int) -> dict[int, str]:
    """Each thread of process `pid`: the CPUs it may run on, as the kernel lists them."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(task.name)] = line.split(":", 1)[1].strip()
    return out


def test_parse_cpus_reads_taskset_lists_and_refuses_the_rest() -> None:
    assert parse_cpus("0-3,6") == {0, 1, 2, 3, 6}
    assert parse_cpus("5") == {5}
    for bad in ("", "a", "3-1", "1-", "-2", "1,,x"):
        with pytest.raises(ValueError, match="--cpus"):
            parse_cpus(bad)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_broker_and_worker_threads_all_run_on_the_cpus_named() -> None:
    cpu = str(max(os.sched_getaffinity(0)))
    with LocalMesh(
        cpu_workers=1,
        memory_budget="16MiB",
        broker_args=["--cpus", cpu],
        worker_args=["--cpus", cpu],
        **FAST,
    ) as mesh:
        with mesh.client() as c:
            c.deploy("m", "flowmesh.examples:mlp", kwargs={"width": 8, "depth": 1}, seed=0)
            x = torch.randn(2, 8)
            assert c.infer("m", x).shape == (2, 8)
        for child in mesh.children:
            if child.name == "partitioner":
                continue
            threads = thread_cpus(child.proc.pid)
            # The event loop, ZeroMQ's I/O and reaper threads, the copy and compute lanes.
            assert len(threads) >= 3, (child.name, threads)
            assert set(threads.values()) == {cpu}, (child.name, threads)
