"""Waiting on a condition: polled, with a timeout that says what was awaited.

The one way the tests wait for something another task, thread or process does: on the real
condition, never for a fixed time. `until` is for async tests (it yields to the loop between
polls); `until_blocking` is for a thread that may block, as a test of thread primitives is;
`within_turns` is for a test where everything runs on its own loop and no timer may fire.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

POLL_S = 0.005


class _Deadline:
    def __init__(self, what: str, timeout: float) -> None:
        self.what, self.timeout = what, timeout
        self.at = time.monotonic() + timeout

    def check(self) -> None:
        if time.monotonic() > self.at:
            raise AssertionError(f"timed out after {self.timeout:.0f} s waiting for {self.what}")


async def until(
    probe: Callable[[], object | Awaitable[object]],
    what: str,
    timeout: float = 60.0,
    poll: float = POLL_S,
) -> None:
    """Return once `probe()` is true (awaited, if it is a coroutine function's), polled every
    `poll` seconds (longer for a probe that costs its other party work: a status call, a
    database query); fail after `timeout` seconds naming `what`."""
    deadline = _Deadline(what, timeout)
    while not await _value(probe()):
        deadline.check()
        await asyncio.sleep(poll)


async def _value(got: object) -> object:
    return await got if inspect.isawaitable(got) else got


def until_blocking(
    probe: Callable[[], object], what: str, timeout: float = 60.0, poll: float = POLL_S
) -> None:
    """`until` for a caller without an event loop: blocks this thread between polls."""
    deadline = _Deadline(what, timeout)
    while not probe():
        deadline.check()
        time.sleep(poll)


async def within_turns(probe: Callable[[], object], what: str, turns: int = 1000) -> None:
    """Return once `probe()` is true, counting loop turns, not time: the loop's timers do not
    come due meanwhile (a test whose only other party is this loop's own tasks)."""
    for _ in range(turns):
        if probe():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"not after {turns} loop turns: {what}")
