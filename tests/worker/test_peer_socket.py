"""A worker's peer socket (direct runs' activations) against what anyone who reaches it sends:
Hops for runs never announced are bounded and expire on the worker's clock, and a flood of
garbage or errors writes few log lines. In-process: the worker's real socket and reader on
loopback, no broker."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio

import flowmesh.transport as transport
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.transport import connect_dealer, send
from gpu_worker.device import CpuStandIn
from gpu_worker.direct import DirectRuns
from gpu_worker.service import PEERS_KEPT, WorkerService
from tests.support.log_lines import Lines, captured_lines
from tests.support.waiting import until

MIB = 1 << 20


@pytest.fixture
def lines() -> Iterator[Lines]:
    with captured_lines() as handler:
        yield handler


@pytest.fixture
async def worker() -> Any:
    svc = WorkerService("w", "tcp://127.0.0.1:1", CpuStandIn(4 * MIB))
    svc.direct = DirectRuns(max_run_bytes=8 * MIB, max_early_bytes=16 * MIB, early_ttl_s=0.5)
    ctx = zmq.asyncio.Context()
    tasks = [asyncio.create_task(c) for c in svc.side_tasks(ctx)]
    yield svc, ctx
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    svc.close()
    ctx.destroy(linger=0)


def hop(run_id: int, chunk: int, nbytes: int = MIB) -> p.Hop:
    x = torch.zeros(nbytes // 4)
    return p.Hop(id=run_id, ticket=5, model="m", stage=1, chunk=chunk, tensors={"x": x})


async def test_early_hops_are_bounded_refused_with_an_error_and_expire_by_the_clock(
    worker: Any,
) -> None:
    svc, ctx = worker
    sender = connect_dealer(ctx, svc.peer_bound)
    try:
        # 100 Hops of 1 MiB for a run nobody announced (the attack: 100 of 8 MiB).
        for chunk in range(100):
            send(sender, hop(123, chunk))
            await until(lambda c=chunk: svc.direct.counters["hops_in"] > c, "the hops")
            assert svc.direct.early_bytes <= 8 * MIB
        answer = p.decode(await asyncio.wait_for(sender.recv_multipart(), 30))
        assert isinstance(answer, p.Error) and answer.code == Code.TOO_LARGE
        assert "run 123" in answer.reason and "8388608 bytes" in answer.reason
        assert svc.direct.early_bytes == 0
        # Within the bounds: kept, then dropped on the worker's clock with no Hop after them.
        for chunk in range(3):
            send(sender, hop(124, chunk))
        await until(lambda: svc.direct.counters["hops_in"] == 103, "every hop")
        assert svc.direct.early_bytes > 3 * MIB
        await until(lambda: svc.direct.early_bytes == 0, "the early hops to expire")
        run = p.Run(id=124, model="m", stage=1, parts=[[1, 4]], ticket=5, from_peer=True, chunks=3)
        with pytest.raises(FlowmeshError) as err:
            svc.direct.announce(run)
        assert err.value.code is Code.TIMEOUT
    finally:
        sender.close(linger=0)


async def test_a_flood_at_the_peer_socket_from_a_sender_that_leaves_writes_few_lines(
    worker: Any, lines: Lines, monkeypatch: pytest.MonkeyPatch
) -> None:
    svc, _ = worker
    flood = 5000
    handled = 0
    handle_one = transport.handle_one

    def counted(*args: Any, **kw: Any) -> Any:
        nonlocal handled
        handled += 1
        return handle_one(*args, **kw)

    monkeypatch.setattr(transport, "handle_one", counted)
    plain = zmq.Context()
    try:
        client = plain.socket(zmq.DEALER)
        client.connect(svc.peer_bound)
        lines.records.clear()
        t0 = time.monotonic()
        kinds = [
            [b"\xc1 garbage"],
            [bytes(f) for f in p.encode(p.Error(id=1, code="internal", reason="forged"))],
            [bytes(f) for f in p.encode(p.Status(id=1))],
        ]
        for i in range(flood):
            client.send_multipart(kinds[i % 3])
        client.close(linger=10_000)
        await asyncio.to_thread(plain.term)
        await until(lambda: handled >= flood, "the flood to be read")
        elapsed = time.monotonic() - t0
        logged = [r.getMessage() for r in lines.records]
    finally:
        plain.destroy(linger=0)
    assert handled == flood
    # Garbage is refused, a Status too, and an Error is logged. (Their answers find nobody
    # once the sender left, and say so unless the burst of lines went to the flood's first
    # messages, read while it was there: tests/test_log_flood.py tests that line on its own.)
    for said in ("rejected message", "refused status", "a peer answered"):
        assert any(said in line for line in logged), (said, logged[:5])
    # Two throttles: the peer socket's reader's and the worker's own.
    assert len(logged) <= 2 * 21 * (math.ceil(elapsed) + 1), (len(logged), elapsed, logged[:3])


async def test_sockets_to_peer_endpoints_are_kept_for_the_last_used_only(worker: Any) -> None:
    """A next-stage worker restarted binds another port: the socket to its old endpoint must
    not stay open (reconnecting for ever, holding what it queued) for the worker's life."""
    svc, _ = worker
    first = svc._peer("tcp://127.0.0.1:2", "", "run 1")
    ports = range(3, PEERS_KEPT + 2)
    opened = [svc._peer(f"tcp://127.0.0.1:{port}", "", "run 1") for port in ports]
    assert svc._peer("tcp://127.0.0.1:2", "", "run 1") is first  # kept, and used last now
    svc._peer("tcp://127.0.0.1:9999", "", "run 1")  # one more: the least recently used goes
    assert len(svc._to_peers) == PEERS_KEPT
    assert ("tcp://127.0.0.1:3", "") not in svc._to_peers and opened[0].closed
    assert not first.closed and ("tcp://127.0.0.1:2", "") in svc._to_peers
