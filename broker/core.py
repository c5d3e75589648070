"""The broker's logic: registries, deploys, residency by bytes, batching, order and failover.

`BrokerCore` is a plain class. Each event (a decoded message, a clock tick, a failed send) changes
its state and appends the messages to send to `self.out`; the process shell (`broker.service`)
delivers them. Tests drive it in-process with exact expectations, no sockets.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from broker.policy import heart_failed, percentile, pick_victims, place_replicas
from broker.state import (
    Batch,
    Model,
    ModelState,
    Peer,
    Phase,
    Replica,
    Request,
    Residency,
    StageKey,
)
from broker.training import TrainingRouter
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.spec import DEFAULT_ALLOW, ModelSpec, check_factory, parse_inputs

log = logging.getLogger("broker.core")

CLIENT, BACKEND = "client", "backend"


@dataclass(frozen=True)
class BrokerConfig:
    heartbeat_s: float = 1.0
    liveness: int = 3
    allow: tuple[str, ...] = DEFAULT_ALLOW
    max_queue: int = 4096  # per model; beyond it, OVERLOADED
    default_timeout_s: float = 60.0
    deploy_timeout_s: float = 600.0
    default_replicas: int = 2
    starvation_s: float = 2.0  # a request waiting this long may evict models with queued work
    max_retries: int = 1  # re-runs of a request whose worker died
    # Every call to a peer has a deadline, so a lost or never-sent answer cannot leave state
    # waiting forever: a load not confirmed in time is dropped; a stage that does not answer a
    # run in time has hung, and its replica is re-created (elsewhere when possible).
    load_timeout_s: float = 120.0
    run_timeout_s: float = 120.0
    repair_backoff_s: float = 5.0  # after a failed replica repair, before trying again


@dataclass
class Call:
    """A request to a worker or partitioner that awaits its answer (until `deadline`)."""

    kind: str  # "plan" | "stage" | "load"
    peer: str
    deadline: float
    data: dict[str, Any] = field(default_factory=dict)


def _fail(code: Code, reason: str) -> FlowmeshError:
    return FlowmeshError(code, reason)


MAX_STATS_ITEMS = 16_384  # a worker lists each stage it holds
MAX_STATS_DEPTH = 3


def check_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """Heartbeat stats as a peer may report them: plain scalars, lists and maps of them, bounded.

    They are stored and shown by status() to every client, so a bad value is refused on receipt
    rather than breaking every later status call.
    """
    count = 0

    def walk(value: Any, where: str, depth: int) -> None:
        nonlocal count
        count += 1
        if count > MAX_STATS_ITEMS:
            raise _fail(Code.BAD_REQUEST, f"heartbeat stats: more than {MAX_STATS_ITEMS} values")
        if value is None or isinstance(value, bool | str):
            return
        if isinstance(value, int | float):
            if value != value or value in (float("inf"), float("-inf")):
                raise _fail(Code.BAD_REQUEST, f"heartbeat stats {where}: not a finite number")
            return
        if depth >= MAX_STATS_DEPTH or not isinstance(value, list | dict):
            raise _fail(
                Code.BAD_REQUEST,
                f"heartbeat stats {where}: {type(value).__name__} is not allowed here",
            )
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            walk(v, f"{where}.{k}", depth + 1)

    for key, value in stats.items():
        walk(value, key, 1)
    for key in ("peak_bytes", "host_bytes"):
        v = stats.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise _fail(Code.BAD_REQUEST, f"heartbeat stats {key}: expected a byte count")
    return stats


def check_plan(plan: dict[str, Any]) -> list[int]:
    """The stage sizes of a partitioner's plan, or BAD_REQUEST naming what is wrong with it."""
    sizes = plan.get("range_bytes")
    ranges = plan.get("ranges", [])
    if (
        not isinstance(sizes, list)
        or not sizes
        or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in sizes)
    ):
        raise _fail(Code.PLAN_ERROR, "plan: range_bytes must be a non-empty list of byte counts")
    if not isinstance(ranges, list) or (ranges and len(ranges) != len(sizes)):
        raise _fail(Code.PLAN_ERROR, "plan: ranges must give one [first, end) per stage")
    return [int(b) for b in sizes]


def _seconds(info: dict[str, Any], key: str) -> float:
    v = info.get(key, 0.0)
    if isinstance(v, bool) or not isinstance(v, int | float) or not (0 <= v < float("inf")):
        raise _fail(Code.BAD_REQUEST, f"run_result info {key}: expected seconds, got {v!r}")
    return float(v)


class BrokerCore:
    def __init__(self, cfg: BrokerConfig | None = None, now: float | None = None) -> None:
        self.cfg = cfg or BrokerConfig()
        self.peers: dict[str, Peer] = {}
        self.by_addr: dict[bytes, str] = {}
        self.models: dict[str, Model] = {}
        self.batches: dict[int, Batch] = {}
        self.calls: dict[int, Call] = {}
        self.plan_cache: dict[str, dict[str, Any]] = {}
        self.out: list[tuple[str, bytes, p.Message]] = []
        self.started = time.monotonic() if now is None else now
        self._ids = itertools.count(1)
        self.totals = {
            "requests": 0,
            "completed": 0,
            "errors": 0,
            "batches": 0,
            "retried": 0,
            "hung_runs": 0,
            "expired_calls": 0,
            "dropped_sends": 0,
        }
        self.training = TrainingRouter(
            peers=self.peers,
            ids=self._ids,
            to_client=lambda addr, msg: self._send(CLIENT, addr, msg),
            to_worker=self._to_worker,
            allow=self.cfg.allow,
            step_timeout_s=self.cfg.default_timeout_s,
            open_timeout_s=self.cfg.deploy_timeout_s,
        )

    # ================================================================== plumbing

    def _send(self, dest: str, addr: bytes, msg: p.Message) -> None:
        self.out.append((dest, addr, msg))

    def _to_peer(self, name: str, msg: p.Message) -> None:
        self._send(BACKEND, self.peers[name].addr, msg)

    def _to_worker(self, name: str, msg: p.Message) -> None:
        if name in self.peers:  # one lost meanwhile has nothing left to be told
            self._to_peer(name, msg)

    def drain(self) -> list[tuple[str, bytes, p.Message]]:
        out, self.out = self.out, []
        return out

    def workers(self, ready_only: bool = True) -> list[Peer]:
        return [
            w for w in self.peers.values() if w.role == "worker" and (w.ready or not ready_only)
        ]

    # ================================================================== client side

    def on_client(self, addr: bytes, msg: p.Message, now: float) -> None:
        handler: Callable[[bytes, Any, float], None] | None = {
            p.Infer: self._infer,
            p.Deploy: self._deploy,
            p.Undeploy: self._undeploy,
            p.Status: self._status,
            p.PlanRequest: self._plan_request,
        }.get(type(msg))
        if handler is None and isinstance(msg, TrainingRouter.CLIENT_TYPES):
            handler = self.training.on_client
        if handler is None:
            raise _fail(Code.BAD_REQUEST, f"{msg.TYPE} is not a client message")
        handler(addr, msg, now)

    def _infer(self, addr: bytes, msg: p.Infer, now: float) -> None:
        model = self.models.get(msg.model)
        if model is None:
            known = ", ".join(sorted(self.models)) or "none"
            raise _fail(Code.MODEL_NOT_FOUND, f"no model {msg.model!r} (deployed: {known})")
        if model.state is ModelState.UNAVAILABLE:
            raise _fail(
                Code.UNAVAILABLE, f"{msg.model!r} has no live replica; waiting for workers to join"
            )
        if model.state is not ModelState.READY:
            raise _fail(Code.UNAVAILABLE, f"{msg.model!r} is still {model.state.value}")
        rows, signature = self._check_inputs(model, msg.tensors)
        if len(model.queue) >= self.cfg.max_queue:
            raise _fail(
                Code.OVERLOADED,
                f"{msg.model!r} has {len(model.queue)} queued requests "
                f"(limit {self.cfg.max_queue}); retry later",
            )
        timeout = (msg.timeout_ms / 1000) if msg.timeout_ms else self.cfg.default_timeout_s
        req = Request(
            tag=next(self._ids),
            client=addr,
            client_id=msg.id,
            model=model.name,
            tensors=msg.tensors,
            rows=rows,
            signature=signature,
            arrived=now,
            deadline=now + timeout,
        )
        model.queue.append(req)
        model.requests += 1
        self.totals["requests"] += 1
        self._pump(now)

    def _check_inputs(
        self, model: Model, tensors: dict[str, p.TensorRef]
    ) -> tuple[int, tuple[Any, ...]]:
        if not tensors:
            raise _fail(Code.BAD_REQUEST, "infer needs at least one input tensor")
        declared = model.inputs
        if declared is not None:
            if list(tensors) == [""] and len(declared) == 1:
                ((name, spec),) = declared.items()
                ref = tensors[""]
                spec.check(name, ref.dtype, ref.shape)
            else:
                if set(tensors) != set(declared):
                    raise _fail(
                        Code.BAD_REQUEST,
                        f"{model.name!r} takes inputs {sorted(declared)}, got {sorted(tensors)}",
                    )
                for name, ref in tensors.items():
                    declared[name].check(name, ref.dtype, ref.shape)
        rows = {ref.shape[0] if ref.shape else None for ref in tensors.values()}
        if None in rows or len(rows) != 1:
            raise _fail(Code.BAD_REQUEST, "inputs must share a leading batch dimension")
        (n,) = rows
        if n == 0:
            raise _fail(Code.BAD_REQUEST, "empty batch (dimension 0 is 0)")
        signature = tuple(sorted((k, r.dtype, r.shape[1:]) for k, r in tensors.items()))
        return int(n), signature

    def _deploy(self, addr: bytes, msg: p.Deploy, now: float) -> None:
        spec = ModelSpec.from_dict(msg.spec)
        check_factory(spec.factory, self.cfg.allow)
        if spec.name in self.models:
            raise _fail(
                Code.MODEL_EXISTS, f"model {spec.name!r} is already deployed; undeploy it first"
            )
        workers = self.workers()
        if not workers:
            raise _fail(Code.UNAVAILABLE, "no worker is registered")
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

    def _plan_request(self, addr: bytes, msg: p.PlanRequest, now: float) -> None:
        spec = ModelSpec.from_dict(msg.spec)
        check_factory(spec.factory, self.cfg.allow)
        if msg.kind not in ("stages", "chunks"):
            raise _fail(Code.BAD_REQUEST, f"plan kind {msg.kind!r}: 'stages' or 'chunks'")
        mem_cap = msg.mem_cap
        if mem_cap is None and self.workers():
            mem_cap = min(w.budget for w in self.workers())
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

    def _undeploy(self, addr: bytes, msg: p.Undeploy, now: float) -> None:
        model = self.models.pop(msg.model, None)
        if model is None:
            raise _fail(Code.MODEL_NOT_FOUND, f"no model {msg.model!r}")
        for req in model.queue:
            self._answer_error(req, Code.MODEL_NOT_FOUND, f"{msg.model!r} was undeployed")
        model.queue.clear()
        for rep in model.replicas:
            self._drop_replica(model.name, rep)
        for cid in [i for i, c in self.calls.items() if c.data.get("model") == msg.model]:
            del self.calls[cid]
        self._send(CLIENT, addr, p.Undeployed(id=msg.id, model=msg.model))
        log.info("undeployed model=%s", msg.model)
        self._pump(now)

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
            raise _fail(Code.UNAVAILABLE, "no partitioner is registered")
        part = min(parts, key=lambda w: (w.inflight_plans, w.name))
        cid = next(self._ids)
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
        self._to_peer(part.name, p.PlanJob(id=cid, request=request))

    def _plan_ready(self, then: dict[str, Any], answer: dict[str, Any], now: float) -> None:
        if then["for"] == "client":
            self._send(
                CLIENT,
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
            self._deploy_failed(model, exc.code, exc.reason)
        except Exception as exc:  # a plan that passed check_plan but still cannot be placed
            log.exception("placing model=%s failed", model.name)
            self._deploy_failed(model, Code.PLAN_ERROR, f"{type(exc).__name__}: {exc}")

    def _place_new_model(
        self, model: Model, plan: dict[str, Any], inputs: dict[str, Any] | None
    ) -> None:
        stage_bytes = check_plan(plan)
        n = len(stage_bytes)
        workers = self.workers()
        if n > len(workers):
            raise _fail(
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
                raise _fail(
                    Code.TOO_BIG,
                    f"{model.name!r} stage {i} needs {b} bytes but the "
                    f"largest device budget is {largest} bytes; {hint}",
                )
        want = model.spec.replicas or max(1, min(self.cfg.default_replicas, len(workers) // n))
        placements = place_replicas(workers, stage_bytes, want)
        if not placements:
            raise _fail(Code.TOO_BIG, f"no set of {n} workers can hold {model.name!r}")
        model.plan, model.stage_bytes = plan, stage_bytes
        model.inputs = parse_inputs(inputs) if inputs else None
        model.state = ModelState.DEPLOYING
        model.desired_replicas = want
        for workers_of in placements:
            self._deploy_replica(model, workers_of, model.deploy_deadline)

    def _deploy_replica(self, model: Model, workers_of: list[str], deadline: float) -> Replica:
        rep = Replica(workers=list(workers_of), ready=[False] * len(workers_of))
        model.replicas.append(rep)
        for stage, wname in enumerate(workers_of):
            cid = next(self._ids)
            self.calls[cid] = Call(
                "stage", wname, deadline, {"model": model.name, "stage": stage, "replica": rep}
            )
            self.peers[wname].hosted[(model.name, stage)] = model.stage_bytes[stage]
            self._to_peer(
                wname,
                p.DeployStage(
                    id=cid,
                    model=model.name,
                    stage=stage,
                    spec=model.spec.to_dict(),
                    plan=model.plan or {},
                ),
            )
        return rep

    def _deploy_failed(self, model: Model, code: Code | str, reason: str) -> None:
        if model.deploy_client is not None:
            addr, ref = model.deploy_client
            self._send(CLIENT, addr, p.Error(id=ref, code=str(code), reason=reason))
            model.deploy_client = None
        self.models.pop(model.name, None)
        for rep in model.replicas:
            self._drop_replica(model.name, rep)
        for cid in [i for i, c in self.calls.items() if c.data.get("model") == model.name]:
            del self.calls[cid]
        log.warning("deploy failed model=%s code=%s reason=%s", model.name, code, reason)

    def _stage_ready(self, peer: Peer, msg: p.StageReady, now: float) -> None:
        call = self._pop_call(msg.id, "stage", peer)
        model = self.models.get(msg.model)
        rep: Replica = call.data["replica"]
        if model is None or rep not in model.replicas:
            self._to_peer(
                peer.name, p.DropStage(id=next(self._ids), model=msg.model, stage=msg.stage)
            )
            peer.hosted.pop((msg.model, msg.stage), None)
            return
        if msg.nbytes > peer.budget:
            self._stage_failed(
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
            model.state = ModelState.READY
            if model.deploy_client is not None:
                addr, ref = model.deploy_client
                self._send(CLIENT, addr, p.Deployed(id=ref, model=self._model_status(model)))
                model.deploy_client = None
            log.info(
                "deployed model=%s stages=%d replicas=%d",
                model.name,
                model.n_stages,
                len(model.replicas),
            )
        elif model.state is ModelState.UNAVAILABLE and rep.live:
            model.state = ModelState.READY
        self._pump(now)

    # ================================================================== backend side

    def on_backend(self, addr: bytes, msg: p.Message, now: float) -> None:
        if isinstance(msg, p.Register):
            self._register(addr, msg, now)
            return
        name = self.by_addr.get(addr)
        if name is None:
            self._send(BACKEND, addr, p.Disconnect(reason="unknown peer: register first"))
            return
        peer = self.peers[name]
        peer.last_seen = now
        if isinstance(msg, p.Heartbeat):
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
                self._reconcile(now)
                self._pump(now)
        elif isinstance(msg, p.RunResult):
            self._run_result(peer, msg, now)
        elif isinstance(msg, p.Loaded):
            self._loaded(peer, msg, now)
        elif isinstance(msg, p.StageReady):
            self._stage_ready(peer, msg, now)
        elif isinstance(msg, p.PlanReply):
            call = self._pop_call(msg.id, "plan", peer)
            peer.inflight_plans -= 1
            try:
                check_plan(msg.plan)
            except FlowmeshError as exc:
                self._plan_failed(call, str(exc.code), f"partitioner {peer.name}: {exc.reason}")
                return
            answer = {"plan": msg.plan, "inputs": msg.inputs}
            self.plan_cache[call.data["key"]] = answer
            self._plan_ready(call.data, answer, now)
        elif isinstance(msg, TrainingRouter.WORKER_TYPES) and peer.role == "worker":
            self.training.on_worker(peer.name, msg, now)
        elif isinstance(msg, p.Error):
            if not self.training.on_error(peer.name, msg, now):
                self._backend_error(peer, msg, now)
        else:
            raise _fail(Code.BAD_REQUEST, f"{msg.TYPE} is not expected from a {peer.role}")

    def _register(self, addr: bytes, msg: p.Register, now: float) -> None:
        if msg.role not in ("worker", "partitioner"):
            raise _fail(Code.BAD_REQUEST, f"unknown role {msg.role!r}")
        if msg.role == "worker" and msg.budget_bytes <= 0:
            raise _fail(Code.BAD_REQUEST, "a worker must report a positive memory budget")
        if not msg.name:
            raise _fail(Code.BAD_REQUEST, "a peer needs a name")
        lanes = msg.info.get("compute_lanes", 2)
        if isinstance(lanes, bool) or not isinstance(lanes, int) or not 1 <= lanes <= 1024:
            raise _fail(Code.BAD_REQUEST, f"register info compute_lanes: bad value {lanes!r}")
        old = self.peers.get(msg.name)
        if (
            old is not None
            and (old.role, old.pid, old.budget) == (msg.role, msg.pid, msg.budget_bytes)
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
            self._send(BACKEND, addr, self._ack(msg.id, kept=True))
            log.info(
                "registered again name=%s role=%s pid=%d (state kept, %d registrations)",
                msg.name,
                msg.role,
                msg.pid,
                old.registrations,
            )
            return
        if old is not None:
            self._peer_dead(old, now, "re-registered (restarted)")
        stale = self.by_addr.get(addr)
        if stale is not None and stale in self.peers:
            self._peer_dead(self.peers[stale], now, "re-registered under another name")
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
        )
        self.by_addr[addr] = msg.name
        self._send(BACKEND, addr, self._ack(msg.id, kept=False))
        log.info("registered name=%s role=%s pid=%d", msg.name, msg.role, msg.pid)

    def _ack(self, ref: int, *, kept: bool) -> p.RegisterAck:
        return p.RegisterAck(
            id=ref, heartbeat_s=self.cfg.heartbeat_s, liveness=self.cfg.liveness, kept=kept
        )

    def _pop_call(self, cid: int, kind: str, peer: Peer) -> Call:
        """The pending call `cid`, only if it is a `kind` call sent to `peer` (nobody else may
        answer it); it stays pending otherwise."""
        call = self.calls.get(cid)
        if call is None or call.kind != kind or call.peer != peer.name:
            raise _fail(Code.BAD_REQUEST, f"no pending {kind} call {cid} for {peer.name}")
        del self.calls[cid]
        return call

    def _loaded(self, peer: Peer, msg: p.Loaded, now: float) -> None:
        call = self.calls.get(msg.id)
        if call is None:
            return  # expired: the residency was dropped and an Evict sent after the load
        if (
            call.kind != "load"
            or call.peer != peer.name
            or ((call.data["model"], call.data["stage"]) != (msg.model, msg.stage))
        ):
            raise _fail(Code.BAD_REQUEST, f"no pending load {msg.id} of that stage for {peer.name}")
        del self.calls[msg.id]
        res = peer.resident.get((msg.model, msg.stage))
        if res is not None and res.phase is Phase.LOADING:
            res.phase = Phase.RESIDENT
            res.nbytes = msg.nbytes
            peer.loads += 1
            peer.flush_next = False
            model = self.models.get(msg.model)
            if model is not None:
                model.loads += 1
        self._pump(now)

    def _backend_error(self, peer: Peer, msg: p.Error, now: float) -> None:
        batch = self.batches.get(msg.id) if msg.id is not None else None
        if batch is not None and batch.worker == peer.name:
            del self.batches[msg.id]  # type: ignore[arg-type]
            self._run_failed(batch, msg.code, msg.reason, now)
            return
        call = self.calls.get(msg.id) if msg.id is not None else None
        if call is None or call.peer != peer.name:
            # Not an answer to anything we asked this peer (a late one, or a forged one).
            log.warning("error from %s: %s %s (id %s)", peer.name, msg.code, msg.reason, msg.id)
            return
        del self.calls[msg.id]  # type: ignore[arg-type]
        if call.kind == "plan":
            peer.inflight_plans -= 1
            self._plan_failed(call, msg.code, msg.reason)
        elif call.kind == "stage":
            self._stage_failed(call, f"worker {peer.name}: {msg.reason}", msg.code, now)
        elif call.kind == "load":
            key = (call.data["model"], call.data["stage"])
            res = peer.resident.get(key)
            if res is not None and res.phase is Phase.LOADING:
                del peer.resident[key]
            if msg.code == Code.NO_SPACE:
                peer.flush_next = True  # fragmented: next time evict every idle stage
            log.warning(
                "load failed worker=%s stage=%s code=%s reason=%s",
                peer.name,
                key,
                msg.code,
                msg.reason,
            )
            self._pump(now)

    def _plan_failed(self, call: Call, code: str, reason: str) -> None:
        if call.data["for"] == "client":
            self._send(
                CLIENT, call.data["addr"], p.Error(id=call.data["id"], code=code, reason=reason)
            )
            return
        model = self.models.get(call.data["model"])
        if model is not None:
            self._deploy_failed(model, code, reason)

    def _stage_failed(self, call: Call, reason: str, code: str, now: float) -> None:
        model = self.models.get(call.data["model"])
        rep: Replica = call.data["replica"]
        if model is None or rep not in model.replicas:
            return
        if model.state is ModelState.DEPLOYING:
            self._deploy_failed(model, code, reason)
            return
        # A repair failed: give the replica up; reconcile tries again after a pause.
        log.warning("replica repair failed model=%s reason=%s", model.name, reason)
        model.repair_after = now + self.cfg.repair_backoff_s
        model.replicas.remove(rep)
        self._drop_replica(model.name, rep)
        self._mark_availability(model, reason)

    # ================================================================== runs

    def _run_result(self, peer: Peer, msg: p.RunResult, now: float) -> None:
        batch = self.batches.get(msg.id)
        if batch is None:
            return  # its replica was lost or it timed out; nobody waits for it
        # Only the worker a batch was sent to may answer it; anyone else is refused and the
        # batch is untouched.
        if batch.worker != peer.name or (msg.model, msg.stage) != (batch.model, batch.stage):
            raise _fail(
                Code.BAD_REQUEST,
                f"run {msg.id} ({msg.model}/{msg.stage}) was not sent to {peer.name}",
            )
        last = batch.stage == len(batch.replica.workers) - 1
        try:  # checked before anything changes, so a bad answer fails its batch cleanly
            seconds = {k: _seconds(msg.info, k) for k in ("compute_s", "wait_s")}
            parts = self._result_parts(batch, msg.tensors, last)
        except FlowmeshError as exc:
            del self.batches[msg.id]
            log.warning("bad run_result from %s: %s", peer.name, exc.reason)
            self._run_failed(batch, str(Code.INTERNAL), f"worker {peer.name}: {exc.reason}", now)
            return
        del self.batches[msg.id]
        self._leave_stage(batch, now)
        model = self.models.get(batch.model)
        for k, v in seconds.items():
            batch.info[k] = batch.info.get(k, 0.0) + v
        if not last:
            if model is not None and batch.replica in model.replicas:
                self._advance(model, batch, msg.tensors, now)
                return
            batch.replica.inflight -= 1
            if model is None:
                for req in batch.requests:
                    self._answer_error(
                        req, Code.MODEL_NOT_FOUND, f"{batch.model!r} was undeployed while running"
                    )
            else:  # its replica was given up midway: start again on another one
                model.queue.extendleft(r for r in reversed(batch.requests) if r.client is not None)
            self._pump(now)
            return
        batch.replica.inflight -= 1
        for req, tensors in zip(batch.requests, parts, strict=True):
            if req.client is None:  # answered already (timed out)
                continue
            latency_ms = (now - req.arrived) * 1000
            info = {
                "latency_ms": latency_ms,
                "batch": len(batch.requests),
                "queue_ms": (batch.started - req.arrived) * 1000,
                "compute_ms": batch.info.get("compute_s", 0.0) * 1000,
                "load_wait_ms": batch.info.get("wait_s", 0.0) * 1000,
                "workers": list(batch.replica.workers),
            }
            self._send(CLIENT, req.client, p.Result(id=req.client_id, tensors=tensors, info=info))
            req.client = None  # type: ignore[assignment]
            if model is not None:
                model.completed += 1
                model.latency_ms.append(latency_ms)
            self.totals["completed"] += 1
        self._pump(now)

    @staticmethod
    def _result_parts(
        batch: Batch, tensors: dict[str, p.TensorRef], last: bool
    ) -> list[dict[str, p.TensorRef]]:
        """A stage's output tensors, split by request ('k/name'); every request needs some."""
        parts: list[dict[str, p.TensorRef]] = [{} for _ in batch.requests]
        for name, ref in tensors.items():
            k, _, out = name.partition("/")
            if not (k.isdigit() and int(k) < len(parts)):
                raise _fail(Code.BAD_REQUEST, f"run_result tensor {name!r}: expected 'k/name'")
            parts[int(k)][out] = ref
        if last and not all(parts):
            raise _fail(Code.BAD_REQUEST, "run_result: a request of the batch has no output")
        return parts

    def _advance(self, model: Model, batch: Batch, tensors: dict[str, Any], now: float) -> None:
        """Send a batch's activations on to the next stage's worker (frames, not copies)."""
        batch.stage += 1
        batch.worker = batch.replica.workers[batch.stage]
        batch.run_id = next(self._ids)
        self._enter_stage(batch, now)
        self.batches[batch.run_id] = batch
        self._to_peer(
            batch.worker,
            p.Run(
                id=batch.run_id,
                model=model.name,
                stage=batch.stage,
                parts=[[r.tag, r.rows] for r in batch.requests],
                tensors=tensors,
            ),
        )

    def _enter_stage(self, batch: Batch, now: float) -> None:
        # A stage that has not answered by the later of the run timeout and its requests'
        # deadlines has hung (see _run_hung): nobody's timeout is cut short by it.
        latest = max((r.deadline for r in batch.requests), default=now)
        batch.deadline = max(now + self.cfg.run_timeout_s, latest)
        peer = self.peers[batch.worker]
        peer.inflight_runs += 1
        res = peer.resident.get((batch.model, batch.stage))
        if res is not None:
            res.inflight += 1
            res.last_used = now
        batch.counted_on = (peer, res)

    def _leave_stage(self, batch: Batch, now: float) -> None:
        if batch.counted_on is None:
            return
        peer, res = batch.counted_on
        batch.counted_on = None
        peer.inflight_runs -= 1
        if res is not None:
            res.inflight -= 1
            res.last_used = now

    def _run_failed(self, batch: Batch, code: str, reason: str, now: float) -> None:
        self._leave_stage(batch, now)
        batch.replica.inflight -= 1
        model = self.models.get(batch.model)
        live = [r for r in batch.requests if r.client is not None]
        if model is not None and code == Code.NOT_RESIDENT:
            # Its load failed (fragmentation) or was undone: run again, not the client's fault.
            model.queue.extendleft(reversed(live))
        elif model is not None and code == Code.MODEL_ERROR and len(live) > 1:
            for r in live:  # find the request that breaks the model; the others succeed
                r.solo = True
            model.queue.extendleft(reversed(live))
        else:
            for r in live:
                self._answer_error(r, code, reason)
        self._pump(now)

    def _answer_error(self, req: Request, code: Code | str, reason: str) -> None:
        if req.client is None:
            return
        self._send(CLIENT, req.client, p.Error(id=req.client_id, code=str(code), reason=reason))
        req.client = None  # type: ignore[assignment]
        model = self.models.get(req.model)
        if model is not None:
            model.errors += 1
        self.totals["errors"] += 1

    # ================================================================== scheduling

    def _pump(self, now: float) -> None:
        """Start every batch that can start now, oldest waiting model first."""
        for peer in self.peers.values():
            owner = self.models.get(peer.reserved_for) if peer.reserved_for else None
            if peer.reserved_for and (owner is None or not owner.queue):
                peer.reserved_for = None
        for _ in range(10_000):  # bounded: each pass either dispatches or stops
            waiting = [m for m in self.models.values() if m.queue and m.state is ModelState.READY]
            waiting.sort(key=lambda m: m.queue[0].arrived)
            if not any(self._dispatch(m, now) for m in waiting):
                return

    def _placed(self, model: Model, rep: Replica) -> bool:
        return all((model.name, s) in self.peers[w].resident for s, w in enumerate(rep.workers))

    def _blocked(self, model: Model, rep: Replica) -> bool:
        for w in rep.workers:
            peer = self.peers[w]
            if peer.reserved_for not in (None, model.name):
                return True
        return self.peers[rep.workers[0]].inflight_runs >= self.peers[rep.workers[0]].max_inflight

    def _dispatch(self, model: Model, now: float) -> bool:
        live = [r for r in model.replicas if r.live]
        if not live:
            return False
        # A pipeline of P stages keeps P batches busy, +1 on its way. Holding the rest here lets
        # them batch; a model that cannot batch gains nothing from waiting here, so it may fill
        # the worker's own queue.
        depth = model.n_stages + 1 if model.spec.max_batch_size > 1 else 1 << 30
        placed = [r for r in live if self._placed(model, r)]
        ready = [r for r in placed if r.inflight < depth and not self._blocked(model, r)]
        if ready:
            self._start_batch(model, min(ready, key=lambda r: r.inflight), now)
            return True
        spare = [r for r in live if r not in placed and not self._blocked(model, r)]
        if placed:
            # Every placed replica is busy: scale out only into free bytes, never by evicting.
            for rep in spare:
                victims = self._victims_for(model, rep, starving=False, free_only=True)
                if victims is not None:
                    self._load_replica(model, rep, victims, now)
                    self._start_batch(model, rep, now)
                    return True
            return False
        starving = now - model.queue[0].arrived >= self.cfg.starvation_s
        best: tuple[int, Replica, dict[str, list[StageKey]]] | None = None
        for rep in live:
            if self._blocked(model, rep) and not starving:
                continue
            victims = self._victims_for(model, rep, starving=starving)
            if victims is None:
                continue
            cost = sum(self.peers[w].resident[k].nbytes for w, ks in victims.items() for k in ks)
            if best is None or cost < best[0]:
                best = (cost, rep, victims)
        if best is None:
            if starving:
                self._reserve(model, live)
            return False
        _, rep, victims = best
        self._load_replica(model, rep, victims, now)
        self._start_batch(model, rep, now)
        return True

    def _victims_for(
        self, model: Model, rep: Replica, *, starving: bool, free_only: bool = False
    ) -> dict[str, list[StageKey]] | None:
        out: dict[str, list[StageKey]] = {}
        for stage, w in enumerate(rep.workers):
            peer = self.peers[w]
            key = (model.name, stage)
            if key in peer.resident:
                out[w] = []
                continue
            need = peer.hosted.get(key, model.stage_bytes[stage])
            if free_only:
                if peer.free < need:
                    return None
                out[w] = []
                continue
            victims = pick_victims(
                peer,
                need,
                lambda r, peer=peer: self._evictable(peer, r, starving),
                flush=peer.flush_next,
            )
            if victims is None:
                return None
            out[w] = victims
        return out

    def _evictable(self, peer: Peer, res: Residency, starving: bool) -> bool:
        if res.phase is not Phase.RESIDENT or res.inflight:
            return False
        model = self.models.get(res.key[0])
        if model is None:
            return True
        for rep in model.replicas:
            if (
                res.key[1] < len(rep.workers)
                and rep.workers[res.key[1]] == peer.name
                and rep.inflight
            ):
                return False  # a batch is in this replica's pipeline; it will need this stage
        return not model.queue or starving

    def _reserve(self, model: Model, live: list[Replica]) -> None:
        """Stop new batches of other models on one replica's workers until this model fits."""
        rep = min(live, key=lambda r: sum(self.peers[w].inflight_runs for w in r.workers))
        for w in rep.workers:
            if self.peers[w].reserved_for is None:
                self.peers[w].reserved_for = model.name
                log.info("reserving worker=%s for starving model=%s", w, model.name)

    def _load_replica(
        self, model: Model, rep: Replica, victims: dict[str, list[StageKey]], now: float
    ) -> None:
        for stage, w in enumerate(rep.workers):
            peer = self.peers[w]
            for key in victims.get(w, []):
                self._evict(peer, key)
            key = (model.name, stage)
            if key not in peer.resident:
                cid = next(self._ids)
                self.calls[cid] = Call(
                    "load", w, now + self.cfg.load_timeout_s, {"model": model.name, "stage": stage}
                )
                peer.resident[key] = Residency(key, peer.hosted[key], Phase.LOADING, now)
                self._to_peer(w, p.Load(id=cid, model=model.name, stage=stage))
            if peer.reserved_for == model.name:
                peer.reserved_for = None
        for peer in self.peers.values():
            if peer.reserved_for == model.name:
                peer.reserved_for = None

    def _evict(self, peer: Peer, key: StageKey) -> None:
        peer.resident.pop(key, None)
        peer.evictions += 1
        victim = self.models.get(key[0])
        if victim is not None:
            victim.evictions += 1
        self._to_peer(peer.name, p.Evict(id=next(self._ids), model=key[0], stage=key[1]))

    def _start_batch(self, model: Model, rep: Replica, now: float) -> None:
        head = model.queue.popleft()
        requests, rows = [head], head.rows
        if not head.solo and model.spec.max_batch_size > 1:
            keep = []
            while model.queue:
                r = model.queue.popleft()
                if (
                    not r.solo
                    and r.signature == head.signature
                    and rows + r.rows <= model.spec.max_batch_size
                ):
                    requests.append(r)
                    rows += r.rows
                else:
                    keep.append(r)
            model.queue.extendleft(reversed(keep))
        tensors = {
            f"{k}/{name}": ref for k, r in enumerate(requests) for name, ref in r.tensors.items()
        }
        batch = Batch(
            run_id=next(self._ids),
            model=model.name,
            replica=rep,
            requests=requests,
            stage=0,
            worker=rep.workers[0],
            started=now,
        )
        rep.inflight += 1
        self._enter_stage(batch, now)
        self.batches[batch.run_id] = batch
        model.batches += 1
        self.totals["batches"] += 1
        self._to_peer(
            batch.worker,
            p.Run(
                id=batch.run_id,
                model=model.name,
                stage=0,
                parts=[[r.tag, r.rows] for r in requests],
                tensors=tensors,
            ),
        )

    # ================================================================== liveness

    def tick(self, now: float) -> None:
        """Heartbeats out, dead peers out, expired requests and deploys answered."""
        for peer in list(self.peers.values()):
            if heart_failed(peer.last_seen, now, self.cfg.heartbeat_s, self.cfg.liveness):
                self._peer_dead(peer, now, "missed heartbeats")
            else:
                self._to_peer(peer.name, p.Heartbeat(stats={}))
        for model in list(self.models.values()):
            expired = [r for r in model.queue if r.deadline <= now]
            if expired:
                model.queue = type(model.queue)(r for r in model.queue if r.deadline > now)
                for r in expired:
                    self._answer_error(
                        r,
                        Code.TIMEOUT,
                        f"not served within {r.deadline - r.arrived:.1f} s (queued)",
                    )
            if (
                model.state in (ModelState.PLANNING, ModelState.DEPLOYING)
                and now >= model.deploy_deadline
            ):
                self._deploy_failed(model, Code.TIMEOUT, "deploy did not finish in time")
        for batch in self.batches.values():
            for r in batch.requests:
                if r.client is not None and r.deadline <= now:
                    self._answer_error(
                        r,
                        Code.TIMEOUT,
                        f"not served within {r.deadline - r.arrived:.1f} s (running)",
                    )
        for run_id, batch in list(self.batches.items()):
            if batch.deadline <= now and self.batches.get(run_id) is batch:
                del self.batches[run_id]
                self._run_hung(batch, now)
        for cid, call in list(self.calls.items()):
            if call.deadline <= now and self.calls.get(cid) is call:
                del self.calls[cid]
                self._call_expired(call, now)
        self.training.tick(now)
        self._reconcile(now)
        self._pump(now)

    def _call_expired(self, call: Call, now: float, undelivered: str | None = None) -> None:
        """A call got no answer in time (or could not be sent: `undelivered` says why): fail
        what waited on it and repair the state."""
        peer = self.peers.get(call.peer)
        code = str(Code.OVERLOADED if undelivered else Code.TIMEOUT)
        if undelivered is None:
            self.totals["expired_calls"] += 1
            log.warning(
                "call expired kind=%s peer=%s model=%s",
                call.kind,
                call.peer,
                call.data.get("model"),
            )
        if call.kind == "plan":
            if peer is not None:
                peer.inflight_plans -= 1
            why = undelivered or f"partitioner {call.peer} did not answer in time"
            self._plan_failed(call, code, why)
        elif call.kind == "stage":
            why = undelivered or (
                f"worker {call.peer} did not prepare stage {call.data['stage']} in time"
            )
            self._stage_failed(call, why, code, now)
        elif call.kind == "load" and peer is not None:
            key = (call.data["model"], call.data["stage"])
            res = peer.resident.get(key)
            if res is not None and res.phase is Phase.LOADING:
                # The worker may still finish it: the Evict, ordered after the Load, frees it.
                self._evict(peer, key)

    def _run_hung(self, batch: Batch, now: float) -> None:
        """A stage did not answer a run by its deadline while its worker still heartbeats.

        Its requests are answered, its counts released, and the replica is given up and
        re-created, away from that worker where another can hold the stage.
        """
        self._leave_stage(batch, now)
        batch.replica.inflight -= 1
        reason = (
            f"worker {batch.worker} did not finish stage {batch.stage} of {batch.model!r} "
            f"within {self.cfg.run_timeout_s:.0f} s; its replica is being re-created"
        )
        self.totals["hung_runs"] += 1
        log.warning("run hung run=%d %s", batch.run_id, reason)
        for r in batch.requests:
            self._answer_error(r, Code.TIMEOUT, reason)
        model = self.models.get(batch.model)
        if model is None or batch.replica not in model.replicas:
            return
        model.avoid.add(batch.worker)
        model.replicas.remove(batch.replica)
        self._drop_replica(model.name, batch.replica)
        self._mark_availability(model, reason)

    def peer_unreachable(self, addr: bytes, now: float) -> None:
        name = self.by_addr.get(addr)
        if name is not None:
            self._peer_dead(self.peers[name], now, "unreachable")

    def _peer_dead(self, peer: Peer, now: float, why: str) -> None:
        self.peers.pop(peer.name, None)
        if self.by_addr.get(peer.addr) == peer.name:
            del self.by_addr[peer.addr]
        log.warning("peer lost name=%s role=%s why=%s", peer.name, peer.role, why)
        for cid, call in list(self.calls.items()):
            if call.peer != peer.name:
                continue
            del self.calls[cid]
            if call.kind == "plan":
                self._plan_failed(
                    call, str(Code.UNAVAILABLE), f"partitioner {peer.name} was lost while planning"
                )
            elif call.kind == "stage":
                self._stage_failed(
                    call, f"worker {peer.name} was lost while deploying", str(Code.WORKER_LOST), now
                )
        if peer.role != "worker":
            return
        self.training.worker_lost(peer.name)
        for model in list(self.models.values()):
            for rep in [r for r in model.replicas if peer.name in r.workers]:
                model.replicas.remove(rep)
                self._drop_replica(model.name, rep, lost=peer.name)
                self._fail_over(model, rep, peer.name, now)
        self._reconcile(now)
        for model in self.models.values():
            if not model.replicas:
                self._mark_availability(model, f"lost with worker {peer.name}")
        self._pump(now)

    def _fail_over(self, model: Model, rep: Replica, lost: str, now: float) -> None:
        """Requests in flight on a lost replica: run once more elsewhere, or WORKER_LOST."""
        others = [r for r in model.replicas if r is not rep]
        for run_id, batch in list(self.batches.items()):
            if batch.replica is not rep:
                continue
            del self.batches[run_id]
            self._leave_stage(batch, now)
            for req in reversed(batch.requests):
                if req.client is None:
                    continue
                if others and req.retries < self.cfg.max_retries:
                    req.retries += 1
                    self.totals["retried"] += 1
                    model.queue.appendleft(req)
                else:
                    self._answer_error(
                        req, Code.WORKER_LOST, f"worker {lost} was lost while running this request"
                    )

    def _drop_replica(self, name: str, rep: Replica, lost: str | None = None) -> None:
        """Free a replica's device and host bytes on its surviving workers."""
        for stage, w in enumerate(rep.workers):
            peer = self.peers.get(w)
            if peer is None or w == lost:
                continue
            key = (name, stage)
            if key in peer.resident:
                self._evict(peer, key)
            if peer.hosted.pop(key, None) is not None:
                self._to_peer(w, p.DropStage(id=next(self._ids), model=name, stage=stage))

    def _reconcile(self, now: float) -> None:
        """Re-create replicas lost with workers, where live workers can hold them."""
        for model in self.models.values():
            if model.state not in (ModelState.READY, ModelState.UNAVAILABLE):
                continue
            missing = model.desired_replicas - len(model.replicas)
            if missing <= 0 or now < model.repair_after:
                continue
            taken = {(s, w) for r in model.replicas for s, w in enumerate(r.workers)}
            # Away from workers where this model's runs hung, unless no other can hold it.
            trusted = [w for w in self.workers() if w.name not in model.avoid]
            places = place_replicas(trusted, model.stage_bytes, missing, taken) or place_replicas(
                self.workers(), model.stage_bytes, missing, taken
            )
            for workers_of in places:
                self._deploy_replica(model, workers_of, now + self.cfg.deploy_timeout_s)
                log.info("re-creating replica model=%s workers=%s", model.name, workers_of)

    def _mark_availability(self, model: Model, why: str) -> None:
        if model.replicas or model.state is not ModelState.READY:
            return
        model.state = ModelState.UNAVAILABLE
        for req in model.queue:
            self._answer_error(req, Code.WORKER_LOST, f"{model.name!r} has no live replica ({why})")
        model.queue.clear()

    # ================================================================== status

    def _model_status(self, model: Model) -> dict[str, Any]:
        ranges = (model.plan or {}).get("ranges", [])
        names = (model.plan or {}).get("block_names", [])
        stages = []
        for i, nbytes in enumerate(model.stage_bytes):
            a, b = ranges[i] if i < len(ranges) else (0, 0)
            stages.append(
                {
                    "index": i,
                    "bytes": nbytes,
                    "blocks": [a, b],
                    "first": names[a] if a < len(names) else "",
                    "last": names[b - 1] if 0 < b <= len(names) else "",
                }
            )
        resident_on = sorted(
            {w.name for w in self.peers.values() for k in w.resident if k[0] == model.name}
        )
        lat = list(model.latency_ms)
        return {
            "name": model.name,
            "state": model.state.value,
            "factory": model.spec.factory,
            "dtype": model.spec.dtype,
            "inputs": {
                n: {"dtype": t.dtype, "shape": list(t.shape)}
                for n, t in (model.inputs or {}).items()
            },
            "bytes": sum(model.stage_bytes),
            "stages": stages,
            "replicas": [
                {"workers": r.workers, "live": r.live, "inflight": r.inflight}
                for r in model.replicas
            ],
            "resident_on": resident_on,
            "queue": len(model.queue),
            "requests": model.requests,
            "completed": model.completed,
            "errors": model.errors,
            "loads": model.loads,
            "evictions": model.evictions,
            "batches": model.batches,
            "mean_ms": sum(lat) / len(lat) if lat else 0.0,
            "p99_ms": percentile(lat, 99),
        }

    def status(self, now: float) -> dict[str, Any]:
        workers, partitioners = [], []
        for peer in sorted(self.peers.values(), key=lambda w: w.name):
            row = {
                "name": peer.name,
                "ready": peer.ready,
                "pid": peer.pid,
                "registrations": peer.registrations,
                "last_seen_s": round(now - peer.last_seen, 3),
            }
            if peer.role == "partitioner":
                partitioners.append({**row, "inflight": peer.inflight_plans, "stats": peer.stats})
                continue
            workers.append(
                {
                    **row,
                    "device": peer.device,
                    "kind": peer.kind,
                    "budget_bytes": peer.budget,
                    "resident_bytes": peer.used,
                    "peak_bytes": int(peer.stats.get("peak_bytes", 0)),
                    "host_bytes": int(peer.stats.get("host_bytes", 0)),
                    "resident": sorted(f"{k[0]}/{k[1]}" for k in peer.resident),
                    "loads": peer.loads,
                    "evictions": peer.evictions,
                    "inflight": peer.inflight_runs,
                    "reserved_for": peer.reserved_for,
                    "stats": peer.stats,
                }
            )
        return {
            "uptime_s": round(now - self.started, 3),
            "protocol": p.PROTOCOL_VERSION,
            "workers": workers,
            "partitioners": partitioners,
            "models": [
                self._model_status(m) for m in sorted(self.models.values(), key=lambda m: m.name)
            ],
            "queued": sum(len(m.queue) for m in self.models.values()),
            "inflight_batches": len(self.batches),
            "jobs": self.training.status(now),
            **self.totals,
            **self.training.totals,
        }

    def _status(self, addr: bytes, msg: p.Status, now: float) -> None:
        self._send(CLIENT, addr, p.StatusReply(id=msg.id, status=self.status(now)))

    # ================================================================== send failures

    def send_failed(
        self, dest: str, addr: bytes, msg: p.Message, exc: FlowmeshError, now: float
    ) -> None:
        """The shell could not deliver `msg`: a gone peer is dead; a full one fails the work
        that waited on the message, so no state is left expecting an answer to it."""
        self.totals["dropped_sends"] += 1
        log.warning("could not send %s to %s %r: %s", msg.TYPE, dest, addr, exc.reason)
        if dest == CLIENT:
            return  # the client's own timeout answers it
        if exc.code == Code.UNAVAILABLE:  # PeerGone
            self.peer_unreachable(addr, now)
            return
        ref = getattr(msg, "id", None)
        reason = f"could not reach {self.by_addr.get(addr, addr)!r}: {exc.reason}"
        if isinstance(msg, p.Run) and ref in self.batches:
            self._run_failed(self.batches.pop(ref), str(Code.OVERLOADED), reason, now)
            return
        if self.training.undelivered(ref, reason):
            return
        call = self.calls.pop(ref, None) if isinstance(ref, int) else None
        if call is not None:
            self._call_expired(call, now, reason)
        elif isinstance(msg, p.Evict | p.DropStage):
            # The worker still holds bytes we count as free; its next load there may fail
            # NO_SPACE, which evicts everything idle there (flush) and retries.
            name = self.by_addr.get(addr)
            if name is not None and name in self.peers:
                self.peers[name].flush_next = True
