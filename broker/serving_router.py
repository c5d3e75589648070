"""The broker's serving router: request queues, batching, residency by bytes, runs and failover.

A plain class, driven by `BrokerCore`; no sockets, no clock of its own. It reads the catalogue
(models, replicas, peers) that `Registry` keeps, and decides, every time something changes
(`pump`), which batch starts where:

- **Queues and batching**: each model keeps a FIFO of checked requests; a batch takes the head
  and every queued request with the same input signature that fits the model's max batch size.
- **Residency**: a replica whose stages are all resident runs at once; otherwise one replica is
  loaded (a `Load` on every stage's worker at once): the one whose expected victims are worth
  least (`policy.pick_victims`: value, then recency; never a stage with work queued or in
  flight, unless the head request has starved, `starvation_s`). A stage's bytes there are its
  weights + the live KV its worker reports (`kv_held`): they count in its value and in the free
  room, and a stage holding KV goes last. The workers own their memory:
  each Load names the stages its worker must keep, the worker chooses what to evict, and its
  `Resident` report replaces our expectation (`resident_report`). A starving model that still
  does not fit reserves a replica's workers, so they drain for it.
- **Runs**: a batch of a model cut over several workers runs *direct* when they all have peer
  endpoints: a `Run` to every stage's worker at once (with a random ticket), the activations going
  worker to worker in micro-batches, the last stage answering; the broker sees no activation byte.
  Under CURVE keys each worker is told the key of the worker it sends to and of the only one it
  takes from (both from the broker's key directory). Otherwise it travels stage by stage (`Run` to
  each worker in turn, the activations forwarded as frames, counted in `activation_bytes_relayed`).
  The last stage's answer is split back into one `Result` per request.
- **Streamed replicas** (more stages than workers, `policy.shared_placement`): no Load and no
  residency to wait for; one batch at a time, stage by stage, each run bringing its stage in
  while the worker prefetches the next (`gpu_worker.executor`).
- **Failover**: a run on a lost worker is queued again once (`max_retries`) when another replica
  lives, else WORKER_LOST; a run unanswered by its deadline has hung: its requests get TIMEOUT
  and its replica is given up to the registry, which re-creates it elsewhere.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from broker.context import Context, fail
from broker.policy import pick_victims
from broker.state import (
    Batch,
    Call,
    Model,
    ModelState,
    Peer,
    Phase,
    Replica,
    Request,
    Residency,
    StageKey,
)
from broker.status import Timings
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.logs import LogThrottle
from flowmesh.value import stage_value

log = logging.getLogger("broker.serving_router")

# Prefetch is a guess from arrival rates, which change slowly: looking every 50 ms is as good
# as looking on every request, and with a large catalogue far cheaper (it scans every model).
PREFETCH_EVERY_S = 0.05


def kv_held(peer: Peer) -> dict[StageKey, int]:
    """The live KV cache bytes of each stage `peer` holds, from its latest heartbeat's
    `kv_stage_bytes` ("model/stage" -> bytes, `gpu_worker.executor.Executor.stats`).

    Only stages we count resident there: one evicted (or expected to be, `peer.leaving`) took
    its KV with it, though the figure lags a beat. The heartbeat's types are checked on receipt
    (`flowmesh.reports.WorkerStats`), not what its names mean: an entry that names no stage is
    passed over.
    """
    stats = peer.stats
    if not isinstance(stats, p.WorkerStats) or not peer.resident:
        return {}
    out: dict[StageKey, int] = {}
    for name, nbytes in stats.kv_stage_bytes.items():
        model, _, stage = name.rpartition("/")
        if not (stage.isascii() and stage.isdigit()) or nbytes <= 0:
            continue
        key = (model, int(stage))
        if key in peer.resident:
            out[key] = nbytes
    return out


class ReplicaKeeper(Protocol):
    """What the router needs from the registry (`broker.registry.Registry`): nothing else, so a
    test can stand in for it."""

    def give_up_replica(
        self, model: Model, rep: Replica, suspects: Sequence[str], reason: str
    ) -> None: ...


class GenSink(Protocol):
    """What the router needs from the generation room (`broker.generation.GenerationRoom`),
    whose iterations it runs as batches (`Batch.gen`) with the machinery requests use."""

    def pump(self, now: float) -> None: ...

    def holds(self, model: Model, rep: Replica) -> bool: ...

    def waits(self, model: Model) -> bool: ...

    def iteration_done(self, batch: Batch, tensors: dict[str, Any], now: float) -> None: ...

    def iteration_failed(self, batch: Batch, code: str, reason: str, now: float) -> None: ...

    def replica_given_up(self, batch: Batch, code: str, reason: str, now: float) -> None: ...


class ServingRouter:
    def __init__(self, ctx: Context, registry: ReplicaKeeper) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.registry = registry  # gives up a replica whose run hung
        # The shared tables, under short names (the very dicts: never rebound).
        self.peers = ctx.peers
        self.models = ctx.models
        self.calls = ctx.calls
        self.totals = ctx.totals
        self.batches: dict[int, Batch] = {}  # run id -> the batch it runs
        # Lines logged per worker answer: what a worker can send at will is not a line each.
        self.log_throttle = LogThrottle(log)
        # Names of the models that may have requests queued (a superset: `pump` drops those
        # without), so that a pump costs what waits, not the size of the catalogue.
        self.queued: dict[str, None] = {}
        # Prefetch looks at every model: at most once per PREFETCH_EVERY_S, not per request.
        self.next_prefetch = float("-inf")
        # What status and /metrics report of answered requests, batches and loads.
        self.timings = Timings()
        # Requests refused at the door: (model, code) -> count; "" for a model not deployed
        # (a name a client made up must not become a metric label).
        self.refused: dict[tuple[str, str], int] = {}
        # Copy bandwidth seen per worker (bytes/s, smoothed), from its Loaded answers: the
        # cost of bringing a stage back, in `stage_value`.
        self.bandwidth: dict[str, float] = {}
        # The generation room, once BrokerCore wires it: pumped with the queues, asked which
        # stages hold live sequences (never evicted), told how its iterations end.
        self.gen: GenSink | None = None

    def forget_gone(self) -> None:
        """Forget the figures of models undeployed and workers gone (each tick): kept, they
        would grow with every model and worker name the broker ever saw."""
        self.timings.keep_only(self.models, self.peers)
        for key in [k for k in self.refused if k[0] and k[0] not in self.models]:
            del self.refused[key]
        for name in [w for w in self.bandwidth if w not in self.peers]:
            del self.bandwidth[name]
        for model in self.models.values():
            # A worker gone is avoided no more: one that comes back under its name is a new
            # process (and a CPU worker's name carries its pid: kept, they would pile up).
            if model.avoid:
                model.avoid.intersection_update(self.peers)

    # ================================================================== requests

    def infer(self, addr: bytes, msg: p.Infer, now: float) -> None:
        try:
            self._accept(addr, msg, now)
        except FlowmeshError as exc:
            key = (msg.model if msg.model in self.models else "", str(exc.code))
            self.refused[key] = self.refused.get(key, 0) + 1
            raise

    def _accept(self, addr: bytes, msg: p.Infer, now: float) -> None:
        model = self.ctx.deployed(msg.model)
        self.ctx.check_ready(model)
        rows, signature = self._check_inputs(model, msg.tensors)
        if len(model.queue) >= self.cfg.max_queue:
            raise fail(
                Code.OVERLOADED,
                f"{msg.model!r} has {len(model.queue)} queued requests "
                f"(limit {self.cfg.max_queue}); retry later",
            )
        mine = self.ctx.client_room(addr)
        timeout = (msg.timeout_ms / 1000) if msg.timeout_ms else self.cfg.default_timeout_s
        req = Request(
            tag=next(self.ctx.ids),
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
        self.queued[model.name] = None
        self.ctx.outstanding[addr] = mine + 1
        model.rate.add(now)
        model.requests += 1
        self.totals["requests"] += 1
        self.pump(now)

    def _check_inputs(
        self, model: Model, tensors: dict[str, p.TensorRef]
    ) -> tuple[int, tuple[Any, ...]]:
        if not tensors:
            raise fail(Code.BAD_REQUEST, "infer needs at least one input tensor")
        declared = model.inputs
        if declared is not None:
            if list(tensors) == [""] and len(declared) == 1:
                ((name, spec),) = declared.items()
                ref = tensors[""]
                spec.check(name, ref.dtype, ref.shape)
            else:
                if set(tensors) != set(declared):
                    raise fail(
                        Code.BAD_REQUEST,
                        f"{model.name!r} takes inputs {sorted(declared)}, got {sorted(tensors)}",
                    )
                for name, ref in tensors.items():
                    declared[name].check(name, ref.dtype, ref.shape)
        rows = {ref.shape[0] if ref.shape else None for ref in tensors.values()}
        if None in rows or len(rows) != 1:
            raise fail(Code.BAD_REQUEST, "inputs must share a leading batch dimension")
        (n,) = rows
        if n == 0:
            raise fail(Code.BAD_REQUEST, "empty batch (dimension 0 is 0)")
        signature = tuple(sorted((k, r.dtype, r.shape[1:]) for k, r in tensors.items()))
        return int(n), signature

    def expire_queued(self, model: Model, now: float) -> None:
        """Answer TIMEOUT to the requests of `model` still queued past their deadline (every
        tick, for every model: it also sees that `pump` knows of every queued request)."""
        if model.queue:
            self.queued[model.name] = None
        expired = [r for r in model.queue if r.deadline <= now]
        if expired:
            model.queue = type(model.queue)(r for r in model.queue if r.deadline > now)
            for r in expired:
                self.ctx.answer_error(
                    r,
                    Code.TIMEOUT,
                    f"not served within {r.deadline - r.arrived:.1f} s (queued)",
                )

    def expire_running(self, now: float) -> None:
        """Answer TIMEOUT to running requests past their deadline (their batch runs on), then
        give up the batches whose stage did not answer by the batch's deadline."""
        for batch in self.batches.values():
            for r in batch.requests:
                if r.client is not None and r.deadline <= now:
                    self.ctx.answer_error(
                        r,
                        Code.TIMEOUT,
                        f"not served within {r.deadline - r.arrived:.1f} s (running)",
                    )
        for run_id, batch in list(self.batches.items()):
            if batch.deadline <= now and self.batches.get(run_id) is batch:
                del self.batches[run_id]
                self.run_hung(batch, now)

    # ================================================================== scheduling

    def pump(self, now: float) -> None:
        """Start every batch that can start now, oldest waiting model first."""
        for peer in self.peers.values():
            owner = self.models.get(peer.reserved_for) if peer.reserved_for else None
            if peer.reserved_for and (owner is None or not self._waits(owner)):
                peer.reserved_for = None
        for _ in range(10_000):  # bounded: each pass either dispatches or stops
            waiting = []
            for name in list(self.queued):
                model = self.models.get(name)
                if model is None or not model.queue:
                    del self.queued[name]
                elif model.state is ModelState.READY:
                    waiting.append(model)
            waiting.sort(key=self._deadline)  # earliest deadline first
            if not any(self._dispatch(m, now) for m in waiting):
                break
        if self.gen is not None:
            self.gen.pump(now)
        if self.cfg.prefetch and now >= self.next_prefetch:
            self.next_prefetch = now + PREFETCH_EVERY_S
            self._prefetch(now)

    def _waits(self, model: Model) -> bool:
        """Whether `model` has requests queued or sequences waiting to join."""
        return bool(model.queue) or (self.gen is not None and self.gen.waits(model))

    def _deadline(self, model: Model) -> float:
        slo = model.spec.slo_ms / 1000 if model.spec.slo_ms else self.cfg.default_slo_s
        return model.queue[0].arrived + slo

    def _prefetch(self, now: float) -> None:
        """Load the models most likely to be asked next, held nowhere, into free bytes only:
        a prefetch never evicts anything (so never a stage worth more)."""
        hot = [
            m
            for m in self.models.values()
            if m.state is ModelState.READY
            and m.drain is None
            and not m.queue
            and not m.prefetch_hold
            and m.rate.at(now) >= self.cfg.prefetch_min_rate
        ]
        hot.sort(key=lambda m: -m.rate.at(now))
        for model in hot:
            # A streamed replica's stages come in with its runs (`_dispatch`), not ahead of them.
            live = [r for r in model.replicas if r.live and not r.streamed]
            if not live or any(self._placed(model, r) for r in live):
                continue
            for rep in live:
                if any(self.peers[w].reserved_for not in (None, model.name) for w in rep.workers):
                    continue  # kept for a starving model
                victims = self._victims_for(model, rep, starving=False, free_only=True, now=now)
                if victims is not None:
                    self._load_replica(model, rep, victims, now, keep_all=True)
                    model.prefetches += 1
                    break

    def _dispatch(self, model: Model, now: float) -> bool:
        live = [r for r in model.replicas if r.live]
        for rep in live:
            # A streamed replica (several stages on one worker, more than its budget holds) has
            # no residency to wait for: each stage-by-stage run brings its stage in, evicting
            # the ones that already ran, and the worker prefetches the next one while it
            # computes. One batch at a time: a second would only compete for the same bytes,
            # and the requests that wait meanwhile join the next batch, which copies once.
            if rep.streamed and rep.inflight == 0 and not self._blocked(model, rep):
                self._start_batch(model, rep, now)
                return True
        live = [r for r in live if not r.streamed]
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
                    self._load_replica(model, rep, victims, now, keep_all=True)
                    self._start_batch(model, rep, now)
                    return True
            return False
        starving = now - model.queue[0].arrived >= self.cfg.starvation_s
        best = self._cheapest_load(model, live, starving, now)
        if best is None:
            if starving:
                self._reserve(model, live)
            return False
        rep, victims = best
        self._load_replica(model, rep, victims, now, starving=starving)
        self._start_batch(model, rep, now)
        return True

    def _cheapest_load(
        self, model: Model, live: list[Replica], starving: bool, now: float
    ) -> tuple[Replica, dict[str, list[StageKey]]] | None:
        """The replica to load: the one whose victims are worth least; among equals, fewest
        bytes evicted. None: none can be loaded now."""
        best: tuple[tuple[float, int], Replica, dict[str, list[StageKey]]] | None = None
        for rep in live:
            if self._blocked(model, rep) and not starving:
                continue
            victims = self._victims_for(model, rep, starving=starving, now=now)
            if victims is None:
                continue
            owners = self._owners(victims)
            kv = {w: kv_held(self.peers[w]) for w in victims}
            cost = (
                sum(self._value(self.peers[w], r, now, kv[w]) for w, r in owners),
                sum(r.nbytes + kv[w].get(r.key, 0) for w, r in owners),  # KV goes with it
            )
            if best is None or cost < best[0]:
                best = (cost, rep, victims)
        return None if best is None else (best[1], best[2])

    def _placed(self, model: Model, rep: Replica) -> bool:
        return all((model.name, s) in self.peers[w].resident for s, w in enumerate(rep.workers))

    def _blocked(self, model: Model, rep: Replica) -> bool:
        for w in rep.workers:
            peer = self.peers[w]
            if peer.reserved_for not in (None, model.name):
                return True
        return self.peers[rep.workers[0]].inflight_runs >= self.peers[rep.workers[0]].max_inflight

    def _start_batch(self, model: Model, rep: Replica, now: float) -> None:
        head = model.queue.popleft()
        requests, rows = [head], head.rows
        separate = False
        if not head.solo and model.spec.max_batch_size == 1 and len(rep.workers) == 1:
            # One forward per request, but queued ones share a run (cfg.group_runs): spread
            # over the runs the worker may still take, so a short queue uses every lane.
            first = self.peers[rep.workers[0]]
            slots = max(1, first.max_inflight - first.inflight_runs)
            size = min(max(1, self.cfg.group_runs), -(-(len(model.queue) + 1) // slots))
            keep = []
            while model.queue and len(requests) < size:
                r = model.queue.popleft()
                (keep if r.solo else requests).append(r)
            model.queue.extendleft(reversed(keep))
            separate = len(requests) > 1
            rows = sum(r.rows for r in requests)
        elif not head.solo and model.spec.max_batch_size > 1:
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
        tensors = [r.tensors for r in requests]
        batch = Batch(
            run_id=next(self.ctx.ids),
            model=model.name,
            replica=rep,
            requests=requests,
            stage=0,
            worker=rep.workers[0],
            started=now,
            separate=separate,
            owner=model,
        )
        rep.inflight += 1
        model.batches += 1
        self.totals["batches"] += 1
        self.timings.batch_started(model.name, 1 if separate else len(requests))
        parts = [[r.tag, r.rows] for r in requests]
        self._send_batch(model, batch, parts, tensors, rows, now)

    def _send_batch(
        self,
        model: Model,
        batch: Batch,
        parts: list[list[int]],
        tensors: list[dict[str, Any]],
        rows: int,
        now: float,
    ) -> None:
        """Send a started batch's first Run(s): direct to every stage when it can, else to
        stage 0 alone (the router relays it on, `_advance`)."""
        rep = batch.replica
        ends = [self.peers[w].info.peer_endpoint for w in rep.workers]
        # Never direct for a streamed replica: a direct batch announces every stage at once, and
        # a worker admits each run as it arrives, so all of its stages would be in flight at
        # once (none evictable for the next): the model would have to fit after all.
        if self.cfg.direct and len(rep.workers) > 1 and not rep.streamed and all(ends):
            keys = [self.peers[w].key for w in rep.workers]
            self._start_direct(model, batch, parts, tensors, ends, keys, rows, now)
            return
        self._enter_stage(batch, now)
        self.batches[batch.run_id] = batch
        self.ctx.to_peer(
            batch.worker,
            p.Run(
                id=batch.run_id,
                model=model.name,
                stage=0,
                parts=parts,
                tensors=tensors,
                separate=batch.separate,
                gen=batch.gen.step if batch.gen is not None else None,
            ),
        )

    def start_gen(
        self, model: Model, rep: Replica, iteration: Any, ids: p.TensorRef, now: float
    ) -> Batch:
        """Run one generation iteration (`broker.generation.Iteration`, its `step` sent with
        every stage's Run) on `rep`, whose stages `ensure_gen` made resident or loading: stage
        0 gets the tokens `ids`, the batch is one part of every token, never cut."""
        batch = Batch(
            run_id=next(self.ctx.ids),
            model=model.name,
            replica=rep,
            requests=[],
            stage=0,
            worker=rep.workers[0],
            started=now,
            gen=iteration,
            owner=model,
        )
        total = ids.shape[0]
        batch.parts = [[batch.run_id, total]]
        rep.inflight += 1
        self._send_batch(model, batch, batch.parts, [{"ids": ids}], total, now)
        return batch

    def ensure_gen(self, model: Model, rep: Replica, now: float, *, starving: bool) -> bool:
        """Whether a generation iteration may start on `rep` now, loading its stages first
        when they are not resident (victims chosen as for a request's load; `starving`: also
        stages of models with work waiting). False: not now (blocked, or no room yet). A
        draining replica still runs the sequences it holds (no new one joins it)."""
        if not all(rep.ready) or rep.streamed or not any(r is rep for r in model.replicas):
            return False
        if self._blocked(model, rep) and not starving:
            return False
        if self._placed(model, rep):
            return True
        victims = self._victims_for(model, rep, starving=starving, now=now)
        if victims is None:
            return False
        self._load_replica(model, rep, victims, now, starving=starving)
        return True

    def may_follow(self, model: Model, rep: Replica) -> bool:
        """Whether one more generation iteration may be sent to `rep` to follow the one in
        flight there (`GenStep.follows`): still live and placed, its worker not at its limit of
        runs, nothing keeping it for another model."""
        return (
            any(r is rep for r in model.replicas)
            and all(rep.ready)
            and not rep.streamed
            and self._placed(model, rep)
            and not self._blocked(model, rep)
        )

    def pick_gen(
        self, model: Model, taken: list[Replica], now: float, *, starving: bool
    ) -> Replica | None:
        """A replica of `model` (not in `taken`) for sequences that have none yet: a resident
        one that may run now, else the cheapest to load (then loaded). None: none now."""
        live = [
            r
            for r in model.replicas
            if r.live and not r.streamed and not any(r is t for t in taken)
        ]
        for rep in live:
            if self._placed(model, rep) and not self._blocked(model, rep):
                return rep
        best = self._cheapest_load(model, live, starving, now)
        if best is None:
            if starving and live:
                # Another model's iterations keep its stages busy: no new one starts on these
                # workers until this model is in (its sequences' KV then parked or dropped).
                # (No replica left to load: its own are in use, full; nothing to reserve.)
                self._reserve(model, live)
            return None
        rep, victims = best
        self._load_replica(model, rep, victims, now, starving=starving)
        return rep

    def _start_direct(
        self,
        model: Model,
        batch: Batch,
        parts: list[list[int]],
        tensors: list[dict[str, Any]],
        ends: list[Any],
        keys: list[str],
        rows: int,
        now: float,
    ) -> None:
        """Announce a batch to every stage's worker at once; the last one answers. Under CURVE
        each learns the key of the worker it sends to and of the one it takes from."""
        stages = len(batch.replica.workers)
        chunks = 1
        # Rows are independent: the batch may be cut (a generation iteration never is: its
        # sequences' tokens are one packed part).
        if model.spec.max_batch_size > 1 and batch.gen is None:
            want = self.cfg.micro_batches or min(stages, rows // self.cfg.micro_batch_rows)
            chunks = max(1, min(want, rows))
        ticket = secrets.randbits(63) or 1
        batch.direct = True
        batch.stage, batch.worker = stages - 1, batch.replica.workers[-1]
        self._enter_stage(batch, now)
        self.batches[batch.run_id] = batch
        self.totals["direct_batches"] += 1
        for stage, w in enumerate(batch.replica.workers):
            self.ctx.to_peer(
                w,
                p.Run(
                    id=batch.run_id,
                    model=model.name,
                    stage=stage,
                    parts=parts,
                    tensors=tensors if stage == 0 else [],
                    ticket=ticket,
                    from_peer=stage > 0,
                    next_peer=ends[stage + 1] if stage + 1 < stages else "",
                    chunks=chunks,
                    next_key=keys[stage + 1] if stage + 1 < stages else "",
                    from_key=keys[stage - 1] if stage > 0 else "",
                    gen=batch.gen.step if batch.gen is not None else None,
                ),
            )

    def _cancel_direct(self, batch: Batch, skip: str | None = None) -> None:
        """Tell a given-up direct batch's other workers to forget it."""
        if not batch.direct:
            return
        for w in batch.replica.workers:
            if w != skip and w in self.peers:
                self.ctx.to_peer(w, p.CancelRun(id=batch.run_id))

    # ================================================================== residency

    def _owners(self, victims: dict[str, list[StageKey]]) -> list[tuple[str, Residency]]:
        return [(w, self.peers[w].resident[k]) for w, ks in victims.items() for k in ks]

    def _value(
        self, peer: Peer, res: Residency, now: float, kv: Mapping[StageKey, int] | None = None
    ) -> float:
        """What keeping `res` on `peer` is worth (`flowmesh.value.stage_value`): its weights and
        the live KV it holds there (`kv`: `kv_held(peer)`, passed in by callers that have it)."""
        if self.cfg.eviction != "value":
            return 0.0  # least recently used alone
        model = self.models.get(res.key[0])
        rate = model.rate.at(now) if model is not None else 0.0
        held = (kv_held(peer) if kv is None else kv).get(res.key, 0)
        return stage_value(rate, res.nbytes, self.bandwidth.get(peer.name, 1e9), held)

    def _victims_for(
        self,
        model: Model,
        rep: Replica,
        *,
        starving: bool,
        free_only: bool = False,
        now: float = 0.0,
    ) -> dict[str, list[StageKey]] | None:
        out: dict[str, list[StageKey]] = {}
        for stage, w in enumerate(rep.workers):
            peer = self.peers[w]
            key = (model.name, stage)
            if key in peer.resident:
                out[w] = []
                continue
            need = peer.hosted.get(key, model.stage_bytes[stage])
            # The live KV its stages hold there takes room beside their weights.
            kv = kv_held(peer)
            if free_only:
                if peer.free - sum(kv.values()) < need:
                    return None
                out[w] = []
                continue
            victims = pick_victims(
                peer,
                need,
                lambda r, peer=peer: self._evictable(peer, r, starving),
                value=lambda r, peer=peer, kv=kv: self._value(peer, r, now, kv),
                max_stages=self._max_stages(peer),
                kv=kv,
            )
            if victims is None:
                return None
            out[w] = victims
        return out

    def _max_stages(self, peer: Peer) -> int | None:
        """Under the count-based policy, how many stages `peer` may hold."""
        if self.cfg.eviction != "count" or not peer.hosted:
            return None
        return max(1, peer.budget // max(peer.hosted.values()))

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
                and (
                    rep.inflight
                    or (not starving and self.gen is not None and self.gen.holds(model, rep))
                )
            ):
                # A batch is in this replica's pipeline and will need this stage: never
                # evicted. Live sequences of the model keep their KV cache beside it: kept
                # but for a starving model (the worker then preempts them, parking their KV
                # where that pays: `gpu_worker.executor.Executor.evict`).
                return False
        waiting = model.queue or (self.gen is not None and self.gen.waits(model))
        return not waiting or starving

    def _reserve(self, model: Model, live: list[Replica]) -> None:
        """Stop new batches of other models on one replica's workers until this model fits."""
        rep = min(live, key=lambda r: sum(self.peers[w].inflight_runs for w in r.workers))
        for w in rep.workers:
            if self.peers[w].reserved_for is None:
                self.peers[w].reserved_for = model.name
                log.info("reserving worker=%s for starving model=%s", w, model.name)

    def _load_replica(
        self,
        model: Model,
        rep: Replica,
        victims: dict[str, list[StageKey]],
        now: float,
        *,
        starving: bool = False,
        keep_all: bool = False,
    ) -> None:
        """Send a `Load` for each stage of `rep` not on its worker yet.

        The worker makes the room itself: `victims` is only what we expect it to evict (taken
        out of our view at once, their bytes counted as the load's, until its `Resident` report
        says what it did). Each Load names the stages the worker must keep: those with work
        queued or in flight here, or all of them (`keep_all`: a prefetch or a scale-out, which
        never evicts).
        """
        for stage, w in enumerate(rep.workers):
            peer = self.peers[w]
            key = (model.name, stage)
            if key not in peer.resident:
                cid = next(self.ctx.ids)
                for v in victims.get(w, []):
                    if self.cfg.eviction == "count":
                        self.ctx.evict(peer, v)  # by count: the worker would keep it (bytes fit)
                        continue
                    del peer.resident[v]
                    peer.leaving[v] = cid
                keep = [
                    [k[0], k[1]]
                    for k, r in peer.resident.items()
                    if keep_all or not self._evictable(peer, r, starving)
                ]
                self.calls[cid] = Call(
                    "load", w, now + self.cfg.load_timeout_s, {"model": model.name, "stage": stage}
                )
                peer.resident[key] = Residency(key, peer.hosted[key], Phase.LOADING, now)
                self.ctx.to_peer(w, p.Load(id=cid, model=model.name, stage=stage, keep=keep))
            if peer.reserved_for == model.name:
                peer.reserved_for = None
        for peer in self.peers.values():
            if peer.reserved_for == model.name:
                peer.reserved_for = None

    def resident_report(self, peer: Peer, msg: p.Resident, now: float) -> None:
        """A worker says what it holds after choosing evictions itself: take its word.

        Stages we counted as resident and it no longer holds were evicted by it; stages we
        expected a load to evict (`peer.leaving`) are settled once the report follows that load;
        stages it holds that we did not count (kept against our expectation, or brought back
        for a run) count again. Loads still in flight stay as they are until answered.
        """
        if peer.role != "worker":
            raise fail(Code.BAD_REQUEST, f"{peer.name} is not a worker")
        held: dict[StageKey, int] = {}
        for item in msg.stages:
            if (
                len(item) != 3
                or not isinstance(item[0], str)
                or not all(isinstance(v, int) and v >= 0 for v in item[1:])
            ):
                raise fail(
                    Code.BAD_REQUEST, f"resident: expected [model, stage, nbytes], got {item!r}"
                )
            held[(item[0], item[1])] = item[2]
        for key, res in list(peer.resident.items()):
            if res.phase is Phase.RESIDENT and key not in held:
                del peer.resident[key]
                self.ctx.count_eviction(peer, key)
        for key, cid in list(peer.leaving.items()):
            if cid <= msg.after_load:  # the load that was to evict it has been handled
                del peer.leaving[key]
                if key not in held:
                    self.ctx.count_eviction(peer, key)
        for key, nbytes in held.items():
            if key not in peer.resident and key not in peer.leaving and key in peer.hosted:
                peer.resident[key] = Residency(key, nbytes, Phase.RESIDENT, now)
        self.pump(now)

    def loaded(self, peer: Peer, msg: p.Loaded, now: float) -> None:
        seconds = msg.seconds
        if not 0 <= seconds < float("inf"):
            raise fail(Code.BAD_REQUEST, f"loaded seconds: expected a duration, got {seconds!r}")
        call = self.calls.get(msg.id)
        if call is None:
            return  # expired: the residency was dropped and an Evict sent after the load
        if (
            call.kind != "load"
            or call.peer != peer.name
            or ((call.data["model"], call.data["stage"]) != (msg.model, msg.stage))
        ):
            raise fail(Code.BAD_REQUEST, f"no pending load {msg.id} of that stage for {peer.name}")
        del self.calls[msg.id]
        res = peer.resident.get((msg.model, msg.stage))
        if res is not None and res.phase is Phase.LOADING:
            res.phase = Phase.RESIDENT
            res.nbytes = msg.nbytes
            peer.loads += 1
            self.timings.loaded(peer.name, msg.nbytes, seconds)
            if seconds > 0:
                bw = msg.nbytes / seconds
                old = self.bandwidth.get(peer.name)
                self.bandwidth[peer.name] = bw if old is None else 0.8 * old + 0.2 * bw
            model = self.models.get(msg.model)
            if model is not None:
                model.loads += 1
                model.prefetch_hold = False
        self.pump(now)

    def load_failed(self, peer: Peer, call: Call, msg: p.Error, now: float) -> None:
        """`peer` could not load a stage: forget the residency and start what can start."""
        key = (call.data["model"], call.data["stage"])
        res = peer.resident.get(key)
        if res is not None and res.phase is Phase.LOADING:
            del peer.resident[key]
        self._hold_prefetch(key[0])
        self.log_throttle.warning(
            "load failed worker=%s stage=%s code=%s reason=%s",
            peer.name,
            key,
            msg.code,
            msg.reason,
        )
        self.pump(now)

    def load_expired(self, call: Call) -> None:
        """A load not confirmed in time (or never sent): drop the residency."""
        peer = self.peers.get(call.peer)
        if peer is None:
            return
        key = (call.data["model"], call.data["stage"])
        res = peer.resident.get(key)
        self._hold_prefetch(key[0])
        if res is not None and res.phase is Phase.LOADING:
            # The worker may still finish it: the Evict, ordered after the Load, frees it.
            self.ctx.evict(peer, key)

    def _hold_prefetch(self, name: str) -> None:
        model = self.models.get(name)
        if model is not None:
            model.prefetch_hold = True

    # ================================================================== runs

    def run_result(self, peer: Peer, msg: p.RunResult, now: float) -> None:
        batch = self.batches.get(msg.id)
        if batch is None:
            return  # its replica was lost or it timed out; nobody waits for it
        # Only the worker a batch was sent to may answer it; anyone else is refused and the
        # batch is untouched.
        if batch.worker != peer.name or (msg.model, msg.stage) != (batch.model, batch.stage):
            raise fail(
                Code.BAD_REQUEST,
                f"run {msg.id} ({msg.model}/{msg.stage}) was not sent to {peer.name}",
            )
        last = batch.stage == len(batch.replica.workers) - 1
        if batch.gen is not None:
            self._gen_result(batch, msg, last, now)
            return
        # Its info was checked as it was decoded (one refused there fails its batch at once,
        # through `BrokerCore.answer_refused`).
        seconds = {"compute_s": msg.info.compute_s, "wait_s": msg.info.wait_s}
        try:  # checked before anything changes, so a bad answer fails its batch cleanly
            parts = self._result_parts(batch, msg.tensors, last)
        except FlowmeshError as exc:
            del self.batches[msg.id]
            self.log_throttle.warning("bad run_result from %s: %s", peer.name, exc.reason)
            self.run_failed(batch, str(Code.INTERNAL), f"worker {peer.name}: {exc.reason}", now)
            return
        del self.batches[msg.id]
        self._leave_stage(batch, now)
        model = self._model_of(batch)
        for k, v in seconds.items():
            batch.info[k] = batch.info.get(k, 0.0) + v
        if not last:
            if model is not None and batch.replica in model.replicas:
                self._advance(model, batch, msg.tensors, now)
                return
            batch.replica.inflight -= 1
            if model is None:
                for req in batch.requests:
                    self.ctx.answer_error(
                        req, Code.MODEL_NOT_FOUND, f"{batch.model!r} was undeployed while running"
                    )
            else:  # its replica was given up midway: start again on another one
                model.queue.extendleft(r for r in reversed(batch.requests) if r.client is not None)
                self.queued[model.name] = None
            self.pump(now)
            return
        batch.replica.inflight -= 1
        for req, tensors in zip(batch.requests, parts, strict=True):
            if req.client is None:  # answered already (timed out)
                continue
            latency_ms = (now - req.arrived) * 1000
            info = {
                "latency_ms": latency_ms,
                # Requests that shared its forward (a grouped run computes each on its own).
                "batch": 1 if batch.separate else len(batch.requests),
                "queue_ms": (batch.started - req.arrived) * 1000,
                # The batch's start to its answer: load wait, compute and the hops between.
                "run_ms": (now - batch.started) * 1000,
                "compute_ms": batch.info.get("compute_s", 0.0) * 1000,
                "load_wait_ms": batch.info.get("wait_s", 0.0) * 1000,
                "workers": list(batch.replica.workers),
            }
            self.timings.answered(batch.model, info)
            result = p.Result(id=req.client_id, tensors=tensors, info=p.ResultInfo(**info))
            self.ctx.to_client(req.client, result)
            self.ctx.client_done(req.client)
            req.client = None  # type: ignore[assignment]
            if model is not None:
                model.completed += 1
                model.latency_ms.append(latency_ms)
                if model.spec.slo_ms is not None and latency_ms <= model.spec.slo_ms:
                    model.within_slo += 1
            self.totals["completed"] += 1
        self.pump(now)

    def _gen_result(self, batch: Batch, msg: p.RunResult, last: bool, now: float) -> None:
        """A stage answered a generation iteration: on to the next stage, or (the last) its
        new tokens to the generation room."""
        assert self.gen is not None
        del self.batches[msg.id]
        self._leave_stage(batch, now)
        batch.info["compute_s"] = batch.info.get("compute_s", 0.0) + msg.info.compute_s
        batch.info["wait_s"] = batch.info.get("wait_s", 0.0) + msg.info.wait_s
        model = self._model_of(batch)
        live = model is not None and any(r is batch.replica for r in model.replicas)
        if not last and live:
            assert model is not None
            self._advance(model, batch, msg.tensors, now)
            return
        batch.replica.inflight -= 1
        if not live:
            why = "was undeployed" if model is None else "lost the replica it ran on"
            self.gen.iteration_failed(
                batch, str(Code.WORKER_LOST), f"{batch.model!r} {why} while generating", now
            )
        else:
            self.gen.iteration_done(batch, msg.tensors, now)
        self.pump(now)

    @staticmethod
    def _result_parts(
        batch: Batch, parts: list[dict[str, p.TensorRef]], last: bool
    ) -> list[dict[str, p.TensorRef]]:
        """A stage's outputs, one part per request of the batch; the last stage's each have
        some."""
        if len(parts) != len(batch.requests):
            raise fail(
                Code.BAD_REQUEST,
                f"run_result: {len(parts)} parts for a batch of {len(batch.requests)} requests",
            )
        if last and not all(parts):
            raise fail(Code.BAD_REQUEST, "run_result: a request of the batch has no output")
        return parts

    def _advance(self, model: Model, batch: Batch, parts: list[dict[str, Any]], now: float) -> None:
        """Send a batch's activations on to the next stage's worker (frames, not copies)."""
        self.totals["activation_bytes_relayed"] += sum(
            getattr(t, "nbytes", 0) for part in parts for t in part.values()
        )
        batch.stage += 1
        batch.worker = batch.replica.workers[batch.stage]
        batch.run_id = next(self.ctx.ids)
        self._enter_stage(batch, now)
        self.batches[batch.run_id] = batch
        self.ctx.to_peer(
            batch.worker,
            p.Run(
                id=batch.run_id,
                model=model.name,
                stage=batch.stage,
                parts=batch.parts or [[r.tag, r.rows] for r in batch.requests],
                tensors=parts,
                gen=batch.gen.step if batch.gen is not None else None,
            ),
        )

    def _enter_stage(self, batch: Batch, now: float) -> None:
        # A stage that has not answered by the later of the run timeout and its requests'
        # deadlines has hung (see run_hung): nobody's timeout is cut short by it.
        latest = max((r.deadline for r in batch.requests), default=now)
        batch.deadline = max(now + self.cfg.run_timeout_s, latest)
        stages = range(len(batch.replica.workers)) if batch.direct else [batch.stage]
        for stage in stages:
            peer = self.peers[batch.replica.workers[stage]]
            peer.inflight_runs += 1
            res = peer.resident.get((batch.model, stage))
            if res is not None:
                res.inflight += 1
                res.last_used = now
            batch.counted_on.append((peer, res))

    def _leave_stage(self, batch: Batch, now: float) -> None:
        for peer, res in batch.counted_on:
            peer.inflight_runs -= 1
            if res is not None:
                res.inflight -= 1
                res.last_used = now
        batch.counted_on = []

    def run_failed(
        self, batch: Batch, code: str, reason: str, now: float, worker: str | None = None
    ) -> None:
        """`batch` failed (on `worker`, by default the one it waits for)."""
        worker = worker or batch.worker
        self._leave_stage(batch, now)
        self._cancel_direct(batch, skip=worker)
        batch.replica.inflight -= 1
        model = self._model_of(batch)
        live = [r for r in batch.requests if r.client is not None]
        if batch.gen is not None and self.gen is not None:
            if model is not None and code == Code.NOT_RESIDENT:
                self._not_resident(batch, worker)
            self.gen.iteration_failed(batch, code, reason, now)
            self.pump(now)
            return
        if model is not None and code == Code.NOT_RESIDENT:
            # Evicted mid-run, or the worker found no room to bring it back: not the client's
            # fault. Stop counting it resident there and run again (through a Load).
            self._not_resident(batch, worker)
            model.queue.extendleft(reversed(live))
            self.queued[model.name] = None
        elif model is not None and code in (Code.MODEL_ERROR, Code.BAD_REQUEST) and len(live) > 1:
            # A request the model raised on, or one its worker refused (a token id outside the
            # vocabulary): find it; the others of the batch succeed.
            for r in live:
                r.solo = True
            model.queue.extendleft(reversed(live))
            self.queued[model.name] = None
        else:
            for r in live:
                self.ctx.answer_error(r, code, reason)
        self.pump(now)

    def _model_of(self, batch: Batch) -> Model | None:
        """The model `batch` runs for; None once undeployed, even if deployed again under its
        name since: the batch's requests were checked against the other's inputs, and its
        stages are not the new one's."""
        model = self.models.get(batch.model)
        return model if model is batch.owner else None

    def _not_resident(self, batch: Batch, worker: str) -> None:
        """`worker` no longer holds `batch`'s stage: stop counting it resident there."""
        peer = self.peers.get(worker)
        stage = batch.replica.workers.index(worker) if batch.direct else batch.stage
        res = peer.resident.get((batch.model, stage)) if peer is not None else None
        if peer is not None and res is not None and res.phase is Phase.RESIDENT:
            del peer.resident[res.key]

    def run_error(self, peer: Peer, msg: p.Error, now: float) -> bool:
        """An Error from `peer` answering one of its runs: fail that batch. False if it is not."""
        batch = self.batches.get(msg.id) if msg.id is not None else None
        if batch is None:
            return False
        # A direct batch may fail at any of its stages; otherwise only where it waits.
        if peer.name != batch.worker and not (batch.direct and peer.name in batch.replica.workers):
            return False
        del self.batches[msg.id]  # type: ignore[arg-type]
        self.run_failed(batch, msg.code, msg.reason, now, worker=peer.name)
        return True

    def run_undelivered(self, run_id: Any, reason: str, now: float) -> bool:
        """A Run could not be sent: fail its batch (OVERLOADED). False if no batch has that id."""
        if run_id not in self.batches:
            return False
        self.run_failed(self.batches.pop(run_id), str(Code.OVERLOADED), reason, now)
        return True

    # ================================================================== failover

    def run_hung(self, batch: Batch, now: float) -> None:
        """A stage did not answer a run by its deadline while its worker still heartbeats.

        Its requests are answered, its counts released, and the replica is given up and
        re-created, away from that worker where another can hold the stage. A generation
        iteration's calls fail; the replica's other sequences start again elsewhere
        (`GenSink.replica_given_up`).
        """
        self._leave_stage(batch, now)
        self._cancel_direct(batch)
        batch.replica.inflight -= 1
        within = f"within {self.cfg.run_timeout_s:.0f} s; its replica is being re-created"
        if batch.direct:
            # Its stages hand activations to each other and only the last one answers: the
            # broker cannot tell which of them hung.
            suspects = list(dict.fromkeys(batch.replica.workers))
            reason = (
                f"the direct run of {batch.model!r} over workers {', '.join(suspects)} (stage "
                f"to stage) did not finish {within}"
            )
        else:
            suspects = [batch.worker]
            reason = (
                f"worker {batch.worker} did not finish stage {batch.stage} of {batch.model!r} "
                + within
            )
        self.totals["hung_runs"] += 1
        log.warning("run hung run=%d %s", batch.run_id, reason)
        for r in batch.requests:
            self.ctx.answer_error(r, Code.TIMEOUT, reason)
        model = self._model_of(batch)
        if model is not None:
            self.registry.give_up_replica(model, batch.replica, suspects, reason)
        if self.gen is not None:
            # The calls of a generation iteration that hung fail; the sequences of the
            # replica's other groups start again elsewhere (their runs are runs of their own).
            self.gen.replica_given_up(batch, str(Code.TIMEOUT), reason, now)

    def fail_over(self, model: Model, rep: Replica, lost: str, now: float) -> None:
        """Requests in flight on a lost replica: run once more elsewhere, or WORKER_LOST."""
        others = [r for r in model.replicas if r is not rep]
        for run_id, batch in list(self.batches.items()):
            if batch.replica is not rep:
                continue
            del self.batches[run_id]
            self._leave_stage(batch, now)
            self._cancel_direct(batch, skip=lost)
            for req in reversed(batch.requests):
                if req.client is None:
                    continue
                if others and req.retries < self.cfg.max_retries:
                    req.retries += 1
                    self.totals["retried"] += 1
                    model.queue.appendleft(req)
                    self.queued[model.name] = None
                else:
                    self.ctx.answer_error(
                        req, Code.WORKER_LOST, f"worker {lost} was lost while running this request"
                    )
