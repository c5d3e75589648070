"""The broker's pure choices with exact expectations: which stages a load evicts
(`pick_victims`, in `flowmesh.eviction.eviction_order`, the worker's order too; the live KV a
worker reports counted beside the weights) and where a model's replicas go (`place_replicas`)."""

from __future__ import annotations

from broker.policy import pick_victims, place_replicas
from broker.state import Peer, Phase, Residency
from flowmesh.eviction import eviction_order


def worker(name: str, budget: int, resident: dict[str, tuple[int, float]] | None = None) -> Peer:
    """A worker holding model -> (bytes, last used) as stage 0 of each, all resident."""
    peer = Peer(name=name, addr=name.encode(), role="worker", pid=1, budget=budget)
    for model, (nbytes, used) in (resident or {}).items():
        key = (model, 0)
        peer.resident[key] = Residency(key, nbytes, Phase.RESIDENT, used)
        peer.hosted[key] = nbytes
    return peer


def test_eviction_order_is_lowest_value_then_least_recently_used_then_key() -> None:
    stages = [
        Residency(("b", 0), 1, Phase.RESIDENT, last_used=5.0),
        Residency(("a", 0), 1, Phase.RESIDENT, last_used=5.0),
        Residency(("c", 0), 1, Phase.RESIDENT, last_used=1.0),
        Residency(("d", 0), 1, Phase.RESIDENT, last_used=9.0),
    ]
    keys = [s.key for s in eviction_order(stages)]
    assert keys == [("c", 0), ("a", 0), ("b", 0), ("d", 0)]  # least recently used alone
    value = {"a": 2.0, "b": 1.0, "c": 3.0, "d": 1.0}
    keys = [s.key for s in eviction_order(stages, lambda s: value[s.key[0]])]
    assert keys == [("b", 0), ("d", 0), ("a", 0), ("c", 0)]


def test_victims_are_the_fewest_worth_least_that_free_the_bytes_needed() -> None:
    w = worker("w", 100, {"hot": (40, 1.0), "old": (30, 2.0), "new": (20, 3.0)})  # 10 free
    evictable = lambda r: True  # noqa: E731
    assert pick_victims(w, 10, evictable) == []  # already free
    assert pick_victims(w, 35, evictable) == [("hot", 0)]  # least recently used first
    value = {"hot": 9.0, "old": 1.0, "new": 1.0}
    assert pick_victims(w, 35, evictable, value=lambda r: value[r.key[0]]) == [("old", 0)]
    assert pick_victims(w, 45, evictable, value=lambda r: value[r.key[0]]) == [
        ("old", 0),
        ("new", 0),
    ]
    # What may not go is passed over; when what may go is not enough, nothing is chosen.
    assert pick_victims(w, 35, lambda r: r.key[0] != "hot") == [("old", 0)]
    assert pick_victims(w, 65, lambda r: r.key[0] != "hot") is None
    assert pick_victims(w, 101, evictable) is None  # over the whole budget


def test_a_count_bound_evicts_even_when_the_bytes_fit() -> None:
    w = worker("w", 100, {"a": (10, 1.0), "b": (10, 2.0)})
    assert pick_victims(w, 10, lambda r: True, max_stages=2) == [("a", 0)]
    assert pick_victims(w, 10, lambda r: True, max_stages=3) == []
    assert pick_victims(w, 10, lambda r: r.key[0] == "b", max_stages=1) is None


def test_replicas_spread_over_the_least_loaded_workers_largest_stage_first() -> None:
    ws = [worker("w0", 100, {"x": (50, 0.0)}), worker("w1", 100), worker("w2", 30)]
    # Stage 1 (60) first, on the least hosted worker that holds it (w1); stage 0 then on the
    # least hosted of the rest that fits (w2 hosts nothing, fits 20).
    assert place_replicas(ws, [20, 60], 1) == [["w2", "w1"]]
    # A second replica reuses no (stage, worker) pair: stage 1 on w0 (w1 has it), stage 0 on
    # w1 (w2 has it; w1 now hosts 60, still the only other one that fits).
    assert place_replicas(ws, [20, 60], 2) == [["w2", "w1"], ["w1", "w0"]]
    # Out of workers for stage 1 at the third replica: two placements only.
    assert place_replicas(ws, [20, 60], 3) == [["w2", "w1"], ["w1", "w0"]]
    # Stage 1 taken on w1 already: on w0; stage 0 on w1 or w2, hosting nothing: by name.
    assert place_replicas(ws, [20, 60], 1, taken={(1, "w1")}) == [["w1", "w0"]]


def test_live_kv_counts_in_the_free_room_and_its_stage_goes_last() -> None:
    # a (least recently used) holds 20 of live KV beside its 30 of weights: 20 free, not 40.
    w = worker("w", 100, {"a": (30, 1.0), "b": (30, 2.0)})
    kv = {("a", 0): 20}
    evictable = lambda r: True  # noqa: E731
    assert pick_victims(w, 25, evictable) == []  # weights alone: 40 free
    # With its KV, 25 does not fit; recency alone would take a, but b holds no KV: b goes.
    assert pick_victims(w, 25, evictable, kv=kv) == [("b", 0)]
    assert pick_victims(w, 45, evictable) == [("a", 0)]
    assert pick_victims(w, 45, evictable, kv=kv) == [("b", 0)]
    # b is not enough (20 + 30): a goes too, last, and frees its weights and KV (100 in all).
    assert pick_victims(w, 51, evictable, kv=kv) == [("b", 0), ("a", 0)]
    assert pick_victims(w, 100, evictable, kv=kv) == [("b", 0), ("a", 0)]
    # Even when it is worth least: value orders the stages without KV, then those with.
    value = {"a": 0.0, "b": 9.0}
    assert pick_victims(w, 45, evictable, value=lambda r: value[r.key[0]], kv=kv) == [("b", 0)]
    # What may go is not enough once the KV is counted: nothing is chosen.
    assert pick_victims(w, 45, lambda r: r.key[0] == "b") == [("b", 0)]
    assert pick_victims(w, 51, lambda r: r.key[0] == "b", kv=kv) is None
