"""The broker's logic, as one facade over its rooms; the process shell is `broker.service`.

`BrokerCore` is a plain class. Each event (a decoded message, a clock tick, a failed send) changes
the state and appends the messages to send to `out`; the shell delivers them (`drain`). Tests
drive it in-process with exact expectations, no sockets.

The work itself is done in rooms, each a plain class with exact-output tests of its own:

- `broker.registry.Registry`, over its parts: peers (registration, heartbeats, loss:
  `broker.peers`), the model catalogue (deploy, undeploy, plans: `broker.catalogue`), stage
  placement and replica repair (`broker.placement`), autoscaling (`broker.autoscale`) and
  restarts (`broker.restore`);
- `broker.serving_router.ServingRouter`: request queues, batching, residency (loads, evictions),
  runs and their failover;
- `broker.training_router.TrainingRouter`: training jobs, their placement, steps and calls;
- `broker.generation.GenerationRoom`: token generation (sequences, continuous batching), its
  iterations run by the serving router as batches.

They share one `broker.context.Context` (tables, ids, outbox, totals). This class only builds
them, routes each message to the room that owns it, and orders the work of a tick.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from broker.config import BrokerConfig
from broker.context import BACKEND, CLIENT, Context, Outgoing, fail
from broker.generation import GenerationRoom
from broker.lm_files import LmFiles
from broker.policy import heart_failed
from broker.registry import Registry
from broker.serving_router import ServingRouter
from broker.state import Batch, Call, Model, Peer, Replica
from broker.status import model_status, peer_rows
from broker.store import Snapshot, Store
from broker.training_router import TrainingRouter
from flowmesh import protocol as p
from flowmesh.auth import Identity, authorize_client
from flowmesh.errors import Code, FlowmeshError
from flowmesh.logs import LogThrottle
from flowmesh.reports import BrokerStatus, Totals

log = logging.getLogger("broker.core")

# Re-exported: the shell, the command line and tests import these from here.
__all__ = [
    "BACKEND",
    "CLIENT",
    "BrokerConfig",
    "BrokerCore",
    "Call",
]


class BrokerCore:
    def __init__(self, cfg: BrokerConfig | None = None, now: float | None = None) -> None:
        self.cfg = cfg or BrokerConfig()
        self.ctx = Context(self.cfg)
        self.started = time.monotonic() if now is None else now
        # What the broker promised, kept across restarts (`--state-dir`; `broker.store`).
        self.store: Store | None = None
        snapshot: Snapshot | None = None
        if self.cfg.state_dir:
            self.store = Store(self.cfg.state_dir).open(lock=True)
            snapshot = self.store.load_all()
            # Ids above those of every earlier life: a late answer to a call of the broker
            # before cannot match a call of this one (before the rooms take the counter).
            self.ctx.ids = itertools.count((self.store.next_epoch() << 40) + 1)
        # Set by the shell when CURVE keys are on: every message then comes with the Identity
        # of its connection's key, and what it may do is checked against it.
        self.auth = False
        # What the frontend's socket accepts, set by the shell: told to each client (`Welcome`).
        self.limits = p.DEFAULT_LIMITS
        self.ctx.totals["auth_refused"] = 0
        # For the lines logged per message, answer or call: what a peer or client can make
        # happen at will must not become a log line each.
        self.log_throttle = LogThrottle(log)
        # Peers lost for missing `liveness` heartbeats in a row (status and /metrics).
        self.ctx.totals["heartbeat_losses"] = 0
        # The rooms call each other only through these callbacks, set here once.
        self.registry = Registry(
            self.ctx,
            on_change=lambda now: self.serving.pump(now),
            on_replica_lost=self._replica_lost,
            on_worker_lost=lambda name: self.training.worker_lost(name),
            on_worker_joined=lambda name, jobs, now: self.training.worker_joined(name, jobs, now),
        )
        self.serving = ServingRouter(self.ctx, self.registry)
        self.generation = GenerationRoom(self.ctx, self.serving)
        self.serving.gen = self.generation
        self.registry.autoscaler.holds = self.generation.holds
        self.registry.catalogue.generating = self.generation.running_calls
        self.generation.on_drained = self.registry.catalogue.check_drain
        self.training = TrainingRouter(
            peers=self.ctx.peers,
            ids=self.ctx.ids,
            to_client=self.ctx.to_client,
            to_worker=self.ctx.to_worker,
            allow=self.cfg.allow,
            step_timeout_s=self.cfg.default_timeout_s,
            open_timeout_s=self.cfg.deploy_timeout_s,
        )
        self.training.ask_plan = self.registry.catalogue.ask_plan  # `pipeline="auto"`
        self.jobs_restore_until: float | None = None
        if self.store is not None and snapshot is not None:
            self._restore(self.store, snapshot, self.started)

    def _replica_lost(self, model: Model, rep: Replica, lost: str, now: float) -> None:
        self.serving.fail_over(model, rep, lost, now)
        self.generation.replica_lost(model, rep, lost, now)

    def close(self) -> None:
        """Release what the broker holds outside itself (its state store and its lock)."""
        if self.store is not None:
            self.store.close()

    def restore_grace_s(self) -> float:
        """How long a restarted broker waits for workers to register with what they hold:
        a worker notices a silent broker after `liveness` heartbeats and registers again on a
        fresh socket (5 s registration timeout), or at once when its socket reconnects."""
        return max(10.0, 2 * self.cfg.heartbeat_s * self.cfg.liveness + 5.0)

    def _restore(self, store: Store, snap: Snapshot, now: float) -> None:
        if snap.allow is not None and tuple(snap.allow) != tuple(self.cfg.allow):
            log.warning(
                "the allow-list changed since the last start (was %s, now %s): the command "
                "line wins; models and jobs it refuses are not restored",
                list(snap.allow),
                list(self.cfg.allow),
            )
        store.save_allow(self.cfg.allow)
        self.registry.store = store
        self.training.store = store
        grace = self.restore_grace_s()
        self.registry.restore(snap.models, now, grace)
        self.training.restore(snap.jobs, now)
        if self.training.jobs:
            self.jobs_restore_until = now + grace
        log.info(
            "state from %s: %d model(s), %d training job(s); waiting up to %.0f s for workers",
            store.path,
            len(self.models),
            len(self.training.jobs),
            grace,
        )

    # ================================================================== shared state

    @property
    def peers(self) -> dict[str, Peer]:
        return self.ctx.peers

    @property
    def by_addr(self) -> dict[bytes, str]:
        return self.ctx.by_addr

    @property
    def models(self) -> dict[str, Model]:
        return self.ctx.models

    @property
    def calls(self) -> dict[int, Call]:
        return self.ctx.calls

    @property
    def batches(self) -> dict[int, Batch]:
        return self.serving.batches

    @property
    def plan_cache(self) -> dict[str, dict[str, Any]]:
        return self.registry.plan_cache.entries

    @property
    def totals(self) -> dict[str, Any]:
        return self.ctx.totals

    @property
    def out(self) -> list[Outgoing]:
        return self.ctx.out

    def drain(self) -> list[Outgoing]:
        return self.ctx.drain()

    def workers(self, ready_only: bool = True) -> list[Peer]:
        return self.ctx.workers(ready_only)

    # ================================================================== client side

    def on_client(
        self, addr: bytes, msg: p.Message, now: float, identity: Identity | None = None
    ) -> None:
        if type(msg) is p.Hello:  # any connection may learn what it must not send (no secret)
            lim = self.limits
            welcome = p.Welcome(msg.id, lim.max_message_bytes, lim.max_header_bytes)
            self.ctx.to_client(addr, welcome)
            return
        if self.auth:
            try:
                authorize_client(identity, msg.TYPE)
            except FlowmeshError:
                self.totals["auth_refused"] += 1
                raise
        handler: Callable[[bytes, Any, float], None] | None = {
            p.Infer: self.serving.infer,
            p.Deploy: self.registry.deploy,
            p.Undeploy: self.registry.undeploy,
            p.Status: self._status,
            p.PlanRequest: self.registry.plan_request,
            p.Generate: self.generation.generate,
            p.StopGenerate: self.generation.stop,
            p.TokenizerInfo: self.generation.tokenizer_info,
        }.get(type(msg))
        if handler is None and isinstance(msg, TrainingRouter.CLIENT_TYPES):
            handler = self.training.on_client
        if handler is None:
            raise fail(Code.BAD_REQUEST, f"{msg.TYPE} is not a client message")
        handler(addr, msg, now)

    # ================================================================== backend side

    def on_backend(
        self, addr: bytes, msg: p.Message, now: float, identity: Identity | None = None
    ) -> None:
        if isinstance(msg, p.Register):
            self.registry.register(addr, msg, now, identity, keyed=self.auth)
            return
        name = self.by_addr.get(addr)
        if self.auth and name is not None and (identity is None or identity.name != name):
            # A key removed from the key directory since this connection registered (the
            # registration check keeps one key from speaking for another name).
            self.totals["auth_refused"] += 1
            whose = f"the key of {identity.name!r}" if identity else "a key no longer allowed"
            raise fail(Code.UNAUTHORIZED, f"{msg.TYPE} as {name!r} refused: {whose}")
        if name is None:
            self.ctx.send(BACKEND, addr, p.Disconnect(reason="unknown peer: register first"))
            return
        peer = self.peers[name]
        peer.last_seen = now
        if isinstance(msg, p.Heartbeat):
            self.registry.heartbeat(peer, msg, now)
        elif isinstance(msg, p.RunResult):
            self.serving.run_result(peer, msg, now)
        elif isinstance(msg, p.Loaded):
            self.serving.loaded(peer, msg, now)
        elif isinstance(msg, p.Resident):
            self.serving.resident_report(peer, msg, now)
        elif isinstance(msg, p.SeqsParked):
            self.generation.seqs_parked(peer.name, msg, now)
        elif isinstance(msg, p.StageReady):
            self.registry.stage_ready(peer, msg, now)
        elif isinstance(msg, p.PlanReply):
            self.registry.plan_reply(peer, msg, now)
        elif isinstance(msg, TrainingRouter.WORKER_TYPES) and peer.role == "worker":
            self.training.on_worker(peer.name, msg, now)
        elif isinstance(msg, p.Error):
            if not self.training.on_error(peer.name, msg, now):
                self._backend_error(peer, msg, now)
        else:
            raise fail(Code.BAD_REQUEST, f"{msg.TYPE} is not expected from a {peer.role}")

    def _backend_error(self, peer: Peer, msg: p.Error, now: float) -> None:
        """An Error from a peer: the answer to one of its runs, or to a call we made to it."""
        if self.serving.run_error(peer, msg, now):
            return
        call = self.calls.get(msg.id) if msg.id is not None else None
        if call is None or call.peer != peer.name:
            # Not an answer to anything we asked this peer (a late one, or a forged one).
            self.log_throttle.warning(
                "error from %s: %s %s (id %s)", peer.name, msg.code, msg.reason, msg.id
            )
            return
        del self.calls[msg.id]  # type: ignore[arg-type]
        if call.kind == "load":
            self.serving.load_failed(peer, call, msg, now)
        else:
            self.registry.call_failed(peer, call, msg.code, msg.reason, now)

    def answer_refused(self, addr: bytes, ref: int, code: str, reason: str, now: float) -> None:
        """The codec refused a message from `addr` (`reason` says why) whose header named `ref`:
        when `ref` is a call made to that very peer, fail it as that peer's Error would have,
        now rather than at its deadline. Any other id changes nothing (a forged one)."""
        name = self.by_addr.get(addr)
        if name is None:
            return
        peer = self.peers[name]
        why = f"{peer.role} {name}'s answer was refused: {reason}"
        err = p.Error(id=ref, code=code, reason=why)
        if not self.training.on_error(name, err, now):
            self._backend_error(peer, err, now)

    # ================================================================== liveness

    def tick(self, now: float) -> None:
        """Heartbeats out, dead peers out, expired requests and deploys answered."""
        cfg = self.cfg
        self.totals["heartbeat_losses"] += sum(
            heart_failed(w.last_seen, now, cfg.heartbeat_s, cfg.liveness)
            for w in self.peers.values()
        )
        self.registry.check_hearts(now)
        for model in list(self.models.values()):
            self.serving.expire_queued(model, now)
            self.registry.deploy_overdue(model, now)
            self.registry.catalogue.check_drain(model, now)
        self.serving.expire_running(now)
        self.serving.forget_gone()
        self.generation.tick(now)
        for cid, call in list(self.calls.items()):
            if call.deadline <= now and self.calls.get(cid) is call:
                del self.calls[cid]
                self._call_expired(call, now)
        self.training.tick(now)
        self.registry.finish_restore(now)
        if self.jobs_restore_until is not None and now >= self.jobs_restore_until:
            self.jobs_restore_until = None
            self.training.finish_restore()
        self.registry.autoscale(now, self.serving.timings.model_means())
        self.registry.reconcile(now)
        self.serving.pump(now)

    def _call_expired(self, call: Call, now: float, undelivered: str | None = None) -> None:
        """A call got no answer in time (or could not be sent: `undelivered` says why): fail
        what waited on it and repair the state, in the room that made the call."""
        code = str(Code.OVERLOADED if undelivered else Code.TIMEOUT)
        if undelivered is None:
            self.totals["expired_calls"] += 1
            self.log_throttle.warning(
                "call expired kind=%s peer=%s model=%s",
                call.kind,
                call.peer,
                call.data.get("model"),
            )
        if call.kind == "load":
            self.serving.load_expired(call)
        else:
            self.registry.call_expired(call, code, undelivered, now)

    # ================================================================== model files

    def drain_reads(self) -> list[tuple[str, str]]:
        """(model, hf directory) to read on a thread (`broker.lm_files.start_reads`)."""
        return self.generation.drain_reads()

    def files_read(self, model: str, hf: str, files: LmFiles, now: float) -> None:
        """A read asked for by `drain_reads` finished (on the loop again)."""
        self.generation.files_read(model, hf, files, now)

    def peer_unreachable(self, addr: bytes, now: float) -> None:
        self.registry.peer_unreachable(addr, now)

    # ================================================================== status

    def status(self, now: float) -> BrokerStatus:
        """What `flowmesh status` shows and the broker's /metrics reads (`flowmesh.metrics`)."""
        timings = self.serving.timings
        workers, partitioners = peer_rows(
            self.peers, now, timings.worker_loads(), self.cfg.heartbeat_s
        )
        means = timings.model_means()
        refused: dict[str, dict[str, int]] = {}
        for (model, code), n in self.serving.refused.items():
            refused.setdefault(model, {})[code] = n
        return BrokerStatus(
            uptime_s=round(now - self.started, 3),
            protocol=p.PROTOCOL_VERSION,
            heartbeat_s=self.cfg.heartbeat_s,
            workers=workers,
            partitioners=partitioners,
            models=[
                model_status(
                    m,
                    self.peers,
                    means.get(m.name),
                    refused.get(m.name),
                    self.generation.figures(m.name),
                )
                for m in sorted(self.models.values(), key=lambda m: m.name)
            ],
            refused_unknown_model=refused.get("", {}),
            queued=sum(len(m.queue) for m in self.models.values()),
            inflight_batches=len(self.batches),
            jobs=self.training.status(now),
            finished_jobs=self.training.finished_status(now),
            restoring=self.registry.restore_until is not None,
            # Every counter is a declared field: one that is not raises here, in the tests.
            totals=Totals(**self.totals, **self.training.totals),
        )

    def _status(self, addr: bytes, msg: p.Status, now: float) -> None:
        self.ctx.to_client(addr, p.StatusReply(id=msg.id, status=self.status(now)))

    # ================================================================== send failures

    def send_failed(
        self, dest: str, addr: bytes, msg: p.Message, exc: FlowmeshError, now: float
    ) -> None:
        """The shell could not deliver `msg`: a gone peer is dead; a full one fails the work
        that waited on the message, so no state is left expecting an answer to it."""
        self.totals["dropped_sends"] += 1
        self.log_throttle.warning(
            "could not send %s to %s %r: %s", msg.TYPE, dest, addr, exc.reason
        )
        if dest == CLIENT:
            if exc.code == Code.UNAVAILABLE and isinstance(msg, p.GenChunk):
                # PeerGone: the ROUTER has no connection under that address (ROUTER_MANDATORY;
                # a full queue is OVERLOADED, not this). The ROUTER numbers connections itself,
                # so a client that reconnects comes under another address: nobody reads this
                # call again. It stops as a StopGenerate would, its KV freed; only this call.
                self.generation.client_gone(addr, msg.id, now)
            elif exc.code == Code.UNAVAILABLE and isinstance(msg, p.Heartbeat):
                # The probe of a client with blocking calls running: all of them, as above.
                self.generation.clients_gone(addr, now)
            return  # the client's own timeout answers it
        if exc.code == Code.UNAVAILABLE:  # PeerGone
            self.peer_unreachable(addr, now)
            return
        ref = getattr(msg, "id", None)
        reason = f"could not reach {self.by_addr.get(addr, addr)!r}: {exc.reason}"
        if isinstance(msg, p.Run) and self.serving.run_undelivered(ref, reason, now):
            return
        if self.training.undelivered(ref, reason):
            return
        call = self.calls.pop(ref, None) if isinstance(ref, int) else None
        if call is not None:
            self._call_expired(call, now, reason)
        # An undelivered Evict or DropStage needs nothing more: the worker still holds bytes we
        # count as free, and its next load there makes the room itself and reports it.
