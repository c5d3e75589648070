"""Waiting on a condition in async tests: polled, with a timeout that says what was awaited."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(probe: Callable[[], object], what: str, timeout: float = 60.0) -> None:
    """Return once `probe()` is true; fail after `timeout` seconds naming `what`."""
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.005)
