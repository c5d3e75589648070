"""The worker's training executor: many jobs' sub-model tasks flowing through one device arena.

Plain classes, no sockets: the worker process (later) feeds it `open` / `submit` / `save` /
`close_job` calls and sends back what the returned futures resolve to; the tests drive it
in-process. Four threads, so heavy work never runs where requests arrive:

- the **driver** owns all bookkeeping (the `FlowScheduler`, the arena, the requests): it admits
  tasks when memory frees, plans their copies, starts computes and settles results;
- the **copy lane** brings admitted tasks' bytes from the host tier into their arena extents,
  ordered after the previous users of those bytes (their markers), and starts bringing back
  what each will read of the host tier besides (activations, gradients, a kept forward's
  stash: `TrainingJob.prefetch`), while
- the **compute lane** runs one task at a time (a job's RNG stream is the global generator for
  the duration of its task, so computes do not overlap; copies do overlap them), and
- the **write lane** copies what a computed task wrote (updated parameters and optimizer state,
  gradients, buffers) back to the host tier, while the compute lane goes on with the next task
  (on CUDA the copies run on a stream of their own; the lane waits for them to land). A step
  is answered once its write-backs are in.

Memory flow: a task's extent is freed the moment its compute is *ordered* (handed to the compute
lane), with a marker set once its write-backs are done; the next owner's copy waits on that
marker, never on a host-wide synchronisation (the Waterwave rule, `gpu_worker.memory.Arena`).
A later task's copies of host regions a task wrote wait on the same marker
(`TrainingJob.written`).

One owner of device memory (`gpu_worker.memory.DeviceMemory`): on a worker that also serves, the
arena is shared with the serving executor and inference comes first. Training may borrow any
range serving is not using; when a serving load needs it back, the driver gives back at once
every range of a task that has not started computing (the task is admitted again later, its copy
redone), and admits nothing while serving claims memory. On the CPU stand-in training also
yields compute while serving has a load or a run in flight, and for a moment after (`ServingGate`):
there, copies and computes share cores and the GIL. The driver starts no compute then; a task
already in the compute lane's queue waits before it starts, and a task computing waits at its
yield points (between its blocks, forward and backward, and before its update), so that a request
arriving mid-task waits for at most one block of training, not for the tasks queued.

Accounting: parameters, gradients, optimizer state and buffers of a running task physically live
in its extent. Activations are allocated by torch outside the arena and accounted by the
reservation each extent carries (`TrainingJob.act_bytes`). `resident_peak` is measured on the
lanes: on the CPU stand-in, bytes of extents whose copy has started writing and whose compute
(and write-backs) have not finished, so it exceeds the budget if any two tasks ever use the same
bytes at once. On CUDA the host does not see when the GPU runs a copy (the copy stream waits on
the previous owner's marker, which the host has no reason to wait for): an extent counts from its
copy's enqueueing until its compute is ordered and the extent given back, so the figure says
what the allocator handed out, and the GPU's stream order keeps two owners apart.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.build import build_reference, build_seeded
from flowmesh.modelio.chain import chain_of
from flowmesh.modelio.costs import ModelProfile, human_bytes
from flowmesh.modelio.inputs import declared_inputs, make_inputs
from flowmesh.modelio.plan import Plan, chunk_plan
from flowmesh.modelio.profile import profile
from flowmesh.optimizers import state_count
from flowmesh.reports import OpenedJob, SubModelRow
from flowmesh.spec import BLOCK_ALIGN, DEFAULT_ALLOW, ModelSpec
from flowmesh.threads import torch_pool
from gpu_worker.device import TRAIN_LANE, TRAIN_WRITE_LANE, Device
from gpu_worker.memory import DeviceMemory, Extent, OutOfSpace
from gpu_worker.model_code import building_model
from gpu_worker.resident_room import NO_ROOM
from gpu_worker.train_checkpoint import load_checkpoint, read_meta, save_checkpoint
from gpu_worker.train_config import LOSSES, TrainConfig
from gpu_worker.train_job import Inputs, StepResult, TaskResult, TrainingJob, no_pause
from gpu_worker.train_layout import CopyPlan
from gpu_worker.train_scheduler import ANY, FlowScheduler, Phase, Task

__all__ = [
    "LOSSES",
    "FlowScheduler",
    "StepResult",
    "TrainConfig",
    "TrainingExecutor",
    "TrainingJob",
    "config_from",
    "load_checkpoint",
    "open_job",
    "read_meta",
    "reservations",
    "save_checkpoint",
    "start_job",
    "step_answer",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(eq=False)
class _Admission:
    """One grant of memory to a task: given back whole if serving reclaims it before it runs."""

    extent: Extent | None
    base: int
    nbytes: int
    plan: CopyPlan = field(default_factory=CopyPlan)
    markers: list[Any] = field(default_factory=list)
    # Set on the copy lane after everything its copy wrote into the extent (the plan's copies
    # and the stashes brought back with them), or once it made none: an extent given back
    # unused is freed after it.
    copied: Any = None
    ready: list[Any] = field(default_factory=list)
    # Markers of the write-backs to host regions its copies read (`TrainingJob.written`).
    waits: list[Any] = field(default_factory=list)
    counted: bool = False  # its bytes count as resident (its copy started writing)
    cancelled: bool = False  # it will not run: its copy, if not started, must not start
    written: bool = False  # its write-backs went to the write lane, which settles it
    settled: bool = False  # its write-backs are in the host tier, its extent's marker set
    failure: BaseException | None = None  # its write-backs failed
    # Driver calls to make once it is settled: a step's answer waits for its write-backs.
    on_settled: list[Callable[[], None]] = field(default_factory=list)


class ServingGate:
    """When training gives way to serving (the CPU stand-in's rule; see the module docstring).

    Held while serving is busy (a load or a run in flight, or a claim on memory) and for
    `resume_after_s` after it went quiet: a run's answer is sent after the run ends, and a
    client's next request often follows within milliseconds; a training task started in that
    gap holds the core and the GIL when it arrives. (scripts/bench_colocated.py on the CPU
    stand-in: with 2 ms, inference p50 was still 1.5-2.7x of serving alone beside four jobs;
    with 5 ms, 0.6-0.9x, training at 0.4-0.7x of its steps/s alone; BENCHMARKS.md.) `pause()` (from
    `task_pauses`) is a yield point on a lane: it waits while the gate is held.

    A task in the lane or computing has already given its memory back (freed with its marker):
    a serving load placed there waits for the task to finish, and keeps serving busy meanwhile.
    So the waits inside one task add up to at most `max_pause_s`, after which the task runs to
    its end; serving then waits for one task, as it did before there were yield points.

    `clock`: the executor's; the decisions are taken on it (a test freezes or moves it), the
    waits between looks at it are real ones, of at most `poll_s`.
    """

    def __init__(
        self,
        memory: DeviceMemory,
        enabled: bool,
        clock: Callable[[], float],
        *,
        resume_after_s: float = 0.005,
        max_pause_s: float = 0.1,
        poll_s: float = 0.05,
    ) -> None:
        self.memory = memory
        self.enabled = enabled
        self.clock = clock
        self.resume_after_s = resume_after_s
        self.max_pause_s = max_pause_s
        self.poll_s = poll_s
        self._cond = threading.Condition()
        self._quiet_at = -math.inf  # when serving was last seen going quiet, on `clock`
        # The lanes (thread names) waiting at a yield point now: what a test waits for.
        self.waiting: list[str] = []
        self.counters = {"pauses": 0, "pause_s": 0.0, "pause_budget_spent": 0}
        self.closed = False
        memory.wake_training.append(self.wake)

    def wake(self) -> None:
        """Serving's state changed (a `DeviceMemory.wake_training` listener, on serving's
        thread): note when it went quiet and let waiting yield points look again."""
        with self._cond:
            if not self.memory.serving_busy():
                self._quiet_at = self.clock()
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def held_for(self) -> float | None:
        """None when training may compute now; else how long it is held at least (inf while
        serving is busy)."""
        if not self.enabled or self.closed:
            return None
        if self.memory.serving_busy():
            return math.inf
        left = self._quiet_at + self.resume_after_s - self.clock()
        return left if left > 0 else None

    def task_pauses(self) -> _TaskPauses:
        """The yield point of one task (its waits share one `max_pause_s`)."""
        return _TaskPauses(self)

    def _pause(self, budget: float) -> float:
        """Wait while held, at most `budget`; returns the time waited."""
        if budget <= 0 or self.held_for() is None:  # the common case: no lock taken
            return 0.0
        t0 = self.clock()
        me = threading.current_thread().name
        with self._cond:
            self.waiting.append(me)
            self.counters["pauses"] += 1
            try:
                while (held := self.held_for()) is not None:
                    remaining = budget - (self.clock() - t0)
                    if remaining <= 0:
                        self.counters["pause_budget_spent"] += 1
                        break
                    self._cond.wait(min(held, remaining, self.poll_s))
            finally:
                self.waiting.remove(me)
        spent = self.clock() - t0
        self.counters["pause_s"] += spent
        return spent


class _TaskPauses:
    """One task's yield point (`ServingGate.task_pauses`): what it waited, in `spent`."""

    def __init__(self, gate: ServingGate) -> None:
        self.gate = gate
        self.spent = 0.0

    def __call__(self) -> None:
        self.spent += self.gate._pause(self.gate.max_pause_s - self.spent)


@dataclass
class _Request:
    job: str
    id: int
    kind: str  # "step" | "eval" | "save"
    future: Future[Any]
    t0: float  # when it was queued, on the executor's clock
    tasks: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    memory_wait_s: float = 0.0  # its tasks' waits for arena memory (`_mark_waiting`)


class TrainingExecutor:
    """Runs training steps of many jobs on one device (see the module docstring)."""

    def __init__(
        self,
        device: Device,
        *,
        prefetch: int = 1,
        max_skips: int = 8,
        queue_computes: int = 2,
        memory: DeviceMemory | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """`clock`: seconds on a monotonic clock, for the requests' and computes' times."""
        self.device = device
        self.clock = clock
        # Computes handed to the (FIFO) compute lane ahead of time, so it never idles while the
        # driver settles the previous one; only chain heads run, so they are of other jobs.
        self.queue_computes = max(1, queue_computes)
        # One owner of device memory: a worker that also serves passes the memory its serving
        # executor allocates from; alone, training owns the whole arena.
        self.memory = (
            memory if memory is not None else DeviceMemory(0, device.budget_bytes, BLOCK_ALIGN)
        )
        if self.memory.capacity > device.budget_bytes:
            raise ValueError("device memory larger than the device's arena")
        self.arena = self.memory.arena
        # See the module docstring: on the CPU stand-in, computes wait for serving to be idle.
        self.yield_compute = device.kind == "cpu" and self.memory.serving_bytes > 0
        self.gate = ServingGate(self.memory, self.yield_compute, clock)
        self._resume_in: float | None = None  # the driver looks again then (the gate's delay)
        self.sched = FlowScheduler(prefetch, max_skips)
        self.jobs: dict[str, TrainingJob] = {}
        self._requests: dict[tuple[str, int], _Request] = {}
        self._ids = itertools.count(1)
        self._events: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._copy = torch_pool(1, "train-copy")
        self._compute = torch_pool(1, "train-compute")
        # Write-backs to the host tier after each compute, off the compute lane (`_write_back`):
        # on the CPU stand-in this thread copies; on CUDA the compute lane enqueues them on a
        # copy stream, and this thread waits for them to land before it settles the task.
        self._write = torch_pool(1, "train-write")
        self._computing = 0
        self._lock = threading.Lock()
        self.resident = 0
        self.resident_peak = 0
        self.counters = {
            "tasks": 0,
            "steps": 0,
            "step_errors": 0,
            "evals": 0,
            "bytes_in": 0,
            "bytes_out": 0,
            "compute_s": 0.0,
            # Interleaving: tasks given memory, tasks handed to the compute lane, and how often
            # the lane went from one job's task to another job's (0 for one job at a time).
            "tasks_admitted": 0,
            "tasks_started": 0,
            "job_switches": 0,
            # Tasks whose memory serving took back before they ran (admitted again later).
            "tasks_reclaimed": 0,
            # What the copy lane brought back from the host tier ahead of the tasks reading it,
            # besides their extents' bytes (`TrainingJob.prefetch`; on a CPU stand-in, where
            # a stash stays where it is, what it would have brought).
            "stash_bytes_prefetched": 0,
        }
        self._last_job: str | None = None
        self._closed = False
        self._driver = threading.Thread(target=self._loop, name="train-driver", daemon=True)
        self._driver.start()
        # A pipelined stage's `hold` waiting for training's tasks to leave its range.
        self._range_freed = threading.Event()
        # The memory's listeners this executor adds (`close` takes them off again: the memory
        # may be the worker's, and outlive it).
        self._listeners: list[tuple[str, Callable[[], None]]] = [
            ("on_claim", lambda: self._post_quiet(self._reclaim)),
            ("wake_training", lambda: self._post_quiet(_nothing)),
            ("wake_training", self._range_freed.set),
            ("wake_training", self.gate.wake),
        ]
        for where, fn in self._listeners[:3]:  # the gate added its own
            getattr(self.memory, where).append(fn)

    # ------------------------------------------------------------------ public API

    def open(self, job: TrainingJob) -> None:
        """Take a job in; its steps may be submitted from now on."""
        if job.device is not self.device:
            raise FlowmeshError(Code.INTERNAL, f"job {job.name!r} was laid out for another device")
        need = job.largest_task()
        room, held = self.memory.task_room(), self.memory.held_bytes
        if need > room:
            beside = f" left beside the {human_bytes(held)} pipelined stages hold" if held else ""
            raise FlowmeshError(
                Code.TOO_BIG,
                f"job {job.name!r}: its largest sub-model task needs {human_bytes(need)}, over "
                f"the {human_bytes(room)} of the device's training bytes{beside}; plan "
                "smaller sub-models (a lower chunk target) or a smaller batch",
            )
        self._call(lambda: self._open(job))

    def hold(self, what: str, nbytes: int, timeout: float) -> Extent:
        """A range of `nbytes` of the arena for the life of a pipelined stage (`what` names it),
        at the top of training's part (`DeviceMemory.hold`): waits up to `timeout` seconds for
        training's tasks to leave it. Refused (TOO_BIG) when it would leave too little for a
        job's largest task, or for the range itself."""
        held = self.memory.held_bytes
        room = self.memory.train_bytes - held - self.memory.round(nbytes)
        jobs = list(self.jobs.values())
        need = max((j.largest_task() for j in jobs), default=0)
        if room < need:
            beside = f" beside the {human_bytes(held)} other pipelined stages hold" if held else ""
            under = ""
            if jobs:
                which = max(jobs, key=lambda j: j.largest_task()).name
                under = f", under the {human_bytes(need)} job {which!r} needs for its largest task"
            raise FlowmeshError(
                Code.TOO_BIG,
                f"{what} holds {human_bytes(nbytes)} of the device's "
                f"{human_bytes(self.memory.train_bytes)} training bytes{beside}, which leaves "
                f"{human_bytes(room) if room > 0 else 'nothing'}{under}",
            )
        deadline = time.monotonic() + timeout
        try:
            while True:
                self._range_freed.clear()
                try:
                    ext = self.memory.hold(nbytes)
                except OutOfSpace as exc:  # (the check above keeps it within training's part)
                    raise FlowmeshError(Code.TOO_BIG, f"{what}: {exc}") from None
                if ext is not None:
                    for m in ext.after:  # the last tasks there may still be running (on a GPU)
                        m.wait()
                    return ext
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise FlowmeshError(
                        Code.UNAVAILABLE,
                        f"{what}: training tasks on this worker kept the {human_bytes(nbytes)} "
                        f"it holds busy for {timeout:.0f} s",
                    )
                self._range_freed.wait(min(left, 0.5))
        except BaseException:
            self.memory.unfence()  # its range is training's tasks' again
            raise

    def release(self, ext: Extent) -> None:
        """A `hold`'s range back, once whatever its stage queued on the device has run."""
        self.device.sync()
        self.memory.release(ext, [])
        self._post_quiet(_nothing)  # tasks waiting for memory may fit now

    def submit(self, name: str, inputs: Inputs, targets: torch.Tensor) -> Future[StepResult]:
        """Queue one training step of job `name`; steps of a job run strictly in order."""

        def plan(job: TrainingJob, rid: int) -> list[Task]:
            job.begin_step(rid, inputs, targets)
            return job.plan_step(rid)

        return self._queue(name, "step", plan)

    def step(
        self, name: str, inputs: Inputs, targets: torch.Tensor, timeout: float | None = None
    ) -> StepResult:
        return self.submit(name, inputs, targets).result(timeout)

    def evaluate(self, name: str, inputs: Inputs, targets: torch.Tensor) -> Future[StepResult]:
        """Queue an evaluation of job `name` (loss and metrics, nothing updated) after the steps
        submitted before it; its result's `step` is the number of steps it saw applied."""

        def plan(job: TrainingJob, rid: int) -> list[Task]:
            job.begin_eval(rid, inputs, targets)
            return job.plan_eval(rid)

        return self._queue(name, "eval", plan)

    def save(self, name: str, path: str | os.PathLike[str]) -> Future[Path]:
        """Checkpoint job `name` after the steps submitted before this call."""
        return self._queue(name, "save", lambda job, rid: job.plan_save(rid, Path(path)))

    def _queue(
        self, name: str, kind: str, plan: Callable[[TrainingJob, int], list[Task]]
    ) -> Future[Any]:
        """Plan request `kind` of job `name` on the caller's thread (a bad input fails its
        future at once) and hand its tasks to the driver, behind the job's earlier requests."""
        fut: Future[Any] = Future()
        job = self.jobs.get(name)
        if job is None:
            fut.set_exception(FlowmeshError(Code.MODEL_NOT_FOUND, f"no training job {name!r}"))
            return fut
        rid = next(self._ids)
        try:
            tasks = plan(job, rid)
        except FlowmeshError as exc:
            fut.set_exception(exc)
            return fut
        self._post(lambda: self._push(_Request(name, rid, kind, fut, self.clock()), tasks))
        return fut

    def close_job(self, name: str) -> None:
        """Drop a job: its queued requests fail, its memory returns to the arena at once."""
        self._call(lambda: self._close_job(name))

    def stats(self) -> dict[str, Any]:
        jobs = {
            name: {
                "step": job.step_count,
                "last_loss": job.last_loss,
                "pending_tasks": self.sched.pending(name),
                "sub_models": job.sub_model_info(),
                "footprint": job.footprint(),
                "broken": job.broken,
            }
            for name, job in list(self.jobs.items())
        }
        return {
            **self.counters,
            "budget_bytes": self.memory.train_bytes,
            "arena_bytes": self.memory.capacity,
            "reserved_bytes": self.memory.used["training"],
            "reserved_peak": self.memory.peak["training"],
            "resident_bytes": self.resident,
            "resident_peak": self.resident_peak,
            # Training's waits for serving at its yield points (`ServingGate`).
            "yield_pauses": self.gate.counters["pauses"],
            "yield_pause_s": self.gate.counters["pause_s"],
            # Stashes kept on the device beside the arena, and those copied to the host tier
            # (`gpu_worker.resident_room`; zero where stashes are never copied).
            **(room.stats() if (room := self.device.resident_room) else NO_ROOM),
            "jobs": jobs,
        }

    def close(self) -> None:
        if self._closed:
            return
        with self._lock:  # an answer posted under the lock before this goes before the None
            self._closed = True
        self.gate.close()
        self._events.put(None)
        self._driver.join(timeout=10)
        if self._driver.is_alive():
            # Still in an event (a job's close waiting for its write-backs): it finds the
            # lanes shut below and marks what it would have handed them (`_start_copy`).
            log.warning("training driver still busy after 10 s at close; closing its lanes")
        # Computes queued are not cancelled but run, each returning at once (`_closed`), so
        # that their markers are set: a copy in progress may be waiting on one, into the range
        # that compute gave back.
        self._compute.shutdown(wait=True)
        self._write.shutdown(wait=True)  # every write queued runs: a copy may wait on its marker
        self._copy.shutdown(wait=True, cancel_futures=True)
        if not self._driver.is_alive():  # (else it may still be reading them)
            # Jobs still open let go of, their steps' kept graphs too (`drop_steps`).
            for job in self.jobs.values():
                job.drop_steps()
            self.jobs.clear()
        for where, fn in self._listeners:
            # A new list, not this one changed: another thread may be calling its listeners.
            setattr(self.memory, where, [f for f in getattr(self.memory, where) if f != fn])

    def __enter__(self) -> TrainingExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ driver thread

    def _post(self, fn: Callable[[], None]) -> None:
        if self._closed:
            raise FlowmeshError(Code.UNAVAILABLE, "the training executor is closed")
        self._events.put(fn)

    def _post_quiet(self, fn: Callable[[], None]) -> None:
        """Post from a memory event (another executor's thread): never raise there."""
        if not self._closed:
            self._events.put(fn)

    def _call(self, fn: Callable[[], T]) -> T:
        done: Future[T] = Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except BaseException as exc:
                done.set_exception(exc)

        self._post(run)
        return done.result()

    def _loop(self) -> None:
        while True:
            wait, self._resume_in = self._resume_in, None
            try:
                fn = self._events.get(timeout=wait)
            except queue.Empty:
                fn = _nothing  # the gate's delay after serving went quiet is over: pump
            if fn is None:
                break
            try:
                fn()
                self._pump()
            except Exception as exc:  # a bookkeeping bug: fail everything loudly, keep running
                log.exception("training driver failed")
                self._fail_all(FlowmeshError(Code.INTERNAL, f"training driver: {exc!r}"))
            # Not kept while waiting for the next event: a callback holds its task, and the
            # task its job, which a close just let go of.
            fn = None
        self._fail_all(FlowmeshError(Code.UNAVAILABLE, "the training executor was closed"))

    def _open(self, job: TrainingJob) -> None:
        if job.name in self.jobs:
            raise FlowmeshError(Code.MODEL_EXISTS, f"training job {job.name!r} is already open")
        self.sched.add_job(job.name)
        job.defer_writes = True
        self.jobs[job.name] = job

    def _push(self, request: _Request, tasks: list[Task]) -> None:
        if request.job not in self.jobs:
            request.future.set_exception(
                FlowmeshError(Code.MODEL_NOT_FOUND, f"training job {request.job!r} was closed")
            )
            return
        for t in tasks:
            t.payload["job"] = self.jobs[request.job]
        self._requests[(request.job, request.id)] = request
        self.sched.push(tasks)

    def _try_alloc(self, task: Task) -> bool:
        if task.nbytes == 0:
            task.payload["adm"] = _Admission(None, 0, 0)
            return True
        ext = self.memory.alloc_training(task.nbytes)
        if ext is None:
            return False
        since = task.payload.pop("waiting_since", None)
        if since is not None:
            waited = task.payload.get("memory_wait_s", 0.0) + self.clock() - since
            task.payload["memory_wait_s"] = waited
        task.payload["adm"] = _Admission(ext, ext.offset, task.nbytes)
        return True

    def _mark_waiting(self) -> None:
        """Start the memory-wait clock of every job whose head task is still without memory
        after an admission round: the job's step can go no further until that task is given
        memory (it failed to fit, or a starved task holds admissions back, or serving claims
        memory). Look-ahead tasks are not counted: while they wait, the head still runs. A
        task becomes a head only on an event, and a round follows every event, so the clock
        starts on the round it first waited in; `_try_alloc` stops it."""
        now: float | None = None
        for chain in self.sched.chains.values():
            head = chain[0] if chain else None
            if head is None or head.phase is not Phase.PENDING or "waiting_since" in head.payload:
                continue
            now = self.clock() if now is None else now
            head.payload["waiting_since"] = now

    def _pump(self) -> None:
        for task in self.sched.admit(self._try_alloc):
            self.counters["tasks_admitted"] += 1
            self._start_copy(task)
        self._mark_waiting()
        # The gate is looked at once per round: the tasks handed to the lane together go in
        # together, even if the first of them makes serving busy before the next is handed
        # (those wait at their first yield point, `_do_compute`).
        held = self.gate.held_for()
        if held is not None:
            # Busy: woken by `wake_training` when serving goes quiet; quiet since less than
            # the gate's delay: the loop looks again when it is over.
            if held != math.inf:
                self._resume_in = held
            return
        while self._computing < self.queue_computes:
            task = self.sched.next_runnable()
            if task is None:
                break
            self._start_compute(task)

    def _reclaim(self) -> None:
        """Serving claims memory: give back every range of a task that is not computing yet."""
        for task in self.sched.unadmit():
            adm: _Admission = task.payload.pop("adm")
            # Counted before the memory goes: the load it wakes (on another thread) may look.
            self.counters["tasks_reclaimed"] += 1
            self._give_back(adm, reclaimed=True)

    def _give_back(self, adm: _Admission, reclaimed: bool = False) -> None:
        with self._lock:
            adm.cancelled = True
            if adm.counted:
                adm.counted = False
                self.resident -= adm.nbytes
        if adm.extent is not None:
            ext, adm.extent = adm.extent, None
            # Ordered after its copy (if it ran): the next owner never races its writes.
            after = [*adm.markers, *([adm.copied] if adm.copied is not None else [])]
            self.memory.free(ext, after, "training", reclaimed)

    def _start_copy(self, task: Task) -> None:
        job: TrainingJob = task.payload["job"]
        adm: _Admission = task.payload["adm"]
        try:
            adm.plan = job.copy_plan(task, adm.base)
        except Exception as exc:
            self._fail_request(task, self._internal(exc))
            return
        # Blocking: on CUDA the lanes wait on them asleep, not spinning a core (`CudaMarker`).
        adm.markers = [self.device.new_marker(blocking=True) for _ in adm.plan.copies]
        adm.copied = self.device.new_marker(blocking=True)
        # The scheduler admits a task only once every earlier task writing a host region it
        # reads has finished computing; the copies wait for those write-backs too.
        keys = job.written if ANY in task.reads else task.reads
        adm.waits = [m for k in keys if (m := job.written.get(k)) is not None and not m.done()]
        try:
            fut = self._copy.submit(self._do_copy, task, adm)
        except RuntimeError:  # closing, and the driver late (`close`): the lane takes no more
            for m in [*adm.markers, adm.copied]:  # whoever waits on these bytes may go
                self.device.mark_copied(m, lane=TRAIN_LANE)
            raise
        # Quiet: at close the lanes' last work ends after the driver (nothing left to tell).
        fut.add_done_callback(
            lambda f, t=task: self._post_quiet(lambda: self._on_copied(t, adm, f))
        )

    def _do_copy(self, task: Task, adm: _Admission) -> None:
        """Copy lane: order after the extent's previous users, then bring the bytes in."""
        try:
            self._copy_in(task, adm)
        finally:
            # After whatever it queued (the stand-in's copies are done): an extent given back
            # unused, even mid-way, is given to its next owner only after them.
            if adm.copied is not None and not adm.copied.recorded():
                self.device.mark_copied(adm.copied, lane=TRAIN_LANE)

    def _copy_in(self, task: Task, adm: _Admission) -> None:
        ext, plan, markers = adm.extent, adm.plan, adm.markers
        after = [*(ext.after if ext is not None else ()), *adm.waits]
        if self.device.kind == "cpu":
            for m in after:  # the stand-in copies on this thread: ordering is waiting
                if adm.cancelled:  # serving took its memory back: no need to wait for writes
                    break
                m.wait()
            after = []
        with self._lock:
            if adm.cancelled:
                for m in markers:  # no copy was made: whoever waits on them may go
                    self.device.mark_copied(m, lane=TRAIN_LANE)
                return
            if adm.nbytes:
                adm.counted = True
                self.resident += adm.nbytes
                self.resident_peak = max(self.resident_peak, self.resident)
        arena = self.device.arena
        brought: list[Any] = []
        try:
            for (offset, src), marker in zip(plan.copies, markers, strict=True):
                self.device.copy_in(
                    arena[offset : offset + src.numel()], src, after, marker, lane=TRAIN_LANE
                )
                after = []
            # What the task reads from the host tier besides its extent's bytes (activations,
            # gradients, a kept forward's stash): on its way too, under the compute before it
            # (not for a task that will not run from here: serving took its memory back).
            if not adm.cancelled:
                job: TrainingJob = task.payload["job"]
                prefetched, brought = job.prefetch(task, adm.base, plan, arena, after)
                with self._lock:
                    self.counters["stash_bytes_prefetched"] += prefetched
        except BaseException:
            for m in markers:  # whoever waits on these bytes must not wait forever
                if not m.recorded():  # (a recorded one is ordered after its copy already)
                    self.device.mark_copied(m, lane=TRAIN_LANE)
            raise
        adm.ready = [*markers, *brought] if markers else [*after, *brought]

    def _on_copied(self, task: Task, adm: _Admission, fut: Future[None]) -> None:
        if task.payload.get("adm") is not adm:
            return  # serving took its memory back before it ran; it will be admitted again
        exc = fut.exception()
        if task.phase is Phase.DROPPED:
            self._release(task)
            return
        if exc is not None:
            self._fail_request(task, self._internal(exc))
            return
        self.sched.copied(task)

    def _start_compute(self, task: Task) -> None:
        self.sched.started(task)
        self._computing += 1
        self.counters["tasks_started"] += 1
        if self._last_job is not None and task.job != self._last_job:
            self.counters["job_switches"] += 1
        self._last_job = task.job
        done = self.device.new_marker(blocking=True)
        adm: _Admission = task.payload["adm"]
        if adm.extent is not None:
            # Its last use is now ordered: the bytes go back at once, and whoever takes them
            # next waits on this compute's marker.
            ext, adm.extent = adm.extent, None
            self.memory.free(ext, [done], "training")
            if self.device.kind == "cuda":  # the count follows the allocator (module docstring)
                with self._lock:
                    if adm.counted:
                        adm.counted = False
                        self.resident -= adm.nbytes
        try:
            fut = self._compute.submit(self._do_compute, task, adm, done)
        except RuntimeError:  # closing, and the driver late (`close`): the extent's next owner
            self.device.mark_done(done)  # must not wait for a compute that will never run
            raise
        fut.add_done_callback(lambda f, t=task: self._post_quiet(lambda: self._on_computed(t, f)))

    def _do_compute(self, task: Task, adm: _Admission, done: Any) -> TaskResult:
        job: TrainingJob = task.payload["job"]
        t0 = self.clock()
        # Queued before serving got busy: it waits here, and at its yield points inside.
        pause = self.gate.task_pauses()
        marked = False
        try:
            if not self._closed:
                pause()
            # Without a gate (nothing served beside training) every pause is a no-op: none is set.
            job.pause = pause if self.gate.enabled else no_pause
            with self.device.compute():
                # First, even for a task that will not run: its marker, set on this lane, is
                # then ordered after the copies into its extent, which its next owner may be.
                for m in adm.ready:
                    m.order_current()
                if adm.cancelled or self._closed:  # its job (or the executor) was closed
                    return TaskResult()
                try:
                    result = job.run(task, adm.base, adm.plan, self.device.arena)
                finally:
                    writes = job.take_writes()
                    if writes:
                        self._write_back(task, job, adm, done, writes)
                if self.device.kind == "cuda":
                    if not adm.written:
                        # Recorded as soon as the task's kernels are queued, not once they ran:
                        # the next owner of its extent (freed with it) queues its copy at once,
                        # the GPU ordering it after them, while this thread waits below. (On
                        # CUDA the resident count is the allocator's: nothing to uncount first.)
                        self.device.mark_done(done)
                        marked = True
                    # The next task's host reads (kept inputs, gradients) happen on the host;
                    # the thread sleeps meanwhile, a task's kernels long.
                    self.device.wait_computed()
            # What the task's activation policy cost, its waits for serving left out.
            job.observe(task, self.clock() - t0 - pause.spent)
            return result
        finally:
            if not adm.written:
                self._settle(adm, done, mark=not marked)
            job.pause = no_pause
            self.counters["compute_s"] += self.clock() - t0 - pause.spent

    def _settle(self, adm: _Admission, done: Any, mark: bool = True) -> None:
        """A task's extent is done with: uncounted, its deferred answers posted, then its marker
        set (`mark`; CUDA's write-backs recorded it on their stream already). The next user of
        these bytes counts itself once the marker lets its copy start, and must never see this
        task still counted; an answer is queued before whatever the marker lets go."""
        with self._lock:
            if adm.counted:
                adm.counted = False
                self.resident -= adm.nbytes
            adm.settled = True
            then, adm.on_settled = adm.on_settled, []
            if not self._closed:  # under the lock: before close's None, so the driver runs it
                for fn in then:
                    self._events.put(fn)
                then = []
        if mark:
            self.device.mark_done(done)
        for fn in then:  # the driver is gone: answer from here
            fn()

    def _write_back(
        self,
        task: Task,
        job: TrainingJob,
        adm: _Admission,
        done: Any,
        writes: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Copy a computed task's write-backs to the host tier on the write lane, then settle
        its extent (`done`); until then whatever reads the regions it wrote waits on `done`
        (`TrainingJob.written`), and the extent's next user too (it was freed with `done`).
        The write lane is one thread, first in first out: a task settled means every earlier
        task's write-backs are in (`job.last_write`)."""
        adm.written = True
        job.last_write = adm
        for key in task.writes:
            job.written[key] = done

        def failed(exc: BaseException) -> None:
            adm.failure = exc
            job.broken = f"a write-back to the host tier failed: {exc}"
            log.error("job %s: a write-back to the host tier failed: %r", job.name, exc)

        if self.device.kind == "cuda":
            try:  # enqueued on the write stream; the compute lane goes on at once
                self.device.copy_out(writes, done, lane=TRAIN_WRITE_LANE)
            except BaseException as exc:
                failed(exc)
                # copy_out recorded `done` on the write stream after what it enqueued, unless
                # it failed before (no stream): then it is marked here, nothing to wait for.
                self._settle(adm, done, mark=not done.recorded())
                return

            def landed() -> None:  # the pinned homes hold them: answer, uncount
                try:
                    done.wait()
                finally:
                    # `writes` held until now: a home's pinned range must not be handed out
                    # again while a copy is landing in it.
                    writes.clear()
                    self._settle(adm, done, mark=False)

            self._write.submit(landed)
            return

        def write() -> None:  # the stand-in's copies are copy_ calls on the lane's thread
            try:
                for home, arena_bytes in writes:
                    home.copy_(arena_bytes)
            except BaseException as exc:
                failed(exc)
            finally:
                self._settle(adm, done)

        try:
            self._write.submit(write)
        except RuntimeError:  # the executor is closing: its write lane takes nothing more
            write()

    def _on_computed(self, task: Task, fut: Future[TaskResult]) -> None:
        self._computing -= 1
        request = self._requests.get((task.job, task.request))
        exc = fut.exception()
        if request is None:  # its job was closed while it ran
            self.sched.finished(task)
            return
        if exc is not None:
            self.sched.finished(task)
            self._fail_request(task, exc if isinstance(exc, FlowmeshError) else self._internal(exc))
            return
        result = fut.result()
        self.sched.finished(task)
        plan: CopyPlan = task.payload["adm"].plan
        request.tasks += 1
        request.bytes_in += plan.bytes_in
        request.bytes_out += result.bytes_out
        request.memory_wait_s += task.payload.get("memory_wait_s", 0.0)
        self.counters["tasks"] += 1
        self.counters["bytes_in"] += plan.bytes_in
        self.counters["bytes_out"] += result.bytes_out
        if not task.last:
            return
        del self._requests[(task.job, task.request)]
        job: TrainingJob = task.payload["job"]
        if request.kind == "save":
            request.future.set_result(result.value)
            return
        if request.kind == "eval":
            evaluated = job.finish_eval(request.id)
            evaluated.metrics["seconds"] = self.clock() - request.t0
            self.counters["evals"] += 1
            request.future.set_result(evaluated)
            return
        step = job.finish_step(request.id)
        step.metrics.update(
            tasks=float(request.tasks),
            bytes_in=float(request.bytes_in),
            bytes_out=float(request.bytes_out),
            memory_wait_s=request.memory_wait_s,
            seconds=self.clock() - request.t0,
        )

        last: _Admission | None = job.last_write

        def answer() -> None:
            if last is not None and last.failure is not None:
                self.counters["step_errors"] += 1
                request.future.set_exception(self._internal(last.failure))
                return
            self.counters["steps"] += 1
            request.future.set_result(step)

        # Answered once its write-backs are in the host tier (those of every task before it:
        # the write lane is first in first out), for whoever reads them next.
        if last is not None:
            with self._lock:
                if not last.settled:
                    last.on_settled.append(answer)
                    return
        answer()

    def _release(self, task: Task) -> None:
        """Give back the memory of a task that will not run."""
        adm: _Admission | None = task.payload.get("adm")
        if adm is not None:
            self._give_back(adm)

    def _fail_request(self, task: Task, error: FlowmeshError) -> None:
        request = self._requests.pop((task.job, task.request), None)
        for held in self.sched.drop_request(task.job, task.request):
            self._release(held)
        if task.phase is not Phase.DONE:
            self._release(task)
            task.phase = Phase.DROPPED
        if request is None:
            return
        job = self.jobs.get(task.job)
        if request.kind == "step" and job is not None:
            job.abort_step(request.id, error.reason)
            self.counters["step_errors"] += 1
        elif request.kind == "eval" and job is not None:
            job.abort_eval(request.id)
        request.future.set_exception(error)

    def _close_job(self, name: str) -> None:
        if name not in self.jobs:
            raise FlowmeshError(Code.MODEL_NOT_FOUND, f"no training job {name!r}")
        for t in self.sched.chains.get(name, ()):
            if t.phase is Phase.RUNNING:
                t.payload["adm"].cancelled = True
        for held in self.sched.remove_job(name):
            self._release(held)
        for key in [k for k in self._requests if k[0] == name]:
            self._requests.pop(key).future.set_exception(
                FlowmeshError(Code.BAD_REQUEST, f"training job {name!r} was closed")
            )
        job = self.jobs.pop(name)
        # Its host tier goes back once it is dropped: not while write-backs are landing in it.
        job.wait_written()
        job.defer_writes = False
        # Its steps' stashes go on the compute lane, after its compute there (one thread, in
        # order), which may still be reading them.
        try:
            self._compute.submit(job.drop_steps)
        except RuntimeError:  # the lanes are shut (the executor closing): nothing runs now
            job.drop_steps()

    def _fail_all(self, error: FlowmeshError) -> None:
        for key in list(self._requests):
            request = self._requests.pop(key)
            if not request.future.done():
                request.future.set_exception(error)

    @staticmethod
    def _internal(exc: BaseException) -> FlowmeshError:
        if isinstance(exc, FlowmeshError):
            return exc
        return FlowmeshError(Code.INTERNAL, f"{type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------- jobs from specs


def _nothing() -> None:
    """A driver event that only makes it pump (memory or serving state changed)."""


def reservations(
    profile: ModelProfile, ranges: Iterable[tuple[int, int]], micro_batch: int
) -> tuple[list[int], list[int]]:
    """Activation bytes a (backward, forward) task of each sub-model holds besides its tensors.

    Backward: what autograd saves for the sub-model's blocks at the micro-batch size, plus the
    gradients entering and leaving it; forward (no grad): its input and output. The boundary term
    is the planner's margin (`modelio.planners.chunk_footprints`), so an extent reserves what
    the chunk plan counted.
    """
    margin = 2 * max(b.out_bytes_per_sample for b in profile.blocks) * micro_batch
    act, fwd = [], []
    for a, b in ranges:
        saved = sum(blk.saved_bytes_per_sample for blk in profile.blocks[a:b])
        act.append(saved * micro_batch + margin)
        fwd.append(margin)
    return act, fwd


def open_job(
    name: str,
    spec: ModelSpec,
    config: TrainConfig,
    device: Device,
    *,
    batch: int,
    target_bytes: int | None = None,
    plan: Plan | None = None,
    seq_len: int = 1,
    allow: Iterable[str] = DEFAULT_ALLOW,
    resume: str | os.PathLike[str] | None = None,
) -> TrainingJob:
    """A job for `spec` with seeded weights: profiled at its micro-batch, cut into sub-models
    under `target_bytes` (or by a given chunk `plan`), optionally resumed from a checkpoint."""
    if batch % config.accumulate:
        raise FlowmeshError(
            Code.BAD_REQUEST, f"batch {batch} does not split into {config.accumulate} micro-batches"
        )
    micro = batch // config.accumulate
    allow = tuple(allow)
    if plan is None and target_bytes is None:
        raise FlowmeshError(Code.BAD_REQUEST, "give a chunk target in bytes or a chunk plan")
    # Profiling, seeding and tracing touch process-wide state that running model code uses
    # (torch's default generator, torch.fx's patch of nn.Module.__call__; `model_code`).
    with building_model():
        # (A training forward may return a tuple: its loss takes the first tensor.)
        prof = profile(spec, batch=micro, seq_len=seq_len, allow=allow, serving=False)
        if plan is None:
            assert target_bytes is not None
            states = state_count(config.optimizer, allow)
            plan = chunk_plan(prof, target_bytes, config.optimizer, micro, states)
        model = build_seeded(spec, allow)
        inputs = declared_inputs(spec, model)
        example = make_inputs(inputs, 1, 1, "cpu") if inputs is not None else None
        blocks = chain_of(model, example)
    if tuple(b.name for b in blocks) != plan.block_names:
        raise FlowmeshError(
            Code.PLAN_ERROR, f"the plan's blocks are not {spec.name!r}'s chain; re-plan the model"
        )
    act, fwd = reservations(prof, plan.ranges, micro)
    job = TrainingJob(
        name,
        blocks,
        plan.ranges,
        config,
        device,
        inputs=inputs,
        act_bytes=act,
        fwd_bytes=fwd,
        allow=allow,
    )
    if resume is not None:
        load_checkpoint(job, resume)
    return job


def start_job(
    trainer: TrainingExecutor,
    name: str,
    spec: ModelSpec,
    config: TrainConfig,
    device: Device,
    *,
    batch: int,
    target_bytes: int,
    allow: tuple[str, ...],
    resume: str | os.PathLike[str] | None,
    worker: str,
) -> OpenedJob:
    """Open job `name` (`open_job`) with the weights of `spec`'s file unless it resumes, and
    take it into `trainer`; returns what the worker answers a TrainOpen with (`JobOpened`)."""
    job = open_job(
        name,
        spec,
        config,
        device,
        batch=batch,
        target_bytes=target_bytes,
        allow=allow,
        resume=resume,
    )
    job.batch = batch  # what its memory was planned for: no step may bring more rows
    if spec.weights is not None and resume is None:
        with torch.no_grad():
            state = build_reference(spec, allow).state_dict()
            for n, info in job.tensors.items():
                info.home.copy_(state[n])
    trainer.open(job)
    return OpenedJob(
        name=job.name,
        worker=worker,
        step=job.step_count,
        sub_models=[SubModelRow(**s) for s in job.sub_model_info()],
        footprint=job.footprint(),
        host_bytes=job.host_bytes(),
        largest_task=job.largest_task(),
        config=config,
    )


def step_answer(msg: p.TrainStep, r: StepResult) -> p.TrainStepResult:
    """The answer to step `msg` that ended with `r`: what the executor measured of it (its
    copies' bytes, its wait for memory: `_on_computed`) in the answer's own fields too."""
    m = r.metrics
    return p.TrainStepResult(
        id=msg.id,
        job=msg.job,
        seq=msg.seq,
        loss=r.loss,
        step=r.step,
        metrics=r.metrics,
        bytes_in=int(m.get("bytes_in", 0)),
        bytes_out=int(m.get("bytes_out", 0)),
        memory_wait_s=float(m.get("memory_wait_s", 0.0)),
        activations=list(r.activations),
    )


def config_from(meta: Mapping[str, Any]) -> TrainConfig:
    """The training configuration stored in a checkpoint's JSON (`read_meta`)."""
    return TrainConfig.from_dict(meta["config"])
