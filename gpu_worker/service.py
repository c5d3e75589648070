"""The gpu_worker process: a thin shell that feeds broker commands to the executors.

Commands are applied in arrival order on the event loop (allocation bookkeeping is cheap and
ordered); stage preparation, copies and compute run on worker threads; results go back as soon as
their futures resolve, so one slow model never holds up the others.

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
a step applied twice.

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
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch
import zmq
import zmq.asyncio

from flowmesh import protocol as p
from flowmesh.auth import PEERS_DOMAIN, PeerKeys, peer_authenticator
from flowmesh.errors import Code, FlowmeshError
from flowmesh.logs import LogThrottle
from flowmesh.peer import MeshPeer
from flowmesh.roots import Roots
from flowmesh.spec import DEFAULT_ALLOW, ModelSpec, check_factory, narrow_allow
from flowmesh.threads import torch_pool
from flowmesh.transport import bind_router, connect_dealer, pump, send
from gpu_worker.device import Device
from gpu_worker.direct import DirectRun, DirectRuns
from gpu_worker.executor import Executor, LoadInfo, RunOutput, concat_parts, split_rows
from gpu_worker.host_tier import ALIGN
from gpu_worker.memory import DeviceMemory
from gpu_worker.stage_loader import prepare_stage
from gpu_worker.train_job import StepResult, TrainConfig
from gpu_worker.training import TrainingExecutor, config_from, open_job, read_meta

T = TypeVar("T")

# Step answers kept per training job for the registration's inventory (see `_train_step`).
KEEP_RESULTS = 32


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
        # For lines logged per message: whoever reaches our sockets cannot flood the log.
        self.log_throttle = LogThrottle(self.log)
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
        self.direct = DirectRuns()
        self.device = device
        if not 0 <= train_bytes <= device.budget_bytes:
            raise ValueError("training bytes must be within the device's arena")
        self.memory = DeviceMemory(device.budget_bytes - train_bytes, train_bytes, ALIGN)
        self.executor = Executor(device, compute_lanes, memory=self.memory, eviction=eviction)
        # The executor decides its own evictions; the broker learns them from `Resident`.
        self.executor.on_residency = self._report_soon
        self._report_due = False
        self._last_load = 0  # id of the last Load handled, carried by each report
        self.train_bytes = train_bytes
        self.trainer = TrainingExecutor(device, memory=self.memory) if train_bytes > 0 else None
        self._seqs: dict[str, int] = {}  # training job -> the highest step seq taken
        # What a broker that restarted needs to take our jobs up (the registration's
        # inventory): each job's latest step answers and the seqs still running.
        self._results: dict[str, deque[dict[str, Any]]] = {}
        self._running: dict[str, set[int]] = {}
        # What each stage was built from (`protocol.stage_digest`), reported with it.
        self._digests: dict[tuple[str, int], str] = {}
        # Stages prepared (weights read into the host tier) since the process started.
        self.stages_prepared = 0
        self.lane_answers = 0
        self.reader_runs = 0  # runs computed (or failed) and answered on the reader thread
        # Stages whose weights are being read in: "model/stage" -> [bytes read, bytes to read]
        # (reported with the heartbeats, so `flowmesh deploy` can show its progress).
        self._preparing: dict[str, list[int]] = {}
        # Bumped when a broker registers us afresh: a stage or job still being prepared for the
        # broker before is dropped when it is ready, as nobody asked for it any more.
        self._epoch = 0
        # The mesh's list arrives at registration (`on_allow`); `own` may only narrow it.
        self.own_allow = allow
        self.allow = allow if allow is not None else DEFAULT_ALLOW
        self.threads = threads
        self._deploys = torch_pool(1, "deploy")
        self._tasks: set[asyncio.Task[Any]] = set()

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

    def inventory(self) -> dict[str, list[dict[str, Any]]]:
        """The stages and training jobs this process holds (see `p.Register.inventory`)."""
        resident = self.executor.resident()
        stages = [
            {
                "model": key[0],
                "stage": key[1],
                "nbytes": st.host.nbytes,
                "resident": key in resident,
                "digest": self._digests.get(key, ""),
            }
            for key, st in self.executor.stages.items()
        ]
        jobs = []
        trainer = self.trainer
        for name, seq in self._seqs.items():
            job = trainer.jobs.get(name) if trainer is not None else None
            if job is None:
                continue
            jobs.append(
                {
                    "name": name,
                    "step": job.step_count,
                    "seq": seq,
                    "footprint": job.footprint(),
                    "results": list(self._results.get(name, ())),
                    "running": sorted(self._running.get(name, ())),
                }
            )
        return {"stages": stages, "jobs": jobs}

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
            # broker before: it is dropped when ready (see `_epoch`).
            self._epoch += 1

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
            self.direct.expire(time.monotonic())

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

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _answer_when_done(
        self, fut: asyncio.Future[T], ref: int, reply: Callable[[T], p.Message | None]
    ) -> None:
        """Send `reply(result)` once `fut` settles (None: answered already), or an error
        naming command `ref`."""

        def done(f: asyncio.Future[T]) -> None:
            if f.cancelled() or f.exception() is not None:
                self._fail(ref, f.exception() or FlowmeshError(Code.INTERNAL, "cancelled"))
            else:
                answer = reply(f.result())
                if answer is not None:
                    self.send(answer)

        fut.add_done_callback(done)

    def _fail(self, ref: int, exc: BaseException) -> None:
        if not isinstance(exc, FlowmeshError):
            self.log_throttle.error("command %d failed: %r", ref, exc)
        self.send(p.error_for(exc, ref))

    def handle(self, msg: p.Message) -> None:
        if isinstance(msg, p.Run):
            if msg.ticket:
                self._direct_run(msg)
            else:
                self._run(msg)
        elif isinstance(msg, p.CancelRun):
            self.direct.cancel(msg.id)
        elif isinstance(msg, p.Load):
            self._load(msg)
        elif isinstance(msg, p.Evict):
            self.executor.evict((msg.model, msg.stage))
        elif isinstance(msg, p.DeployStage):
            self._spawn(self._deploy_stage(msg))
        elif isinstance(msg, p.DropStage):
            self.executor.drop_stage((msg.model, msg.stage))
            self._digests.pop((msg.model, msg.stage), None)
        elif isinstance(msg, p.TrainStep):
            self._train_step(msg)
        elif isinstance(msg, p.TrainEval):
            self._train_eval(msg)
        elif isinstance(msg, p.TrainOpen):
            self._spawn(self._train_open(msg))
        elif isinstance(msg, p.TrainSave):
            self._train_save(msg)
        elif isinstance(msg, p.TrainClose):
            self._spawn(self._train_close(msg))
        elif isinstance(msg, p.Error):
            self.log.warning("broker answered %s: %s %s", msg.id, msg.code, msg.reason)
        else:
            raise FlowmeshError(Code.BAD_REQUEST, f"a worker does not take {msg.TYPE}")

    async def _deploy_stage(self, msg: p.DeployStage) -> None:
        t0 = time.perf_counter()
        epoch = self._epoch
        key = f"{msg.model}/{msg.stage}"
        read = self._preparing[key] = [0, 0]

        def progress(done: int, total: int) -> None:  # on the deploy thread
            read[:] = [done, total]

        try:
            spec = ModelSpec.from_dict(msg.spec)
            check_factory(spec.factory, self.allow, f"worker {self.name}")
            self._check_files(spec)
            blocks, host = await asyncio.get_running_loop().run_in_executor(
                self._deploys,
                prepare_stage,
                spec,
                msg.plan,
                msg.stage,
                self.device,
                self.allow,
                progress,
            )
        except Exception as exc:
            self._fail(msg.id, exc)
            return
        finally:
            if self._preparing.get(key) is read:
                del self._preparing[key]
        self.stages_prepared += 1
        if epoch != self._epoch:
            self.log.info(
                "stage prepared for a broker that forgot it, dropped model=%s stage=%d",
                msg.model,
                msg.stage,
            )
            return
        self.executor.add_stage((msg.model, msg.stage), blocks, host)
        self._digests[(msg.model, msg.stage)] = p.stage_digest(msg.spec, msg.plan, msg.stage)
        self.log.info("stage ready model=%s stage=%d bytes=%d", msg.model, msg.stage, host.nbytes)
        self.send(
            p.StageReady(
                id=msg.id,
                model=msg.model,
                stage=msg.stage,
                nbytes=host.nbytes,
                seconds=time.perf_counter() - t0,
            )
        )

    def _report_soon(self) -> None:
        """One `Resident` report after whatever the current loop pass changes."""
        if not self._report_due:
            self._report_due = True
            asyncio.get_running_loop().call_soon(self._report)

    def _report(self) -> None:
        self._report_due = False
        self.send(p.Resident(stages=self.executor.residency(), after_load=self._last_load))

    def _load(self, msg: p.Load) -> None:
        keep = []
        for k in msg.keep:
            if len(k) != 2 or not isinstance(k[0], str) or not isinstance(k[1], int):
                raise FlowmeshError(
                    Code.BAD_REQUEST, f"load keep: expected [model, stage], got {k!r}"
                )
            keep.append((k[0], k[1]))
        self._last_load = msg.id
        # Answered even when nothing changed: the broker's expectation of which stages this load
        # evicts is settled by what we report.
        self._report_soon()
        try:
            fut = self.executor.load((msg.model, msg.stage), keep)
        except FlowmeshError as exc:
            self._fail(msg.id, exc)
            return

        def loaded(info: LoadInfo) -> p.Message:
            return p.Loaded(
                id=msg.id,
                model=msg.model,
                stage=msg.stage,
                nbytes=info.nbytes,
                seconds=info.seconds,
            )

        self._answer_when_done(fut, msg.id, loaded)

    @staticmethod
    def _parts(msg: p.Run) -> list[dict[str, Any]]:
        parts: list[dict[str, Any]] = [{} for _ in msg.parts]
        for name, ref in msg.tensors.items():
            k, _, inner = name.partition("/")
            if not k.isdigit() or int(k) >= len(parts):
                raise FlowmeshError(Code.BAD_REQUEST, f"run tensor {name!r}: expected 'k/name'")
            parts[int(k)][inner] = ref
        if not msg.parts or any(not part for part in parts):
            raise FlowmeshError(Code.BAD_REQUEST, "every part of a run needs its tensors")
        return parts

    @staticmethod
    def _run_result(msg: p.Run, out: RunOutput) -> p.RunResult:
        tensors = {f"{k}/{name}": t for k, part in enumerate(out.parts) for name, t in part.items()}
        return p.RunResult(
            id=msg.id,
            model=msg.model,
            stage=msg.stage,
            tensors=tensors,
            info={"compute_s": out.compute_s, "wait_s": out.wait_s},
        )

    def _run(self, msg: p.Run) -> None:
        def unless_answered(out: RunOutput) -> p.Message | None:
            if out.answered:
                self.lane_answers += 1
                return None
            return self._run_result(msg, out)

        # The result goes out from the compute lane that computed it (one thread hand-off
        # less on every request's path); the loop sends it only if the lane could not.
        fut = self.executor.run(
            (msg.model, msg.stage),
            self._parts(msg),
            separate=msg.separate,
            on_lane=lambda out: self.send_from_thread(self._run_result(msg, out)),
        )
        self._answer_when_done(fut, msg.id, unless_answered)

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
            out = self.executor.run_here((msg.model, msg.stage), self._parts(msg), msg.separate)
        except Exception as exc:
            if not isinstance(exc, FlowmeshError):
                self.log_throttle.error("run %d failed: %r", msg.id, exc)
            answer = p.error_for(exc, msg.id)
        else:
            if out is None:
                return False
            answer = self._run_result(msg, out)
        self.reader_runs += 1
        if not self.send_from_thread(answer):  # the loop's send says what happened to it
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to answer
                loop.call_soon_threadsafe(self.send, answer)
        return True

    # ------------------------------------------------------------------ direct runs

    def _direct_run(self, msg: p.Run) -> None:
        """A stage of a direct run: stage 0 cuts its inputs into micro-batches and computes
        them; a later stage computes each micro-batch as it arrives from the stage before."""
        if not msg.parts:
            raise FlowmeshError(Code.BAD_REQUEST, "a run needs parts")
        if not msg.from_peer:
            merged, _ = concat_parts(self._parts(msg), torch.device("cpu"))
            rows = sum(r for _, r in msg.parts)
            if not 1 <= msg.chunks <= rows:
                raise FlowmeshError(
                    Code.BAD_REQUEST, f"run {msg.id}: {msg.chunks} chunks of {rows} rows"
                )
        self.peer_keys.allow(msg.from_key)
        run, early = self.direct.announce(msg)
        if msg.from_peer:
            for hop in early:
                self._direct_chunk(run, hop.chunk, hop.tensors)
            return
        pieces = {n: torch.tensor_split(t, msg.chunks, dim=0) for n, t in merged.items()}
        for i in range(msg.chunks):
            run.seen.add(i)
            self._direct_chunk(run, i, {n: ts[i] for n, ts in pieces.items()})

    def _on_peer(self, _sender: bytes | None, msg: p.Message, key: str | None = None) -> None:
        """What other workers send to our peer socket: activations, nothing else. `key`: the
        sender's CURVE key (its connection's ZAP User-Id), under keys."""
        if isinstance(msg, p.Error):
            self.log_throttle.warning("a peer answered %s: %s %s", msg.id, msg.code, msg.reason)
            return
        if not isinstance(msg, p.Hop):
            raise FlowmeshError(Code.BAD_REQUEST, f"a worker's peer socket takes no {msg.TYPE}")
        run = self.direct.accept(msg, sender=key or "")
        if run is not None:
            self._direct_chunk(run, msg.chunk, msg.tensors)

    def _direct_chunk(self, run: DirectRun, chunk: int, tensors: dict[str, Any]) -> None:
        msg = run.msg
        if msg.id not in self.direct.runs:
            return  # given up (failed, or cancelled by the broker)
        try:
            fut = self.executor.run((msg.model, msg.stage), [tensors])
        except Exception as exc:
            self._direct_failed(run, exc)
            return

        def done(f: asyncio.Future[RunOutput]) -> None:
            if f.cancelled() or f.exception() is not None:
                self._direct_failed(run, f.exception() or FlowmeshError(Code.INTERNAL, "cancelled"))
                return
            if msg.id not in self.direct.runs:
                return
            out = f.result()
            run.compute_s += out.compute_s
            run.wait_s += out.wait_s
            try:
                if run.last:
                    run.outputs[chunk] = out.parts[0]
                else:
                    self._hop(run, chunk, out.parts[0])
            except Exception as exc:
                self._direct_failed(run, exc)
                return
            if self.direct.finished(run) and run.last:
                self._direct_answer(run)

        fut.add_done_callback(done)

    def _hop(self, run: DirectRun, chunk: int, outputs: dict[str, torch.Tensor]) -> None:
        msg = run.msg
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
        hop = p.Hop(
            id=msg.id,
            ticket=msg.ticket,
            model=msg.model,
            stage=msg.stage + 1,
            chunk=chunk,
            tensors={n: t.contiguous() for n, t in outputs.items()},
        )
        send(sock, hop)

    def _direct_answer(self, run: DirectRun) -> None:
        msg = run.msg
        try:
            chunks = [run.outputs[i] for i in range(msg.chunks)]
            names = list(chunks[0])
            merged = {n: torch.cat([c[n] for c in chunks], dim=0) for n in names}
            parts = split_rows(merged, [r for _, r in msg.parts])
        except Exception as exc:
            self._direct_failed(run, exc)
            return
        self.send(
            p.RunResult(
                id=msg.id,
                model=msg.model,
                stage=msg.stage,
                tensors={f"{k}/{n}": t for k, part in enumerate(parts) for n, t in part.items()},
                info={"compute_s": run.compute_s, "wait_s": run.wait_s},
            )
        )

    def _direct_failed(self, run: DirectRun, exc: BaseException) -> None:
        if run.msg.id not in self.direct.runs:
            return  # failed once already: one answer per run
        self.direct.cancel(run.msg.id)
        self._fail(run.msg.id, exc)

    # ------------------------------------------------------------------ training jobs

    def _trainer(self) -> TrainingExecutor:
        if self.trainer is None:
            raise FlowmeshError(
                Code.UNAVAILABLE, f"worker {self.name} takes no training jobs (--train-bytes 0)"
            )
        return self.trainer

    def _check_files(self, spec: ModelSpec) -> None:
        """A spec's files are read only under this worker's roots."""
        if spec.weights is not None:
            self.roots.readable(spec.weights, "weights")
        if spec.hf is not None:
            self.roots.readable(spec.hf, "hf directory")

    def _open_job(self, msg: p.TrainOpen) -> dict[str, Any]:
        """On a thread: build, plan and lay out the job (profiling and weights take a while)."""
        trainer = self._trainer()
        spec = ModelSpec.from_dict(msg.spec)
        check_factory(spec.factory, self.allow, f"worker {self.name}")
        self._check_files(spec)
        resume = None if msg.resume is None else self.roots.readable(msg.resume, "checkpoint")
        if msg.config:
            config = TrainConfig.from_dict(msg.config)
        elif resume is not None:
            config = config_from(read_meta(resume))
        else:
            raise FlowmeshError(Code.BAD_REQUEST, "a training job needs a configuration")
        # Chunk target: half the training bytes, so that one sub-model task computes while the
        # next is brought in.
        target = msg.chunk_bytes or self.train_bytes // 2
        job = open_job(
            msg.job,
            spec,
            config,
            self.device,
            batch=msg.batch,
            target_bytes=target,
            allow=self.allow,
            resume=resume,
        )
        job.batch = msg.batch  # what its memory was planned for: no step may bring more rows
        if spec.weights is not None and resume is None:
            from flowmesh.build import build_reference

            with torch.no_grad():
                state = build_reference(spec, self.allow).state_dict()
                for n, info in job.tensors.items():
                    info.home.copy_(state[n])
        trainer.open(job)
        return {
            "name": job.name,
            "worker": self.name,
            "step": job.step_count,
            "sub_models": job.sub_model_info(),
            "footprint": job.footprint(),
            "host_bytes": job.host_bytes(),
            "largest_task": job.largest_task(),
            "config": config.to_dict(),
        }

    async def _train_open(self, msg: p.TrainOpen) -> None:
        epoch = self._epoch
        try:
            info = await asyncio.get_running_loop().run_in_executor(
                self._deploys, self._open_job, msg
            )
        except Exception as exc:
            self._fail(msg.id, exc)
            return
        if epoch != self._epoch:
            self.log.info("training job opened for a broker that forgot it, closed job=%s", msg.job)
            await self._train_close(p.TrainClose(id=0, job=msg.job), answer=False)
            return
        self._seqs[msg.job] = 0
        self._results[msg.job] = deque(maxlen=KEEP_RESULTS)
        self._running[msg.job] = set()
        self.log.info("training job open job=%s sub_models=%d", msg.job, len(info["sub_models"]))
        self.send(p.TrainOpened(id=msg.id, job=info))

    def _train_step(self, msg: p.TrainStep) -> None:
        trainer = self._trainer()
        last = self._seqs.get(msg.job)
        if last is None:
            raise FlowmeshError(Code.MODEL_NOT_FOUND, f"no training job {msg.job!r} here")
        if msg.seq <= last:
            raise FlowmeshError(
                Code.BAD_REQUEST,
                f"step seq {msg.seq} of {msg.job!r} was already taken (last {last}); not run twice",
            )
        self._seqs[msg.job] = msg.seq
        inputs, targets = _batch(msg.tensors, "a training step")
        fut = asyncio.wrap_future(trainer.submit(msg.job, inputs, targets))
        running = self._running.setdefault(msg.job, set())
        running.add(msg.seq)
        kept = self._results.setdefault(msg.job, deque(maxlen=KEEP_RESULTS))

        def keep(f: asyncio.Future[StepResult]) -> None:
            # Kept for the inventory: a broker that restarted meanwhile replays the answer of a
            # step its client sends again, instead of running it twice.
            running.discard(msg.seq)
            if f.cancelled():
                kept.append({"seq": msg.seq, "code": str(Code.INTERNAL), "reason": "cancelled"})
            elif f.exception() is not None:
                err = p.error_for(f.exception())  # type: ignore[arg-type]
                kept.append({"seq": msg.seq, "code": err.code, "reason": err.reason})
            else:
                r = f.result()
                kept.append(
                    {"seq": msg.seq, "loss": r.loss, "step": r.step, "metrics": dict(r.metrics)}
                )

        fut.add_done_callback(keep)

        def result(r: StepResult) -> p.Message:
            return p.TrainStepResult(
                id=msg.id, job=msg.job, seq=msg.seq, loss=r.loss, step=r.step, metrics=r.metrics
            )

        self._answer_when_done(fut, msg.id, result)

    def _train_eval(self, msg: p.TrainEval) -> None:
        trainer = self._trainer()
        if msg.job not in self._seqs:
            raise FlowmeshError(Code.MODEL_NOT_FOUND, f"no training job {msg.job!r} here")
        inputs, targets = _batch(msg.tensors, "an evaluation")
        # Submitted in arrival order, as steps are: it runs after every step that came first.
        fut = trainer.evaluate(msg.job, inputs, targets)

        def result(r: StepResult) -> p.Message:
            return p.TrainEvalResult(
                id=msg.id, job=msg.job, loss=r.loss, step=r.step, metrics=r.metrics
            )

        self._answer_when_done(asyncio.wrap_future(fut), msg.id, result)

    def _train_save(self, msg: p.TrainSave) -> None:
        trainer = self._trainer()
        job = trainer.jobs.get(msg.job)
        if job is None:
            raise FlowmeshError(Code.MODEL_NOT_FOUND, f"no training job {msg.job!r} here")
        path = self.roots.writable(msg.path, "checkpoint")
        saved: Future[tuple[str, int]] = Future()

        def done(f: Future[Any]) -> None:
            # On the training driver, as the save task ends: the job's step count is the
            # checkpoint's, before any later step of the job finishes.
            exc = f.exception()
            if exc is not None:
                saved.set_exception(exc)
            else:
                saved.set_result((msg.path, job.step_count))  # the path as the client wrote it

        trainer.save(msg.job, path).add_done_callback(done)

        def reply(r: tuple[str, int]) -> p.Message:
            return p.TrainSaved(id=msg.id, job=msg.job, path=r[0], step=r[1])

        self._answer_when_done(asyncio.wrap_future(saved), msg.id, reply)

    async def _train_close(self, msg: p.TrainClose, answer: bool = True) -> None:
        try:
            trainer = self._trainer()
            # On the thread that opens jobs: a close never overtakes the open before it.
            await asyncio.get_running_loop().run_in_executor(
                self._deploys, trainer.close_job, msg.job
            )
        except Exception as exc:
            if answer:
                self._fail(msg.id, exc)
            return
        finally:
            self._seqs.pop(msg.job, None)
            self._results.pop(msg.job, None)
            self._running.pop(msg.job, None)
        if answer:
            self.send(p.TrainClosed(id=msg.id, job=msg.job))


def _batch(tensors: dict[str, Any], what: str) -> tuple[Any, torch.Tensor]:
    """(inputs, targets) of a step or an evaluation: 'inputs' or 'inputs/<name>', 'targets'."""
    # Copies: the request keeps its batch until it ends, and model code may write its input
    # in place; a received frame is read-only.
    t = {name: ref.tensor().clone() for name, ref in tensors.items()}
    targets = t.pop("targets", None)
    if targets is None:
        raise FlowmeshError(Code.BAD_REQUEST, f"{what} needs 'targets'")
    inputs: Any = t.pop("inputs", None)
    if inputs is None:
        inputs = {k.removeprefix("inputs/"): v for k, v in t.items()}
    if not isinstance(inputs, torch.Tensor) and not inputs:
        raise FlowmeshError(Code.BAD_REQUEST, f"{what} needs 'inputs'")
    return inputs, targets
