"""DirectRuns alone: which Hops a worker takes for the direct runs the broker announced."""

from __future__ import annotations

import asyncio

import pytest
import torch

from flowmesh import protocol as p
from flowmesh.auth import PEERS_DOMAIN, PeerKeys
from flowmesh.errors import Code, FlowmeshError
from gpu_worker.direct import DirectRuns

MIB = 1 << 20


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


def refused(d: DirectRuns, msg: p.Run) -> FlowmeshError:
    with pytest.raises(FlowmeshError) as err:
        d.announce(msg)
    assert msg.id not in d.runs
    return err.value


def test_hops_of_a_cancelled_run_are_dropped_and_early_ones_are_bounded() -> None:
    d = DirectRuns(max_early=2, early_ttl_s=1.0)
    d.announce(run())
    d.cancel(7)
    assert d.accept(hop()) is None and d.counters["hops_dropped"] == 1 and d.runs == {}
    d.accept(hop(run_id=1), now=0.0)
    d.accept(hop(run_id=2), now=0.0)
    d.accept(hop(run_id=3), now=0.5)  # over the bound: the oldest goes
    # Its Run could never finish without that Hop: it fails when it comes, saying why.
    err = refused(d, run(run_id=1))
    assert err.code is Code.OVERLOADED and "at most 2 runs" in err.reason
    d.accept(hop(run_id=4), now=5.0)  # past the time limit: run 2's and 3's go
    for run_id in (2, 3):
        err = refused(d, run(run_id=run_id))
        assert err.code is Code.TIMEOUT and "over 1 s" in err.reason
    assert [h.id for h in d.announce(run(run_id=4))[1]] == [4]
    assert d.early_bytes == 0


def big_hop(run_id: int = 7, chunk: int = 0, ticket: int = 99, nbytes: int = MIB) -> p.Hop:
    x = torch.zeros(nbytes // 4)
    return p.Hop(id=run_id, ticket=ticket, model="m", stage=1, chunk=chunk, tensors={"x": x})


def test_early_hops_of_one_run_are_bounded_in_bytes_and_its_run_fails_when_it_comes() -> None:
    # The attack: 100 Hops of 8 MiB (here 1 MiB) for a run nobody announced. Before, all kept.
    d = DirectRuns(max_run_bytes=8 * MIB, max_early_bytes=32 * MIB)
    errors = []
    for chunk in range(100):
        try:
            assert d.accept(big_hop(chunk=chunk), now=0.0) is None
        except FlowmeshError as exc:
            errors.append(exc)
        assert d.early_bytes <= 8 * MIB
    assert d.early_bytes == 0  # a run over its bytes keeps nothing: it cannot finish
    assert len(errors) == 1 and errors[0].code is Code.TOO_LARGE
    assert "over the 8388608 bytes a run may keep waiting" in errors[0].reason
    assert d.counters["hops_early"] == 7 and d.counters["hops_dropped"] == 100
    # The rest of that run's Hops were dropped quietly; its Run fails at once.
    err = refused(d, run(chunks=100))
    assert err.code is Code.TOO_LARGE and err.reason == errors[0].reason
    assert d.accept(big_hop(chunk=0)) is None and d.early_bytes == 0  # still on their way


def test_a_forged_oversized_hop_fails_no_real_run() -> None:
    d = DirectRuns(max_run_bytes=2 * MIB, max_early_bytes=8 * MIB)
    with pytest.raises(FlowmeshError) as err:
        d.accept(big_hop(ticket=1, nbytes=3 * MIB), now=0.0)  # the ticket is the broker's secret
    assert err.value.code is Code.TOO_LARGE
    assert d.accept(big_hop(chunk=1), now=0.0) is None  # the real one, with the real ticket
    state, early = d.announce(run())
    assert [h.chunk for h in early] == [1] and d.accept(hop(chunk=0)) is state


def test_a_forged_hop_after_a_real_one_neither_takes_its_room_nor_fails_it() -> None:
    # Its bytes used to count with the real Hops of that run id: over the bound together,
    # the real ones were dropped and the real Run failed TOO_LARGE.
    d = DirectRuns(max_run_bytes=2 * MIB, max_early_bytes=8 * MIB)
    assert d.accept(big_hop(chunk=0), now=0.0) is None  # the real one, with the real ticket
    assert d.accept(big_hop(ticket=1, chunk=1, nbytes=3 * MIB // 2), now=0.0) is None  # forged
    assert d.early_bytes == 2 * (MIB + 1024 + 1) + MIB // 2
    state, early = d.announce(run())
    assert [(h.chunk, h.ticket) for h in early] == [(0, 99)]
    assert d.early_bytes == 0 and d.counters["hops_dropped"] == 1  # the forged one, quietly
    assert d.accept(hop(chunk=1)) is state


def test_a_cancelled_runs_early_hops_go_at_once_whatever_their_ticket() -> None:
    d = DirectRuns(max_run_bytes=2 * MIB, max_early_bytes=8 * MIB)
    d.accept(big_hop(chunk=0), now=0.0)
    d.accept(big_hop(ticket=1, chunk=1), now=0.0)
    d.accept(big_hop(run_id=8), now=0.0)
    d.cancel(7)
    assert d.early_bytes == MIB + 1024 + 1  # run 8's alone
    assert d.accept(big_hop(chunk=2), now=0.0) is None and d.early_bytes == MIB + 1024 + 1


def test_early_hops_of_all_runs_are_bounded_in_bytes_the_oldest_go_first() -> None:
    d = DirectRuns(max_run_bytes=2 * MIB, max_early_bytes=4 * MIB)
    for run_id in range(1, 7):
        d.accept(big_hop(run_id=run_id), now=float(run_id))
        d.accept(big_hop(run_id=run_id, chunk=1, nbytes=MIB // 2), now=float(run_id))
        assert d.early_bytes <= 4 * MIB
    for run_id in range(1, 5):  # pushed out by the newer ones
        err = refused(d, run(run_id=run_id))
        assert err.code is Code.OVERLOADED and f"at most {4 * MIB} bytes" in err.reason
    for run_id in (5, 6):
        assert [h.chunk for h in d.announce(run(run_id=run_id))[1]] == [0, 1]
    assert d.early_bytes == 0


def test_early_hops_expire_by_the_clock_even_if_no_hop_comes_after_them() -> None:
    d = DirectRuns(early_ttl_s=30.0)
    d.accept(big_hop(run_id=1), now=0.0)
    d.accept(big_hop(run_id=2), now=20.0)
    d.expire(29.0)
    assert d.early_bytes > 2 * MIB  # both still in time
    d.expire(31.0)  # the worker's clock, no Hop: run 1's go
    assert MIB < d.early_bytes < 2 * MIB
    assert refused(d, run(run_id=1)).code is Code.TIMEOUT
    d.expire(51.0)
    assert d.early_bytes == 0 and d._early == {}
    assert refused(d, run(run_id=2)).code is Code.TIMEOUT
    # Empty Hops count too (the message's own cost): a flood of them is bounded as well.
    d = DirectRuns(max_run_bytes=64 * 1024)
    with pytest.raises(FlowmeshError):
        for chunk in range(1000):
            d.accept(hop(chunk=chunk), now=0.0)
    assert d.early_bytes == 0 and d.counters["hops_early"] < 64


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


async def test_a_peer_key_is_let_in_while_a_recent_run_or_an_open_pipelined_job_names_it() -> None:
    """A key a Run named is let in for `keep_s` after the last such Run, then refused again (a
    worker whose key left the broker's directory is named by no Run after); one a pipelined
    job named is let in while that job is open here, whatever the clock says."""
    now = [0.0]
    keys = PeerKeys(wait_s=0.0, keep_s=10.0, clock=lambda: now[0])
    keys.allow("alice")
    keys.allow("bob", "job#1")
    keys.allow("bob", "job#2")
    now[0] = 9.0
    keys.allow("alice")  # named again: its leave starts over
    now[0] = 18.0
    assert await keys.callback(PEERS_DOMAIN, b"alice")
    now[0] = 19.5
    assert not await keys.callback(PEERS_DOMAIN, b"alice")
    assert await keys.callback(PEERS_DOMAIN, b"bob")
    keys.release("job#1")
    assert await keys.callback(PEERS_DOMAIN, b"bob")  # job#2 (another open) still holds it
    keys.release("job#2")
    assert not await keys.callback(PEERS_DOMAIN, b"bob")
    assert keys.refused == 2 and keys.held == {}
    keys.allow("carol")  # a new key: the expired ones are forgotten
    assert set(keys.until) == {"carol"}


async def test_a_peer_key_is_let_in_once_a_run_names_it_and_refused_otherwise() -> None:
    keys = PeerKeys(wait_s=0.2)
    assert not await keys.callback(PEERS_DOMAIN, b"mallory")  # named by no run: refused
    assert keys.refused == 1
    waiting = asyncio.create_task(keys.callback(PEERS_DOMAIN, b"alice"))
    await asyncio.sleep(0)
    keys.allow("alice")  # the Run naming it came while its handshake waited
    assert await waiting
    assert not await keys.callback("another-domain", b"alice")
