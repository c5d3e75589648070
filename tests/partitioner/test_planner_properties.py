"""The planners against brute force over every contiguous partition of small inputs (n <= 8)."""

from __future__ import annotations

from itertools import combinations, pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.costs import BlockProfile
from flowmesh.modelio.planners import balance, chunk_footprints, chunks, part_sums
from partitioner.stage_planners import auto_stages

SETTINGS = settings(max_examples=300, deadline=None)


def all_bounds(n: int, parts: int):
    """Every split of n blocks into `parts` contiguous non-empty parts, as bounds."""
    for cuts in combinations(range(1, n), parts - 1):
        yield [0, *cuts, n]


def fits(bounds, mem, cap) -> bool:
    return mem is None or cap is None or all(s <= cap for s in part_sums(mem, bounds))


def check_valid(bounds, n, parts):
    assert bounds[0] == 0 and bounds[-1] == n
    assert len(bounds) == parts + 1
    assert all(a < b for a, b in pairwise(bounds))


costs_lists = st.lists(st.integers(0, 30), min_size=1, max_size=8)


@st.composite
def balance_cases(draw):
    costs = draw(costs_lists)
    n = len(costs)
    parts = draw(st.integers(1, n))
    mem = cap = None
    if draw(st.booleans()):
        mem = draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
        cap = draw(st.integers(0, 60))
    return costs, parts, mem, cap


@SETTINGS
@given(balance_cases())
def test_balance_matches_brute_force(case):
    costs, parts, mem, cap = case
    n = len(costs)
    feasible = [b for b in all_bounds(n, parts) if fits(b, mem, cap)]
    try:
        bounds = balance(costs, parts, mem=mem, mem_cap=cap)
    except FlowmeshError as exc:
        assert exc.code == Code.PLAN_ERROR
        assert not feasible, f"brute force found {feasible[0]} but balance raised {exc}"
        return
    check_valid(bounds, n, parts)
    assert fits(bounds, mem, cap)
    best = min(max(part_sums(costs, b)) for b in feasible)
    assert max(part_sums(costs, bounds)) == best
    # Deterministic tie-break: among optimal splits, the left-packed (lexicographically largest).
    optimal = [b for b in feasible if max(part_sums(costs, b)) == best]
    assert bounds == max(optimal)


@SETTINGS
@given(costs_lists, st.integers(0, 80))
def test_auto_stages_is_fewest_then_best(costs, cap):
    n = len(costs)
    try:
        bounds = auto_stages(costs, cap)
    except FlowmeshError as exc:
        assert exc.code == Code.PLAN_ERROR
        assert max(costs) > cap
        return
    fewest = min(p for p in range(1, n + 1) if any(fits(b, costs, cap) for b in all_bounds(n, p)))
    assert len(bounds) - 1 == fewest
    assert fits(bounds, costs, cap)


@st.composite
def chunk_cases(draw):
    n = draw(st.integers(1, 8))
    blocks = [
        BlockProfile(
            name=f"b{i}",
            param_bytes=draw(st.integers(0, 50)),
            buffer_bytes=draw(st.integers(0, 5)),
            shared_bytes=draw(st.sampled_from([0, 0, 7])),
            out_bytes_per_sample=draw(st.integers(0, 6)),
            saved_bytes_per_sample=draw(st.integers(0, 9)),
        )
        for i in range(n)
    ]
    optimizer = draw(st.sampled_from(["sgd", {"name": "sgd", "momentum": 0.9}, "adam", "adamw"]))
    batch = draw(st.integers(1, 4))
    target = draw(st.integers(1, 1500))
    return blocks, optimizer, batch, target


@SETTINGS
@given(chunk_cases())
def test_chunks_match_brute_force(case):
    blocks, optimizer, batch, target = case
    n = len(blocks)
    footprints, margin = chunk_footprints(blocks, optimizer, batch)

    def ok(b):
        return all(s + margin <= target for s in part_sums(footprints, b))

    candidates = [b for p in range(1, n + 1) for b in all_bounds(n, p) if ok(b)]
    try:
        bounds = chunks(target, blocks, optimizer, batch)
    except FlowmeshError as exc:
        assert exc.code == Code.PLAN_ERROR
        assert not candidates
        first_over = next(i for i in range(n) if footprints[i] + margin > target)
        assert f"'{blocks[first_over].name}'" in exc.reason
        return
    assert candidates
    fewest = min(len(b) - 1 for b in candidates)
    check_valid(bounds, n, fewest)
    assert ok(bounds)
    best = min(max(part_sums(footprints, b)) for b in candidates if len(b) - 1 == fewest)
    assert max(part_sums(footprints, bounds)) == best
