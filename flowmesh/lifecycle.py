"""Children of a launcher (`flowmesh up`, the tests) stop when the launcher dies.

The launcher starts each child in its own session (so a terminal's Ctrl-C reaches only the
launcher, which then stops the children in order). If the launcher is killed outright it cannot
do that; each child then notices that its parent changed and stops by itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

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


async def run_until_stopped(
    tasks: list[asyncio.Task[object]], stop: asyncio.Event, log: logging.Logger
) -> None:
    """Run a process's tasks until SIGINT/SIGTERM, the launcher's death, or one task failing.

    Also pings the systemd watchdog from the event loop when systemd asked for one, so a loop
    that stops turning gets the process restarted.
    """
    import contextlib
    import signal

    from flowmesh.sdnotify import watchdog_interval

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
    for task in (*tasks, *helpers, stopped):
        task.cancel()
    for task in done:
        if task is not stopped and not task.cancelled() and task.exception():
            log.error("stopping on error: %r", task.exception())
