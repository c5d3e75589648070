"""Exact outputs of the planners on hand-made cases, their errors, and optimal plans at scale."""

from __future__ import annotations

import itertools
import random

import pytest

from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.costs import BlockProfile, ModelProfile
from flowmesh.modelio.planners import (
    balance,
    chunk_footprints,
    chunks,
    even_cut,
    min_parts,
    optimizer_states,
    part_sums,
    pipeline_stages,
    seconds_to_ns,
    split,
    stage_footprints,
)
from partitioner.stage_planners import auto_stages, stages


def test_torchgpipe_example():
    bounds = balance([1, 2, 3, 4, 5, 6], 2)
    assert bounds == [0, 4, 6]
    assert split([1, 2, 3, 4, 5, 6], bounds) == [[1, 2, 3, 4], [5, 6]]


@pytest.mark.parametrize(
    ("costs", "parts", "bounds"),
    [
        ([1, 2, 3, 4, 5, 6], 1, [0, 6]),
        ([1, 2, 3, 4, 5, 6], 3, [0, 3, 5, 6]),  # bottleneck 9: [1,2,3] [4,5] [6]
        ([1, 2, 3, 4, 5, 6], 6, [0, 1, 2, 3, 4, 5, 6]),
        ([1, 1, 1, 1, 1, 1], 3, [0, 2, 4, 6]),
        ([5, 1, 1, 1, 1, 1], 2, [0, 1, 6]),
        ([1, 1, 1, 1, 1, 5], 2, [0, 5, 6]),
        ([0, 0, 0], 2, [0, 2, 3]),  # ties: the first part takes all it can
        ([10, 1, 1, 1], 4, [0, 1, 2, 3, 4]),
        ([7], 1, [0, 1]),
        ([2, 2, 2, 2, 9, 2, 2, 2, 2], 3, [0, 4, 5, 9]),
    ],
)
def test_balance_exact(costs, parts, bounds):
    assert balance(costs, parts) == bounds


def test_balance_memory_cap_moves_the_cut():
    # Time alone says [[1,1],[1,1]], but blocks 0+1 hold 7 > 6 bytes.
    assert balance([1, 1, 1, 1], 2, mem=[1, 6, 0, 0], mem_cap=6) == [0, 1, 4]
    assert balance([1, 1, 1, 1], 2, mem=[3, 3, 3, 3], mem_cap=6) == [0, 2, 4]


def test_balance_errors_are_clear():
    with pytest.raises(FlowmeshError) as info:
        balance([1, 2, 3], 4)
    assert info.value.code == Code.PLAN_ERROR
    assert "3 blocks into 4" in info.value.reason

    with pytest.raises(FlowmeshError) as info:
        balance([1, 2, 3], 2, mem=[1, 9, 1], mem_cap=4, names=["a", "big", "c"])
    assert info.value.code == Code.PLAN_ERROR
    assert "'big'" in info.value.reason and "memory cap" in info.value.reason

    with pytest.raises(FlowmeshError) as info:
        balance([1, 1, 1, 1], 2, mem=[3, 3, 3, 3], mem_cap=3)
    assert "at least 4 parts" in info.value.reason

    for bad_costs, parts in (([1, -1], 1), ([1.5, 2], 1), ([], 1), ([1, 2], 0), ([True], 1)):
        with pytest.raises(FlowmeshError) as info:
            balance(bad_costs, parts)
        assert info.value.code == Code.PLAN_ERROR

    with pytest.raises(FlowmeshError, match="mem_cap needs per-block mem"):
        balance([1, 2], 1, mem_cap=4)
    with pytest.raises(FlowmeshError, match="2 entries for 3 blocks"):
        balance([1, 2, 3], 1, mem=[1, 2], mem_cap=9)


def test_min_parts():
    assert min_parts([3, 3, 3, 3], 6) == 2
    assert min_parts([3, 3, 3, 3], 5) == 4
    assert min_parts([0, 0, 0], 0) == 1


def test_seconds_to_ns():
    assert seconds_to_ns(1.5e-3) == 1_500_000
    assert seconds_to_ns(0.0) == 0


def _blocks(params, *, times=None, shared=None, saved=None, out=None):
    n = len(params)
    return [
        BlockProfile(
            name=f"b{i}",
            param_bytes=params[i],
            buffer_bytes=0,
            shared_bytes=(shared or [0] * n)[i],
            saved_bytes_per_sample=(saved or [0] * n)[i],
            out_bytes_per_sample=(out or [0] * n)[i],
            forward_s=None if times is None else times[i],
        )
        for i in range(n)
    ]


def test_stages_by_time_when_timed_else_bytes():
    timed = _blocks([100, 1, 1, 100], times=[1e-3, 1e-3, 1e-3, 3e-3])
    assert stages(timed, 2) == [0, 3, 4]  # time: 3 ms | 3 ms
    untimed = _blocks([100, 1, 1, 100])
    assert stages(untimed, 2) == [0, 2, 4]  # bytes: 101 | 101
    profile = ModelProfile(spec_digest="d", blocks=tuple(timed))
    assert stages(profile, 2) == [0, 3, 4]
    # Under a cap of 150 bytes the time-optimal [0,3) (102 bytes) still fits; 101 | 101 too.
    assert stages(timed, 2, 150) == [0, 3, 4]
    assert stages(timed, 2, 101) == [0, 2, 4]


def test_stages_count_shared_tensors_against_the_cap():
    # Block 3 holds a tensor (50 bytes) owned by block 0: a stage with block 3 must hold it.
    blocks = _blocks([50, 10, 10, 10], shared=[0, 0, 0, 50])
    with pytest.raises(FlowmeshError, match="at least"):
        stages(blocks, 2, 60)
    # Both [b0 b1 b2 | b3] and [b0 b1 | b2 b3] peak at 70: left-packed takes the first.
    assert stages(blocks, 2, 70) == [0, 3, 4]


def test_stages_from_plain_costs():
    assert stages([1, 2, 3, 4, 5, 6], 2) == [0, 4, 6]
    assert stages([1, 2, 3, 4, 5, 6], 2, 11) == [0, 4, 6]  # plain costs are bytes too
    with pytest.raises(FlowmeshError, match="at least 3 parts"):
        stages([1, 2, 3, 4, 5, 6], 2, 10)  # 21 bytes cannot fit two parts of 10


def test_auto_stages_fewest_then_balanced():
    assert auto_stages([4, 4, 4, 4, 4, 4], 8) == [0, 2, 4, 6]
    assert auto_stages([4, 4, 4, 4, 4, 4], 100) == [0, 6]
    timed = _blocks([5, 5, 5, 5], times=[4e-3, 1e-3, 1e-3, 1e-3])
    # 2 stages are needed for 10 bytes each; time picks [b0] | [b1..b3] (4 ms | 3 ms) but
    # that puts 15 bytes in stage 1, so the cap forces [b0, b1] | [b2, b3].
    assert auto_stages(timed, 10) == [0, 2, 4]
    assert auto_stages(timed, 15) == [0, 1, 4]


def test_optimizer_states():
    assert optimizer_states("sgd") == 0
    assert optimizer_states({"name": "sgd", "momentum": 0.9}) == 1
    assert optimizer_states({"name": "sgd", "momentum": 0.0}) == 0
    assert optimizer_states("adam") == 2
    assert optimizer_states({"type": "AdamW"}) == 2
    assert optimizer_states({"name": "adam", "amsgrad": True}) == 3
    with pytest.raises(FlowmeshError) as info:
        optimizer_states("lion")
    assert info.value.code == Code.BAD_REQUEST


def test_chunk_footprints_model():
    blocks = _blocks([100, 200], shared=[0, 10], saved=[7, 3], out=[5, 9])
    footprints, margin = chunk_footprints(blocks, "adam", 4)
    # (params + shared) x (1 + 1 + 2) + buffers + saved x batch
    assert footprints == [100 * 4 + 7 * 4, 210 * 4 + 3 * 4]
    assert margin == 2 * 9 * 4


def test_chunks_fewest_then_even():
    blocks = _blocks([100] * 6, out=[1] * 6)  # sgd: 200 bytes per block, margin 2
    # 1002 bytes hold 5 blocks: two chunks needed, evened out to 3 + 3.
    assert chunks(1002, blocks, "sgd", 1) == [0, 3, 6]
    assert chunks(1202, blocks, "sgd", 1) == [0, 6]
    assert chunks(401, blocks, "sgd", 1) == [0, 1, 2, 3, 4, 5, 6]


def test_chunks_block_over_target_names_it():
    blocks = _blocks([100, 5000, 100])
    with pytest.raises(FlowmeshError) as info:
        chunks(2000, blocks, "adam", 1)
    assert info.value.code == Code.PLAN_ERROR
    assert "'b1'" in info.value.reason and "19.5 KiB" in info.value.reason


def _parts_within(costs: list[int], cap: int) -> int:
    """Parts a greedy left-to-right fill needs when no part may exceed `cap` (inf if a block
    alone does): the textbook feasibility test of a bottleneck."""
    parts, run = 1, 0
    for c in costs:
        if c > cap:
            return 10**9
        if run + c > cap:
            parts, run = parts + 1, 0
        run += c
    return parts


def test_thousand_blocks_are_planned_optimally():
    # Large inputs, checked against an independent optimality test instead of brute force (the
    # property tests do that on small inputs). How fast this runs belongs to
    # scripts/bench_planners.py, not here.
    rng = random.Random(0)
    costs = [rng.randrange(10**7) for _ in range(1000)]
    mem = [rng.randrange(10**8) for _ in range(1000)]
    for parts in (8, 64, 999):
        bounds = balance(costs, parts)
        assert len(bounds) == parts + 1 and bounds[0] == 0 and bounds[-1] == 1000
        assert all(a < b for a, b in itertools.pairwise(bounds))
        worst = max(part_sums(costs, bounds))
        assert _parts_within(costs, worst) <= parts  # feasible ...
        assert _parts_within(costs, worst - 1) > parts  # ... and nothing smaller is
    cap = sum(mem) // 32
    bounds = balance(costs, 64, mem=mem, mem_cap=cap)
    assert max(part_sums(mem, bounds)) <= cap
    blocks = [
        BlockProfile(f"b{i}", rng.randrange(10**6), 0, 0, rng.randrange(10**4), 10**5)
        for i in range(1000)
    ]
    footprints, margin = chunk_footprints(blocks, "adam", 8)
    cut = chunks(10**8, blocks, "adam", 8)
    assert max(part_sums(footprints, cut)) + margin <= 10**8
    assert len(cut) - 1 == min_parts(footprints, 10**8 - margin)
    staged = auto_stages(costs, 10**9, mem=mem)
    assert max(part_sums(mem, staged)) <= 10**9
    assert len(staged) - 1 == min_parts(mem, 10**9)


# -- pipelined training (`pipeline="auto"`): the fewest stages that fit the workers


def blocks(params: list[int], buffers: list[int] | None = None) -> list[BlockProfile]:
    buffers = buffers or [0] * len(params)
    pairs = zip(params, buffers, strict=True)
    return [BlockProfile(f"b{i}", pb, bb) for i, (pb, bb) in enumerate(pairs)]


@pytest.mark.parametrize(
    ("free", "ranges", "footprints"),
    [
        # Each block: 100 bytes of parameters, x4 with their gradient and Adam's two states.
        ([2000, 10], [(0, 4)], [1600]),  # fits the first worker whole: one stage
        ([900, 900], [(0, 2), (2, 4)], [800, 800]),
        ([900, 500, 500], [(0, 2), (2, 3), (3, 4)], [800, 400, 400]),  # two would not fit
        ([500, 900, 500, 500], [(0, 2), (2, 3), (3, 4)], [800, 400, 400]),  # largest first
    ],
)
def test_pipeline_stages_are_the_fewest_that_fit(
    free: list[int], ranges: list[tuple[int, int]], footprints: list[int]
) -> None:
    assert pipeline_stages(blocks([100] * 4), free, "adam") == (ranges, footprints)


def test_no_pipeline_fits_and_the_cut_is_by_resident_bytes() -> None:
    assert pipeline_stages(blocks([100] * 4), [300] * 4, "adam") is None
    assert pipeline_stages(blocks([100] * 4), [10**6] * 8, "sgd") == ([(0, 4)], [800])
    # A block of buffers only (BatchNorm's statistics): held, no gradient or state; the cut
    # evens the bytes held, as each worker's cut of its built chain does.
    two = blocks([100, 0, 100, 100], [0, 300, 0, 0])
    assert even_cut([b.resident_bytes for b in two], 2) == [(0, 2), (2, 4)]
    assert stage_footprints(two, [(0, 2), (2, 4)], "adam") == [700, 800]
    assert pipeline_stages(two, [800, 800], "adam") == ([(0, 2), (2, 4)], [700, 800])
    with pytest.raises(FlowmeshError, match="needs at least as many blocks"):
        even_cut([1, 2], 3)
    # The cut whose largest stage holds the least: not the first to pass its share of the bytes.
    assert even_cut([4, 3, 3], 2) == [(0, 1), (1, 3)]
