"""The worker's hands: what does `gpu_worker.core.WorkerCore`'s work, on the executors and
threads, with no socket of its own.

The core decides; `WorkerHands` does each item of its outbox (`flush`) on the executor (runs,
loads, evictions), the training executor (steps, evaluations, saves) and the deploy thread
(stage preparation, and the opening and closing of training jobs, in arrival order), and feeds
what each piece of work ended with back to the core as soon as its future settles, so one slow
model never holds up the others. It also says what the worker holds (`inventory`) and what it
reports with its heartbeats (`stats`).

What needs a socket is given as callbacks: `send` (a message to the broker, on the loop),
`send_from_thread` (the same from a compute lane; False when it cannot go from there),
`send_hop` (a direct run's micro-batch to the next stage's worker), `allow_peer` (a key the
peer socket may take, for a while or while a pipelined job's open holds it) and
`release_peers` (those such an open held). The process shell (`gpu_worker.service`) gives its
sockets; the in-process test mesh (tests/support/inproc.py) gives the other workers' cores.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.costs import human_bytes
from flowmesh.reports import OpenedJob, SubModelRow
from flowmesh.threads import torch_pool
from gpu_worker.core import (
    AddStage,
    AllowPeer,
    CloseJob,
    DropStage,
    Evaluate,
    EvictStage,
    FreeKV,
    LoadStage,
    OpenJob,
    PipeEval,
    PipeHopIn,
    PipeSave,
    PipeStep,
    PrepareStage,
    ReleasePeers,
    RunChunk,
    RunStage,
    SaveJob,
    Send,
    SendHop,
    SubmitStep,
    Work,
    WorkerCore,
    run_result,
)
from gpu_worker.device import Device
from gpu_worker.executor import Executor, RunOutput
from gpu_worker.host_tier import ALIGN
from gpu_worker.kv_cache import kv_limit_bytes
from gpu_worker.memory import DeviceMemory, Extent
from gpu_worker.pipe_checkpoint import config_of, load_stage, read_pipe_meta, save_stage
from gpu_worker.pipe_runner import PipeRunner
from gpu_worker.pipe_stage import build_stage
from gpu_worker.stage_loader import prepare_stage
from gpu_worker.train_executor import TrainingExecutor, start_job

# How long a pipelined stage's open waits for the memory-flow tasks using the arena range it is
# to hold to end (tasks are short: seconds at most; past it the open fails UNAVAILABLE).
HOLD_WAIT_S = 60.0


def stage_row(start: int, stop: int, footprint: int) -> SubModelRow:
    """A pipelined job's stage as its sub-model row: its blocks, resident (no host-tier bytes),
    each micro-batch's graph kept from its forward to its backward ("keep")."""
    return SubModelRow(
        blocks=[start, stop], host_bytes=0, task_bytes=footprint, activations="keep"
    )


class WorkerHands:
    """The executors and threads of worker `core.name` on `device`, doing its core's work.

    Use it on one running event loop (the callbacks' `send` and `send_hop` are called there).
    """

    def __init__(
        self,
        core: WorkerCore,
        device: Device,
        *,
        send: Callable[[p.Message], bool],
        send_from_thread: Callable[[p.Message], bool],
        send_hop: Callable[[SendHop], None],
        allow_peer: Callable[[str, str], None],
        release_peers: Callable[[str], None],
        clock: Callable[[], float],
        compute_lanes: int = 2,
        train_bytes: int = 0,
        eviction: str = "value",
        kv_preempt: str = "auto",
        log: logging.Logger | None = None,
        send_pipe: Callable[[p.PipePeer, p.PipeHop], None] | None = None,
    ) -> None:
        if not 0 <= train_bytes <= device.budget_bytes:
            raise ValueError("training bytes must be within the device's arena")
        self.core = core
        self.device = device
        self.send, self.send_from_thread = send, send_from_thread
        self.send_hop, self.allow_peer, self.release_peers = send_hop, allow_peer, release_peers
        self.send_pipe = send_pipe
        # The stages of pipelined jobs held here: each job's runner and the one thread it runs
        # on (its compute, and its messages in the order they came).
        self.pipes: dict[str, tuple[PipeRunner, Any]] = {}
        # The arena range each pipelined job's stage lives in here (`TrainingExecutor.hold`).
        self.pipe_holds: dict[str, Extent] = {}
        self.clock = clock
        self.log = log or logging.getLogger("worker")
        self.train_bytes = train_bytes
        self.memory = DeviceMemory(device.budget_bytes - train_bytes, train_bytes, ALIGN)
        self.executor = Executor(
            device, compute_lanes, memory=self.memory, eviction=eviction, kv_preempt=kv_preempt
        )
        # The executor decides its own evictions; the broker learns them from `Resident`.
        self.executor.on_residency = self.report_soon
        self._report_due = False
        self.trainer = TrainingExecutor(device, memory=self.memory) if train_bytes > 0 else None
        # Stages prepared (weights read into the host tier) since the process started.
        self.stages_prepared = 0
        self.lane_answers = 0  # runs answered from their compute lane
        # Stages whose weights are being read in: "model/stage" -> [bytes read, bytes to read]
        # (reported with the heartbeats, so `flowmesh deploy` can show its progress).
        self.preparing: dict[str, list[int]] = {}
        # Stage preparation, and the opening and closing of training jobs, in arrival order.
        self._deploys = torch_pool(1, "deploy")

    def close(self) -> None:
        self.executor.close()
        if self.trainer is not None:
            self.trainer.close()
        self._deploys.shutdown(wait=False, cancel_futures=True)
        for _, pool in self.pipes.values():
            pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ what the worker holds

    def registration(self, name: str, threads: int, peer_endpoint: str) -> p.Register:
        """The Register message of this worker: its device, its arena and its inventory."""
        dev = self.device.info()  # the figures its heartbeats report too
        return p.Register(
            id=1,
            role="worker",
            name=name,
            pid=os.getpid(),
            device=getattr(self.device, "name", self.device.kind),
            kind=self.device.kind,
            # The broker plans serving residency against this; training has its own bytes.
            budget_bytes=self.memory.serving_bytes,
            info=p.PeerInfo(
                compute_lanes=self.executor.compute_lanes,
                threads=threads,
                train_bytes=self.train_bytes,
                arena_bytes=self.memory.capacity,
                peer_endpoint=peer_endpoint,
                prefault_s=self.device.prefault_s,
                host_tier_bytes=dev.get("host_tier_bytes", 0),  # a device without one: none
                host_tier_used_bytes=dev.get("host_tier_used_bytes", 0),
            ),
            inventory=self.inventory(),
        )

    def inventory(self) -> p.Inventory:
        """The stages and training jobs this worker holds (see `p.Inventory`)."""
        resident = self.executor.resident()
        digests = self.core.digests
        stages = [
            p.HeldStage(
                model=key[0],
                stage=key[1],
                nbytes=st.host.nbytes,
                resident=key in resident,
                digest=digests.get(key, ""),
            )
            for key, st in self.executor.stages.items()
        ]

        jobs = []
        trainer = self.trainer
        for name, ledger in self.core.jobs.items():
            pipe = self.pipes.get(name)
            if pipe is not None:  # its steps' answers and running seqs: stage 0's alone
                stage = pipe[0].stage
                a, b = stage.ranges[stage.stage]
                footprint = stage.footprint(self.core.allow)
                jobs.append(
                    p.HeldJob(
                        name=name,
                        step=pipe[0].step_count,
                        seq=ledger.last,
                        footprint=footprint,
                        results=list(ledger.answers.values()),
                        running=sorted(ledger.running),
                        sub_models=[stage_row(a, b, footprint)],
                    )
                )
                continue
            job = trainer.jobs.get(name) if trainer is not None else None
            if job is None:
                continue
            jobs.append(
                p.HeldJob(
                    name=name,
                    step=job.step_count,
                    seq=ledger.last,
                    footprint=job.footprint(),
                    results=list(ledger.answers.values()),
                    running=sorted(ledger.running),
                    sub_models=[SubModelRow(**s) for s in job.sub_model_info()],
                )
            )
        return p.Inventory(stages=stages, jobs=jobs)

    def stats(self) -> dict[str, Any]:
        """What the worker's heartbeats report of its executors and memory."""
        out = {**self.executor.stats(), **self.device.info(), **self.memory.stats()}
        out["stages_prepared"] = self.stages_prepared
        # Beside the executor's kv_bytes and kv_blocks: what its models' KV may take together.
        stages = self.executor.stages
        shares = ((key[0], st.kv_share) for key, st in stages.items())
        out["kv_limit_bytes"] = kv_limit_bytes(shares, self.memory.serving_bytes)
        # Blocks of the largest kind here that the limit still allows (stages' blocks may differ);
        # not reported before a KV cache is made here (no block size to count in).
        kvs = [st.kv for st in stages.values() if st.kv is not None]
        sizes = [self.memory.round(kv.block_bytes) for kv in kvs]
        if sizes:
            out["kv_blocks_free"] = max(0, out["kv_limit_bytes"] - out["kv_bytes"]) // max(sizes)
        out["lane_answers"] = self.lane_answers
        out["preparing"] = {k: list(v) for k, v in list(self.preparing.items())}
        direct = self.core.direct
        out.update(direct.counters)
        out["direct_pending"] = len(direct.runs)  # announced runs not finished here
        if self.trainer is not None:
            # The trainer's totals, by the names `flowmesh.reports.WorkerStats` declares.
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
                train_stash_device_bytes=t["stash_device_bytes"],
                train_stash_device_peak=t["stash_device_peak"],
                train_stash_device_limit=t["stash_device_limit"],
                train_stash_device_kept_bytes=t["stash_device_kept_bytes"],
                train_stash_host_bytes=t["stash_host_bytes"],
            )
        pipes = [runner.stage for runner, _ in list(self.pipes.values())]
        out["pipe_stages"] = len(pipes)
        out["pipe_bytes"] = sum(st.footprint(self.core.allow) for st in pipes)
        return out

    # ------------------------------------------------------------------ the core's work

    def flush(self) -> None:
        """Do what the core asked for, in its order; what that leads to, too."""
        core = self.core
        while core.out:
            action = core.out.pop(0)
            if isinstance(action, Send):
                self.send(action.msg)
            elif isinstance(action, AllowPeer):
                self.allow_peer(action.key, action.holder)
            elif isinstance(action, ReleasePeers):
                self.release_peers(action.holder)
            else:
                try:
                    self._start(action)
                except Exception as exc:
                    core.finished(action, exc, self.clock())

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
            self.flush()

        fut.add_done_callback(done)

    def _start(self, work: Work) -> None:
        """Start `work` on its executor or thread; raises what fails it at once."""
        loop = asyncio.get_running_loop()
        if isinstance(work, RunStage):
            self._run(work)
        elif isinstance(work, RunChunk):
            msg = work.run.msg
            if msg.id in self.core.direct.runs:  # else failed meanwhile: nobody waits for it
                fut = self.executor.run((msg.model, msg.stage), [work.tensors], gen=msg.gen)
                self._feed(fut, work)
        elif isinstance(work, SendHop):
            self.send_hop(work)
            self.core.finished(work, None, self.clock())
        elif isinstance(work, LoadStage):
            # Answered even when nothing changed: the broker's expectation of which stages
            # this load evicts is settled by what we report.
            self.report_soon()
            msg = work.msg
            self._feed(self.executor.load((msg.model, msg.stage), work.keep), work)
        elif isinstance(work, EvictStage):
            self.executor.evict((work.msg.model, work.msg.stage))
        elif isinstance(work, DropStage):
            self.executor.drop_stage((work.msg.model, work.msg.stage))
        elif isinstance(work, FreeKV):
            key = (work.msg.model, work.msg.stage)
            if work.msg.park:
                self.core.finished(work, self.executor.park_seqs(key, work.msg.seqs), self.clock())
            else:
                self.executor.free_seqs(key, work.msg.seqs)
        elif isinstance(work, PrepareStage):
            self._prepare(work)
        elif isinstance(work, AddStage):
            self.executor.add_stage(work.key, work.blocks, work.host, work.kv_share)
        elif isinstance(work, OpenJob):
            msg = work.msg
            if isinstance(msg, p.PipeOpen):
                self._feed(loop.run_in_executor(self._deploys, self.open_pipe, msg, loop), work)
            else:
                self._feed(loop.run_in_executor(self._deploys, self.open_job, msg), work)
        elif isinstance(work, PipeStep):
            runner, pool = self._pipe(work.msg.job)
            fut = pool.submit(runner.on_step, work.msg, work.inputs, work.targets)
            self._feed(asyncio.wrap_future(fut), work)
        elif isinstance(work, PipeEval):
            runner, pool = self._pipe(work.msg.job)
            fut = pool.submit(runner.on_eval, work.msg, work.inputs, work.targets)
            self._feed(asyncio.wrap_future(fut), work)
        elif isinstance(work, PipeSave):
            runner, pool = self._pipe(work.msg.job)
            fut = pool.submit(runner.on_save, work.msg.id, work.msg.path, work.msg.timeout_ms)
            self._feed(asyncio.wrap_future(fut), work)
        elif isinstance(work, PipeHopIn):
            runner, pool = self._pipe(work.hop.job)
            self._feed(asyncio.wrap_future(pool.submit(runner.on_hop, work.hop)), work)
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

    def report_soon(self) -> None:
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
        read = self.preparing[key] = [0, 0]

        def progress(done: int, total: int) -> None:  # on the deploy thread
            read[:] = [done, total]

        fut = asyncio.get_running_loop().run_in_executor(
            self._deploys,
            prepare_stage,
            work.spec,
            msg.plan,
            msg.stage,
            self.device,
            self.core.allow,
            progress,
        )

        def prepared(f: asyncio.Future[Any]) -> None:  # before the core hears of it
            if self.preparing.get(key) is read:
                del self.preparing[key]
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
            gen=msg.gen,
            run_id=msg.id,
        )
        fut.add_done_callback(counted)
        self._feed(fut, work)

    # ------------------------------------------------------------------ training jobs

    def _trainer(self) -> TrainingExecutor:
        if self.trainer is None:
            raise FlowmeshError(
                Code.UNAVAILABLE,
                f"worker {self.core.name} takes no training jobs (--train-bytes 0)",
            )
        return self.trainer

    def open_job(self, msg: p.TrainOpen) -> dict[str, Any]:
        """On a thread: build, plan and lay out the job (profiling and weights take a while)."""
        trainer = self._trainer()
        opening = self.core.job_opening(msg)
        target = opening.target_bytes
        if msg.chunk_bytes is None:  # the default (half the training bytes), within what the
            target = min(target, max(1, trainer.memory.task_room()))  # pipelined stages leave
        return start_job(
            trainer,
            msg.job,
            opening.spec,
            opening.config,
            self.device,
            batch=msg.batch,
            target_bytes=target,
            allow=self.core.allow,
            resume=opening.resume,
            worker=self.core.name,
        )

    def _close_job(self, name: str) -> None:
        pipe = self.pipes.pop(name, None)
        if pipe is not None:
            pool = pipe[1]
            pool.shutdown(wait=False, cancel_futures=True)  # the steps queued are given up
            held = self.pipe_holds.pop(name, None)
            if held is not None:
                # Its range goes back once the stage's thread is done with it (a step under
                # way ends first), before the next open or close in line here is done: an open
                # after this close finds the range free.
                pool.shutdown(wait=True)
                self._trainer().release(held)
            return
        self._trainer().close_job(name)

    # ------------------------------------------------------------------ pipelined jobs

    def _pipe(self, job: str) -> tuple[PipeRunner, Any]:
        pipe = self.pipes.get(job)
        if pipe is None:
            raise FlowmeshError(Code.MODEL_NOT_FOUND, f"no pipelined job {job!r} here")
        return pipe

    def open_pipe(self, msg: p.PipeOpen, loop: asyncio.AbstractEventLoop) -> OpenedJob:
        """On a thread: build this worker's stage of a pipelined job, its runner and thread."""
        trainer = self._trainer()
        if msg.job in self.pipes or msg.job in trainer.jobs:
            raise FlowmeshError(Code.MODEL_EXISTS, f"training job {msg.job!r} is open here")
        if self.send_pipe is None:
            raise FlowmeshError(Code.UNAVAILABLE, f"worker {self.core.name} has no peer socket")
        resume = None
        config = msg.config
        if msg.resume is not None:
            resume = self.core.roots.readable(msg.resume, "checkpoint")
            config = config or config_of(read_pipe_meta(resume))
        assert config is not None  # the core refused an open with neither
        stage = build_stage(
            msg.job, msg.spec, config, msg.stage, len(msg.peers),
            self.device.torch_device, self.core.allow, place_later=True,
        )  # fmt: skip
        step, rng = load_stage(stage, resume) if resume is not None else (0, None)
        footprint = stage.footprint(self.core.allow)
        # Pipelined stages stay resident: together they hold at most the training bytes.
        others = sum(r.stage.footprint(self.core.allow) for r, _ in self.pipes.values())
        if footprint + others > self.train_bytes:
            beside = f", beside the {human_bytes(others)} of its other pipelined stages" if (
                others) else ""  # fmt: skip
            raise FlowmeshError(
                Code.TOO_BIG,
                f"job {msg.job!r}: stage {msg.stage} of {len(msg.peers)} holds "
                f"{human_bytes(footprint)} ({footprint} bytes) with its gradients and optimizer "
                f"state, over the {human_bytes(self.train_bytes)} ({self.train_bytes} bytes) of "
                f"training bytes of worker {self.core.name}{beside}: cut it into more stages "
                "(more workers), or train it on one worker by memory flow (pipeline=1), which "
                "trains a job of any size",
            )
        # It lives in the arena, in a range held for the job's life: what is left for the
        # memory-flow jobs and served models here shrinks by it (or the open is refused).
        held = trainer.hold(
            f"job {msg.job!r}: stage {msg.stage} of {len(msg.peers)}",
            stage.lay_out(self.core.allow),
            HOLD_WAIT_S,
        )
        try:
            stage.place(self.device.arena, held.offset)
            peers, job = list(msg.peers), msg.job

            def send(to: int, hop: p.PipeHop) -> None:  # on the job's thread
                loop.call_soon_threadsafe(self._send_pipe, peers[to], hop)

            def answer(out: p.Message) -> None:  # on the job's thread
                loop.call_soon_threadsafe(self._pipe_answered, job, out)

            roots = self.core.roots

            def save(stage: Any, path: str, step: int, rng: Any, save_id: str) -> None:
                # (on the job's thread)
                save_stage(stage, roots.writable(path, "checkpoint"), step, rng, save_id)

            runner = PipeRunner(
                stage, msg.ticket, send, answer, step_count=step, save=save, batch=msg.batch
            )
            if rng is not None:
                runner.rng = rng
            self.pipes[job] = (runner, torch_pool(1, f"pipe-{job}"))
            self.pipe_holds[job] = held
        except BaseException:
            trainer.release(held)
            raise
        a, b = stage.ranges[msg.stage]
        return OpenedJob(
            name=job,
            worker=self.core.name,
            step=step,
            sub_models=[stage_row(a, b, footprint)],
            footprint=footprint,
            host_bytes=0,
            largest_task=footprint,
            config=config,
        )

    def tick(self) -> None:
        """Each pipelined job's coordinator checks the deadline of what it has under way (a step,
        an evaluation, a save), on the job's thread."""
        for runner, pool in list(self.pipes.values()):
            if runner.coordinator and runner.under_way:
                pool.submit(runner.on_tick)

    def _send_pipe(self, peer: p.PipePeer, hop: p.PipeHop) -> None:
        assert self.send_pipe is not None
        try:
            self.send_pipe(peer, hop)
        except Exception as exc:  # the step waits on it: its deadline on the broker fails it
            self.log.error("a hop to %s failed: %r", peer.worker, exc)

    def _pipe_answered(self, job: str, msg: p.Message) -> None:
        if job in self.pipes:
            self.core.pipe_answered(job, msg)
            self.flush()

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
