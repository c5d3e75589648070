"""Stage plans: a model's chain cut into pipeline stages for serving, as a `Plan`.

`stage_plan` plans from a profile; `make_stage_plan` profiles the spec first.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.costs import ModelProfile
from flowmesh.modelio.plan import Plan, explain_uncut, range_times, ranges_of
from flowmesh.modelio.profile import profile_for
from flowmesh.spec import DEFAULT_ALLOW, ModelSpec
from partitioner import stage_planners


def stage_plan(
    profile: ModelProfile, stages: int | None = None, mem_cap: int | None = None
) -> Plan:
    """Pipeline stages from a profile: `stages` of them (each within `mem_cap` when given), or
    with `stages=None` the fewest that each fit `mem_cap`."""
    if stages is None:
        if mem_cap is None:
            raise FlowmeshError(
                Code.PLAN_ERROR, "give a number of stages, a memory cap per stage, or both"
            )
        with explain_uncut(profile):
            bounds = stage_planners.auto_stages(profile, mem_cap)
    else:
        with explain_uncut(profile):
            bounds = stage_planners.stages(profile, stages, mem_cap)
    ranges = ranges_of(bounds)
    objective = stage_planners.stage_costs(profile)[3]
    return Plan(
        kind="stages",
        spec_digest=profile.spec_digest,
        block_names=tuple(profile.names),
        block_bytes=tuple(b.own_bytes for b in profile.blocks),
        ranges=ranges,
        range_bytes=tuple(profile.range_bytes(a, b) for a, b in ranges),
        objective=objective,
        range_time_s=range_times(profile, ranges, "forward_s"),
        request={"stages": stages, "mem_cap": mem_cap},
    )


def make_stage_plan(
    spec: ModelSpec,
    stages: int | None = None,
    mem_cap: int | None = None,
    *,
    batch: int = 1,
    seq_len: int = 1,
    measure_device: Any = None,
    allow: Iterable[str] = DEFAULT_ALLOW,
    profile: ModelProfile | None = None,
) -> Plan:
    """Profile `spec` (unless `profile` is given) and plan its stages.

    `stages=None` takes `spec.stages`; if that is None too, the fewest stages fitting `mem_cap`.
    """
    prof = profile_for(
        spec, profile, batch=batch, seq_len=seq_len, measure_device=measure_device, allow=allow
    )
    return stage_plan(prof, spec.stages if stages is None else stages, mem_cap)
