"""The reader's batched fast path (`transport.pump`): every queued message is read, in order,
without a loop turn per message; an empty socket sleeps until input arrives, including input whose
FD edge a send from another task consumed; a flood still lets other tasks run."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgpack
import zmq
import zmq.asyncio

from flowmesh import protocol as p
from flowmesh import transport
from flowmesh.errors import Code, FlowmeshError
from tests.support.reports import broker_status
from tests.support.waiting import until

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
        await until(lambda: len(seen) == 1000, "the burst")
        assert seen == list(range(1, 1001))
        # The reader found the socket empty and sleeps until its FD fires.
        await until(lambda: transport._CHANNELS[router].idle, "the reader asleep")
        await dealer.send_multipart(p.encode(p.Status(id=5000)))
        await until(lambda: seen[-1] == 5000, "the message sent to the sleeping reader")
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
        transport.send(front, p.StatusReply(id=msg.id, status=broker_status()), [who.pop(msg.id)])

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
        await until(lambda: handled == 20_000, "the flood")
        # The ticker ran while the flood was being read, not only before and after it.
        assert len({n for n in ticks_during if 0 < n < 20_000}) > 10
    finally:
        await _stop(tick)
        await _stop(task)
        router.close(0)
        dealer.close(0)
        ctx.term()


async def test_each_member_of_a_bundle_is_handled_alone_and_in_order() -> None:
    """A bundle's members reach the handler one by one, in order; a member that cannot be
    decoded, one the handler refuses and a bundle inside the bundle are each answered with
    their own error, and the members after them are still handled. A coroutine handler's
    member is done before the next one starts, as for messages sent alone."""
    ctx = zmq.asyncio.Context()
    router, ep = transport.bind_router(ctx, "inproc://batch-bundle")
    dealer = transport.connect_dealer(ctx, ep)
    events: list[str] = []

    async def handle(_a: bytes | None, msg: p.Message) -> None:
        assert isinstance(msg, p.Status)
        if msg.id == 4:
            raise FlowmeshError(Code.BAD_REQUEST, "not this one")
        events.append(f"start {msg.id}")
        await asyncio.sleep(0.01)  # slow work, not a wait: the next member waits for this one
        events.append(f"end {msg.id}")

    task = asyncio.create_task(transport.pump(router, handle, routed=True, log=LOG))
    try:
        members = [
            p.encode(p.Status(id=1)),
            # An unknown field: refused, answered with its id.
            [msgpack.packb({"v": p.PROTOCOL_VERSION, "t": "status", "id": 2, "oops": 1})],
            p.encode(p.Status(id=3)),
            p.encode(p.Status(id=4)),  # the handler refuses it
            p.encode(p.Bundle(members=[p.encode(p.Status(id=5))])),
            p.encode(p.Status(id=6)),
        ]
        await dealer.send_multipart(p.encode(p.Bundle(members=members)))
        errors = []
        for _ in range(3):
            reply = p.decode(await asyncio.wait_for(dealer.recv_multipart(), 5))
            assert isinstance(reply, p.Error)
            errors.append((reply.id, reply.code))
        assert errors == [
            (2, str(Code.BAD_MESSAGE)),
            (4, str(Code.BAD_REQUEST)),
            (None, str(Code.BAD_MESSAGE)),  # the inner bundle: no id to answer
        ]
        await until(lambda: len(events) == 6, "every member handled")
        assert events == ["start 1", "end 1", "start 3", "end 3", "start 6", "end 6"]
    finally:
        await _stop(task)
        router.close(0)
        dealer.close(0)
        ctx.term()


async def test_send_bundled_says_which_messages_did_not_go() -> None:
    """Messages to one peer go in bundles; one that cannot be encoded is reported alone and the
    others still go; to a peer that is not connected, every message is reported, none raised."""
    ctx = zmq.asyncio.Context()
    router, ep = transport.bind_router(ctx, "inproc://batch-bundled-send")
    dealer = transport.connect_dealer(ctx, ep, identity="d")
    try:
        await dealer.send_multipart(p.encode(p.Status(id=0)))  # the router learns our address
        await asyncio.wait_for(router.recv_multipart(), 5)
        good = [p.StatusReply(id=i, status=broker_status(uptime_s=i)) for i in range(1, 5)]
        bad = p.StatusReply(id=99, status=broker_status(uptime_s=object()))  # cannot be packed
        failed = transport.send_bundled(router, [*good[:2], bad, *good[2:]], [b"d"])
        assert [([m.id for m in msgs], type(exc)) for msgs, exc in failed] == [([99], TypeError)]
        got = p.decode(await asyncio.wait_for(dealer.recv_multipart(), 5))
        assert isinstance(got, p.Bundle)
        assert [p.decode_member(m).id for m in got.members] == [1, 2, 3, 4]  # type: ignore[attr-defined]
        failed = transport.send_bundled(router, good, [b"nobody"])
        assert [([m.id for m in msgs], type(exc)) for msgs, exc in failed] == [
            ([1, 2, 3, 4], transport.PeerGone)
        ]
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()


async def test_a_coroutine_handler_finishes_one_message_before_the_next_is_read() -> None:
    """The reader reads in the FD's callback; a message whose handler is a coroutine is
    awaited before the reader takes the next one, however many are queued, and a failing
    coroutine is answered while the messages after it still come."""
    ctx = zmq.asyncio.Context()
    router, ep = transport.bind_router(ctx, "inproc://batch-coroutine")
    dealer = transport.connect_dealer(ctx, ep)
    events: list[str] = []

    async def handle(_a: bytes | None, msg: p.Message) -> None:
        assert isinstance(msg, p.Status)
        events.append(f"start {msg.id}")
        await asyncio.sleep(0.005)  # slow work, not a wait: the reader must not read on
        if msg.id == 2:
            raise FlowmeshError(Code.BAD_REQUEST, "not this one")
        events.append(f"end {msg.id}")

    for i in (1, 2, 3):  # all queued before the reader starts
        await dealer.send_multipart(p.encode(p.Status(id=i)))
    task = asyncio.create_task(transport.pump(router, handle, routed=True, log=LOG))
    try:
        reply = p.decode(await asyncio.wait_for(dealer.recv_multipart(), 5))
        assert isinstance(reply, p.Error) and reply.id == 2
        await until(lambda: len(events) == 5, "every message handled")
        assert events == ["start 1", "end 1", "start 2", "start 3", "end 3"]
        assert not task.done()  # a failed message never ends the reader
    finally:
        await _stop(task)
        router.close(0)
        dealer.close(0)
        ctx.term()
