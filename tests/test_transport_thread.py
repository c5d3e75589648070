"""A socket read by a thread of its own (`transport.read_frames_on_thread`, through `pump`): the
thread handles what `here` takes, the loop the rest, every message once and in arrival order;
the thread wakes for input whoever sent meanwhile; it ends without leaving anything behind."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest
import zmq
import zmq.asyncio

from flowmesh import protocol as p
from flowmesh import transport
from tests.support.waiting import until

LOG = logging.getLogger("test.reader-thread")


class Pair:
    """A ROUTER (the broker's side) and a DEALER read by a reader thread (the worker's side)."""

    def __init__(
        self,
        here: Callable[[list[Any]], bool],
        init: Any = None,
        on_loop: Any = None,
        inproc: bool = False,
    ) -> None:
        self.ctx = zmq.asyncio.Context()
        endpoint = f"inproc://reader-{id(self)}" if inproc else "tcp://127.0.0.1:0"
        self.router, ep = transport.bind_router(self.ctx, endpoint, hwm=100_000)
        self.dealer = transport.connect_dealer(self.ctx, ep, identity="w", hwm=100_000)
        self.on_loop: list[int] = []
        self.lock = threading.Lock()
        self.order: list[int] = []  # ids as they were handled, on either side

        def handle(_a: bytes | None, msg: p.Message) -> None:
            assert isinstance(msg, p.Status)
            with self.lock:
                self.order.append(msg.id)
            self.on_loop.append(msg.id)

        self.task = asyncio.create_task(
            transport.pump(
                self.dealer, on_loop or handle, routed=False, log=LOG, here=here, init=init
            )
        )

    def handled(self, ident: int) -> None:
        with self.lock:
            self.order.append(ident)

    async def joined(self) -> None:
        """The dealer's connection is up: the router can address it."""
        await self.dealer.send_multipart(p.encode(p.Heartbeat()))
        await asyncio.wait_for(self.router.recv_multipart(), 10)

    async def send(self, ident: int) -> None:
        await self.router.send_multipart([b"w", *p.encode(p.Status(id=ident))])

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.router.close(0)
        self.dealer.close(0)
        self.ctx.term()


async def test_the_thread_takes_what_here_accepts_the_loop_the_rest_in_arrival_order() -> None:
    loop_thread = threading.get_ident()
    took: list[int] = []
    threads: set[int] = set()
    pair: Pair

    def here(frames: list[Any]) -> bool:
        msg = p.decode(frames)
        assert isinstance(msg, p.Status)
        if msg.id % 2:
            return False  # odd: the loop's
        threads.add(threading.get_ident())
        took.append(msg.id)
        pair.handled(msg.id)
        return True

    pair = Pair(here)
    try:
        await pair.joined()
        # One at a time: each even one finds the loop done with everything before it.
        for i in range(1, 41):
            await pair.send(i)
            await until(lambda i=i: len(pair.order) == i, f"message {i}")
        assert took == list(range(2, 41, 2)) and pair.on_loop == list(range(1, 41, 2))
        assert threads and loop_thread not in threads
        # A burst queued at once: the odd ones go to the loop in batches, and an even one after
        # them is not taken on the thread before the loop has handled them.
        for i in range(41, 1041):
            await pair.send(i)
        await until(lambda: len(pair.order) == 1040, "the burst")
        assert pair.order == list(range(1, 1041))
    finally:
        await pair.close()


@pytest.mark.parametrize("sender", ["loop", "thread"])
async def test_a_send_that_takes_the_fd_edge_still_wakes_the_reader(
    sender: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """libzmq's FD is edge-triggered and any use of the socket may take the edge of input that
    arrived meanwhile. Here a message arrives after the reader thread found the socket empty
    and before it sleeps, and a send from the loop or from another thread takes its edge: the
    reader must still wake for it (not a second later, at its closed-socket check)."""
    in_window, go = threading.Event(), threading.Event()
    real_wait = transport._wait_for_input
    woke: list[bool] = []  # each sleep after `go`: ended by an FD (True) or its timeout (False)

    class Recorded:
        def __init__(self, poller: Any) -> None:
            self.poller = poller

        def poll(self, timeout_ms: float) -> list[tuple[int, int]]:
            events = self.poller.poll(timeout_ms)
            woke.append(bool(events))
            return events

    def wait(poller: Any, wake_r: int) -> None:
        if not go.is_set():
            in_window.set()  # found the socket empty, about to sleep
            assert go.wait(10)
        real_wait(Recorded(poller), wake_r)

    monkeypatch.setattr(transport, "_wait_for_input", wait)
    took: list[int] = []

    def here(frames: list[Any]) -> bool:
        took.append(p.decode(frames).id)  # type: ignore[attr-defined]
        return True

    pair = Pair(here, inproc=True)
    try:
        assert await asyncio.to_thread(in_window.wait, 10)
        await pair.send(7)  # inproc: in the dealer's queue once this returns
        reply = p.encode(p.Heartbeat())
        if sender == "loop":
            transport.send_frames(pair.dealer, reply)
        else:
            await asyncio.to_thread(transport.send_from_thread, pair.dealer, reply)
        go.set()
        await until(lambda: took == [7], "the message")
        # Woken by its socket or its pipe, not found at the closed-socket check a second later.
        assert woke[0], woke
    finally:
        go.set()
        await pair.close()


def _reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "reader"]


async def test_the_reader_ends_with_its_task_and_leaves_nothing_behind(
    caplog: pytest.LogCaptureFixture,
) -> None:
    inits: list[int] = []
    seen_on: list[int] = []

    def here(frames: list[Any]) -> bool:
        seen_on.append(threading.get_ident())
        return True

    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    before = len(_reader_threads())
    pair = Pair(here, init=lambda: inits.append(threading.get_ident()))
    try:
        await pair.joined()
        await pair.send(1)
        await until(lambda: bool(seen_on), "the message")
        assert inits == seen_on  # set up first, on the thread that then reads
        assert len(_reader_threads()) == before + 1
    finally:
        await pair.close()
    await until(lambda: len(_reader_threads()) == before, "the reader thread to end")
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) <= fds  # its wake-up pipe is closed
    assert "never retrieved" not in caplog.text


async def test_a_message_here_fails_on_is_logged_and_the_next_ones_still_come(
    caplog: pytest.LogCaptureFixture,
) -> None:
    took: list[int] = []

    def here(frames: list[Any]) -> bool:
        msg = p.decode(frames)
        assert isinstance(msg, p.Status)
        if msg.id == 1:
            raise RuntimeError("here broke")
        took.append(msg.id)
        return True

    pair = Pair(here)
    try:
        await pair.joined()
        for i in (1, 2, 3):
            await pair.send(i)
        await until(lambda: took == [2, 3], "the messages after the failure")
    finally:
        await pair.close()
    assert "here broke" in caplog.text
    assert pair.on_loop == []  # a message `here` failed on is not handled twice
