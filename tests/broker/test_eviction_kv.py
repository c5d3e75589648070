"""The broker's eviction choice counts the live KV cache its workers report (`kv_stage_bytes` in
their heartbeat stats, beside `resident_stages`): BrokerCore in process, a fake clock, fake
workers, the exact stage it expects a load to evict (`peer.leaving`).

A stage's bytes on a worker are its weights + its live KV: in the free room a load needs, in
its keep-value (`flowmesh.value.stage_value`), and a stage holding KV goes only when nothing
else frees enough.
"""

from __future__ import annotations

import pytest

from broker.serving_router import kv_held
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from tests.support.broker import MIB, Harness, only


def rig(budget: int, stages: dict[str, int], **cfg: str) -> tuple[Harness, bytes]:
    """One worker of `budget` holding `stages` (model -> weight bytes, one stage each), run
    once each in this order a second apart: all resident, the first least recently used."""
    h = Harness(**cfg)
    h.partitioner()
    w0 = h.worker("w0", budget=budget)
    for name, nbytes in stages.items():
        h.deploy(name, [nbytes], replicas=1)
    for name, nbytes in stages.items():
        _, out = h.infer(name)
        h.loaded(w0, out, nbytes)
        h.now += 1
        h.finish(w0, only(out, p.Run)[0])
    return h, w0


def heartbeat(h: Harness, w0: bytes, kv: dict[str, int]) -> None:
    h.backend(w0, p.Heartbeat(stats=p.WorkerStats(kv_stage_bytes=kv)))


def expected_victims(h: Harness, model: str) -> list[tuple[str, int]]:
    """Ask for `model` (deployed, not resident): the stages its Load is expected to evict."""
    _, out = h.infer(model)
    (load,) = only(out, p.Load)
    assert load.model == model
    leaving = h.core.peers["w0"].leaving
    assert set(leaving.values()) <= {load.id}
    return sorted(leaving)


def test_a_stage_holding_live_kv_is_kept_and_its_kv_counts_in_the_room() -> None:
    # Weights alone: a and b hold 60 of 100 MiB, and d's 30 fit in the 40 free.
    h, w0 = rig(100 * MIB, {"a": 30 * MIB, "b": 30 * MIB})
    h.deploy("d", [30 * MIB], replicas=1)
    heartbeat(h, w0, {})
    assert expected_victims(h, "d") == []
    # a holds 30 MiB of live KV: 10 free. Recency alone would take a (used first); b goes.
    h, w0 = rig(100 * MIB, {"a": 30 * MIB, "b": 30 * MIB})
    h.deploy("d", [30 * MIB], replicas=1)
    heartbeat(h, w0, {"a/0": 30 * MIB})
    assert kv_held(h.core.peers["w0"]) == {("a", 0): 30 * MIB}
    assert expected_victims(h, "d") == [("b", 0)]
    # So too by recency alone (`eviction="lru"`, no value): a stage holding KV goes last.
    h, w0 = rig(100 * MIB, {"a": 30 * MIB, "b": 30 * MIB}, eviction="lru")
    h.deploy("d", [30 * MIB], replicas=1)
    heartbeat(h, w0, {"a/0": 30 * MIB})
    assert expected_victims(h, "d") == [("b", 0)]


def test_a_prefetch_fits_into_the_room_the_live_kv_leaves() -> None:
    def prefetched(kv: dict[str, int]) -> list[str]:
        h, w0 = rig(100 * MIB, {"a": 30 * MIB, "c": 30 * MIB})
        heartbeat(h, w0, kv)
        h.now += 1
        # The worker evicted c by itself: c, asked for before, is prefetched where it fits.
        out = h.backend(w0, p.Resident(stages=[["a", 0, 30 * MIB]], after_load=0))
        return [m.model for m in only(out, p.Load)]

    assert prefetched({"a/0": 40 * MIB}) == ["c"]  # 30 free
    assert prefetched({"a/0": 50 * MIB}) == []  # 20 free: weights alone would leave 70


def test_a_stage_holding_live_kv_goes_last_when_nothing_else_frees_enough() -> None:
    h, w0 = rig(100 * MIB, {"a": 40 * MIB, "b": 10 * MIB})
    h.deploy("d", [70 * MIB], replicas=1)
    heartbeat(h, w0, {"a/0": 20 * MIB})  # 30 free; b's 10 are not enough: a goes too
    assert expected_victims(h, "d") == [("a", 0), ("b", 0)]


def test_the_keep_value_counts_weights_and_live_kv() -> None:
    # Both hold KV: value (rate x bytes to bring back) decides. Weights alone, a (20 MiB, asked
    # a second before b) is worth least and would go, as by recency; with its 30 MiB of KV it
    # is worth 50 against b's 30 + 5: b goes.
    def victims(kv: dict[str, int]) -> list[tuple[str, int]]:
        h, w0 = rig(100 * MIB, {"a": 20 * MIB, "b": 30 * MIB})
        h.deploy("d", [50 * MIB], replicas=1)
        heartbeat(h, w0, kv)
        return expected_victims(h, "d")

    assert victims({"a/0": 1 * MIB, "b/0": 5 * MIB}) == [("a", 0)]
    assert victims({"a/0": 30 * MIB, "b/0": 5 * MIB}) == [("b", 0)]


def test_kv_figures_that_are_not_a_held_stage_s_byte_count_are_passed_over() -> None:
    h, w0 = rig(100 * MIB, {"a": 30 * MIB})
    heartbeat(h, w0, {"a/0": 7, "gone/0": 5, "a/x": 3, "a/1": 2, "a": 1})
    assert kv_held(h.core.peers["w0"]) == {("a", 0): 7}
    # A value that is not a byte count: the heartbeat is refused on receipt (its type,
    # `flowmesh.reports.WorkerStats`), the last good figures stand.
    for bad in (-1, True, 1.5, "9"):
        with pytest.raises(FlowmeshError) as info:
            heartbeat(h, w0, {"a/0": bad})  # type: ignore[dict-item]
        assert info.value.code == Code.BAD_MESSAGE
        assert kv_held(h.core.peers["w0"]) == {("a", 0): 7}
    heartbeat(h, w0, {})
    assert kv_held(h.core.peers["w0"]) == {}
