"""An in-process mesh for end-to-end scenarios: the broker's core, the workers' cores and their
hands, and a partitioner, wired through their outboxes on one event loop, with no socket and
no child process (vLLM's in-process client idea).

- The broker is a real `broker.core.BrokerCore`: its outbox is delivered as `BrokerService`'s
  `_flush` delivers it, its `tick` runs on the loop every `heartbeat_s`.
- Each worker is a real `gpu_worker.core.WorkerCore` with a real CPU stand-in device, executor
  and training executor, driven by `gpu_worker.hands.WorkerHands` as `WorkerService` drives
  them; it registers with its inventory and sends heartbeat stats as the shell does
  (`flowmesh.peer.MeshPeer`), and direct runs' Hops go to the next stage's worker's core (each
  worker advertises an `inproc://` peer endpoint).
- The partitioner plans with `partitioner.service.plan_for` on a thread, as the process does;
  the broker's reads of language models' directories run on threads as its shell runs them.
- Every message, each way, goes through the real codec (`flowmesh.codec` encode, then decode
  with the receiver's limits): the schema is checked on every hop, tensors included.

The real SDK runs on top unchanged: `client()` is a blocking `Client`, `async_client()` an
`AsyncClient`, each over an `InProcConnection` (a `client_sdk.connection.Connection` whose
`call` and `notify` hand the frames to this loop instead of a socket). Callers may be on any
thread or loop.

What needs real processes (transport, faults, restarts, keys, the CLI) stays in tests/mesh/.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from broker.core import BACKEND, CLIENT, BrokerConfig, BrokerCore
from broker.lm_files import start_reads
from client_sdk.client import AsyncClient, Client
from client_sdk.connection import Connection, PendingCall
from client_sdk.errors import ClientError
from client_sdk.loop_thread import LoopThread
from flowmesh import codec
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.roots import Roots
from flowmesh.spec import DEFAULT_ALLOW, narrow_allow
from flowmesh.threads import torch_pool
from flowmesh.units import parse_size
from gpu_worker.core import SendHop, WorkerCore
from gpu_worker.device import open_device
from gpu_worker.hands import WorkerHands
from partitioner.service import plan_for
from tests.support.waiting import until_blocking

log = logging.getLogger("inproc")

FRONTEND = "inproc://flowmesh-broker"


def frames_of(msg: p.Message) -> list[bytes]:
    """`msg` as it leaves its sender: the codec's frames, copied to bytes as a socket would."""
    return [bytes(memoryview(f).cast("B")) for f in codec.encode(msg)]


class _Peer:
    """What a process behind the broker does the same way (`flowmesh.peer.MeshPeer`): register
    with its session, heartbeat, take the allow-list from the ack, answer a failed command."""

    role = "peer"
    stats_type: type[p.WorkerStats] | type[p.PartitionerStats]

    def __init__(self, mesh: InProcMesh, name: str) -> None:
        self.mesh, self.name = mesh, name
        self.addr = f"inproc-{name}".encode()
        self.session = secrets.token_hex(16)
        self.registrations = 0
        self.own_allow: tuple[str, ...] | None = None

    def registration(self) -> p.Register:
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        return {}

    def handle(self, msg: p.Message) -> None:
        raise NotImplementedError

    def on_registered(self, again: bool) -> None:
        pass

    def send(self, msg: p.Message) -> bool:
        """To the broker, from any thread; an answer that cannot be encoded is answered with an
        Error for its id instead (as `MeshPeer.send`)."""
        try:
            frames = frames_of(msg)
        except FlowmeshError as exc:
            ref = getattr(msg, "id", None)
            if ref is not None and not isinstance(msg, p.Error):
                return self.send(p.error_for(exc, ref))
            return False
        return self.mesh.post(self.mesh.from_peer, self.addr, frames)

    def register(self) -> None:
        reg = self.registration()
        info = msgspec.structs.replace(reg.info, session=self.session)
        self.send(msgspec.structs.replace(reg, info=info))

    def heartbeat(self) -> None:
        self.send(p.Heartbeat(stats=self.stats_type(**self.stats())))

    def receive(self, frames: list[bytes]) -> None:
        """A message from the broker, on the loop (`MeshPeer._on_message`)."""
        msg = codec.decode(frames)
        if isinstance(msg, p.RegisterAck):
            if msg.allow is not None:
                self.allow = narrow_allow(tuple(msg.allow), self.own_allow)
            again = self.registrations > 0 and not msg.kept
            self.registrations += 1
            self.on_registered(again)
            self.heartbeat()  # the broker marks us ready on it
        elif isinstance(msg, p.Heartbeat):
            pass
        elif isinstance(msg, p.Disconnect):
            self.register()
        elif isinstance(msg, p.Error):
            log.warning("%s: broker error %s %s (id %s)", self.name, msg.code, msg.reason, msg.id)
        else:
            try:
                self.handle(msg)
            except Exception as exc:  # answered as `transport.pump` answers a handler's failure
                if not isinstance(exc, FlowmeshError):
                    log.exception("%s failed on %s", self.name, msg.TYPE)
                self.send(p.error_for(exc, getattr(msg, "id", None)))


class InProcWorker(_Peer):
    """A worker: its core, its hands and a CPU stand-in device."""

    role = "worker"
    stats_type = p.WorkerStats

    def __init__(
        self,
        mesh: InProcMesh,
        name: str,
        budget_bytes: int,
        train_bytes: int,
        roots: Roots,
        compute_lanes: int,
        kv_preempt: str = "auto",
    ) -> None:
        super().__init__(mesh, name)
        self.endpoint = f"inproc://{name}"
        self.device = open_device("cpu", budget_bytes + train_bytes)
        self.core = WorkerCore(name, train_bytes=train_bytes, roots=roots, log=log)
        self.hands = WorkerHands(
            self.core,
            self.device,
            send=self.send,
            send_from_thread=self.send,  # encoded on the lane's thread, as the shell does
            send_hop=self._hop,
            allow_peer=lambda key, holder: None,  # no keys in process
            release_peers=lambda holder: None,
            clock=time.monotonic,
            compute_lanes=compute_lanes,
            train_bytes=train_bytes,
            kv_preempt=kv_preempt,
            log=log,
            send_pipe=self._pipe_hop,
        )

    @property
    def allow(self) -> tuple[str, ...]:
        return self.core.allow

    @allow.setter
    def allow(self, allow: tuple[str, ...]) -> None:
        self.core.allow = allow

    @property
    def executor(self) -> Any:
        return self.hands.executor

    @property
    def trainer(self) -> Any:
        return self.hands.trainer

    def registration(self) -> p.Register:
        return self.hands.registration(self.name, 0, self.endpoint)

    def stats(self) -> dict[str, Any]:
        return {**self.hands.stats(), "reader_runs": 0}

    def on_registered(self, again: bool) -> None:
        if again:
            self.core.registered_again()

    def handle(self, msg: p.Message) -> None:
        try:
            self.core.handle(msg, time.monotonic())
        finally:
            self.hands.flush()

    def _hop(self, work: SendHop) -> None:
        """A direct run's micro-batch to the next stage's worker, by its peer endpoint."""
        to = self.mesh.by_endpoint[work.run.msg.next_peer]
        self.mesh.post(to.on_peer, frames_of(work.hop))

    def _pipe_hop(self, peer: p.PipePeer, hop: p.PipeHop) -> None:
        """A pipelined job's hop to another stage's worker, by its peer endpoint."""
        self.mesh.post(self.mesh.by_endpoint[peer.endpoint].on_peer, frames_of(hop))

    def on_peer(self, frames: list[bytes]) -> None:
        try:
            self.core.on_peer(codec.decode(frames), "", time.monotonic())
        finally:
            self.hands.flush()

    def close(self) -> None:
        self.hands.close()


class InProcPartitioner(_Peer):
    """The partitioner: `plan_for` on a thread for each PlanJob (`partitioner.service`)."""

    role = "partitioner"
    stats_type = p.PartitionerStats

    def __init__(self, mesh: InProcMesh, name: str, roots: Roots) -> None:
        super().__init__(mesh, name)
        self.allow = DEFAULT_ALLOW  # the mesh's, from the registration's ack
        self.roots = roots
        self.pool = torch_pool(2, "plan")
        self.planned = self.failed = self.inflight = 0

    def registration(self) -> p.Register:
        return p.Register(
            id=1,
            role="partitioner",
            name=self.name,
            pid=os.getpid(),
            info=p.PeerInfo(measure_device="cpu"),
        )

    def stats(self) -> dict[str, Any]:
        return {"planned": self.planned, "failed": self.failed, "inflight": self.inflight}

    def handle(self, msg: p.Message) -> None:
        if not isinstance(msg, p.PlanJob):
            raise FlowmeshError(Code.BAD_REQUEST, f"a partitioner does not take {msg.TYPE}")
        self.inflight += 1
        fut = asyncio.get_running_loop().run_in_executor(
            self.pool,
            plan_for,
            msg.request,
            self.allow,
            "cpu",
            f"partitioner {self.name}",
            self.roots,
        )

        def planned(f: asyncio.Future[Any]) -> None:
            self.inflight -= 1
            exc = f.exception()
            if exc is not None:
                self.failed += 1
                self.send(p.error_for(exc, msg.id))
                return
            self.planned += 1
            plan, inputs = f.result()
            self.send(p.PlanReply(id=msg.id, plan=plan, inputs=inputs))

        fut.add_done_callback(planned)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class InProcConnection(Connection):
    """A `Connection` to an `InProcMesh`: the same calls, ids, limits checks and answers
    (`Connection._dispatch`), with the frames handed to the mesh's loop instead of a socket;
    the messages the broker does not answer (`notify`: StopGenerate) too. Use it from one
    event loop (any thread's)."""

    def __init__(self, mesh: InProcMesh, *, timeout: float, limits: p.Limits = p.DEFAULT_LIMITS):
        super().__init__(mesh.frontend, timeout=timeout, limits=limits)
        self.mesh = mesh
        self.addr = f"client-{next(mesh.client_ids)}".encode()
        self.contacted = True
        self.broker_limits = mesh.limits  # what its Welcome states
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def deliver(self, frames: list[bytes]) -> None:
        """An answer from the broker (on the mesh's loop): read on the caller's."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                self._loop.call_soon_threadsafe(self._on_frames, frames)

    async def call(
        self,
        msg: p.Message,
        timeout: float | None,
        on_part: Callable[[p.Message], None] | None = None,
    ) -> p.Message:
        loop = self._loop = asyncio.get_running_loop()
        self._closed = False  # a call after close connects again, as `Connection.call` does
        frames, nbytes = self._encode(msg)
        ref: int = msg.id  # type: ignore[attr-defined]
        pending = PendingCall(loop.create_future(), nbytes, msg.TYPE, on_part=on_part)
        self._pending[ref] = pending
        self.mesh.post(self.mesh.from_client, self, _copied(frames))
        return await self._answer(pending, ref, self.seconds(timeout))

    def notify(self, msg: p.Message) -> bool:
        """A message the broker does not answer (StopGenerate), to the broker's frontend after
        the calls already on their way, as `Connection.notify` sends it on the socket: encoded
        and checked against the limits alike; False once closed or when the mesh has stopped
        (no connection)."""
        if self._closed:
            return False
        frames = self._encode_notice(msg)
        return frames is not None and self.mesh.post(self.mesh.from_client, self, _copied(frames))

    async def close(self) -> None:
        self._closed = True
        self.mesh.post(self.mesh.clients.pop, self.addr, None)
        self._fail_pending(ClientError(Code.UNAVAILABLE, "client closed"))


class InProcMesh:
    """`with InProcMesh(cpu_workers=2, memory_budget="8MiB") as mesh: ...`: the arguments of
    `client_sdk.mesh.LocalMesh` that mean something in process (`broker`: BrokerConfig fields
    beyond the heartbeat and the allow-list, as LocalMesh's `broker_args` give them)."""

    def __init__(
        self,
        *,
        cpu_workers: int = 2,
        memory_budget: str | int = "8MiB",
        train_bytes: str | int = 0,
        allow: list[str] | tuple[str, ...] | None = None,
        data_roots: list[str | Path] | None = None,
        checkpoint_roots: list[str | Path] | None = None,
        heartbeat_s: float = 0.2,
        liveness: int = 100,
        compute_lanes: int = 2,
        partitioner: bool = True,
        broker: dict[str, Any] | None = None,
        ready_timeout_s: float = 60.0,
        threads_per_worker: int | None = 1,
        kv_preempt: str = "auto",
    ) -> None:
        self.cfg = BrokerConfig(
            heartbeat_s=heartbeat_s,
            liveness=liveness,
            allow=tuple(allow) if allow else DEFAULT_ALLOW,
            **(broker or {}),
        )
        self.n_workers = cpu_workers
        self.budget_bytes = parse_size(memory_budget)
        self.train_bytes = parse_size(train_bytes)
        self.data_roots = [str(r) for r in data_roots] if data_roots is not None else None
        self.checkpoint_roots = (
            [str(r) for r in checkpoint_roots] if checkpoint_roots is not None else None
        )
        self.compute_lanes = compute_lanes
        self.kv_preempt = kv_preempt  # the workers' `--kv-preempt`
        # The torch threads of each worker's lanes (`--threads`; None: torch's default): each
        # pool takes the count of the thread that makes it, the mesh's loop thread.
        self.threads_per_worker = threads_per_worker
        self.with_partitioner = partitioner
        self.ready_timeout_s = ready_timeout_s
        self.frontend = FRONTEND
        self.limits = p.DEFAULT_LIMITS
        self.client_ids = itertools.count(1)
        self.clients: dict[bytes, InProcConnection] = {}
        self.peers: dict[bytes, _Peer] = {}
        self.by_endpoint: dict[str, InProcWorker] = {}
        self.workers: list[InProcWorker] = []
        self._runner: LoopThread | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ life

    def __enter__(self) -> InProcMesh:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._runner = LoopThread("flowmesh-inproc")
        self.loop = self._runner.loop
        try:
            self._runner.wait(self._start())
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    async def _start(self) -> None:
        if self.threads_per_worker:
            torch.set_num_threads(self.threads_per_worker)  # this thread's: see __init__
        self.core = BrokerCore(self.cfg, now=time.monotonic())
        self.core.limits = self.limits
        peers: list[_Peer] = []
        if self.with_partitioner:
            roots = Roots.of(self.data_roots, (), "partitioner partitioner-0")
            peers.append(InProcPartitioner(self, "partitioner-0", roots))
        for i in range(self.n_workers):
            name = f"worker-{i}"
            roots = Roots.of(self.data_roots, self.checkpoint_roots, f"worker {name}")
            w = InProcWorker(
                self,
                name,
                self.budget_bytes,
                self.train_bytes,
                roots,
                self.compute_lanes,
                self.kv_preempt,
            )
            self.workers.append(w)
            self.by_endpoint[w.endpoint] = w
            peers.append(w)
        for peer in peers:
            self.peers[peer.addr] = peer
            peer.register()
        self._tasks = [asyncio.create_task(self._beats(), name="inproc-beats")]

    async def _beats(self) -> None:
        """Every `heartbeat_s`: the peers' heartbeats, then the broker's tick (`BrokerService`'s
        `_ticks` and `MeshPeer._session`)."""
        while True:
            for peer in self.peers.values():
                peer.heartbeat()
            await asyncio.sleep(0)  # the heartbeats are delivered before the tick
            try:
                self.core.tick(time.monotonic())
            finally:
                self._flush()
            await asyncio.sleep(self.cfg.heartbeat_s)

    def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is None:
            return

        async def stop() -> None:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for peer in self.peers.values():
                peer.close()  # type: ignore[attr-defined]
            self.core.close()

        with contextlib.suppress(Exception):
            runner.run(stop(), 10.0)
        runner.stop()

    # ------------------------------------------------------------------ delivery

    def post(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Run `fn(*args)` on the mesh's loop soon (from any thread): a message in flight."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the mesh stopped: as a socket closed under its sender
            return False
        return True

    def from_client(self, conn: InProcConnection, frames: list[bytes]) -> None:
        """A client's call arrives at the broker's frontend (`BrokerService._on_client`)."""
        self.clients[conn.addr] = conn
        self._arrive(CLIENT, conn.addr, frames, self.core.on_client)

    def from_peer(self, addr: bytes, frames: list[bytes]) -> None:
        """A peer's message arrives at the broker's backend (`BrokerService._on_backend`)."""
        self._arrive(BACKEND, addr, frames, self.core.on_backend)

    def _arrive(
        self, dest: str, addr: bytes, frames: list[bytes], handle: Callable[..., None]
    ) -> None:
        msg: p.Message | None = None
        try:
            msg = codec.decode(frames, self.limits)
            handle(addr, msg, time.monotonic())
        except Exception as exc:  # answered as `transport.pump` answers it
            if not isinstance(exc, FlowmeshError):
                log.exception("the broker failed on a message from %r", addr)
            if msg is None:  # refused by the codec: the error carries the id it read, if any
                self.core.ctx.send(dest, addr, p.error_for(exc))
            elif not isinstance(msg, p.Error):
                self.core.ctx.send(dest, addr, p.error_for(exc, getattr(msg, "id", None)))
        finally:
            self._flush()

    def _flush(self) -> None:
        """Deliver what the broker's core queued (`BrokerService._flush`): each message
        encoded now, decoded by its receiver on a later loop turn. Reads of model directories
        the core asked for start here too, on threads, as the shell starts them."""
        if self.core.generation.reads:
            start_reads(self.core, asyncio.get_running_loop(), time.monotonic, self._flush)
        now = time.monotonic()
        for _ in range(1000):  # send failures may queue answers of their own
            out = self.core.drain()
            if not out:
                return
            for dest, addr, msg in out:
                try:
                    frames = frames_of(msg)
                except FlowmeshError as exc:
                    self.core.send_failed(dest, addr, msg, exc, now)
                    continue
                if dest == CLIENT:
                    conn = self.clients.get(addr)
                    if conn is not None:
                        conn.deliver(frames)
                else:
                    peer = self.peers.get(addr)
                    if peer is None:
                        gone = FlowmeshError(Code.UNAVAILABLE, "no such peer")
                        self.core.send_failed(dest, addr, msg, gone, now)
                    else:
                        self.loop.call_soon(peer.receive, frames)

    # ------------------------------------------------------------------ for tests

    def on_loop(self, fn: Callable[[], Any]) -> Any:
        """`fn()` run on the mesh's loop (to read the cores' state between messages)."""
        assert self._runner is not None

        async def run() -> Any:
            return fn()

        return self._runner.wait(run())

    def wait_ready(self) -> None:
        want = self.n_workers

        def ready() -> bool:
            workers = self.on_loop(lambda: self.core.workers(ready_only=True))
            parts = self.on_loop(
                lambda: [x for x in self.core.peers.values() if x.role == "partitioner" and x.ready]
            )
            return len(workers) >= want and (bool(parts) or not self.with_partitioner)

        until_blocking(
            ready, f"{want} worker(s) and the partitioner to register", self.ready_timeout_s
        )

    def wait_until(self, probe: Callable[[], Any], what: str, timeout: float | None = None) -> Any:
        """Poll `probe` until it returns something other than None (`LocalMesh.wait_until`)."""
        got: list[Any] = []

        def probed() -> bool:
            value = probe()
            if value is not None:
                got.append(value)
            return value is not None

        until_blocking(probed, what, timeout or self.ready_timeout_s)
        return got[0]

    def worker(self, name: str) -> InProcWorker:
        return next(w for w in self.workers if w.name == name)

    def async_client(self, timeout: float = 60.0) -> AsyncClient:
        """An `AsyncClient` of the mesh, for the caller's running loop."""
        return AsyncClient(connection=InProcConnection(self, timeout=timeout))

    def client(self, timeout: float = 60.0, keys: Any = None) -> Client:
        """A blocking `Client` of the mesh, as `LocalMesh.client()` gives (its calls on its
        own loop thread, over an in-process connection)."""
        connection = InProcConnection(self, timeout=timeout)
        return Client(self.frontend, timeout=timeout, keys=False, connection=connection)


@pytest.fixture(scope="module", name="mesh")
def inproc_mesh(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InProcMesh]:
    """An in-process mesh shared by a test module: by default two CPU stand-in workers of
    8 MiB each, reading clients' files under the session's tmp directories. A module changes
    its arguments with `pytestmark = mesh_options(...)` (`tests.support.mesh.mesh_options`,
    with `InProcMesh`'s arguments: LocalMesh's names where they mean something in process)."""
    base = str(tmp_path_factory.getbasetemp())
    options: dict[str, Any] = {
        "cpu_workers": 2,
        "memory_budget": "8MiB",
        "data_roots": [base],
        "checkpoint_roots": [base],
    }
    marker = request.node.get_closest_marker("mesh_options")
    if marker is not None:
        options.update(marker.kwargs)
    options = {k: v() if callable(v) else v for k, v in options.items()}
    with InProcMesh(**options) as m:
        yield m


def _copied(frames: list[Any]) -> list[bytes]:
    """The frames as bytes of their own, as a socket copies them."""
    return [bytes(memoryview(f).cast("B")) for f in frames]
