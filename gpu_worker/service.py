"""The gpu_worker process: a thin shell around `gpu_worker.core.WorkerCore`, with the sockets,
the threads and the executors.

Commands are applied in arrival order on the event loop: the core decides (allocation bookkeeping
is cheap and ordered), and its hands (`gpu_worker.hands.WorkerHands`, given this shell's sockets
as callbacks) do the work it asks for: stage preparation, copies and compute run on worker
threads; results go back to the core, and its answers to the broker, as soon as their futures
resolve, so one slow model never holds up the others.

The broker's socket is read by a thread of its own (`transport.read_frames_on_thread`): a quick
run of a resident stage (`Executor.run_here`) is computed and answered right there, without a
hand-off to a compute lane, which for a small model cost more than its forward; every other
message goes to the loop, in order.

The worker is the one owner of its device memory (`gpu_worker.memory.DeviceMemory`): one arena
holds the serving stages (within the serving budget; the executor chooses which idle stages to
evict for a load, and `Resident` tells the broker what it holds after each Load and each choice
of its own) and the training jobs' sub-model tasks (guaranteed `train_bytes`, and whatever
serving leaves free, given back at once when a serving load needs it). A job's steps are
submitted in arrival order, which is the order the executor runs them in; `seq` guards against
a step applied twice (the core's job ledger).

A model cut into stages over several workers runs *direct* (`gpu_worker.direct`): the broker
announces the batch to every stage's worker at once, and each worker sends its stage's output,
micro-batch by micro-batch, straight to the next stage's worker over its peer socket
(`--peer-endpoint`); only the last stage answers the broker.

Registration carries the worker's inventory (`inventory`): the stages it holds and its training
jobs. A broker that restarted takes them up as they are; whatever it does not know, it tells the
worker to drop (`DropStage`, `TrainClose`), so the worker keeps everything until told.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import zmq
import zmq.asyncio

from flowmesh import protocol as p
from flowmesh.auth import PEERS_DOMAIN, PeerKeys, peer_authenticator
from flowmesh.errors import Code, FlowmeshError
from flowmesh.peer import MeshPeer
from flowmesh.roots import Roots
from flowmesh.spec import DEFAULT_ALLOW, narrow_allow
from flowmesh.transport import bind_router, connect_dealer, pump, send
from gpu_worker.core import SendHop, WorkerCore, run_parts, run_result
from gpu_worker.device import Device
from gpu_worker.direct import DirectRuns
from gpu_worker.hands import WorkerHands

# Sockets to other workers' peer endpoints a worker keeps open (`WorkerService._peer`): far
# more than a mesh has workers, so that only endpoints gone long ago are closed.
PEERS_KEPT = 64


class WorkerService(MeshPeer):
    role = "worker"
    stats_type = p.WorkerStats

    def __init__(
        self,
        name: str,
        broker: str,
        device: Device,
        *,
        compute_lanes: int = 2,
        allow: tuple[str, ...] | None = None,
        limits: p.Limits = p.DEFAULT_LIMITS,
        threads: int | None = None,
        train_bytes: int = 0,
        peer_endpoint: str = "tcp://127.0.0.1:0",
        eviction: str = "value",
        kv_preempt: str = "auto",
        roots: Roots | None = None,
    ) -> None:
        super().__init__(name, broker, limits=limits)
        # Where clients' paths may lead (weights, hf directories, checkpoints): `flowmesh.roots`.
        self.roots = roots or Roots.of(None, None, f"worker {name}")
        # The worker's logic: what each message and each finished piece of work leads to.
        self.core = WorkerCore(name, train_bytes=train_bytes, roots=self.roots, log=self.log)
        # For lines logged per message: whoever reaches our sockets cannot flood the log.
        self.log_throttle = self.core.log_throttle
        # The clock the core is told the time by.
        self.clock: Callable[[], float] = time.monotonic
        # Where other workers send us activations ("": no direct runs, the broker relays them).
        # Under CURVE keys it is a CURVE server with our own key, and takes only the workers
        # the broker named lately as a run's previous stage, or as a stage of a pipelined job
        # open here (`peer_keys`).
        self.peer_endpoint = peer_endpoint
        self.peer_bound = ""  # the endpoint actually bound, advertised at registration
        self._peer_sock: zmq.asyncio.Socket | None = None
        self.peer_keys = PeerKeys()
        self._peer_auth: Any = None
        # Connections to the next stages' workers, by (endpoint, its key), used last at the
        # end: at most PEERS_KEPT (a worker restarted binds another port, and the socket to
        # its old endpoint would reconnect for ever with what it queued).
        self._to_peers: OrderedDict[tuple[str, str], zmq.asyncio.Socket] = OrderedDict()
        self._ctx: zmq.asyncio.Context | None = None
        # What does the core's work: the executors and the deploy thread (`gpu_worker.hands`).
        self.hands = WorkerHands(
            self.core,
            device,
            send=lambda msg: self.send(msg),
            send_from_thread=lambda msg: self.send_from_thread(msg),
            send_hop=self._hop,
            send_pipe=self._pipe_hop,
            allow_peer=self.peer_keys.allow,
            release_peers=self.peer_keys.release,
            clock=lambda: self.clock(),
            compute_lanes=compute_lanes,
            train_bytes=train_bytes,
            eviction=eviction,
            kv_preempt=kv_preempt,
            log=self.log,
        )
        self.device = device
        self.memory = self.hands.memory
        self.executor = self.hands.executor
        self.trainer = self.hands.trainer
        self.train_bytes = train_bytes
        self.reader_runs = 0  # runs computed (or failed) and answered on the reader thread
        # The mesh's list arrives at registration (`on_allow`); `own` may only narrow it.
        self.own_allow = allow
        self.allow = allow if allow is not None else DEFAULT_ALLOW
        self.threads = threads

    # ------------------------------------------------------------------ the core's state

    @property
    def allow(self) -> tuple[str, ...]:
        """The factories this worker builds (`flowmesh.spec.check_factory`)."""
        return self.core.allow

    @allow.setter
    def allow(self, allow: tuple[str, ...]) -> None:
        self.core.allow = allow

    @property
    def direct(self) -> DirectRuns:
        return self.core.direct

    @direct.setter
    def direct(self, direct: DirectRuns) -> None:  # a test's bounds
        self.core.direct = direct

    def registration(self) -> p.Register:
        return self.hands.registration(self.name, self.threads or 0, self.peer_bound)

    def inventory(self) -> p.Inventory:
        """The stages and training jobs this process holds (see `p.Inventory`)."""
        return self.hands.inventory()

    def stats(self) -> dict[str, Any]:
        out = self.hands.stats()
        out["reader_runs"] = self.reader_runs  # runs answered from the reader thread
        if self.curve is not None:  # keyless stats stay as they were
            out["peer_refused"] = self.peer_keys.refused  # keys no recent run or open job named
        return out

    def on_allow(self, allow: tuple[str, ...]) -> None:
        self.allow = narrow_allow(allow, self.own_allow)

    def on_registered(self, again: bool) -> None:
        if again:
            # A broker that did not know us (it restarted, or lost us): it had our inventory
            # with the registration, adopts what it knows and tells us to drop the rest
            # (`DropStage`, `TrainClose`). What is still being prepared was asked for by the
            # broker before: it is dropped when ready.
            self.core.registered_again()

    def side_tasks(self, ctx: zmq.asyncio.Context) -> list[Any]:
        if not self.peer_endpoint:
            return []
        self._ctx = ctx
        curve = None
        if self.curve is not None:
            self._peer_auth = peer_authenticator(ctx, self.peer_keys)  # before the bind
            curve = (self.curve.secret, PEERS_DOMAIN)
        self._peer_sock, self.peer_bound = bind_router(
            ctx, self.peer_endpoint, self.limits, curve=curve
        )
        self.log.info(
            "peer socket for direct runs at %s%s", self.peer_bound, " (CURVE)" if curve else ""
        )
        return [
            pump(
                self._peer_sock,
                self._on_peer,
                routed=True,
                log=self.log,
                limits=self.limits,
                with_user=curve is not None,
            ),
            self._expire_early_hops(),
        ]

    async def _expire_early_hops(self) -> None:
        """Hops kept for runs not announced go when they are too old, whether or not more
        Hops come (`DirectRuns.expire`); a pipelined job's step past its deadline fails."""
        while True:
            await asyncio.sleep(max(self.direct.early_ttl_s / 10, 0.1))
            self.core.tick(self.clock())
            self.hands.tick()  # pipelined jobs' steps past their deadline

    def close(self) -> None:
        for sock in (*self._to_peers.values(), self._peer_sock):
            if sock is not None:
                sock.close(linger=0)
        self._to_peers.clear()
        if self._peer_auth is not None:
            self._peer_auth.stop()
        self.hands.close()

    # ------------------------------------------------------------------ the core's work

    def handle(self, msg: p.Message) -> None:
        try:
            self.core.handle(msg, self.clock())  # raises what refuses it: `pump` answers
        finally:
            self.hands.flush()

    def reader_thread(self) -> tuple[Callable[[list[Any]], bool], Callable[[], None]]:
        loop = asyncio.get_running_loop()
        threads = torch.get_num_threads()  # see flowmesh.threads: a new thread must be told

        def here(frames: list[Any]) -> bool:
            return self._run_here(frames, loop)

        return here, lambda: torch.set_num_threads(threads)

    def _run_here(self, frames: list[Any], loop: asyncio.AbstractEventLoop) -> bool:
        """On the reader thread: a run of a quick resident stage is computed and answered right
        here (`Executor.run_here`: no hand-off to a lane, no trip through the loop). False for
        every other message, which the loop then decodes (again) and handles."""
        try:
            msg = p.decode(frames, self.limits)
        except Exception:  # the loop answers it with the reason
            return False
        if not isinstance(msg, p.Run) or msg.ticket or msg.gen is not None:
            return False  # generation runs place KV blocks on the loop first
        self.last_heard = time.monotonic()
        answer: p.Message
        try:
            out = self.executor.run_here((msg.model, msg.stage), run_parts(msg), msg.separate)
        except Exception as exc:
            if not isinstance(exc, FlowmeshError):
                self.log_throttle.error("run %d failed: %r", msg.id, exc)
            answer = p.error_for(exc, msg.id)
        else:
            if out is None:
                return False
            answer = run_result(msg, out)
        self.reader_runs += 1
        if not self.send_from_thread(answer):  # the loop's send says what happened to it
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to answer
                loop.call_soon_threadsafe(self.send, answer)
        return True

    # ------------------------------------------------------------------ direct runs

    def _on_peer(self, _sender: bytes | None, msg: p.Message, key: str | None = None) -> None:
        """What other workers send to our peer socket (`WorkerCore.on_peer`). `key`: the
        sender's CURVE key (its connection's ZAP User-Id), under keys."""
        try:
            self.core.on_peer(msg, key or "", self.clock())
        finally:
            self.hands.flush()

    def _hop(self, work: SendHop) -> None:
        msg = work.run.msg
        send(self._peer(msg.next_peer, msg.next_key, f"run {msg.id}"), work.hop)

    def _pipe_hop(self, peer: p.PipePeer, hop: p.PipeHop) -> None:
        send(self._peer(peer.endpoint, peer.key, f"job {hop.job!r}"), hop)

    def _peer(self, endpoint: str, key: str, what: str) -> zmq.asyncio.Socket:
        """The socket to another worker's peer endpoint (one per endpoint and key, kept for
        the PEERS_KEPT used last)."""
        sock = self._to_peers.get((endpoint, key))
        if sock is not None:
            self._to_peers.move_to_end((endpoint, key))
        else:
            assert self._ctx is not None
            curve = None
            if self.curve is not None:
                if not key:
                    raise FlowmeshError(Code.BAD_REQUEST, f"{what}: no key for the next worker")
                curve = dataclasses.replace(self.curve, server_public=key.encode())
            sock = self._to_peers[(endpoint, key)] = connect_dealer(
                self._ctx, endpoint, limits=self.limits, curve=curve
            )
            while len(self._to_peers) > PEERS_KEPT:
                _, old = self._to_peers.popitem(last=False)
                old.close(linger=0)
        return sock
