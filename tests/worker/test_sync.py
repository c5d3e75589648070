"""The worker's thread primitives on their own: CPU markers and the serving calls' lock."""

from __future__ import annotations

import threading

from gpu_worker.device import CpuMarker
from gpu_worker.model_code import SharedLock
from tests.support.waiting import until_blocking


def test_a_marker_wakes_a_thread_that_waited_before_it_was_set() -> None:
    marker = CpuMarker()
    assert not marker.done() and not marker.wait(timeout=0.01)
    woke = threading.Event()

    def waiter() -> None:
        marker.order_current()
        woke.set()

    threads = [threading.Thread(target=waiter, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    until_blocking(lambda: marker._event is not None, "a waiter in its wait")
    assert not woke.is_set()
    marker.set()
    for t in threads:
        t.join(timeout=5)
        assert not t.is_alive(), "a waiter was not woken by set()"
    assert marker.done() and marker.wait(timeout=0)
    assert CpuMarker(done=True).wait(timeout=0)


def test_an_exclusive_holder_gets_in_when_the_last_shared_one_leaves() -> None:
    lock = SharedLock()
    order: list[str] = []
    lock.acquire_shared()
    lock.acquire_shared()

    def exclusive() -> None:
        with lock.exclusive():
            order.append("exclusive")

    t = threading.Thread(target=exclusive, daemon=True)
    t.start()
    until_blocking(lambda: lock._waiting == 1, "the exclusive holder to wait for the shared")
    # A new shared holder queues behind the waiting exclusive one (it must not starve).
    late = threading.Thread(
        target=lambda: (lock.acquire_shared(), order.append("late")), daemon=True
    )
    late.start()
    assert order == []
    lock.release_shared()
    # One shared holder is still in: the exclusive one still waits, and nothing woke it.
    assert lock._shared == 1 and lock._waiting == 1 and lock._owner is None
    assert order == []
    lock.release_shared()
    t.join(timeout=5)
    late.join(timeout=5)
    assert not t.is_alive() and not late.is_alive(), "a waiter was never woken"
    assert order == ["exclusive", "late"]
    lock.release_shared()
