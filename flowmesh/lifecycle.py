"""Children of a launcher (`flowmesh up`, the tests) stop when the launcher dies.

The launcher starts each child in its own session (so a terminal's Ctrl-C reaches only the
launcher, which then stops the children in order). If the launcher is killed outright it cannot
do that; each child then notices that its parent changed and stops by itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any, NoReturn

PARENT_ENV = "FLOWMESH_PARENT_PID"
log = logging.getLogger("flowmesh.lifecycle")


async def stop_with_parent(stop: Callable[[], None], interval: float = 1.0) -> None:
    """Call `stop` once the launcher named in $FLOWMESH_PARENT_PID is no longer our parent."""
    parent = os.environ.get(PARENT_ENV, "")
    if not parent.isdigit():
        return
    while os.getppid() == int(parent):
        await asyncio.sleep(interval)
    log.warning("launcher %s is gone; stopping", parent)
    stop()


async def _watchdog(interval: float) -> None:
    from flowmesh.sdnotify import notify

    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval)


# Why the process stopped: set by `run_until_stopped` when a task failed, read by `exit_status`
# once the event loop is gone (the services' `serve()` return nothing a `main()` could read).
_failure: list[str] = []


def exit_status() -> int:
    """The process's exit status: 1 when it stopped because a task failed, else 0. A stop asked
    for (SIGINT, SIGTERM, the launcher's death) is a success, so systemd's Restart=on-failure
    restarts exactly the processes that broke."""
    return 1 if _failure else 0


def run_process(main: Coroutine[Any, Any, object]) -> NoReturn:
    """Run a process's `serve()` on uvloop and exit with `exit_status()`."""
    import uvloop

    uvloop.run(main)
    sys.exit(exit_status())


async def run_until_stopped(
    tasks: list[asyncio.Task[object]], stop: asyncio.Event, log: logging.Logger
) -> bool:
    """Run a process's tasks until SIGINT/SIGTERM, the launcher's death, or one task failing
    (or ending, which they never should). Returns True when it stopped because a task did.

    Also pings the systemd watchdog from the event loop when systemd asked for one, so a loop
    that stops turning gets the process restarted, and tells systemd STOPPING=1 once stopping.
    """
    import contextlib
    import signal

    from flowmesh.sdnotify import notify, watchdog_interval

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    helpers = [asyncio.create_task(stop_with_parent(stop.set))]
    interval = watchdog_interval()
    if interval:
        helpers.append(asyncio.create_task(_watchdog(interval)))
    stopped = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({*tasks, stopped}, return_when=asyncio.FIRST_COMPLETED)
    notify("STOPPING=1")  # systemd: shutting down (a stop asked for, or a failure)
    for task in (*tasks, *helpers, stopped):
        task.cancel()
    failed = False
    if stopped not in done:  # tasks end only when stopped; anything else is a failure
        for task in done:
            exc = None if task.cancelled() else task.exception()
            reason = repr(exc) if exc is not None else "ended unexpectedly"
            log.error("stopping on error: task %s %s", task.get_name(), reason, exc_info=exc)
            _failure.append(reason)
            failed = True
    return failed
