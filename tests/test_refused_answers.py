"""A peer's answer that the codec refuses fails the call it answers at once, not at its deadline.

The codec reads the refused header's type and id (and nothing else of it); the reader hands them
to `on_refused`, and the broker's backend fails the call when it made it to that very peer.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from broker.core import BrokerConfig
from broker.service import BrokerService
from flowmesh import protocol as p
from flowmesh.errors import Code
from tests.support.waiting import until

MIB = 1 << 20
BAD_PLAN = {"range_bytes": ["lots"]}


def header(**fields: object) -> bytes:
    return msgpack.packb({"v": p.PROTOCOL_VERSION, **fields})


@pytest.mark.parametrize(
    ("frames", "ref", "kind"),
    [
        ([header(t="plan_reply", id=7, plan=BAD_PLAN)], 7, "plan_reply"),  # in the payload
        ([header(t="status", id=4), b"extra"], 4, "status"),  # after the header decoded
        ([header(t="warp_drive", id=5)], 5, None),  # no such type: nothing to answer
        ([header(t="plan_reply", id=True, plan=BAD_PLAN)], None, "plan_reply"),
        ([b"\xc1 not msgpack"], None, None),
    ],
)
def test_a_refusal_names_the_type_and_id_its_header_carried(
    frames: list[Any], ref: int | None, kind: str | None
) -> None:
    with pytest.raises(p.DecodeError) as info:
        p.decode(frames)
    assert (info.value.ref, info.value.type) == (ref, kind)


async def recv_until(sock: zmq.asyncio.Socket, cls: type[p.Message]) -> Any:
    while True:
        msg = p.decode(await asyncio.wait_for(sock.recv_multipart(copy=False), 30))
        if isinstance(msg, cls):
            return msg


async def test_a_refused_plan_fails_the_deploy_at_once_through_the_real_sockets() -> None:
    # Heartbeats far apart: these peers send one only, and must not be lost while it runs.
    cfg = BrokerConfig(heartbeat_s=60.0)
    svc = BrokerService(cfg, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    serving = asyncio.create_task(svc.serve())
    ctx = zmq.asyncio.Context()
    socks: list[zmq.asyncio.Socket] = []

    def dealer(endpoint: str) -> zmq.asyncio.Socket:
        s = ctx.socket(zmq.DEALER)
        s.connect(endpoint)
        socks.append(s)
        return s

    try:
        await until(lambda: len(svc.socks) == 2, "the broker's sockets")
        front, back = (s.getsockopt_string(zmq.LAST_ENDPOINT) for s in svc.socks.values())
        part, worker, client = dealer(back), dealer(back), dealer(front)
        await part.send_multipart(
            p.encode(p.Register(id=1, role="partitioner", name="p0", pid=2))
        )
        await part.send_multipart(p.encode(p.Heartbeat()))
        reg = p.Register(
            id=1, role="worker", name="w0", pid=3, device="cpu", kind="cpu", budget_bytes=MIB
        )
        await worker.send_multipart(p.encode(reg))
        await worker.send_multipart(p.encode(p.Heartbeat()))
        # The deploy comes on the other socket: it must not overtake the registrations.
        peers = svc.core.peers
        await until(lambda: all(n in peers and peers[n].ready for n in ("p0", "w0")), "peers")
        spec = {"name": "m", "factory": "flowmesh.examples:mlp", "seed": 0}
        # A deadline far past the test's: an answer that is not TIMEOUT came at once.
        await client.send_multipart(p.encode(p.Deploy(id=9, spec=spec, timeout_ms=600_000)))
        job = await recv_until(part, p.PlanJob)
        await part.send_multipart([header(t="plan_reply", id=job.id, plan=BAD_PLAN)])
        told = await recv_until(part, p.Error)  # the sender is answered, as for any refusal
        assert told.id == job.id and told.code == Code.BAD_REQUEST
        err = await recv_until(client, p.Error)
        assert err.id == 9 and err.code == Code.BAD_REQUEST
        assert "p0's answer was refused" in err.reason and "$.plan.range_bytes" in err.reason
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()
        svc._stop.set()
        await serving
