"""TorchLanes: calls run on the lanes' threads and settle their futures on the loop, errors
included; shutting down cancels what has not started, so no caller waits for ever."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading

import pytest

from flowmesh.threads import TorchLanes


async def test_results_and_errors_come_back_on_the_loop() -> None:
    lanes = TorchLanes(2, "t")
    loop = asyncio.get_running_loop()
    caller = threading.get_ident()
    try:
        total, ran_in = await lanes.submit(loop, lambda a, b: (a + b, threading.get_ident()), 2, 3)
        assert total == 5 and ran_in != caller
        got, ran_on = await lanes.submit(loop, lambda: (7, threading.current_thread().name))
        assert got == 7 and ran_on.startswith("t_")

        def boom() -> None:
            raise ValueError("from a lane")

        with pytest.raises(ValueError, match="from a lane"):
            await lanes.submit(loop, boom)
    finally:
        lanes.shutdown()


async def test_shutdown_cancels_calls_not_started_and_refuses_new_ones() -> None:
    lanes = TorchLanes(1, "t")
    loop = asyncio.get_running_loop()
    release = threading.Event()
    started = threading.Event()

    def hold() -> str:
        started.set()
        release.wait(10)
        return "held"

    running = lanes.submit(loop, hold)
    queued = [lanes.submit(loop, lambda: "never") for _ in range(3)]
    await asyncio.to_thread(started.wait, 10)
    lanes.shutdown(cancel_futures=True)
    release.set()
    assert await running == "held"  # the call under way finishes
    for fut in queued:
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(fut, 10)
    with pytest.raises(RuntimeError, match="shut down"):
        lanes.submit(loop, lambda: 1)


def test_the_interpreters_exit_joins_lanes_still_running_a_call() -> None:
    """A daemon lane thread alive when the interpreter finalizes is stopped wherever it next
    takes the GIL, within torch's C++ as likely as not, which aborts the process after its work
    is done. The exit joins them first: a check registered before the lanes' own (atexit runs
    last in, first out) finds none alive, with a call still running and the lanes never shut
    down, and the process exits 0."""
    script = textwrap.dedent(
        """
        import atexit, threading
        atexit.register(lambda: print("alive at exit:", sorted(
            t.name for t in threading.enumerate() if t.name.startswith("exit-lane"))))
        import asyncio, time
        from flowmesh.threads import TorchLanes
        lanes = TorchLanes(2, "exit-lane")
        lanes.submit(asyncio.new_event_loop(), time.sleep, 0.5)
        print("leaving")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["leaving", "alive at exit: []"], done.stdout


def test_the_exit_waits_for_busy_lanes_within_one_deadline_in_all() -> None:
    """Lanes whose calls never return hold the exit up `EXIT_JOIN_S` in all, not that much per
    thread (checked in a child interpreter with four threads stuck in a call and a deadline of
    1 s: the joins take about 1 s together, where a deadline per thread would take 4)."""
    script = textwrap.dedent(
        """
        import asyncio, threading, time
        from flowmesh import threads
        threads.EXIT_JOIN_S = 1.0
        stuck, entered = threading.Event(), threading.Semaphore(0)

        def call():
            entered.release()
            stuck.wait()

        lanes = [threads.TorchLanes(2, f"stuck-{i}") for i in range(2)]
        for ln in lanes:
            for _ in ln._threads:
                ln.submit(asyncio.new_event_loop(), call)
        for _ in range(4):
            entered.acquire()  # every thread is in its call
        t0 = time.monotonic()
        threads._join_at_exit()
        print(time.monotonic() - t0 < 2.5)
        stuck.set()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"], done.stdout
