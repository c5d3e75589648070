"""sd_notify without a dependency: readiness and watchdog pings for systemd `Type=notify`."""

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
    """Half the watchdog period systemd asked for (seconds), or None without a watchdog."""
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec or not usec.isdigit():
        return None
    return int(usec) / 2e6
