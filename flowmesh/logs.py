"""Structured, one-line logs: `time level service event key=value ...`, greppable and parseable."""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any


def setup(service: str, level: str | None = None) -> logging.Logger:
    level = level or os.environ.get("FLOWMESH_LOG", "INFO")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    return logging.getLogger(service)


class LogThrottle:
    """At most `burst` log lines per `period` seconds through it; the rest are counted and said
    in one line when the next period's first line comes, so that a flood of bad messages cannot
    turn into a flood of log lines. Not locked: a thread racing the loop through it may let a
    line more or fewer through, never a flood."""

    def __init__(
        self,
        log: logging.Logger,
        burst: int = 20,
        period: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log, self.burst, self.period, self.clock = log, burst, period, clock
        self.window = -math.inf
        self.count = 0
        self.suppressed = 0

    def allow(self) -> bool:
        now = self.clock()
        if now - self.window >= self.period:
            if self.suppressed:
                self.log.warning("%d more line(s) like these not logged", self.suppressed)
            self.window, self.count, self.suppressed = now, 0, 0
        self.count += 1
        if self.count > self.burst:
            self.suppressed += 1
            return False
        return True

    def warning(self, msg: str, *args: Any, **kw: Any) -> None:
        if self.allow():
            self.log.warning(msg, *args, stacklevel=2, **kw)  # the caller's line

    def error(self, msg: str, *args: Any, **kw: Any) -> None:
        if self.allow():
            self.log.error(msg, *args, stacklevel=2, **kw)

    def exception(self, msg: str, *args: Any, **kw: Any) -> None:
        if self.allow():
            self.log.exception(msg, *args, stacklevel=2, **kw)
