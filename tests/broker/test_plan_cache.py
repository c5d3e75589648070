"""The plan cache: bounded by the bytes its entries take, least recently used first out, alone
and behind the registry's plan requests (any client key may plan, each distinct request an
entry)."""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

from broker.config import BrokerConfig
from broker.context import Context
from broker.plan_cache import PlanCache, deep_size
from broker.registry import Registry
from flowmesh import protocol as p
from flowmesh.modelio.plan import Plan
from flowmesh.spec import ModelSpec

KIB = 1 << 10


def answer(n: int, blocks: int = 16) -> dict[str, Any]:
    plan = {  # valid: the broker takes a plan once `Plan.from_dict` does
        "version": 1,
        "kind": "stages",
        "spec_digest": f"d{n}",
        "objective": "bytes",
        "ranges": [[0, blocks]],
        "range_bytes": [blocks * KIB],
        "block_names": [f"model{n}.layers.{i}" for i in range(blocks)],
        "block_bytes": [KIB] * blocks,
    }
    return {"plan": plan, "inputs": None}


def test_the_cache_keeps_what_fits_and_drops_the_least_recently_used() -> None:
    size = deep_size(answer(0))
    cache = PlanCache(max_bytes=3 * size)
    for n in range(3):
        cache.put(f"k{n}", answer(n))
    assert cache.get("k0") == answer(0)  # used: now the most recent
    cache.put("k3", answer(3))
    assert list(cache.entries) == ["k2", "k0", "k3"] and cache.nbytes == 3 * size
    cache.put("k2", answer(2))  # again: replaced, not counted twice
    assert list(cache.entries) == ["k0", "k3", "k2"] and cache.nbytes == 3 * size
    cache.put("huge", answer(4, blocks=1000))  # over the whole bound: not kept, nothing dropped
    assert len(cache) == 3 and cache.get("huge") is None and cache.get("k1") is None


def rig() -> tuple[Context, Registry]:
    ctx = Context(BrokerConfig())
    reg = Registry(
        ctx,
        on_change=lambda now: None,
        on_replica_lost=lambda *a: None,
        on_worker_lost=lambda name: None,
    )
    reg.register(b"part", p.Register(id=1, role="partitioner", name="part", pid=1), 0.0)
    reg.heartbeat(ctx.peers["part"], p.Heartbeat(), 0.0)
    ctx.drain()
    return ctx, reg


def plan(ctx: Context, reg: Registry, n: int) -> list[Any]:
    """A client's plan request for a spec of its own: what the broker sends for it."""
    spec = ModelSpec(name=f"m{n}", factory="flowmesh.examples:mlp", kwargs={"width": n + 1})
    reg.plan_request(b"client", p.PlanRequest(id=n, spec=spec), 0.0)
    out = [msg for _, _, msg in ctx.drain()]
    for job in [m for m in out if isinstance(m, p.PlanJob)]:
        reply = p.PlanReply(id=job.id, plan=Plan.from_dict(answer(n)["plan"]), inputs=None)
        reg.plan_reply(ctx.peers["part"], reply, 0.0)
        out += [msg for _, _, msg in ctx.drain()]
    return out


def test_distinct_plan_requests_keep_the_broker_s_memory_within_the_cache_s_bytes() -> None:
    ctx, reg = rig()
    kept = {"plan": Plan.from_dict(answer(0)["plan"]), "inputs": None}  # as the cache keeps it
    bound = reg.plan_cache.max_bytes = 64 * deep_size(kept)
    plan(ctx, reg, 0)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(1, 400):  # each a new entry; the first kept in use
            plan(ctx, reg, n)
            assert [type(m) for m in plan(ctx, reg, 0)] == [p.PlanReply]  # from the cache
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert reg.plan_cache.nbytes <= bound and 1 < len(reg.plan_cache) < 64
    # What the process holds, not only the cache's own count (before: all 400 kept).
    assert grown <= bound, (grown, bound)
    assert ctx.calls == {} and ctx.peers["part"].inflight_plans == 0
