"""Autoscaling: one more replica of a model its queue says one is not enough for, one fewer of
a cooled one.

Part of the broker's registry (`broker.registry`); the rule itself is `policy.scale_step`,
the replicas are placed and dropped by `broker.placement`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from broker.context import Context
from broker.placement import Placement
from broker.policy import place_replicas, scale_step
from broker.state import Model, ModelState, Replica

log = logging.getLogger("broker.autoscale")


class Autoscaler:
    def __init__(self, ctx: Context, placement: Placement) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.models = ctx.models  # the shared table (the very dict: never rebound)
        self.placement = placement
        # Whether live sequences of a model keep their KV on a replica's workers (set by the
        # core: `GenerationRoom.holds`): such a replica drains until they end.
        self.holds: Callable[[Model, Replica], bool] = lambda model, rep: False

    def autoscale(self, now: float, means: dict[str, dict[str, float]]) -> None:
        """One more replica of a model its queue says one is not enough for, one fewer of a
        cooled one (`policy.scale_step`); `means` is `Timings.model_means()`. A replica being
        removed takes no new batch nor sequence and is dropped once its batches have answered
        and its sequences ended, so a shrink fails no request and cuts no generation short."""
        cfg = self.cfg
        for model in self.models.values():
            for rep in [r for r in model.replicas if r.draining]:
                if not any(r.live for r in model.replicas):
                    # The replica it kept was lost meanwhile: keep this one after all.
                    rep.draining = False
                    model.desired_replicas += 1
                    log.info("keeping draining replica model=%s: the other was lost", model.name)
                elif self._drop_if_drained(model, rep):
                    log.info("dropped drained replica model=%s workers=%s", model.name, rep.workers)
            if not cfg.autoscale or model.state is not ModelState.READY or model.drain is not None:
                continue
            live = [r for r in model.replicas if r.live]
            taken = {(s, w) for r in model.replicas for s, w in enumerate(r.workers)}
            workers = [w for w in self.ctx.workers() if w.name not in model.avoid]
            room = place_replicas(workers, model.stage_bytes, 1, taken)
            m = means.get(model.name, {})
            service_s = (
                m["run_ms"] / 1000 / max(1.0, m.get("mean_batch", 1.0)) / max(1, model.n_stages)
                if m.get("run_ms")
                else None
            )
            step = scale_step(
                now,
                queue=len(model.queue),
                rate=model.rate.at(now),
                inflight=sum(r.inflight for r in live) / len(live) if live else 0.0,
                service_s=service_s,
                live=len(live),
                replicas=len(model.replicas),
                floor=model.floor_replicas or model.desired_replicas,
                workers=len(self.ctx.workers()),
                room=bool(room),
                hot_since=model.hot_since,
                cool_since=model.cool_since,
                last_scaled=model.last_scaled,
                queue_high=cfg.scale_queue_high,
                up_load=cfg.scale_up_load,
                down_load=cfg.scale_down_load,
                cool_rate=cfg.scale_cool_rate,
                up_after_s=cfg.scale_up_after_s,
                down_after_s=cfg.scale_down_after_s,
                cooldown_s=cfg.scale_cooldown_s,
            )
            model.hot_since, model.cool_since = step.hot_since, step.cool_since
            if step.delta > 0:
                model.desired_replicas += 1
                model.scale_ups += 1
                model.last_scaled = now
                self.placement.deploy_replica(model, room[0], now + cfg.deploy_timeout_s)
                self.placement.persist(model)
                log.info("scaling up model=%s workers=%s: %s", model.name, room[0], step.why)
            elif step.delta < 0:
                # The idlest live replica (one without live sequences first), the newest among
                # equals.
                rep = min(reversed(live), key=lambda r: (self.holds(model, r), r.inflight))
                rep.draining = True
                model.desired_replicas -= 1
                model.scale_downs += 1
                model.last_scaled = now
                log.info("scaling down model=%s workers=%s: %s", model.name, rep.workers, step.why)
                self._drop_if_drained(model, rep)

    def _drop_if_drained(self, model: Model, rep: Replica) -> bool:
        """Drop draining `rep` when nothing runs on it: no batch, no live sequence."""
        if rep.inflight > 0 or self.holds(model, rep):
            return False
        model.replicas.remove(rep)
        self.placement.drop_replica(model.name, rep)
        self.placement.persist(model)
        return True
