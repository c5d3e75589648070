"""The partitioner process: plans on request, as a peer of the broker.

Stateless: each PlanJob is profiled (on the meta device, or timed when asked) and planned on a
worker thread, so heartbeats and other requests keep flowing while a large model is read.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.logs import LogThrottle
from flowmesh.modelio import planners
from flowmesh.modelio.plan import Plan, chunk_plan
from flowmesh.modelio.profile import profile
from flowmesh.optimizers import state_count
from flowmesh.peer import MeshPeer
from flowmesh.roots import Roots
from flowmesh.spec import (
    BLOCK_ALIGN,
    DEFAULT_ALLOW,
    TENSOR_ALIGN,
    TensorSpec,
    check_factory,
    narrow_allow,
    parse_inputs,
)
from flowmesh.threads import torch_pool
from partitioner.stage_plans import stage_plan


def plan_for(
    request: p.PlanAsk,
    allow: tuple[str, ...] = DEFAULT_ALLOW,
    measure_device: str | None = None,
    who: str = "partitioner",
    roots: Roots | None = None,
) -> tuple[Plan, dict[str, TensorSpec] | None]:
    """(plan, declared inputs) for a PlanJob request (checked on receipt). Pure apart from
    torch on meta, and a Hugging Face directory's config, read only under `roots` (default: the
    working directory). A spec's weights file is not read here: the workers read it, under
    theirs."""
    spec = request.spec
    check_factory(spec.factory, allow, who)
    if spec.hf is not None:
        (roots or Roots.of(None, (), who)).readable(spec.hf, "hf directory")
    kind = request.kind
    batch = request.batch or 1
    prof = profile(
        spec,
        batch=batch,
        allow=allow,
        measure_device=measure_device if request.measure else None,
        # A model served answers a tensor or a dict of them; one trained may return a tuple
        # (its loss takes the first tensor).
        serving=kind == "stages",
    )
    if kind == "stages":
        mem_cap = request.mem_cap
        if mem_cap is not None:
            # Leave room for the worker's padding (per tensor and per block), so that a stage
            # planned under the cap still fits the device once laid out.
            n_tensors = len(prof.tensor_bytes) or sum(len(b.tensors) for b in prof.blocks)
            mem_cap = int(mem_cap) - TENSOR_ALIGN * n_tensors - BLOCK_ALIGN * len(prof.blocks)
            if mem_cap <= 0:
                raise FlowmeshError(
                    Code.TOO_BIG,
                    "the device budget cannot hold even the padding of this model's tensors",
                )
        try:
            plan = stage_plan(prof, request.stages, mem_cap)
        except FlowmeshError as exc:
            if mem_cap is None or exc.code != Code.PLAN_ERROR:
                raise
            # Would it plan without the devices' cap? Then the model is too big, not malformed.
            try:
                stage_plan(prof, request.stages or 1, None)
            except FlowmeshError:
                raise exc from None
            splittable = max(b.resident_bytes for b in prof.blocks) <= mem_cap
            hint = (
                " (omit stages to choose automatically)" if (request.stages and splittable) else ""
            )
            raise FlowmeshError(Code.TOO_BIG, f"{exc.reason}{hint}") from None
    elif kind == "chunks":
        target = request.target_bytes or request.mem_cap
        if not target:
            raise FlowmeshError(Code.BAD_REQUEST, "a chunk plan needs target_bytes")
        optimizer = request.optimizer or "adam"
        plan = chunk_plan(prof, target, optimizer, batch, _state_count(optimizer))
    elif kind == "pipeline":
        plan = _pipeline_plan(prof, request, allow)
    else:
        raise FlowmeshError(Code.BAD_REQUEST, f"unknown plan kind {kind!r}")
    return plan, parse_inputs(prof.inputs) if prof.inputs else None


def _pipeline_plan(prof: Any, request: p.PlanAsk, allow: tuple[str, ...]) -> Plan:
    """Where a training job opened with `pipeline="auto"` goes: the fewest stages whose
    resident footprints fit the workers' free training bytes (`request.worker_bytes`, stage i
    on the i-th largest), one stage when it fits one worker whole; when no count does, one
    stage marked `fits` False (the broker then trains it by memory flow on one worker)."""
    if not request.worker_bytes:
        raise FlowmeshError(Code.BAD_REQUEST, "a pipeline plan needs the workers' free bytes")
    states = state_count(request.optimizer, allow)
    found = planners.pipeline_stages(prof, request.worker_bytes, request.optimizer, states)
    whole = [(0, len(prof.blocks))]
    ranges, footprints = found or (whole, planners.stage_footprints(prof, whole, "", states))
    return Plan(
        kind="pipeline",
        spec_digest=prof.spec_digest,
        block_names=tuple(prof.names),
        block_bytes=tuple(b.own_bytes for b in prof.blocks),
        ranges=tuple(ranges),
        range_bytes=tuple(prof.range_bytes(a, b) for a, b in ranges),
        objective="bytes",
        range_footprint=tuple(footprints),
        request={
            "worker_bytes": list(request.worker_bytes),
            "optimizer_states": states,
            "fits": found is not None,
        },
    )


def _state_count(optimizer: str) -> int:
    """The planner's own count where it has one (it knows `flowmesh plan --momentum`'s
    "sgd_momentum"), else torch.optim's, probed."""
    try:
        return planners.optimizer_states(optimizer)
    except FlowmeshError:
        return state_count(optimizer)


class PartitionerService(MeshPeer):
    role = "partitioner"
    stats_type = p.PartitionerStats

    def __init__(
        self,
        name: str,
        broker: str,
        *,
        allow: tuple[str, ...] | None = None,
        threads: int = 2,
        measure_device: str = "cpu",
        limits: p.Limits = p.DEFAULT_LIMITS,
        data_roots: list[str] | None = None,
    ) -> None:
        super().__init__(name, broker, limits=limits)
        # Where a plan's Hugging Face directory may be (`flowmesh.roots`; None: here).
        self.roots = Roots.of(data_roots, (), f"partitioner {name}")
        # The mesh's list arrives at registration (`on_allow`); `own` may only narrow it.
        self.own_allow = allow
        self.allow = allow if allow is not None else DEFAULT_ALLOW
        self.measure_device = measure_device
        self._pool = torch_pool(threads, "plan")
        self._tasks: set[asyncio.Task[None]] = set()
        self.planned = 0
        self.failed = 0
        # One traceback per failed plan request would let any client fill the log.
        self.log_throttle = LogThrottle(self.log)

    def registration(self) -> p.Register:
        return p.Register(
            id=1,
            role="partitioner",
            name=self.name,
            pid=os.getpid(),
            info=p.PeerInfo(measure_device=self.measure_device),
        )

    def on_allow(self, allow: tuple[str, ...]) -> None:
        self.allow = narrow_allow(allow, self.own_allow)

    def stats(self) -> dict[str, Any]:
        return {"planned": self.planned, "failed": self.failed, "inflight": len(self._tasks)}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def handle(self, msg: p.Message) -> None:
        if isinstance(msg, p.PlanJob):
            task = asyncio.get_running_loop().create_task(self._plan(msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif isinstance(msg, p.Error):
            self.log.warning("broker answered %s: %s %s", msg.id, msg.code, msg.reason)
        else:
            raise FlowmeshError(Code.BAD_REQUEST, f"a partitioner does not take {msg.TYPE}")

    async def _plan(self, msg: p.PlanJob) -> None:
        loop = asyncio.get_running_loop()
        try:
            plan, inputs = await loop.run_in_executor(
                self._pool,
                plan_for,
                msg.request,
                self.allow,
                self.measure_device,
                f"partitioner {self.name}",
                self.roots,
            )
        except Exception as exc:
            self.failed += 1
            if not isinstance(exc, FlowmeshError):
                self.log_throttle.exception("planning failed")
            self.send(p.error_for(exc, msg.id))
            return
        self.planned += 1
        self.send(p.PlanReply(id=msg.id, plan=plan, inputs=inputs))
