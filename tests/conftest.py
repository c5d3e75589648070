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

import faulthandler
import os
import sys

import pytest
import torch

# The longest a whole run may take (it takes under 10 minutes on two cores): past it, the run's
# main process prints its threads' stacks and ends, its xdist workers with it, rather than CI
# waiting out its own limit. A test's own hang is ended sooner, in its worker (pyproject.toml:
# pytest-timeout, then faulthandler_timeout); this is for one outside any test.
# FLOWMESH_TEST_RUN_LIMIT_S sets another (0: none).
RUN_LIMIT_S = float(os.environ.get("FLOWMESH_TEST_RUN_LIMIT_S") or 2400)


def pytest_configure(config: pytest.Config) -> None:
    if _watched(config):
        # xdist's controller, which runs no test itself: pytest's own faulthandler_timeout,
        # armed around each test in the process that runs it, would replace this one.
        faulthandler.dump_traceback_later(RUN_LIMIT_S, exit=True, file=sys.__stderr__)
    from tests.support import prefork

    if prefork.enabled():
        from client_sdk.mesh import set_launcher

        set_launcher(prefork.launcher)
    threads = os.environ.get("FLOWMESH_TEST_THREADS")
    if threads:
        torch.set_num_threads(int(threads))


def pytest_unconfigure(config: pytest.Config) -> None:
    if _watched(config):
        faulthandler.cancel_dump_traceback_later()


def _watched(config: pytest.Config) -> bool:
    """Whether this process is the controller of an xdist run, under a run limit."""
    workers = config.getoption("numprocesses", None)
    return RUN_LIMIT_S > 0 and bool(workers) and not hasattr(config, "workerinput")


def pytest_enter_pdb(config: pytest.Config) -> None:
    faulthandler.cancel_dump_traceback_later()  # a person is debugging: no limit


def pytest_report_header(config: pytest.Config) -> str:
    capability = torch.backends.cpu.get_cpu_capability()
    return f"torch {torch.__version__}: {torch.get_num_threads()} threads, CPU code {capability}"
