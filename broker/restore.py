"""What a restarted broker restores (`--state-dir`): the models it kept, and their stages that
the workers bring back.

Part of the broker's registry (`broker.registry`); a plain class, no sockets, no clock of its
own. Deployed models are kept in `broker.store` before their deploy is answered (placement
updated as it changes: `broker.placement`); a restarted broker `restore`s them and takes up the
stages each worker lists in its registration's inventory (`adopt`); what nobody brought back is
repaired (`finish_restore`). A worker registering afresh with stages this broker does not expect
there (unknown model, other spec or plan, no replica slot) is told to drop them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from broker.context import Context, fail
from broker.placement import Placement, stored_plan
from broker.state import Model, ModelState, Peer, Phase, Replica, Residency
from broker.store import ModelRecord
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.spec import ModelSpec, check_factory, parse_inputs
from flowmesh.value import ArrivalRate

log = logging.getLogger("broker.restore")


class Restorer:
    def __init__(
        self, ctx: Context, placement: Placement, on_change: Callable[[float], None]
    ) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        # The shared tables, under short names (the very dicts: never rebound).
        self.peers = ctx.peers
        self.models = ctx.models
        self.placement = placement
        self.on_change = on_change
        # After a restart: replicas read from the store that wait for their workers to register
        # with the stages they hold, until `restore_until` (see `restore`, `finish_restore`).
        self.restoring: list[tuple[str, Replica]] = []
        self.restore_until: float | None = None

    def restore(self, records: dict[str, ModelRecord], now: float, grace_s: float) -> None:
        """After a restart: the models the store kept, deployed again as they were, each
        replica waiting for its workers to register with its stages (`_adopt`). A model is
        READY at once, so that its requests queue rather than fail; they run as soon as one of
        its replicas lives. What is still missing at `now + grace_s`, or once every worker
        named has registered, is repaired (`finish_restore`)."""
        for rec in records.values():
            try:
                spec = ModelSpec.from_dict(rec.spec)
                check_factory(spec.factory, self.cfg.allow)
                plan = stored_plan(rec.plan)
                stage_bytes = list(plan.range_bytes)
                if list(stage_bytes) != list(rec.stage_bytes):
                    raise fail(Code.PLAN_ERROR, "its stage sizes do not match its plan")
                inputs = parse_inputs(rec.inputs) if rec.inputs else None
            except FlowmeshError as exc:
                log.error("not restoring model=%s: %s", rec.name, exc.reason)
                if self.placement.store is not None:
                    self.placement.store.drop_model(rec.name)
                continue
            model = Model(
                spec=spec,
                state=ModelState.READY,
                plan=plan,
                stage_bytes=list(rec.stage_bytes),
                inputs=inputs,
                desired_replicas=max(1, rec.desired_replicas),
                floor_replicas=max(1, rec.desired_replicas),
                rate=ArrivalRate(self.cfg.rate_window_s),
            )
            for workers_of in rec.placement:
                if len(workers_of) == model.n_stages:  # shared workers: a streamed replica
                    rep = Replica(workers=list(workers_of), ready=[False] * model.n_stages)
                    model.replicas.append(rep)
                    self.restoring.append((model.name, rep))
            self.models[model.name] = model
            log.info(
                "restored model=%s stages=%d replicas=%d (waiting for their workers)",
                model.name,
                model.n_stages,
                len(model.replicas),
            )
        self.restore_until = now + grace_s

    def adopt(self, peer: Peer, held: list[p.HeldStage], now: float) -> None:
        """A worker registered afresh with the stages it holds: each one that a restored
        replica expects there, built from the same spec and plan (its digest), is taken up as
        it is, device copy included; every other stage is dropped (`DropStage`), as no
        replica will run it and its bytes would be lost to the budget."""
        lived = False
        for item in held:
            key = (item.model, item.stage)
            model = self.models.get(key[0])
            slot = None
            if model is not None and key[1] < model.n_stages:
                digest = p.stage_digest(model.spec, model.plan or {}, key[1])
                if item.digest == digest:
                    slot = next(
                        (
                            r
                            for r in model.replicas
                            if r.workers[key[1]] == peer.name and not r.ready[key[1]]
                        ),
                        None,
                    )
            if model is None or slot is None or key in peer.hosted:
                log.info("dropping stage model=%s stage=%d held by %s", *key, peer.name)
                self.ctx.to_peer(
                    peer.name, p.DropStage(id=next(self.ctx.ids), model=key[0], stage=key[1])
                )
                continue
            slot.ready[key[1]] = True
            peer.hosted[key] = item.nbytes
            if item.resident and peer.used + item.nbytes <= peer.budget:
                peer.resident[key] = Residency(key, item.nbytes, Phase.RESIDENT, now)
            elif item.resident:  # over what we plan with: free it
                self.ctx.to_peer(
                    peer.name, p.Evict(id=next(self.ctx.ids), model=key[0], stage=key[1])
                )
            log.info(
                "adopted stage model=%s stage=%d on %s (resident: %s)",
                *key,
                peer.name,
                key in peer.resident,
            )
            if slot.live:
                lived = True
                log.info("replica live again model=%s workers=%s", key[0], slot.workers)
        if lived:
            self.on_change(now)

    def finish_restore(self, now: float) -> None:
        """End the wait for workers after a restart, once every worker a restored replica names
        has registered or the grace has passed: a stage its worker did not bring back is
        deployed there again (a repair that reads its weights); a replica whose worker never
        came back is given up, and `reconcile` places it anew."""
        if self.restore_until is None:
            return
        waiting = {
            w
            for name, rep in self.restoring
            if name in self.models and rep in self.models[name].replicas and not rep.live
            for w in rep.workers
        }
        if now < self.restore_until and not all(w in self.peers for w in waiting):
            return
        restoring, self.restoring, self.restore_until = self.restoring, [], None
        for name, rep in restoring:
            model = self.models.get(name)
            if model is None or rep not in model.replicas or rep.live:
                continue
            gone = [w for w in rep.workers if w not in self.peers]
            if gone:
                why = f"worker(s) {', '.join(gone)} did not come back after the broker restarted"
                log.warning("giving up restored replica model=%s: %s", name, why)
                model.replicas.remove(rep)
                self.placement.drop_replica(name, rep)
                self.placement.mark_availability(model, why)
            else:
                for stage, ready in enumerate(rep.ready):
                    if not ready:
                        log.info(
                            "repairing restored replica model=%s stage=%d on %s",
                            name,
                            stage,
                            rep.workers[stage],
                        )
                        self.placement.deploy_stage(
                            model, rep, stage, now + self.cfg.deploy_timeout_s
                        )
            self.placement.persist(model)
        log.info("restore done: %d model(s)", len(self.models))
        self.placement.reconcile(now)
        self.on_change(now)
