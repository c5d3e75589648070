"""The reader's batched fast path (`transport.pump`): every queued message is read, in order,
without a loop turn per message; an empty socket sleeps until input arrives, including input whose
FD edge a send from another task consumed; a flood still lets other tasks run."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import zmq
import zmq.asyncio

from flowmesh import protocol as p
from flowmesh import transport

LOG = logging.getLogger("test.batching")


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_a_burst_is_read_in_order_and_the_reader_wakes_for_more() -> None:
    ctx = zmq.asyncio.Context()
    router, ep = transport.bind_router(ctx, "inproc://batch-burst", hwm=100_000)
    dealer = transport.connect_dealer(ctx, ep, hwm=100_000)
    seen: list[int] = []
    task = asyncio.create_task(
        transport.pump(router, lambda _a, m: seen.append(m.id), routed=True, log=LOG)
    )
    try:
        for i in range(1, 1001):  # queued before the reader runs: drained in batches
            await dealer.send_multipart(p.encode(p.Status(id=i)))
        for _ in range(200):
            if len(seen) == 1000:
                break
            await asyncio.sleep(0.01)
        assert seen == list(range(1, 1001))
        await asyncio.sleep(0.05)  # the reader is asleep on an empty socket now
        await dealer.send_multipart(p.encode(p.Status(id=5000)))
        for _ in range(200):
            if seen[-1] == 5000:
                break
            await asyncio.sleep(0.01)
        assert seen[-1] == 5000
    finally:
        await _stop(task)
        router.close(0)
        dealer.close(0)
        ctx.term()


async def test_a_send_from_elsewhere_never_hides_input_from_a_sleeping_reader() -> None:
    """Two pumped ROUTERs relaying to each other, as in the broker: each answer goes out from
    the other socket's reader. Every one of many sequential round trips must complete promptly
    (a lost FD edge would stall one until unrelated traffic arrived)."""
    ctx = zmq.asyncio.Context()
    front, ep1 = transport.bind_router(ctx, "tcp://127.0.0.1:0")
    back, ep2 = transport.bind_router(ctx, "tcp://127.0.0.1:0")
    worker = transport.connect_dealer(ctx, ep2, identity="w")
    client = transport.connect_dealer(ctx, ep1)
    who: dict[int, bytes] = {}

    def on_front(addr: bytes | None, msg: p.Message) -> None:
        assert addr is not None and isinstance(msg, p.Status)
        who[msg.id] = addr
        transport.send(back, msg, [b"w"])

    joined = asyncio.Event()

    def on_back(_addr: bytes | None, msg: p.Message) -> None:
        assert isinstance(msg, p.Status)
        if msg.id == 0:  # the worker's hello: its connection is up
            joined.set()
            return
        transport.send(front, p.StatusReply(id=msg.id, status={}), [who.pop(msg.id)])

    def on_worker(_addr: bytes | None, msg: p.Message) -> None:
        transport.send(worker, msg)

    tasks = [
        asyncio.create_task(transport.pump(front, on_front, routed=True, log=LOG)),
        asyncio.create_task(transport.pump(back, on_back, routed=True, log=LOG)),
        asyncio.create_task(transport.pump(worker, on_worker, routed=False, log=LOG)),
    ]
    try:
        await worker.send_multipart(p.encode(p.Status(id=0)))
        await asyncio.wait_for(joined.wait(), 10)
        for i in range(1, 301):
            await client.send_multipart(p.encode(p.Status(id=i)))
            reply = p.decode(await asyncio.wait_for(client.recv_multipart(), 2))
            assert isinstance(reply, p.StatusReply) and reply.id == i
    finally:
        for t in tasks:
            await _stop(t)
        for s in (front, back, worker, client):
            s.close(0)
        ctx.term()


async def test_a_flood_lets_other_tasks_run() -> None:
    ctx = zmq.asyncio.Context()
    router, ep = transport.bind_router(ctx, "inproc://batch-flood", hwm=100_000)
    dealer = transport.connect_dealer(ctx, ep, hwm=100_000)
    handled = 0
    ticks_during: list[int] = []

    def handle(_a: bytes | None, _m: p.Message) -> None:
        nonlocal handled
        handled += 1

    for i in range(1, 20_001):
        await dealer.send_multipart(p.encode(p.Status(id=i)))

    async def ticker() -> None:
        while True:
            ticks_during.append(handled)
            await asyncio.sleep(0)

    task = asyncio.create_task(transport.pump(router, handle, routed=True, log=LOG))
    tick = asyncio.create_task(ticker())
    try:
        for _ in range(1000):
            if handled == 20_000:
                break
            await asyncio.sleep(0.01)
        assert handled == 20_000
        # The ticker ran while the flood was being read, not only before and after it.
        assert len({n for n in ticks_during if 0 < n < 20_000}) > 10
    finally:
        await _stop(tick)
        await _stop(task)
        router.close(0)
        dealer.close(0)
        ctx.term()
