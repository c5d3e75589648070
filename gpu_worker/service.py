"""The gpu_worker process: a thin shell around `gpu_worker.core.WorkerCore`, with the sockets,
the threads and the executors.

Commands are applied in arrival order on the event loop: the core decides (allocation bookkeeping
is cheap and ordered), and this shell does the work it asks for (`_flush`): stage preparation,
copies and compute run on worker threads; results go back to the core, and its answers to the
broker, as soon as their futures resolve, so one slow model never holds up the others.

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
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
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
from flowmesh.threads import torch_pool
from flowmesh.transport import bind_router, connect_dealer, pump, send
from gpu_worker.core import (
    AddStage,
    AllowPeer,
    CloseJob,
    DropStage,
    Evaluate,
    EvictStage,
    LoadStage,
    OpenJob,
    PrepareStage,
    RunChunk,
    RunStage,
    SaveJob,
    Send,
    SendHop,
    SubmitStep,
    Work,
    WorkerCore,
    run_parts,
    run_result,
)
from gpu_worker.device import Device
from gpu_worker.direct import DirectRuns
from gpu_worker.executor import Executor, RunOutput
from gpu_worker.host_tier import ALIGN
from gpu_worker.memory import DeviceMemory
from gpu_worker.stage_loader import prepare_stage
from gpu_worker.train_executor import TrainingExecutor, start_job


class WorkerService(MeshPeer):
    role = "worker"

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
        roots: Roots | None = None,
    ) -> None:
        super().__init__(name, broker, limits=limits)
        # Where clients' paths may lead (weights, hf directories, checkpoints): `flowmesh.roots`.
        self.roots = roots or Roots.of(None, None, f"worker {name}")
        if not 0 <= train_bytes <= device.budget_bytes:
            raise ValueError("training bytes must be within the device's arena")
        # The worker's logic: what each message and each finished piece of work leads to.
        self.core = WorkerCore(name, train_bytes=train_bytes, roots=self.roots, log=self.log)
        # For lines logged per message: whoever reaches our sockets cannot flood the log.
        self.log_throttle = self.core.log_throttle
        # The clock the core is told the time by.
        self.clock: Callable[[], float] = time.monotonic
        # Where other workers send us activations ("": no direct runs, the broker relays them).
        # Under CURVE keys it is a CURVE server with our own key, and takes only the workers
        # the broker names as a run's previous stage (`peer_keys`).
        self.peer_endpoint = peer_endpoint
        self.peer_bound = ""  # the endpoint actually bound, advertised at registration
        self._peer_sock: zmq.asyncio.Socket | None = None
        self.peer_keys = PeerKeys()
        self._peer_auth: Any = None
        # Connections to the next stages' workers, by (endpoint, its key).
        self._to_peers: dict[tuple[str, str], zmq.asyncio.Socket] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self.device = device
        self.memory = DeviceMemory(device.budget_bytes - train_bytes, train_bytes, ALIGN)
        self.executor = Executor(device, compute_lanes, memory=self.memory, eviction=eviction)
        # The executor decides its own evictions; the broker learns them from `Resident`.
        self.executor.on_residency = self._report_soon
        self._report_due = False
        self.train_bytes = train_bytes
        self.trainer = TrainingExecutor(device, memory=self.memory) if train_bytes > 0 else None
        # Stages prepared (weights read into the host tier) since the process started.
        self.stages_prepared = 0
        self.lane_answers = 0
        self.reader_runs = 0  # runs computed (or failed) and answered on the reader thread
        # Stages whose weights are being read in: "model/stage" -> [bytes read, bytes to read]
        # (reported with the heartbeats, so `flowmesh deploy` can show its progress).
        self._preparing: dict[str, list[int]] = {}
        # The mesh's list arrives at registration (`on_allow`); `own` may only narrow it.
        self.own_allow = allow
        self.allow = allow if allow is not None else DEFAULT_ALLOW
        self.threads = threads
        # Stage preparation, and the opening and closing of training jobs, in arrival order.
        self._deploys = torch_pool(1, "deploy")

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

    # What `inventory` reads of the core's job ledger and stages.

    @property
    def _digests(self) -> dict[tuple[str, int], str]:
        return self.core.digests

    @property
    def _seqs(self) -> dict[str, int]:
        return {name: ledger.last for name, ledger in self.core.jobs.items()}

    @property
    def _results(self) -> dict[str, list[dict[str, Any]]]:
        return {name: list(ledger.answers.values()) for name, ledger in self.core.jobs.items()}

    @property
    def _running(self) -> dict[str, set[int]]:
        return {name: ledger.running for name, ledger in self.core.jobs.items()}

    def registration(self) -> p.Register:
        return p.Register(
            id=1,
            role="worker",
            name=self.name,
            pid=os.getpid(),
            device=getattr(self.device, "name", self.device.kind),
            kind=self.device.kind,
            # The broker plans serving residency against this; training has its own bytes.
            budget_bytes=self.memory.serving_bytes,
            info={
                "compute_lanes": self.executor.compute_lanes,
                "threads": self.threads or 0,
                "train_bytes": self.train_bytes,
                "arena_bytes": self.memory.capacity,
                **({"peer_endpoint": self.peer_bound} if self.peer_bound else {}),
                **self.device.info(),
            },
            inventory=self.inventory(),
        )

    def inventory(self) -> p.Inventory:
        """The stages and training jobs this process holds (see `p.Inventory`)."""
        resident = self.executor.resident()
        stages = [
            p.HeldStage(
                model=key[0],
                stage=key[1],
                nbytes=st.host.nbytes,
                resident=key in resident,
                digest=self._digests.get(key, ""),
            )
            for key, st in self.executor.stages.items()
        ]

        def answer(r: Any) -> p.StepOk | p.StepFailed:  # the ledger's {"seq", ...} dicts
            if isinstance(r, p.StepOk | p.StepFailed):
                return r
            return p.StepFailed(**r) if "code" in r else p.StepOk(**r)

        jobs = []
        trainer = self.trainer
        for name, seq in self._seqs.items():
            job = trainer.jobs.get(name) if trainer is not None else None
            if job is None:
                continue
            jobs.append(
                p.HeldJob(
                    name=name,
                    step=job.step_count,
                    seq=seq,
                    footprint=job.footprint(),
                    results=[answer(r) for r in self._results.get(name, ())],
                    running=sorted(self._running.get(name, ())),
                )
            )
        return p.Inventory(stages=stages, jobs=jobs)

    def stats(self) -> dict[str, Any]:
        out = {**self.executor.stats(), **self.device.info(), **self.memory.stats()}
        out["stages_prepared"] = self.stages_prepared
        out["lane_answers"] = self.lane_answers  # runs answered from their compute lane
        out["reader_runs"] = self.reader_runs  # runs answered from the reader thread
        out["preparing"] = {k: list(v) for k, v in list(self._preparing.items())}
        out.update(self.direct.counters)
        out["direct_pending"] = len(self.direct.runs)  # announced runs not finished here
        if self.curve is not None:  # keyless stats stay as they were
            out["peer_refused"] = self.peer_keys.refused  # peer-socket keys no run named
        if self.trainer is not None:
            # Flat figures: heartbeat stats are bounded in depth (broker.core.check_stats).
            t = self.trainer.stats()
            out.update(
                train_jobs=len(t["jobs"]),
                train_steps=t["steps"],
                train_step_errors=t["step_errors"],
                train_budget_bytes=t["budget_bytes"],
                train_reserved_bytes=t["reserved_bytes"],
                train_resident_bytes=t["resident_bytes"],
                train_evals=t["evals"],
                train_reserved_peak=t["reserved_peak"],
                train_resident_peak=t["resident_peak"],
                train_bytes_in=t["bytes_in"],
                train_tasks=t["tasks"],
                train_tasks_admitted=t["tasks_admitted"],
                train_tasks_started=t["tasks_started"],
                train_job_switches=t["job_switches"],
                train_tasks_reclaimed=t["tasks_reclaimed"],
            )
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
        Hops come (`DirectRuns.expire`)."""
        while True:
            await asyncio.sleep(max(self.direct.early_ttl_s / 10, 0.1))
            self.core.tick(self.clock())

    def close(self) -> None:
        for sock in (*self._to_peers.values(), self._peer_sock):
            if sock is not None:
                sock.close(linger=0)
        self._to_peers.clear()
        if self._peer_auth is not None:
            self._peer_auth.stop()
        self.executor.close()
        if self.trainer is not None:
            self.trainer.close()
        self._deploys.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ the core's work

    def handle(self, msg: p.Message) -> None:
        try:
            self.core.handle(msg, self.clock())  # raises what refuses it: `pump` answers
        finally:
            self._flush()

    def _flush(self) -> None:
        """Do what the core asked for, in its order; what that leads to, too."""
        while self.core.out:
            action = self.core.out.pop(0)
            if isinstance(action, Send):
                self.send(action.msg)
            elif isinstance(action, AllowPeer):
                self.peer_keys.allow(action.key)
            else:
                try:
                    self._start(action)
                except Exception as exc:
                    self.core.finished(action, exc, self.clock())

    def _feed(self, fut: asyncio.Future[Any], work: Work) -> None:
        """Tell the core what `work` ended with once `fut` settles."""

        def done(f: asyncio.Future[Any]) -> None:
            result: Any
            if f.cancelled():
                result = FlowmeshError(Code.INTERNAL, "cancelled")
            else:
                result = f.exception()
                if result is None:
                    result = f.result()
            self.core.finished(work, result, self.clock())
            self._flush()

        fut.add_done_callback(done)

    def _start(self, work: Work) -> None:
        """Start `work` on its executor or thread; raises what fails it at once."""
        loop = asyncio.get_running_loop()
        if isinstance(work, RunStage):
            self._run(work)
        elif isinstance(work, RunChunk):
            msg = work.run.msg
            if msg.id in self.direct.runs:  # else failed meanwhile: nobody waits for it
                self._feed(self.executor.run((msg.model, msg.stage), [work.tensors]), work)
        elif isinstance(work, SendHop):
            self._hop(work)
            self.core.finished(work, None, self.clock())
        elif isinstance(work, LoadStage):
            # Answered even when nothing changed: the broker's expectation of which stages
            # this load evicts is settled by what we report.
            self._report_soon()
            msg = work.msg
            self._feed(self.executor.load((msg.model, msg.stage), work.keep), work)
        elif isinstance(work, EvictStage):
            self.executor.evict((work.msg.model, work.msg.stage))
        elif isinstance(work, DropStage):
            self.executor.drop_stage((work.msg.model, work.msg.stage))
        elif isinstance(work, PrepareStage):
            self._prepare(work)
        elif isinstance(work, AddStage):
            self.executor.add_stage(work.key, work.blocks, work.host)
        elif isinstance(work, OpenJob):
            self._feed(loop.run_in_executor(self._deploys, self._open_job, work.msg), work)
        elif isinstance(work, CloseJob):
            # On the thread that opens jobs: a close never overtakes the open before it.
            self._feed(loop.run_in_executor(self._deploys, self._close_job, work.msg.job), work)
        elif isinstance(work, SubmitStep):
            fut = self._trainer().submit(work.msg.job, work.inputs, work.targets)
            self._feed(asyncio.wrap_future(fut), work)
        elif isinstance(work, Evaluate):
            fut = self._trainer().evaluate(work.msg.job, work.inputs, work.targets)
            self._feed(asyncio.wrap_future(fut), work)
        elif isinstance(work, SaveJob):
            self._feed(asyncio.wrap_future(self._save(work)), work)
        else:
            raise FlowmeshError(Code.INTERNAL, f"no way to do {type(work).__name__}")

    def _report_soon(self) -> None:
        """One `Resident` report after whatever the current loop pass changes."""
        if not self._report_due:
            self._report_due = True
            asyncio.get_running_loop().call_soon(self._report)

    def _report(self) -> None:
        self._report_due = False
        self.send(p.Resident(stages=self.executor.residency(), after_load=self.core.last_load))

    def _prepare(self, work: PrepareStage) -> None:
        msg = work.msg
        key = f"{msg.model}/{msg.stage}"
        read = self._preparing[key] = [0, 0]

        def progress(done: int, total: int) -> None:  # on the deploy thread
            read[:] = [done, total]

        fut = asyncio.get_running_loop().run_in_executor(
            self._deploys,
            prepare_stage,
            work.spec,
            msg.plan,
            msg.stage,
            self.device,
            self.allow,
            progress,
        )

        def prepared(f: asyncio.Future[Any]) -> None:  # before the core hears of it
            if self._preparing.get(key) is read:
                del self._preparing[key]
            if not f.cancelled() and f.exception() is None:
                self.stages_prepared += 1

        fut.add_done_callback(prepared)
        self._feed(fut, work)

    def _run(self, work: RunStage) -> None:
        msg = work.msg

        def counted(f: asyncio.Future[RunOutput]) -> None:
            if not f.cancelled() and f.exception() is None and f.result().answered:
                self.lane_answers += 1

        # The result goes out from the compute lane that computed it (one thread hand-off
        # less on every request's path); the loop sends it only if the lane could not.
        fut = self.executor.run(
            (msg.model, msg.stage),
            work.parts,
            separate=msg.separate,
            on_lane=lambda out: self.send_from_thread(run_result(msg, out)),
        )
        fut.add_done_callback(counted)
        self._feed(fut, work)

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
        if not isinstance(msg, p.Run) or msg.ticket:
            return False
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
            self._flush()

    def _hop(self, work: SendHop) -> None:
        msg = work.run.msg
        to = (msg.next_peer, msg.next_key)
        sock = self._to_peers.get(to)
        if sock is None:
            assert self._ctx is not None
            curve = None
            if self.curve is not None:
                if not msg.next_key:
                    raise FlowmeshError(
                        Code.BAD_REQUEST, f"run {msg.id}: no key for the next stage's worker"
                    )
                curve = dataclasses.replace(self.curve, server_public=msg.next_key.encode())
            sock = self._to_peers[to] = connect_dealer(
                self._ctx, msg.next_peer, limits=self.limits, curve=curve
            )
        send(sock, work.hop)

    # ------------------------------------------------------------------ training jobs

    def _trainer(self) -> TrainingExecutor:
        if self.trainer is None:
            raise FlowmeshError(
                Code.UNAVAILABLE, f"worker {self.name} takes no training jobs (--train-bytes 0)"
            )
        return self.trainer

    def _open_job(self, msg: p.TrainOpen) -> dict[str, Any]:
        """On a thread: build, plan and lay out the job (profiling and weights take a while)."""
        trainer = self._trainer()
        opening = self.core.job_opening(msg)
        return start_job(
            trainer,
            msg.job,
            opening.spec,
            opening.config,
            self.device,
            batch=msg.batch,
            target_bytes=opening.target_bytes,
            allow=self.allow,
            resume=opening.resume,
            worker=self.name,
        )

    def _close_job(self, name: str) -> None:
        self._trainer().close_job(name)

    def _save(self, work: SaveJob) -> Future[tuple[str, int]]:
        msg = work.msg
        trainer = self._trainer()
        job = trainer.jobs.get(msg.job)
        if job is None:
            raise FlowmeshError(Code.MODEL_NOT_FOUND, f"no training job {msg.job!r} here")
        saved: Future[tuple[str, int]] = Future()

        def done(f: Future[Any]) -> None:
            # On the training driver, as the save task ends: the job's step count is the
            # checkpoint's, before any later step of the job finishes.
            exc = f.exception()
            if exc is not None:
                saved.set_exception(exc)
            else:
                saved.set_result((msg.path, job.step_count))  # the path as the client wrote it

        trainer.save(msg.job, work.path).add_done_callback(done)
        return saved
