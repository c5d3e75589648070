"""The model catalogue: deploys, undeploys and plans, and the calls they make to peers.

Part of the broker's registry (`broker.registry`); a plain class, no sockets, no clock of its
own. `deploy` asks a partitioner for a plan (cached by the spec's hash and the request:
`broker.plan_cache`), has `broker.placement` place its replicas, then answers once every stage's
`DeployStage` is answered (`stage_ready`), after keeping the model in the store (`--state-dir`).
`undeploy` forgets a model, at once or once its running generations have ended (a drain:
`check_drain`); `plan_request` answers a client's plan request the same way. A plan or stage
call that fails or expires fails what waited on it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

import msgpack
import msgspec

from broker.context import Context, fail
from broker.placement import Placement
from broker.plan_cache import PlanCache
from broker.state import Call, Drain, Model, ModelState, Peer, Replica
from broker.status import model_status
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.spec import check_factory
from flowmesh.value import ArrivalRate

log = logging.getLogger("broker.catalogue")


class Catalogue:
    def __init__(
        self, ctx: Context, placement: Placement, on_change: Callable[[float], None]
    ) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        # The shared tables, under short names (the very dicts: never rebound).
        self.peers = ctx.peers
        self.models = ctx.models
        self.calls = ctx.calls
        self.placement = placement
        self.plan_cache = PlanCache()  # spec and request hash -> answer, bounded in bytes
        self.on_change = on_change
        # The generation calls a model has running or waiting (`GenerationRoom.running_calls`;
        # set by the broker core, which holds both rooms).
        self.generating: Callable[[Model], int] = lambda model: 0

    def deploy(self, addr: bytes, msg: p.Deploy, now: float) -> None:
        spec = msg.spec
        check_factory(spec.factory, self.cfg.allow)
        spec.check_generation_settings()
        if spec.name in self.models:
            if self.models[spec.name].drain is not None:
                raise fail(
                    Code.MODEL_EXISTS,
                    f"model {spec.name!r} is being undeployed (its running generations are "
                    "ending); deploy it again once the undeploy is answered",
                )
            raise fail(
                Code.MODEL_EXISTS, f"model {spec.name!r} is already deployed; undeploy it first"
            )
        workers = self.ctx.workers()
        if not workers:
            raise fail(Code.UNAVAILABLE, "no worker is registered")
        timeout = (msg.timeout_ms / 1000) if msg.timeout_ms else self.cfg.deploy_timeout_s
        model = Model(
            spec=spec,
            state=ModelState.PLANNING,
            deploy_client=(addr, msg.id),
            deploy_deadline=now + timeout,
            rate=ArrivalRate(self.cfg.rate_window_s),
        )
        self.models[spec.name] = model
        request = p.PlanAsk(
            spec=spec, kind="stages", stages=spec.stages, mem_cap=min(w.budget for w in workers)
        )
        try:
            self._ask_plan(request, {"for": "deploy", "model": spec.name}, now)
        except FlowmeshError:
            del self.models[spec.name]
            raise

    def plan_request(self, addr: bytes, msg: p.PlanRequest, now: float) -> None:
        spec = msg.spec
        check_factory(spec.factory, self.cfg.allow)
        if msg.kind not in ("stages", "chunks"):
            raise fail(Code.BAD_REQUEST, f"plan kind {msg.kind!r}: 'stages' or 'chunks'")
        mem_cap = msg.mem_cap
        if mem_cap is None and self.ctx.workers():
            mem_cap = min(w.budget for w in self.ctx.workers())
        request = p.PlanAsk(
            spec=spec,
            kind=msg.kind,
            stages=msg.stages,
            mem_cap=mem_cap,
            target_bytes=msg.target_bytes,
            optimizer=msg.optimizer,
            batch=msg.batch,
            measure=msg.measure,
        )
        timeout = (msg.timeout_ms / 1000) if msg.timeout_ms else self.cfg.deploy_timeout_s
        self._ask_plan(request, {"for": "client", "addr": addr, "id": msg.id}, now, now + timeout)

    def undeploy(self, addr: bytes, msg: p.Undeploy, now: float) -> None:
        """Forget a model: at once, or once its running generations have ended (a drain, up
        to `drain_s`, the broker's `undeploy_drain_s` by default), refusing new calls
        meanwhile. The answer says how many ended meanwhile and how many were cut."""
        model = self.models.get(msg.model)
        if model is None:
            raise fail(Code.MODEL_NOT_FOUND, f"no model {msg.model!r}")
        drain = self.cfg.undeploy_drain_s if msg.drain_s is None else msg.drain_s
        if model.drain is not None:  # asked again while it drains: the earlier end wins
            model.drain.waiters.append((addr, msg.id))
            model.drain.until = min(model.drain.until, now + drain)
            self.check_drain(model, now)
            return
        running = self.generating(model)
        self._forget(model)
        if running and drain > 0:
            model.drain = Drain(now, now + drain, running, [(addr, msg.id)])
            log.info(
                "undeploying model=%s once its %d running generation(s) end (up to %.1f s)",
                model.name,
                running,
                drain,
            )
            return
        self._remove(model, [(addr, msg.id)], now, drained=0, cut=running)

    def check_drain(self, model: Model, now: float) -> None:
        """A draining model goes once its generations and queued requests are done, or at the
        end of its drain, whatever still runs."""
        d = model.drain
        if d is None or self.models.get(model.name) is not model:
            return
        left = self.generating(model)
        if (left or model.queue) and now < d.until:
            return
        self._remove(model, d.waiters, now, drained=max(0, d.running - left), cut=left)

    def _forget(self, model: Model) -> None:
        if self.placement.store is not None:
            try:
                self.placement.store.drop_model(model.name)
            except Exception as exc:
                raise fail(Code.INTERNAL, f"could not forget {model.name!r}: {exc}") from None

    def _remove(
        self, model: Model, waiters: list[tuple[bytes, int]], now: float, *, drained: int, cut: int
    ) -> None:
        del self.models[model.name]
        if model.deploy_client is not None:  # still planning or deploying: its deploy never ends
            addr, ref = model.deploy_client
            reason = f"{model.name!r} was undeployed while deploying"
            self.ctx.to_client(addr, p.Error(id=ref, code=str(Code.MODEL_NOT_FOUND), reason=reason))
            model.deploy_client = None
        for req in model.queue:
            self.ctx.answer_error(req, Code.MODEL_NOT_FOUND, f"{model.name!r} was undeployed")
        model.queue.clear()
        for rep in model.replicas:
            self.placement.drop_replica(model.name, rep)
        self._drop_calls(model.name)
        waited = now - model.drain.since if model.drain is not None else 0.0
        for addr, ref in waiters:
            self.ctx.to_client(
                addr,
                p.Undeployed(id=ref, model=model.name, drained=drained, cut=cut, waited_s=waited),
            )
        log.info("undeployed model=%s drained=%d cut=%d", model.name, drained, cut)
        self.on_change(now)  # the generation room answers the calls it cut (`pump`)

    def ask_plan(
        self,
        request: p.PlanAsk,
        done: Callable[[dict[str, Any] | None, tuple[str, str] | None, float], None],
        now: float,
        deadline: float,
    ) -> None:
        """A plan for another room (the training router's `pipeline="auto"`): `done(answer,
        None, now)` with the plan and inputs, or `done(None, (code, reason), now)`; perhaps
        before this returns, from the plan cache. Raises UNAVAILABLE with no partitioner."""
        self._ask_plan(request, {"for": "room", "done": done}, now, deadline)

    def _ask_plan(
        self,
        request: p.PlanAsk,
        then: dict[str, Any],
        now: float,
        deadline: float | None = None,
    ) -> None:
        # The cache key as it was when the request was a dict: its fields by name, the spec's
        # digest standing for the spec.
        fields = msgspec.structs.asdict(request)
        key = hashlib.sha256(
            msgpack.packb({**fields, "spec": request.spec.digest()}, use_bin_type=True)
        ).hexdigest()
        cached = self.plan_cache.get(key)
        if cached is not None:
            self._plan_ready(then, cached, now)
            return
        parts = [w for w in self.peers.values() if w.role == "partitioner" and w.ready]
        if not parts:
            raise fail(Code.UNAVAILABLE, "no partitioner is registered")
        part = min(parts, key=lambda w: (w.inflight_plans, w.name))
        cid = next(self.ctx.ids)
        if then["for"] == "deploy":
            deadline = self.models[then["model"]].deploy_deadline
        elif deadline is None:
            deadline = now + self.cfg.deploy_timeout_s
        self.calls[cid] = Call(
            "plan",
            part.name,
            deadline,
            {**then, "key": key, "request": request, "model": then.get("model")},
        )
        part.inflight_plans += 1
        self.ctx.to_peer(part.name, p.PlanJob(id=cid, request=request))

    def plan_reply(self, peer: Peer, msg: p.PlanReply, now: float) -> None:
        call = self._pop_call(msg.id, "plan", peer)
        peer.inflight_plans -= 1
        # The plan checked itself on receipt (`Plan`, BAD_REQUEST to the partitioner if not).
        answer = {"plan": msg.plan, "inputs": msg.inputs}
        self.plan_cache.put(call.data["key"], answer)
        self._plan_ready(call.data, answer, now)

    def _plan_ready(self, then: dict[str, Any], answer: dict[str, Any], now: float) -> None:
        if then["for"] == "room":
            then["done"](answer, None, now)
            return
        if then["for"] == "client":
            self.ctx.to_client(
                then["addr"],
                p.PlanReply(id=then["id"], plan=answer["plan"], inputs=answer["inputs"]),
            )
            return
        model = self.models.get(then["model"])
        if model is None or model.state is not ModelState.PLANNING:
            return
        try:
            self.placement.place_new_model(model, answer["plan"], answer["inputs"])
        except FlowmeshError as exc:
            self.deploy_failed(model, exc.code, exc.reason)
        except Exception as exc:  # a plan that passed its checks but still cannot be placed
            log.exception("placing model=%s failed", model.name)
            self.deploy_failed(model, Code.PLAN_ERROR, f"{type(exc).__name__}: {exc}")

    def plan_failed(self, call: Call, code: str, reason: str, now: float) -> None:
        if call.data["for"] == "room":
            call.data["done"](None, (code, reason), now)
            return
        if call.data["for"] == "client":
            self.ctx.to_client(
                call.data["addr"], p.Error(id=call.data["id"], code=code, reason=reason)
            )
            return
        model = self.models.get(call.data["model"])
        if model is not None:
            self.deploy_failed(model, code, reason)

    def stage_ready(self, peer: Peer, msg: p.StageReady, now: float) -> None:
        if (
            msg.id not in self.calls
            and peer.role == "worker"
            and not self._counts_on(peer, msg.model, msg.stage)
        ):
            # Its call was dropped (the deploy failed or timed out, the model was undeployed, a
            # repair was given up) while the worker still prepared the stage: it holds it now,
            # and would for good, counted nowhere. Refusing it would not free it.
            self._drop_stage(peer, msg.model, msg.stage)
            return
        call = self._pop_call(msg.id, "stage", peer)
        model = self.models.get(msg.model)
        rep: Replica = call.data["replica"]
        if model is None or rep not in model.replicas:
            self._drop_stage(peer, msg.model, msg.stage)
            return
        if msg.nbytes > peer.budget:
            self.stage_failed(
                call,
                f"stage {msg.stage} takes {msg.nbytes} device bytes on "
                f"worker {peer.name}, over its budget of {peer.budget}",
                str(Code.TOO_BIG),
                now,
            )
            return
        peer.hosted[(msg.model, msg.stage)] = msg.nbytes
        rep.ready[msg.stage] = True
        if model.state is ModelState.DEPLOYING and all(r.live for r in model.replicas):
            if self.placement.store is not None:
                # Kept before it is promised: the answer below says the model is deployed.
                try:
                    self.placement.store.save_model(self.placement.record(model))
                except Exception as exc:
                    self.deploy_failed(model, Code.INTERNAL, f"could not keep the model: {exc}")
                    return
            model.state = ModelState.READY
            if model.deploy_client is not None:
                addr, ref = model.deploy_client
                self.ctx.to_client(addr, p.Deployed(id=ref, model=model_status(model, self.peers)))
                model.deploy_client = None
            log.info(
                "deployed model=%s stages=%d replicas=%d",
                model.name,
                model.n_stages,
                len(model.replicas),
            )
        elif model.state is ModelState.UNAVAILABLE and rep.live:
            model.state = ModelState.READY
        self.on_change(now)

    def stage_failed(self, call: Call, reason: str, code: str, now: float) -> None:
        model = self.models.get(call.data["model"])
        rep: Replica = call.data["replica"]
        if model is None or rep not in model.replicas:
            return
        if model.state is ModelState.DEPLOYING:
            self.deploy_failed(model, code, reason)
            return
        # A repair failed: give the replica up; reconcile tries again after a pause.
        log.warning("replica repair failed model=%s reason=%s", model.name, reason)
        model.repair_after = now + self.cfg.repair_backoff_s
        model.replicas.remove(rep)
        self.placement.drop_replica(model.name, rep)
        self.placement.mark_availability(model, reason)
        self.placement.persist(model)

    def deploy_failed(self, model: Model, code: Code | str, reason: str) -> None:
        if model.deploy_client is not None:
            addr, ref = model.deploy_client
            self.ctx.to_client(addr, p.Error(id=ref, code=str(code), reason=reason))
            model.deploy_client = None
        self.models.pop(model.name, None)
        for rep in model.replicas:
            self.placement.drop_replica(model.name, rep)
        self._drop_calls(model.name)
        log.warning("deploy failed model=%s code=%s reason=%s", model.name, code, reason)

    def deploy_overdue(self, model: Model, now: float) -> None:
        """Fail a deploy still planning or deploying past its deadline."""
        if (
            model.state in (ModelState.PLANNING, ModelState.DEPLOYING)
            and now >= model.deploy_deadline
        ):
            self.deploy_failed(model, Code.TIMEOUT, "deploy did not finish in time")

    def call_failed(self, peer: Peer, call: Call, code: str, reason: str, now: float) -> None:
        """`peer` answered a plan or stage call of ours with an error."""
        if call.kind == "plan":
            peer.inflight_plans -= 1
            self.plan_failed(call, code, reason, now)
        elif call.kind == "stage":
            self.stage_failed(call, f"worker {peer.name}: {reason}", code, now)

    def call_expired(self, call: Call, code: str, undelivered: str | None, now: float) -> None:
        """A plan or stage call got no answer in time (or could not be sent: `undelivered`
        says why): fail what waited on it."""
        if call.kind == "plan":
            peer = self.peers.get(call.peer)
            if peer is not None:
                peer.inflight_plans -= 1
            why = undelivered or f"partitioner {call.peer} did not answer in time"
            self.plan_failed(call, code, why, now)
        elif call.kind == "stage":
            why = undelivered or (
                f"worker {call.peer} did not prepare stage {call.data['stage']} in time"
            )
            self.stage_failed(call, why, code, now)

    def _drop_calls(self, name: str) -> None:
        """Forget the plan and stage calls made for model `name` (undeployed, or its deploy
        failed): a plan's answer, if one comes, is refused; a stage's is answered with
        DropStage (`stage_ready`), the worker holding it by then. A partitioner's plan is no
        longer counted as in progress there (its count chooses the partitioner of the next
        plan)."""
        for cid in [i for i, c in self.calls.items() if c.data.get("model") == name]:
            call = self.calls.pop(cid)
            peer = self.peers.get(call.peer) if call.kind == "plan" else None
            if peer is not None:  # (perhaps registered anew since: never below 0)
                peer.inflight_plans = max(0, peer.inflight_plans - 1)

    def _counts_on(self, peer: Peer, name: str, stage: int) -> bool:
        """Whether live model `name` counts on `peer` for its stage `stage`, held or still being
        prepared (`deploy_stage` counts it from the start): a StageReady nobody awaits (late,
        repeated or forged) must not make the worker drop that one."""
        return name in self.models and (name, stage) in peer.hosted

    def _drop_stage(self, peer: Peer, name: str, stage: int) -> None:
        """Tell `peer` to free a stage that no replica here runs."""
        log.info("dropping stage model=%s stage=%d on %s (no replica)", name, stage, peer.name)
        self.ctx.to_peer(peer.name, p.DropStage(id=next(self.ctx.ids), model=name, stage=stage))
        peer.hosted.pop((name, stage), None)

    def _pop_call(self, cid: int, kind: str, peer: Peer) -> Call:
        """The pending call `cid`, only if it is a `kind` call sent to `peer` (nobody else may
        answer it); it stays pending otherwise."""
        call = self.calls.get(cid)
        if call is None or call.kind != kind or call.peer != peer.name:
            raise fail(Code.BAD_REQUEST, f"no pending {kind} call {cid} for {peer.name}")
        del self.calls[cid]
        return call
