"""Suite-wide settings.

`FLOWMESH_TEST_THREADS=N` sets torch's intra-op threads in the test process, so that the suite
can be run under the thread counts that change how reductions are split (the exactness rule of
flowmesh/testing.py says results must not depend on it). Workers and other children take their
own `threads_per_worker`; `ATEN_CPU_CAPABILITY`, set for the run, reaches them through the
environment they inherit.

The meshes' worker, partitioner and gateway processes are forked from one server that imported
torch once (tests/support/prefork.py); `FLOWMESH_TEST_PREFORK=0` execs each instead.
"""

from __future__ import annotations

import os

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    from tests.support import prefork

    if prefork.enabled():
        from client_sdk.mesh import set_launcher

        set_launcher(prefork.launcher)
    threads = os.environ.get("FLOWMESH_TEST_THREADS")
    if threads:
        torch.set_num_threads(int(threads))


def pytest_report_header(config: pytest.Config) -> str:
    capability = torch.backends.cpu.get_cpu_capability()
    return f"torch {torch.__version__}: {torch.get_num_threads()} threads, CPU code {capability}"
