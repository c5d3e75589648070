"""Plans as versioned plain data, their validation and table, and planning from a spec."""

from __future__ import annotations

import msgpack
import pytest

from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.plan import PLAN_VERSION, Plan, chunk_plan
from flowmesh.modelio.planners import chunk_footprints
from flowmesh.modelio.profile import make_chunk_plan, profile
from partitioner.stage_plans import make_stage_plan
from tests.support.archs import spec_of


def stage_plan_example() -> Plan:
    return Plan(
        kind="stages",
        spec_digest="abc",
        block_names=("embed", "h.0", "h.1", "head"),
        block_bytes=(1024, 2048, 2048, 1024),
        ranges=((0, 2), (2, 4)),
        range_bytes=(3072, 3072),
        objective="time",
        range_time_s=(0.002, 0.0025),
        request={"stages": 2, "mem_cap": None},
    )


def test_table_exact():
    assert stage_plan_example().table() == "\n".join(
        [
            "stage  blocks  names         bytes    fwd time  share",
            "0      0-1     embed .. h.0  3.0 KiB  2.00 ms   44.4%",
            "1      2-3     h.1 .. head   3.0 KiB  2.50 ms   55.6%",
            "2 stages over 4 blocks; balance 1.111 (largest / mean time)",
        ]
    )
    chunked = Plan(
        kind="chunks",
        spec_digest="abc",
        block_names=("a", "b", "c"),
        block_bytes=(10, 20, 30),
        ranges=((0, 1), (1, 3)),
        range_bytes=(10, 50),
        objective="footprint",
        range_footprint=(100, 300),
    )
    assert chunked.table() == "\n".join(
        [
            "chunk  blocks  names   bytes  footprint  share",
            "0      0       a       10 B   100 B      25.0%",
            "1      1-2     b .. c  50 B   300 B      75.0%",
            "2 chunks over 3 blocks; balance 1.500 (largest / mean training footprint)",
        ]
    )
    assert chunked.balance == 1.5


def test_round_trip_through_msgpack():
    plan = stage_plan_example()
    data = msgpack.unpackb(msgpack.packb(plan.to_dict()))
    assert data["version"] == PLAN_VERSION
    assert Plan.from_dict(data) == plan
    assert plan.names_in(1) == ("h.1", "head")


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"version": 2}, "version 2"),
        ({"version": None}, "version None"),
        ({"ranges": [[0, 1], [2, 4]]}, "expected 1"),  # gap
        ({"ranges": [[0, 3], [2, 4]]}, "expected 3"),  # overlap
        ({"ranges": [[0, 2], [2, 3]]}, "end at block 3"),  # short
        ({"ranges": [[0, 0], [0, 4]], "range_bytes": [0, 1]}, "empty"),
        ({"ranges": [[0, 4]]}, "range_bytes"),  # per-range lists must match
        ({"range_time_s": [0.1]}, "range_time_s"),
        ({"range_time_s": None}, "needs range_time_s"),
        ({"block_names": ["a", "a", "b", "c"]}, "distinct"),
        ({"block_bytes": [1, 2, 3]}, "block_bytes"),
        ({"kind": "layers"}, "kind"),
        ({"extra": 1}, "unknown field"),
        ({"ranges": [[0, "2"], [2, 4]]}, "pair of integers"),
    ],
)
def test_from_dict_rejects_inconsistent_plans(change, words):
    data = {**stage_plan_example().to_dict(), **change}
    with pytest.raises(FlowmeshError) as info:
        Plan.from_dict(data)
    assert info.value.code == Code.PLAN_ERROR
    assert words in info.value.reason


def test_from_dict_missing_fields():
    data = stage_plan_example().to_dict()
    del data["ranges"]
    with pytest.raises(FlowmeshError, match="missing field"):
        Plan.from_dict(data)


def test_make_stage_plan_counts_and_caps():
    spec = spec_of("hf_gpt2")
    plan = make_stage_plan(spec, 3)
    assert plan.kind == "stages" and plan.parts == 3 and plan.objective == "bytes"
    assert plan.spec_digest == spec.digest()
    assert plan.block_names[0] == "embed" and plan.block_names[-1] == "head"
    # The head holds wte, which the embedding owns: a head stage without the embedding holds it too.
    wte = 97 * 32 * 4
    assert sum(plan.range_bytes) == sum(plan.block_bytes) + wte
    # spec.stages is the default count; without either, the fewest stages under the cap.
    assert make_stage_plan(spec_of("hf_gpt2", stages=2)).parts == 2
    prof = profile(spec)
    cap = max(prof.range_bytes(i, i + 1) for i in range(len(prof.blocks))) * 2
    auto = make_stage_plan(spec, None, cap, profile=prof)
    assert all(b <= cap for b in auto.range_bytes)
    assert auto.request == {"stages": None, "mem_cap": cap}
    with pytest.raises(FlowmeshError, match="number of stages"):
        make_stage_plan(spec, None, None, profile=prof)
    with pytest.raises(FlowmeshError, match="non-empty parts"):
        make_stage_plan(spec, 9, profile=prof)


def test_make_stage_plan_by_time_when_measured():
    plan = make_stage_plan(spec_of("tiny_gpt"), 2, measure_device="cpu")
    assert plan.objective == "time" and plan.range_time_s is not None
    assert plan.balance >= 1.0
    assert "fwd time" in plan.table()


def test_profile_of_another_model_is_refused():
    with pytest.raises(FlowmeshError) as info:
        make_stage_plan(spec_of("mlp"), 2, profile=profile(spec_of("tiny_gpt")))
    assert info.value.code == Code.PLAN_ERROR and "digest" in info.value.reason


def test_make_chunk_plan_fits_the_target_with_fewest_chunks():
    spec = spec_of("tiny_gpt")
    prof = profile(spec, batch=4, seq_len=8)
    footprints, margin = chunk_footprints(prof, "adam", 4)
    target = max(footprints) + margin + sum(sorted(footprints)[:1])
    plan = make_chunk_plan(spec, target, "adam", 4, seq_len=8)
    assert plan.kind == "chunks" and plan.objective == "footprint"
    assert plan == chunk_plan(prof, target, "adam", 4)
    assert plan.range_footprint is not None
    assert all(f <= target for f in plan.range_footprint)
    assert plan.range_footprint == tuple(sum(footprints[a:b]) + margin for a, b in plan.ranges)
    # One chunk fewer would not fit: some pair of neighbouring chunks exceeds the target.
    assert plan.parts == 1 or any(
        plan.range_footprint[i] + plan.range_footprint[i + 1] - margin > target
        for i in range(plan.parts - 1)
    )
    assert plan.request["optimizer_states"] == 2 and plan.request["batch"] == 4
    assert Plan.from_dict(msgpack.unpackb(msgpack.packb(plan.to_dict()))) == plan


def test_chunk_plan_block_too_big_names_it():
    prof = profile(spec_of("tiny_gpt"), batch=4, seq_len=8)
    with pytest.raises(FlowmeshError) as info:
        chunk_plan(prof, 100_000, "adam", 4)
    assert info.value.code == Code.PLAN_ERROR
    assert "block 1 ('1')" in info.value.reason and "target" in info.value.reason
