"""Where a model's replicas live: placed, deployed stage by stage, repaired, dropped, kept.

Part of the broker's registry (`broker.registry`); a plain class, no sockets, no clock of its
own. Replicas are placed by `policy.place_replicas` on distinct workers that can hold their
stages, or, for a model with more stages than such workers, as one streamed replica whose
workers hold several stages each (`policy.shared_placement`); each stage is deployed with one
`DeployStage` call (answered in `broker.catalogue`). A replica lost with a worker, or given up
after a hung run, is re-created by `reconcile` where live workers can hold it. With
`--state-dir`, a deployed model's placement is kept in `broker.store` as it changes (`persist`),
so that a restarted broker can take it up (`broker.restore`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from broker.context import Context, fail
from broker.policy import place_replicas
from broker.state import Call, Model, ModelState, Replica
from broker.store import ModelRecord, Store
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.plan import Plan
from flowmesh.spec import TensorSpec

log = logging.getLogger("broker.placement")


class Placement:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        # The shared tables, under short names (the very dicts: never rebound).
        self.peers = ctx.peers
        self.models = ctx.models
        self.calls = ctx.calls
        # Where deployed models are kept across restarts (`--state-dir`); None: nowhere.
        self.store: Store | None = None

    def record(self, model: Model) -> ModelRecord:
        return ModelRecord(
            name=model.name,
            spec=model.spec.to_dict(),
            plan=model.plan.to_dict() if model.plan is not None else {},
            inputs=(
                {n: {"dtype": t.dtype, "shape": list(t.shape)} for n, t in model.inputs.items()}
                if model.inputs
                else None
            ),
            stage_bytes=list(model.stage_bytes),
            # The deployed count: replicas the autoscaler added are not promised across restarts.
            desired_replicas=model.floor_replicas or model.desired_replicas,
            placement=[list(r.workers) for r in model.replicas],
        )

    def persist(self, model: Model) -> None:
        """Keep a deployed model's placement (its spec and plan do not change) in the store.
        A failure is logged: the model stays deployed, and a restart re-creates what it lacks."""
        if self.store is None or model.state not in (ModelState.READY, ModelState.UNAVAILABLE):
            return
        if model.drain is not None:  # forgotten already: being undeployed
            return
        if self.models.get(model.name) is not model:
            return
        try:
            self.store.save_model(self.record(model))
        except Exception as exc:
            log.error("could not keep the placement of model=%s: %s", model.name, exc)

    def place_new_model(
        self, model: Model, plan: Plan, inputs: dict[str, TensorSpec] | None
    ) -> None:
        stage_bytes = list(plan.range_bytes)
        n = len(stage_bytes)
        workers = self.ctx.workers()
        if not workers:
            raise fail(Code.TOO_BIG, f"{model.name!r} needs a worker; none is registered")
        # More stages than workers is no refusal: they share workers and stream (`place_replicas`).
        largest = max(w.budget for w in workers)
        for i, b in enumerate(stage_bytes):
            if b > largest:
                hint = (
                    "deploy with more stages, or omit stages to choose automatically"
                    if model.spec.stages
                    else "no split of its blocks fits"
                )
                raise fail(
                    Code.TOO_BIG,
                    f"{model.name!r} stage {i} needs {b} bytes but the "
                    f"largest device budget is {largest} bytes; {hint}",
                )
        want = model.spec.replicas or max(1, min(self.cfg.default_replicas, len(workers) // n))
        placements = place_replicas(workers, stage_bytes, want)
        if not placements:
            raise fail(Code.TOO_BIG, f"no set of {n} workers can hold {model.name!r}")
        model.plan, model.stage_bytes = plan, stage_bytes
        model.inputs = inputs or None
        model.state = ModelState.DEPLOYING
        model.desired_replicas = model.floor_replicas = want
        for workers_of in placements:
            self.deploy_replica(model, workers_of, model.deploy_deadline)

    def deploy_replica(self, model: Model, workers_of: list[str], deadline: float) -> Replica:
        rep = Replica(workers=list(workers_of), ready=[False] * len(workers_of))
        model.replicas.append(rep)
        for stage in range(len(workers_of)):
            self.deploy_stage(model, rep, stage, deadline)
        return rep

    def deploy_stage(self, model: Model, rep: Replica, stage: int, deadline: float) -> None:
        wname = rep.workers[stage]
        cid = next(self.ctx.ids)
        self.calls[cid] = Call(
            "stage", wname, deadline, {"model": model.name, "stage": stage, "replica": rep}
        )
        self.peers[wname].hosted[(model.name, stage)] = model.stage_bytes[stage]
        self.ctx.to_peer(
            wname,
            p.DeployStage(
                id=cid,
                model=model.name,
                stage=stage,
                spec=model.spec,
                plan=model.plan,
            ),
        )

    def reconcile(self, now: float) -> None:
        """Re-create replicas lost with workers, where live workers can hold them."""
        for model in self.models.values():
            if model.state not in (ModelState.READY, ModelState.UNAVAILABLE):
                continue
            missing = model.desired_replicas - len(model.replicas)
            if missing <= 0 or now < model.repair_after:
                continue
            taken = {(s, w) for r in model.replicas for s, w in enumerate(r.workers)}
            # Away from workers where this model's runs hung, unless no other can hold it, or
            # only by streaming its stages through one device (slower, and no generation)
            # where all the workers would give each stage a worker of its own.
            trusted = [w for w in self.ctx.workers() if w.name not in model.avoid]
            places = place_replicas(trusted, model.stage_bytes, missing, taken)
            if not places or any(len(set(ws)) < len(ws) for ws in places):
                anywhere = place_replicas(self.ctx.workers(), model.stage_bytes, missing, taken)
                if not places or (anywhere and all(len(set(ws)) == len(ws) for ws in anywhere)):
                    places = anywhere
            for workers_of in places:
                self.deploy_replica(model, workers_of, now + self.cfg.deploy_timeout_s)
                log.info("re-creating replica model=%s workers=%s", model.name, workers_of)
            if places:
                self.persist(model)

    def give_up_replica(
        self, model: Model, rep: Replica, suspects: Sequence[str], reason: str
    ) -> None:
        """A run hung on one of `suspects` (the worker it waited for; every stage's, for a
        direct run, which does not say where it is): drop the replica; `reconcile` re-creates
        it away from them when other workers can hold the stages."""
        if rep not in model.replicas:
            return
        model.avoid.update(suspects)
        model.replicas.remove(rep)
        self.drop_replica(model.name, rep)
        self.mark_availability(model, reason)
        self.persist(model)

    def drop_replica(self, name: str, rep: Replica, lost: str | None = None) -> None:
        """Free a replica's device and host bytes on its surviving workers."""
        for stage, w in enumerate(rep.workers):
            peer = self.peers.get(w)
            if peer is None or w == lost:
                continue
            key = (name, stage)
            if key in peer.resident:
                self.ctx.evict(peer, key)
            if peer.hosted.pop(key, None) is not None:
                self.ctx.to_peer(w, p.DropStage(id=next(self.ctx.ids), model=name, stage=stage))

    def mark_availability(self, model: Model, why: str) -> None:
        if model.replicas or model.state is not ModelState.READY:
            return
        model.state = ModelState.UNAVAILABLE
        for req in model.queue:
            self.ctx.answer_error(
                req, Code.WORKER_LOST, f"{model.name!r} has no live replica ({why})"
            )
        model.queue.clear()


def stored_plan(plan: dict[str, Any]) -> Plan:
    """A plan as the store keeps it (plain data, perhaps written by an older broker), once the
    plan's own validation took it (`Plan.from_dict`: PLAN_ERROR naming what is wrong)."""
    try:
        return Plan.from_dict(plan)
    except FlowmeshError:
        raise
    except Exception as exc:  # a plan's values are a peer's: whatever they are, not fatal
        raise fail(Code.PLAN_ERROR, f"bad plan: {type(exc).__name__}: {exc}"[:300]) from None
