"""sd_notify without a dependency: readiness and watchdog pings for systemd `Type=notify`.

The protocol (sd_notify(3)): one datagram of newline-separated VAR=VALUE assignments sent to the
AF_UNIX socket named in $NOTIFY_SOCKET (a leading '@' names an abstract socket). The services
send READY=1 once serving (broker: bound; worker, partitioner: registered with the broker),
WATCHDOG=1 every half $WATCHDOG_USEC from their event loop, and STOPPING=1 when they stop.
"""

from __future__ import annotations

import contextlib
import os
import socket


def notify(state: str) -> None:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        s.sendall(state.encode())


def watchdog_interval() -> float | None:
    """Half the watchdog period systemd asked for (seconds), or None without a watchdog.

    As sd_watchdog_enabled(3): a watchdog set for another process (WATCHDOG_PID names a pid
    that is not ours, e.g. inherited by a child) is none of ours.
    """
    usec = os.environ.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid is not None and pid != str(os.getpid()):
        return None
    return int(usec) / 2e6
