"""The broker's registry: who is in the mesh, which models are deployed, where their stages live.

A plain class, driven by `BrokerCore`; no sockets, no clock of its own. It owns:

- **Peers**: registration (a process registering again keeps its state; a restarted one replaces
  its old self once that is lost; a name a live peer of another process holds is refused with
  `name_taken`), readiness on the first heartbeat, liveness on `tick`, and the clean-up of a lost
  peer's calls and replicas.
- **The model catalogue**: `deploy` (plan from a partitioner, cached by the spec's hash, then one
  `DeployStage` per stage and replica), `undeploy`, and plans asked for by clients.
- **Placement and repair**: replicas placed by `policy.place_replicas`; a replica lost with a
  worker, or given up after a hung run, is re-created by `reconcile` where live workers can hold it.
- **Restarts** (`--state-dir`): deployed models are kept in `broker.store` before their deploy is
  answered (placement updated as it changes); a restarted broker `restore`s them and takes up
  the stages each worker lists in its registration's inventory (`_adopt`); what nobody brought
  back is repaired (`finish_restore`). A worker registering afresh with stages this broker does
  not expect there (unknown model, other spec or plan, no replica slot) is told to drop them.

What it does not decide: which requests run and which stages are resident (`ServingRouter`), and
training jobs (`TrainingRouter`). It tells the others through four callbacks: `on_change` (a
replica became ready, a worker joined, a queue was answered: start what can start now),
`on_replica_lost` (a replica's runs in flight need failing over), `on_worker_lost` (a worker's
training jobs are gone) and `on_worker_joined` (a worker registered afresh with these jobs).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Callable
from typing import Any

import msgpack

from broker.checks import check_stats
from broker.context import BACKEND, Context, fail
from broker.plan_cache import PlanCache
from broker.policy import heart_failed, place_replicas, scale_step
from broker.state import Call, Model, ModelState, Peer, Phase, Replica, Residency
from broker.status import model_status
from broker.store import ModelRecord, Store
from flowmesh import protocol as p
from flowmesh.auth import Identity, check_registration
from flowmesh.errors import Code, FlowmeshError
from flowmesh.logs import LogThrottle
from flowmesh.modelio.plan import Plan
from flowmesh.spec import ModelSpec, check_factory, parse_inputs

log = logging.getLogger("broker.registry")


class Registry:
    def __init__(
        self,
        ctx: Context,
        *,
        on_change: Callable[[float], None],
        on_replica_lost: Callable[[Model, Replica, str, float], None],
        on_worker_lost: Callable[[str], None],
        on_worker_joined: Callable[[str, list[p.HeldJob], float], None] | None = None,
    ) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        # The shared tables, under short names (the very dicts: never rebound).
        self.peers = ctx.peers
        self.by_addr = ctx.by_addr
        self.models = ctx.models
        self.calls = ctx.calls
        self.plan_cache = PlanCache()  # spec and request hash -> answer, bounded in bytes
        self.on_change = on_change
        self.on_replica_lost = on_replica_lost
        self.on_worker_lost = on_worker_lost
        # A worker registered afresh, with the training jobs it holds (its inventory's "jobs").
        self.on_worker_joined = on_worker_joined or (lambda name, jobs, now: None)
        # Where deployed models are kept across restarts (`--state-dir`); None: nowhere.
        self.store: Store | None = None
        # After a restart: replicas read from the store that wait for their workers to register
        # with the stages they hold, until `restore_until` (see `restore`, `finish_restore`).
        self.restoring: list[tuple[str, Replica]] = []
        self.restore_until: float | None = None
        # Registrations refused for a name a live peer holds: a flood of them logs a few lines.
        self.refusals = LogThrottle(log)

    # ================================================================== peers

    def register(
        self,
        addr: bytes,
        msg: p.Register,
        now: float,
        identity: Identity | None = None,
        *,
        keyed: bool = False,
    ) -> None:
        """`keyed` (CURVE on): only under the name and role `identity`'s certificate grants."""
        if keyed:
            try:
                check_registration(identity, msg.name, msg.role)
            except FlowmeshError:
                self.ctx.totals["auth_refused"] = self.ctx.totals.get("auth_refused", 0) + 1
                self.refusals.warning(
                    "refused registration name=%s role=%s key=%s",
                    msg.name,
                    msg.role,
                    identity.name if identity else None,
                )
                raise
        if msg.role not in ("worker", "partitioner"):
            raise fail(Code.BAD_REQUEST, f"unknown role {msg.role!r}")
        if msg.role == "worker" and msg.budget_bytes <= 0:
            raise fail(Code.BAD_REQUEST, "a worker must report a positive memory budget")
        if not msg.name:
            raise fail(Code.BAD_REQUEST, "a peer needs a name")
        lanes = msg.info.get("compute_lanes", 2)
        if isinstance(lanes, bool) or not isinstance(lanes, int) or not 1 <= lanes <= 1024:
            raise fail(Code.BAD_REQUEST, f"register info compute_lanes: bad value {lanes!r}")
        held_stages, held_jobs = check_inventory(msg.inventory)
        old = self.peers.get(msg.name)
        if (
            old is not None
            and same_process(old, addr, msg)
            and self.by_addr.get(addr) in (None, msg.name)
        ):
            # The same process registering again (it missed our heartbeats, or opened a fresh
            # socket): it still holds what it held, so keep its state and work in flight.
            if old.addr != addr:
                self.by_addr.pop(old.addr, None)
                old.addr = addr
            self.by_addr[addr] = old.name
            old.last_seen = now
            old.registrations += 1
            self.ctx.send(BACKEND, addr, self._ack(msg.id, kept=True))
            log.info(
                "registered again name=%s role=%s pid=%d (state kept, %d registrations)",
                msg.name,
                msg.role,
                msg.pid,
                old.registrations,
            )
            return
        if old is not None and old.addr != addr and not self._silent(old, now):
            # Another process under a name a live peer holds: an impostor, or a second worker
            # started under the same name. Refused (its process stops), never flapping between
            # the two; a restarted process gets in once its predecessor is lost (its connection
            # gone, the next tick's heartbeat cannot reach it; or silent past liveness).
            self.ctx.totals["names_refused"] = self.ctx.totals.get("names_refused", 0) + 1
            self.refusals.warning(
                "refused registration name=%s role=%s pid=%d: held by the live pid %d",
                msg.name,
                msg.role,
                msg.pid,
                old.pid,
            )
            raise fail(
                Code.NAME_TAKEN,
                f"name {msg.name!r} is held by a live {old.role} of another process (pid "
                f"{old.pid}, heard from {now - old.last_seen:.1f} s ago): start this one under "
                "another --name, or stop that one first",
            )
        if old is not None:
            self.peer_dead(old, now, "re-registered (restarted)")
        stale = self.by_addr.get(addr)
        if stale is not None and stale in self.peers:
            self.peer_dead(self.peers[stale], now, "re-registered under another name")
        self.peers[msg.name] = Peer(
            name=msg.name,
            addr=addr,
            role=msg.role,
            pid=msg.pid,
            device=msg.device,
            kind=msg.kind,
            budget=msg.budget_bytes,
            info=msg.info,
            last_seen=now,
            max_inflight=2 * max(1, lanes),
            key=identity.public if keyed and identity is not None else "",
        )
        self.by_addr[addr] = msg.name
        self.ctx.send(BACKEND, addr, self._ack(msg.id, kept=False))
        log.info(
            "registered name=%s role=%s pid=%d holding stages=%d jobs=%d",
            msg.name,
            msg.role,
            msg.pid,
            len(held_stages),
            len(held_jobs),
        )
        if msg.role == "worker":
            self._adopt(self.peers[msg.name], held_stages, now)
            self.on_worker_joined(msg.name, held_jobs, now)
            self.finish_restore(now)

    def _silent(self, peer: Peer, now: float) -> bool:
        return heart_failed(peer.last_seen, now, self.cfg.heartbeat_s, self.cfg.liveness)

    def _ack(self, ref: int, *, kept: bool) -> p.RegisterAck:
        return p.RegisterAck(
            id=ref,
            heartbeat_s=self.cfg.heartbeat_s,
            liveness=self.cfg.liveness,
            kept=kept,
            allow=list(self.cfg.allow),
        )

    def heartbeat(self, peer: Peer, msg: p.Heartbeat, now: float) -> None:
        peer.stats = check_stats(msg.stats)
        if not peer.ready:
            peer.ready = True
            log.info(
                "peer ready name=%s role=%s device=%s budget=%d",
                peer.name,
                peer.role,
                peer.device,
                peer.budget,
            )
            self.reconcile(now)
            self.on_change(now)

    def check_hearts(self, now: float) -> None:
        """Heartbeats out to live peers; peers silent too long are lost."""
        for peer in list(self.peers.values()):
            if heart_failed(peer.last_seen, now, self.cfg.heartbeat_s, self.cfg.liveness):
                self.peer_dead(peer, now, "missed heartbeats")
            else:
                self.ctx.to_peer(peer.name, p.Heartbeat(stats={}))

    def peer_unreachable(self, addr: bytes, now: float) -> None:
        name = self.by_addr.get(addr)
        if name is not None:
            self.peer_dead(self.peers[name], now, "unreachable")

    def peer_dead(self, peer: Peer, now: float, why: str) -> None:
        self.peers.pop(peer.name, None)
        if self.by_addr.get(peer.addr) == peer.name:
            del self.by_addr[peer.addr]
        log.warning("peer lost name=%s role=%s why=%s", peer.name, peer.role, why)
        for cid, call in list(self.calls.items()):
            if call.peer != peer.name:
                continue
            del self.calls[cid]
            if call.kind == "plan":
                self.plan_failed(
                    call, str(Code.UNAVAILABLE), f"partitioner {peer.name} was lost while planning"
                )
            elif call.kind == "stage":
                self.stage_failed(
                    call, f"worker {peer.name} was lost while deploying", str(Code.WORKER_LOST), now
                )
        if peer.role != "worker":
            return
        self.on_worker_lost(peer.name)
        for model in list(self.models.values()):
            lost = [r for r in model.replicas if peer.name in r.workers]
            for rep in lost:
                model.replicas.remove(rep)
                self.drop_replica(model.name, rep, lost=peer.name)
                self.on_replica_lost(model, rep, peer.name, now)
            if lost:
                self.persist(model)
        self.reconcile(now)
        for model in self.models.values():
            if not model.replicas:
                self.mark_availability(model, f"lost with worker {peer.name}")
        self.on_change(now)

    # ================================================================== catalogue

    def deploy(self, addr: bytes, msg: p.Deploy, now: float) -> None:
        spec = ModelSpec.from_dict(msg.spec)
        check_factory(spec.factory, self.cfg.allow)
        if spec.name in self.models:
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
        )
        self.models[spec.name] = model
        request = {
            "spec": spec.to_dict(),
            "kind": "stages",
            "stages": spec.stages,
            "mem_cap": min(w.budget for w in workers),
        }
        try:
            self._ask_plan(request, {"for": "deploy", "model": spec.name}, now)
        except FlowmeshError:
            del self.models[spec.name]
            raise

    def plan_request(self, addr: bytes, msg: p.PlanRequest, now: float) -> None:
        spec = ModelSpec.from_dict(msg.spec)
        check_factory(spec.factory, self.cfg.allow)
        if msg.kind not in ("stages", "chunks"):
            raise fail(Code.BAD_REQUEST, f"plan kind {msg.kind!r}: 'stages' or 'chunks'")
        mem_cap = msg.mem_cap
        if mem_cap is None and self.ctx.workers():
            mem_cap = min(w.budget for w in self.ctx.workers())
        request = {
            "spec": spec.to_dict(),
            "kind": msg.kind,
            "stages": msg.stages,
            "mem_cap": mem_cap,
            "target_bytes": msg.target_bytes,
            "optimizer": msg.optimizer,
            "batch": msg.batch,
            "measure": msg.measure,
        }
        timeout = (msg.timeout_ms / 1000) if msg.timeout_ms else self.cfg.deploy_timeout_s
        self._ask_plan(request, {"for": "client", "addr": addr, "id": msg.id}, now, now + timeout)

    def undeploy(self, addr: bytes, msg: p.Undeploy, now: float) -> None:
        if msg.model not in self.models:
            raise fail(Code.MODEL_NOT_FOUND, f"no model {msg.model!r}")
        if self.store is not None:
            try:
                self.store.drop_model(msg.model)
            except Exception as exc:
                raise fail(Code.INTERNAL, f"could not forget {msg.model!r}: {exc}") from None
        model = self.models.pop(msg.model)
        for req in model.queue:
            self.ctx.answer_error(req, Code.MODEL_NOT_FOUND, f"{msg.model!r} was undeployed")
        model.queue.clear()
        for rep in model.replicas:
            self.drop_replica(model.name, rep)
        for cid in [i for i, c in self.calls.items() if c.data.get("model") == msg.model]:
            del self.calls[cid]
        self.ctx.to_client(addr, p.Undeployed(id=msg.id, model=msg.model))
        log.info("undeployed model=%s", msg.model)
        self.on_change(now)

    # ================================================================== planning

    def _ask_plan(
        self,
        request: dict[str, Any],
        then: dict[str, Any],
        now: float,
        deadline: float | None = None,
    ) -> None:
        key = hashlib.sha256(
            msgpack.packb(
                {**request, "spec": ModelSpec.from_dict(request["spec"]).digest()},
                use_bin_type=True,
            )
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
        try:
            stage_sizes(msg.plan)
        except FlowmeshError as exc:
            self.plan_failed(call, str(exc.code), f"partitioner {peer.name}: {exc.reason}")
            return
        answer = {"plan": msg.plan, "inputs": msg.inputs}
        self.plan_cache.put(call.data["key"], answer)
        self._plan_ready(call.data, answer, now)

    def _plan_ready(self, then: dict[str, Any], answer: dict[str, Any], now: float) -> None:
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
            self._place_new_model(model, answer["plan"], answer["inputs"])
        except FlowmeshError as exc:
            self.deploy_failed(model, exc.code, exc.reason)
        except Exception as exc:  # a plan that passed its checks but still cannot be placed
            log.exception("placing model=%s failed", model.name)
            self.deploy_failed(model, Code.PLAN_ERROR, f"{type(exc).__name__}: {exc}")

    def plan_failed(self, call: Call, code: str, reason: str) -> None:
        if call.data["for"] == "client":
            self.ctx.to_client(
                call.data["addr"], p.Error(id=call.data["id"], code=code, reason=reason)
            )
            return
        model = self.models.get(call.data["model"])
        if model is not None:
            self.deploy_failed(model, code, reason)

    # ================================================================== placement

    def _place_new_model(
        self, model: Model, plan: dict[str, Any], inputs: dict[str, Any] | None
    ) -> None:
        stage_bytes = stage_sizes(plan)
        n = len(stage_bytes)
        workers = self.ctx.workers()
        if n > len(workers):
            raise fail(
                Code.TOO_BIG,
                f"{model.name!r} needs {n} stages on distinct devices; "
                f"{len(workers)} worker(s) are registered",
            )
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
        model.inputs = parse_inputs(inputs) if inputs else None
        model.state = ModelState.DEPLOYING
        model.desired_replicas = model.floor_replicas = want
        for workers_of in placements:
            self._deploy_replica(model, workers_of, model.deploy_deadline)

    def _deploy_replica(self, model: Model, workers_of: list[str], deadline: float) -> Replica:
        rep = Replica(workers=list(workers_of), ready=[False] * len(workers_of))
        model.replicas.append(rep)
        for stage in range(len(workers_of)):
            self._deploy_stage(model, rep, stage, deadline)
        return rep

    def _deploy_stage(self, model: Model, rep: Replica, stage: int, deadline: float) -> None:
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
                spec=model.spec.to_dict(),
                plan=model.plan or {},
            ),
        )

    def stage_ready(self, peer: Peer, msg: p.StageReady, now: float) -> None:
        call = self._pop_call(msg.id, "stage", peer)
        model = self.models.get(msg.model)
        rep: Replica = call.data["replica"]
        if model is None or rep not in model.replicas:
            self.ctx.to_peer(
                peer.name, p.DropStage(id=next(self.ctx.ids), model=msg.model, stage=msg.stage)
            )
            peer.hosted.pop((msg.model, msg.stage), None)
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
            if self.store is not None:
                # Kept before it is promised: the answer below says the model is deployed.
                try:
                    self.store.save_model(self._record(model))
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
        self.drop_replica(model.name, rep)
        self.mark_availability(model, reason)
        self.persist(model)

    def deploy_failed(self, model: Model, code: Code | str, reason: str) -> None:
        if model.deploy_client is not None:
            addr, ref = model.deploy_client
            self.ctx.to_client(addr, p.Error(id=ref, code=str(code), reason=reason))
            model.deploy_client = None
        self.models.pop(model.name, None)
        for rep in model.replicas:
            self.drop_replica(model.name, rep)
        for cid in [i for i, c in self.calls.items() if c.data.get("model") == model.name]:
            del self.calls[cid]
        log.warning("deploy failed model=%s code=%s reason=%s", model.name, code, reason)

    def deploy_overdue(self, model: Model, now: float) -> None:
        """Fail a deploy still planning or deploying past its deadline."""
        if (
            model.state in (ModelState.PLANNING, ModelState.DEPLOYING)
            and now >= model.deploy_deadline
        ):
            self.deploy_failed(model, Code.TIMEOUT, "deploy did not finish in time")

    # ================================================================== repair

    def reconcile(self, now: float) -> None:
        """Re-create replicas lost with workers, where live workers can hold them."""
        for model in self.models.values():
            if model.state not in (ModelState.READY, ModelState.UNAVAILABLE):
                continue
            missing = model.desired_replicas - len(model.replicas)
            if missing <= 0 or now < model.repair_after:
                continue
            taken = {(s, w) for r in model.replicas for s, w in enumerate(r.workers)}
            # Away from workers where this model's runs hung, unless no other can hold it.
            trusted = [w for w in self.ctx.workers() if w.name not in model.avoid]
            places = place_replicas(trusted, model.stage_bytes, missing, taken) or place_replicas(
                self.ctx.workers(), model.stage_bytes, missing, taken
            )
            for workers_of in places:
                self._deploy_replica(model, workers_of, now + self.cfg.deploy_timeout_s)
                log.info("re-creating replica model=%s workers=%s", model.name, workers_of)
            if places:
                self.persist(model)

    # ================================================================== autoscaling

    def autoscale(self, now: float, means: dict[str, dict[str, float]]) -> None:
        """One more replica of a model its queue says one is not enough for, one fewer of a
        cooled one (`policy.scale_step`); `means` is `Timings.model_means()`. A replica being
        removed takes no new batch and is dropped once its batches have answered, so a shrink
        fails no request."""
        cfg = self.cfg
        for model in self.models.values():
            for rep in [r for r in model.replicas if r.draining]:
                if not any(r.live for r in model.replicas):
                    # The replica it kept was lost meanwhile: keep this one after all.
                    rep.draining = False
                    model.desired_replicas += 1
                    log.info("keeping draining replica model=%s: the other was lost", model.name)
                elif rep.inflight <= 0:
                    model.replicas.remove(rep)
                    self.drop_replica(model.name, rep)
                    self.persist(model)
                    log.info("dropped drained replica model=%s workers=%s", model.name, rep.workers)
            if not cfg.autoscale or model.state is not ModelState.READY:
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
                self._deploy_replica(model, room[0], now + cfg.deploy_timeout_s)
                self.persist(model)
                log.info("scaling up model=%s workers=%s: %s", model.name, room[0], step.why)
            elif step.delta < 0:
                # The idlest live replica, the newest among equals.
                rep = min(reversed(live), key=lambda r: r.inflight)
                rep.draining = True
                model.desired_replicas -= 1
                model.scale_downs += 1
                model.last_scaled = now
                log.info("scaling down model=%s workers=%s: %s", model.name, rep.workers, step.why)
                if rep.inflight <= 0:
                    model.replicas.remove(rep)
                    self.drop_replica(model.name, rep)
                    self.persist(model)

    def give_up_replica(self, model: Model, rep: Replica, worker: str, reason: str) -> None:
        """A run hung on `worker`: drop the replica; `reconcile` re-creates it elsewhere when
        another worker can hold the stage."""
        if rep not in model.replicas:
            return
        model.avoid.add(worker)
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

    # ================================================================== restart

    def _record(self, model: Model) -> ModelRecord:
        return ModelRecord(
            name=model.name,
            spec=model.spec.to_dict(),
            plan=model.plan or {},
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
        if self.models.get(model.name) is not model:
            return
        try:
            self.store.save_model(self._record(model))
        except Exception as exc:
            log.error("could not keep the placement of model=%s: %s", model.name, exc)

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
                stage_bytes = stage_sizes(rec.plan)
                if list(stage_bytes) != list(rec.stage_bytes):
                    raise fail(Code.PLAN_ERROR, "its stage sizes do not match its plan")
                inputs = parse_inputs(rec.inputs) if rec.inputs else None
            except FlowmeshError as exc:
                log.error("not restoring model=%s: %s", rec.name, exc.reason)
                if self.store is not None:
                    self.store.drop_model(rec.name)
                continue
            model = Model(
                spec=spec,
                state=ModelState.READY,
                plan=rec.plan,
                stage_bytes=list(rec.stage_bytes),
                inputs=inputs,
                desired_replicas=max(1, rec.desired_replicas),
                floor_replicas=max(1, rec.desired_replicas),
            )
            for workers_of in rec.placement:
                if len(workers_of) == model.n_stages and len(set(workers_of)) == len(workers_of):
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

    def _adopt(self, peer: Peer, held: list[p.HeldStage], now: float) -> None:
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
                digest = p.stage_digest(model.spec.to_dict(), model.plan or {}, key[1])
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
                self.drop_replica(name, rep)
                self.mark_availability(model, why)
            else:
                for stage, ready in enumerate(rep.ready):
                    if not ready:
                        log.info(
                            "repairing restored replica model=%s stage=%d on %s",
                            name,
                            stage,
                            rep.workers[stage],
                        )
                        self._deploy_stage(model, rep, stage, now + self.cfg.deploy_timeout_s)
            self.persist(model)
        log.info("restore done: %d model(s)", len(self.models))
        self.reconcile(now)
        self.on_change(now)

    # ================================================================== answers to calls

    def call_failed(self, peer: Peer, call: Call, code: str, reason: str, now: float) -> None:
        """`peer` answered a plan or stage call of ours with an error."""
        if call.kind == "plan":
            peer.inflight_plans -= 1
            self.plan_failed(call, code, reason)
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
            self.plan_failed(call, code, why)
        elif call.kind == "stage":
            why = undelivered or (
                f"worker {call.peer} did not prepare stage {call.data['stage']} in time"
            )
            self.stage_failed(call, why, code, now)

    def _pop_call(self, cid: int, kind: str, peer: Peer) -> Call:
        """The pending call `cid`, only if it is a `kind` call sent to `peer` (nobody else may
        answer it); it stays pending otherwise."""
        call = self.calls.get(cid)
        if call is None or call.kind != kind or call.peer != peer.name:
            raise fail(Code.BAD_REQUEST, f"no pending {kind} call {cid} for {peer.name}")
        del self.calls[cid]
        return call


# ====================================================================== what peers send


def stage_sizes(plan: dict[str, Any]) -> list[int]:
    """The stage sizes of a partitioner's plan, once the plan's own validation took it
    (`Plan.from_dict`: PLAN_ERROR naming what is wrong)."""
    try:
        return list(Plan.from_dict(plan).range_bytes)
    except FlowmeshError:
        raise
    except Exception as exc:  # a plan's values are a peer's: whatever they are, not fatal
        raise fail(Code.PLAN_ERROR, f"bad plan: {type(exc).__name__}: {exc}"[:300]) from None


def same_process(old: Peer, addr: bytes, msg: p.Register) -> bool:
    """`msg` comes from the very process that registered `old`: on the same connection (the
    broker names connections, and none can take another's), or on a fresh one with the secret
    that process sent with its first registration (`info["session"]`, see `flowmesh.peer`). A
    pid and a budget alone, which anyone reading status knows, prove nothing."""
    if (old.role, old.pid, old.budget) != (msg.role, msg.pid, msg.budget_bytes):
        return False
    if old.addr == addr:
        return True
    session, known = msg.info.get("session"), old.info.get("session")
    return (
        isinstance(session, str)
        and isinstance(known, str)
        and bool(known)
        and secrets.compare_digest(session.encode(), known.encode())
    )


def check_inventory(inv: p.Inventory) -> tuple[list[p.HeldStage], list[p.HeldJob]]:
    """The stages and jobs of a registration's inventory (typed and checked on receipt:
    `p.Inventory`), refused with BAD_REQUEST if a stage is listed twice, before the
    registration changes anything."""
    if len({(s.model, s.stage) for s in inv.stages}) != len(inv.stages):
        raise fail(Code.BAD_REQUEST, "register inventory stages: a stage is listed twice")
    return inv.stages, inv.jobs
