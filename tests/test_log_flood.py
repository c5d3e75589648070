"""A flood of garbage cannot become a flood of log lines (`flowmesh.logs.LogThrottle`).

The broker runs in-process on loopback (`BrokerService`, its real sockets and reader); a raw
client floods its frontend with malformed messages, requests it refuses and requests it answers,
then leaves, so that each answer to it fails as well. The core alone, on its own clock: errors a
worker sends for nothing asked, answers to a client that left, plan calls and training steps
that expire. Every line logged meanwhile is counted: at most a burst per throttle per period,
whatever the number of messages.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio

import flowmesh.transport as transport
from broker.core import CLIENT, BrokerConfig, BrokerCore
from broker.service import BrokerService
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.logs import LogThrottle
from flowmesh.spec import ModelSpec
from flowmesh.train_spec import TrainConfig
from tests.support.broker import opened_job
from tests.support.log_lines import Lines, captured_lines
from tests.support.waiting import until

FLOOD = 5000


@pytest.fixture
def lines() -> Iterator[Lines]:
    with captured_lines() as handler:
        yield handler


def garbage(i: int) -> list[bytes]:
    kind = i % 4
    if kind == 0:
        return [b"\xc1 not msgpack"]
    if kind == 1:
        return [p.encode(p.Status(id=i))[0][:5]]  # truncated
    if kind == 2:  # decodes; the broker refuses it (no such model)
        return [bytes(f) for f in p.encode(p.Infer(id=i, model=f"m{i}"))]
    return [bytes(f) for f in p.encode(p.Status(id=i))]  # answered: the answer finds nobody


def test_the_throttle_lets_a_burst_through_per_period_and_says_how_many_it_held() -> None:
    now = [0.0]
    log = logging.getLogger("test.throttle")
    seen = Lines()
    log.addHandler(seen)
    try:
        throttle = LogThrottle(log, burst=3, period=1.0, clock=lambda: now[0])
        for _ in range(1000):
            throttle.warning("bad message")
        now[0] = 1.0
        throttle.warning("bad message")
    finally:
        log.removeHandler(seen)
    assert [r.getMessage() for r in seen.records] == [
        *["bad message"] * 3,
        "997 more line(s) like these not logged",
        "bad message",
    ]


async def test_a_garbage_flood_from_a_client_that_leaves_writes_few_lines(
    lines: Lines, monkeypatch: pytest.MonkeyPatch
) -> None:
    handled = 0
    handle_one = transport.handle_one

    def counted(*args: Any, **kw: Any) -> Any:
        nonlocal handled
        handled += not kw.get("member")
        return handle_one(*args, **kw)

    monkeypatch.setattr(transport, "handle_one", counted)
    svc = BrokerService(BrokerConfig(), "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    serving = asyncio.create_task(svc.serve())
    await until(lambda: CLIENT in svc.socks, "the client socket")
    frontend = svc.socks[CLIENT].getsockopt_string(zmq.LAST_ENDPOINT)
    ctx = zmq.Context()
    try:
        lines.records.clear()
        t0 = time.monotonic()
        client = ctx.socket(zmq.DEALER)
        client.connect(frontend)
        # Sent from the loop's thread, so that all of it is queued before the broker reads any,
        # and most of it is read after the client has gone.
        for i in range(FLOOD):
            client.send_multipart(garbage(i))
        client.close(linger=10_000)
        await asyncio.to_thread(ctx.term)
        await until(lambda: handled >= FLOOD, "the flood to be read")
        elapsed = time.monotonic() - t0
        logged = [r.getMessage() for r in lines.records]
    finally:
        svc._stop.set()
        await serving
    assert handled == FLOOD
    # Each way a line comes per message was taken: refused, undeliverable. (Unanswerable too,
    # unless the burst of lines went to the flood's first messages, read while the client was
    # still there: that line's own test is the next one.)
    for said in ("rejected message", "refused infer", "could not send"):
        assert any(said in line for line in logged), (said, logged[:5])
    # Two throttles speak here, the frontend reader's and the core's: each lets 20 lines and
    # one summary through per second.
    bound = 2 * 21 * (math.ceil(elapsed) + 1)
    assert len(logged) <= bound, (len(logged), elapsed, logged[:3])


async def test_the_answer_to_a_sender_that_left_fails_in_one_throttled_line(
    lines: Lines,
) -> None:
    ctx = zmq.asyncio.Context()
    sock, _ = transport.bind_router(ctx, "tcp://127.0.0.1:0")
    log = logging.getLogger("flood-test")
    throttle = LogThrottle(log, burst=2, period=1.0, clock=lambda: 0.0)
    try:
        for _ in range(5):  # from a routing id no connection holds: the refusal cannot go out
            transport.handle_one(
                sock,
                [b"\x00gone", b"\xc1 garbage"],
                lambda *a: None,
                routed=True,
                log=log,
                throttle=throttle,
            )
    finally:
        sock.close(linger=0)
        ctx.destroy(linger=0)
    logged = [r.getMessage() for r in lines.records if r.name == "flood-test"]
    assert len(logged) == 2, logged
    assert logged[0].startswith("rejected message") and logged[1].startswith("could not answer")
    assert throttle.suppressed == 8  # the other 4 refusals and 4 failed answers


def flood_errors(core: BrokerCore) -> None:
    """Errors from a worker answering nothing the broker asked (late ones, or forged)."""
    register = p.Register(
        id=1, role="worker", name="w", pid=1, device="cpu", kind="cpu", budget_bytes=1 << 20
    )
    core.on_backend(b"w", register, 0.0)
    core.on_backend(b"w", p.Heartbeat(), 0.0)
    for i in range(FLOOD):
        core.on_backend(b"w", p.Error(id=10**9 + i, code="internal", reason="forged"), 0.0)


def flood_undelivered(core: BrokerCore) -> None:
    """Answers to a client that left."""
    gone = FlowmeshError(Code.UNAVAILABLE, "peer is not connected")
    for i in range(FLOOD):
        core.send_failed(CLIENT, b"client", p.StatusReply(id=i, status={}), gone, 0.0)
    assert core.totals["dropped_sends"] == FLOOD


def flood_expired_calls(core: BrokerCore) -> None:
    """Plans any client may ask for, which the partitioner never answers."""
    register = p.Register(id=1, role="partitioner", name="part", pid=1)
    core.on_backend(b"part", register, 0.0)
    core.on_backend(b"part", p.Heartbeat(), 0.0)
    for i in range(FLOOD):
        spec = ModelSpec(name="m", factory="flowmesh.examples:mlp", kwargs={"width": i + 1})
        core.on_client(b"client", p.PlanRequest(id=i, spec=spec, timeout_ms=1000), 0.0)
    core.tick(2.0)
    assert core.calls == {}


def flood_expired_steps(core: BrokerCore) -> None:
    """Training steps a client sends to a job whose worker never answers them."""
    info = p.PeerInfo(train_bytes=1 << 20)
    register = p.Register(
        id=1, role="worker", name="w", pid=1, device="cpu", kind="cpu", budget_bytes=1, info=info
    )
    core.on_backend(b"w", register, 0.0)
    core.on_backend(b"w", p.Heartbeat(), 0.0)
    spec = ModelSpec(name="j", factory="flowmesh.examples:mlp", seed=1)
    config = TrainConfig(optimizer={"name": "sgd"})
    core.on_client(b"client", p.TrainOpen(id=1, job="j", spec=spec, config=config, batch=4), 0.0)
    (opening,) = [m for _, _, m in core.drain() if isinstance(m, p.TrainOpen)]
    core.on_backend(b"w", p.JobOpened(id=opening.id, job=opened_job("j")), 0.0)
    tensors = {"inputs": torch.zeros(4, 8), "targets": torch.zeros(4, dtype=torch.int64)}
    for i in range(FLOOD):
        core.on_client(b"client", p.TrainStep(id=i, job="j", seq=i + 1, tensors=tensors), 0.0)
    core.on_backend(b"w", p.Heartbeat(), 100.0)
    core.tick(100.0)
    assert core.training.totals["train_expired"] == FLOOD


@pytest.mark.parametrize(
    ("flood", "said"),
    [
        (flood_errors, "error from w"),
        (flood_undelivered, "could not send status_reply"),
        (flood_expired_calls, "call expired kind=plan"),
        (flood_expired_steps, "training call expired"),
    ],
)
def test_what_a_peer_or_client_causes_per_message_in_the_core_is_throttled(
    lines: Lines, flood: Any, said: str
) -> None:
    core = BrokerCore(BrokerConfig(), now=0.0)
    lines.records.clear()
    t0 = time.monotonic()
    flood(core)
    elapsed = time.monotonic() - t0
    logged = [r.getMessage() for r in lines.records]
    assert any(said in line for line in logged), logged[:5]
    assert len(logged) <= 21 * (math.ceil(elapsed) + 1), (len(logged), elapsed, logged[:3])
