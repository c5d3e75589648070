"""DirectRuns alone: which Hops a worker takes for the direct runs the broker announced."""

from __future__ import annotations

import asyncio

import pytest

from flowmesh import protocol as p
from flowmesh.auth import PEERS_DOMAIN, PeerKeys
from flowmesh.errors import Code, FlowmeshError
from gpu_worker.direct import DirectRuns


def run(
    run_id: int = 7, stage: int = 1, chunks: int = 2, ticket: int = 99, from_key: str = ""
) -> p.Run:
    return p.Run(
        id=run_id,
        model="m",
        stage=stage,
        parts=[[1, 4]],
        ticket=ticket,
        from_peer=True,
        chunks=chunks,
        from_key=from_key,
    )


def hop(run_id: int = 7, chunk: int = 0, ticket: int = 99, stage: int = 1) -> p.Hop:
    return p.Hop(id=run_id, ticket=ticket, model="m", stage=stage, chunk=chunk)


def test_hops_of_an_announced_run_are_taken_once_each_with_its_ticket() -> None:
    d = DirectRuns()
    state, early = d.announce(run())
    assert early == []
    assert d.accept(hop(chunk=0)) is state
    for bad in (hop(chunk=0), hop(chunk=1, ticket=98), hop(chunk=2), hop(chunk=1, stage=2)):
        with pytest.raises(FlowmeshError) as err:  # again, forged, out of range, wrong stage
            d.accept(bad)
        assert err.value.code is Code.FORBIDDEN
    assert d.accept(hop(chunk=1)) is state
    assert not d.finished(state) and d.finished(state)  # two chunks computed: forgotten
    assert d.runs == {}


def test_a_hop_before_its_run_waits_and_a_forged_one_is_dropped_then() -> None:
    d = DirectRuns()
    assert d.accept(hop(chunk=1)) is None
    assert d.accept(hop(chunk=0, ticket=1)) is None  # cannot be checked yet: kept
    _, early = d.announce(run())
    assert [h.chunk for h in early] == [1]  # the forged one did not pass
    with pytest.raises(FlowmeshError):
        d.announce(run())  # announced twice


def test_hops_of_a_cancelled_run_are_dropped_and_early_ones_are_bounded() -> None:
    d = DirectRuns(max_early=2, early_ttl_s=1.0)
    d.announce(run())
    d.cancel(7)
    assert d.accept(hop()) is None and d.counters["hops_dropped"] == 1 and d.runs == {}
    d.accept(hop(run_id=1), now=0.0)
    d.accept(hop(run_id=2), now=0.0)
    d.accept(hop(run_id=3), now=0.5)  # over the bound: the oldest goes
    assert d.announce(run(run_id=1))[1] == []
    d.accept(hop(run_id=4), now=5.0)  # past the time limit: run 2's and 3's go
    assert d.announce(run(run_id=2))[1] == [] and d.announce(run(run_id=3))[1] == []
    assert [h.id for h in d.announce(run(run_id=4))[1]] == [4]


def test_under_keys_only_the_announced_previous_worker_s_hops_are_taken() -> None:
    d = DirectRuns()
    assert d.accept(hop(chunk=1), sender="mallory") is None  # early: kept, checked later
    state, early = d.announce(run(from_key="alice"))
    assert early == [] and d.counters["hops_dropped"] == 1
    for sender in ("mallory", ""):
        with pytest.raises(FlowmeshError) as err:
            d.accept(hop(chunk=0), sender=sender)
        assert err.value.code is Code.FORBIDDEN
    assert d.accept(hop(chunk=0), sender="alice") is state


async def test_a_peer_key_is_let_in_once_a_run_names_it_and_refused_otherwise() -> None:
    keys = PeerKeys(wait_s=0.2)
    assert not await keys.callback(PEERS_DOMAIN, b"mallory")  # named by no run: refused
    assert keys.refused == 1
    waiting = asyncio.create_task(keys.callback(PEERS_DOMAIN, b"alice"))
    await asyncio.sleep(0)
    keys.allow("alice")  # the Run naming it came while its handshake waited
    assert await waiting
    assert not await keys.callback("another-domain", b"alice")
