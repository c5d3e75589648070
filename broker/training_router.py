"""The broker's training router: a registry of training jobs, their placement and their calls.

A plain class, driven by `BrokerCore` (which only delegates): client messages in (`train_open`,
`train_step`, `train_eval`, `train_save`, `train_close`, `jobs`), worker answers in, clock ticks
and lost workers; messages out through the two callbacks it is given. No sockets, no clock of its
own.

- **Placement**: a new job goes to the ready worker with the most free training bytes (its
  `train_bytes` from registration, less the footprints of the jobs it already holds; a worker
  runs jobs whose footprints add up to more than its training bytes, by memory flow, so "free"
  may be negative and only orders the candidates).
- **Order**: a job's steps carry a sequence number `seq`. The worker's training executor runs a
  job's steps in the order it receives them, and one connection keeps the order the broker sends
  in, so the broker forwards each step at once, provided its `seq` is above every `seq` already
  taken. A step whose `seq` was taken is never sent again: its answer is replayed when it is
  known, a retry of a step still running is answered when it finishes, anything else is refused.
  Gaps are allowed (a client may fail to send a step it numbered), so nothing waits for a `seq`
  that may never come.
- **Deadlines**: every call to a worker has one, enforced on `tick`; an expired open closes the
  half-opened job on its worker.
- **Idle jobs**: a job opened with `idle_close_s` is closed by the broker once no client call
  has named it, nor been in flight for it, for that long (a sweep driver killed, a notebook
  lost: its memory goes back to the mesh); a later call of it is told so.
- **Lost workers**: the job's pending calls fail with `worker_lost`, naming the last step saved
  to a checkpoint (from which `train_open(resume=...)` continues), and the job is forgotten.
- **Restarts** (`--state-dir`): an opened job is kept in the store (`broker.store`) before its
  open is answered, with its last checkpoint. A restarted broker restores it as "restoring" and
  holds the job's commands until its worker registers again with the job in its inventory:
  the job's step count, its highest `seq` and its latest answers come from there, so a step
  the client sends again after the restart is answered from them (or when it finishes), never
  run twice. A pipelined job waits for every stage's worker, and takes its steps' figures from
  stage 0's (where its steps go). A job a worker did not bring back is lost as above (a
  pipelined job's other stages are closed).
- **Progress** (`JobRow`): rows trained per second (each step's rows read from its targets as
  it is forwarded), and what the worker measured of each step (`p.TrainStepResult`: bytes
  copied between the host tier and the device, seconds waited for memory), the last step's
  and summed; the sub-models' activation policies as the worker opened them.
"""

from __future__ import annotations

import functools
import logging
import math
import secrets
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from broker.context import fail
from broker.state import Peer
from broker.store import JobRecord, Store
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.logs import LogThrottle
from flowmesh.reports import JobRow, SubModelRow
from flowmesh.spec import ModelSpec, check_factory
from flowmesh.steps import StepLedger
from flowmesh.train_spec import TrainConfig

log = logging.getLogger("broker.training_router")

# Answers kept per job for steps that may be retried (by seq; `flowmesh.steps`); older ones
# are forgotten.
KEEP_RESULTS = 256
RATE_WINDOW = 32  # step completions the steps/s figure is measured over
MAX_HELD = 1024  # commands held per job while it waits for its worker after a restart
# Jobs that ended (closed, or lost with their worker) whose final figures status still shows,
# the latest by name: their metrics outlive them (`flowmesh.metrics`, `train_final_*`).
FINISHED_KEPT = 64


def _check_batch(msg: p.TrainStep | p.TrainEval, what: str) -> None:
    """A batch carries exactly the tensors its `inputs` names, and 'targets'."""
    names = p.batch_names(msg.inputs)
    if len(set(names)) != len(names):
        raise fail(Code.BAD_REQUEST, f"{what} names an input twice: {msg.inputs}")
    missing = [n for n in names if n not in msg.tensors]
    if missing:
        raise fail(Code.BAD_REQUEST, f"{what} needs tensors {missing}")
    unnamed = sorted(set(msg.tensors) - set(names))
    if unnamed:
        raise fail(
            Code.BAD_REQUEST,
            f"{what} carries tensors {unnamed} that are not its inputs ({names[:-1]}) or 'targets'",
        )


def train_bytes_of(peer: Peer) -> int:
    """The training bytes a worker registered with (0: it takes no training jobs)."""
    return peer.info.train_bytes


@dataclass
class JobCall:
    """A job command sent to a worker, awaiting its answer until `deadline`."""

    kind: str  # "open" | "step" | "eval" | "save" | "close"
    job: str
    worker: str
    client: bytes | None  # None once answered (a timeout, say)
    client_id: int
    deadline: float
    seq: int = 0


@dataclass
class Job:
    name: str
    worker: str
    spec: ModelSpec
    config: TrainConfig | None  # None: a checkpoint's, until the worker opened the job
    batch: int
    opened: float
    # "planning" (`pipeline="auto"`: where it goes) | "opening" | "ready" | "closing" |
    # "restoring"; once it ended: "closed" | "lost"
    state: str = "opening"
    step: int = 0
    last_loss: float | None = None
    saved_step: int | None = None
    saved_path: str | None = None
    # What the worker reported on open: its sub-models (their activation policies as of the
    # last answered step), the device bytes it would hold at once.
    sub_models: list[SubModelRow] = field(default_factory=list)
    footprint: int = 0
    steps: int = 0
    errors: int = 0
    # Its steps by seq: the highest taken, and the answers sent (a TrainStepResult or an
    # Error). Its `running`: after a restart, the seqs the worker was still running then
    # (their answers come with the ids of the broker before); the steps this broker sent are
    # found by their calls.
    ledger: StepLedger[p.Message] = field(default_factory=lambda: StepLedger(KEEP_RESULTS))
    done_at: deque[float] = field(default_factory=lambda: deque(maxlen=RATE_WINDOW))
    # The rows and tokens of each step in `done_at` (0: not known, a step sent before a restart).
    done_rows: deque[int] = field(default_factory=lambda: deque(maxlen=RATE_WINDOW))
    done_tokens: deque[int] = field(default_factory=lambda: deque(maxlen=RATE_WINDOW))
    # (rows, tokens) of the steps forwarded and not answered yet, by seq (the batch is read
    # here, so a step answered after its call expired still counts them).
    rows: dict[int, tuple[int, int]] = field(default_factory=dict)
    samples: int = 0
    tokens: int = 0
    # What the last answered step measured (`p.TrainStepResult`), and the sums over all.
    step_bytes_in: int = 0
    step_bytes_out: int = 0
    step_memory_wait_s: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0
    memory_wait_s: float = 0.0
    # After a restart: commands held until the worker brings the job back.
    held: list[tuple[bytes, p.Message]] = field(default_factory=list)
    # A pipelined job: its stages' workers, in stage order (`worker` is stage 0's, where its
    # steps go), those whose answer to the open (or, closing, to the close) is awaited, and
    # each one's sub-model row and footprint once open.
    workers: list[str] = field(default_factory=list)
    awaiting: set[str] = field(default_factory=set)
    # Closing: the ids of the closes sent to its workers. An answer to one that comes after its
    # call expired (the client was told of a timeout) still counts: the job goes once every
    # worker closed it, instead of staying open on the broker for good.
    closes: set[int] = field(default_factory=set)
    opened_rows: dict[str, tuple[SubModelRow, int]] = field(default_factory=dict)
    # A job `pipeline="auto"` pipelined: the client's open, for memory flow on one worker
    # should a stage not open on its worker after all (the plan counted its bytes beforehand);
    # and when the client's open times out (`_open_auto`).
    auto: p.TrainOpen | None = None
    deadline: float = math.inf
    # Closed once idle that long (`TrainOpen.idle_close_s`; None: never), counted from the
    # last client call naming it, or the last tick with a call of it in flight.
    idle_close_s: float | None = None
    active: float = -math.inf
    why: str = ""  # once ended by the broker itself: what a later call of it is told

    @property
    def holders(self) -> list[str]:
        """Every worker that holds a part of it."""
        return self.workers or [self.worker]

    @property
    def last_seq(self) -> int:
        """The highest seq taken."""
        return self.ledger.last

    @last_seq.setter
    def last_seq(self, seq: int) -> None:
        self.ledger.last = seq

    @property
    def awaited(self) -> set[int]:
        """The seqs its worker was running when it came back after a restart."""
        return self.ledger.running

    @awaited.setter
    def awaited(self, seqs: set[int]) -> None:
        self.ledger.running = seqs

    def steps_per_s(self) -> float:
        if len(self.done_at) < 2 or self.done_at[-1] <= self.done_at[0]:
            return 0.0
        return (len(self.done_at) - 1) / (self.done_at[-1] - self.done_at[0])

    def samples_per_s(self) -> float:
        """Rows trained per second over the steps `steps_per_s` is measured over: the rows of
        every step but the first, whose end is where the span starts."""
        return self._rate(self.done_rows)

    def tokens_per_s(self) -> float:
        """Target tokens trained per second, as `samples_per_s` (0 for a job not on tokens)."""
        return self._rate(self.done_tokens)

    def _rate(self, counts: deque[int]) -> float:
        if len(self.done_at) < 2 or self.done_at[-1] <= self.done_at[0]:
            return 0.0
        return (sum(counts) - counts[0]) / (self.done_at[-1] - self.done_at[0])

    def step_done(self, msg: p.TrainStepResult, now: float) -> None:
        """Count an answered step: its rows, what the worker measured of it."""
        rows, tokens = self.rows.pop(msg.seq, (0, 0))
        self.steps += 1
        self.samples += rows
        self.tokens += tokens
        self.done_at.append(now)
        self.done_rows.append(rows)
        self.done_tokens.append(tokens)
        self.step_bytes_in, self.step_bytes_out = msg.bytes_in, msg.bytes_out
        self.step_memory_wait_s = msg.memory_wait_s
        self.bytes_in += msg.bytes_in
        self.bytes_out += msg.bytes_out
        self.memory_wait_s += msg.memory_wait_s
        if len(msg.activations) == len(self.sub_models):  # the policies this step ran with
            self.sub_models = [
                msgspec.structs.replace(row, activations=a)
                for row, a in zip(self.sub_models, msg.activations, strict=True)
            ]

    def step_sent(self, seq: int, tensors: Mapping[str, Any]) -> None:
        """Note the rows of step `seq` as it goes to the worker (its targets' first dim), and its
        tokens: every target when they are ids over a sequence (integers, 2+ dims: a language
        model's next tokens), else none."""
        targets = tensors.get("targets")
        shape = tuple(getattr(targets, "shape", ()))
        rows = int(shape[0]) if shape else 0
        ids = len(shape) >= 2 and str(getattr(targets, "dtype", "")).startswith(("int", "uint"))
        self.rows[seq] = (rows, math.prod(shape) if ids else 0)
        while len(self.rows) > KEEP_RESULTS:  # steps whose answer never came
            del self.rows[next(iter(self.rows))]

    def checkpoint_note(self) -> str:
        if self.saved_step is None:
            return f"job {self.name!r} saved no checkpoint"
        return (
            f"job {self.name!r} was last saved at step {self.saved_step} to "
            f"{self.saved_path!r}; train_open(resume=...) continues from there"
        )


class TrainingRouter:
    def __init__(
        self,
        *,
        peers: Mapping[str, Peer],
        ids: Iterator[int],
        to_client: Callable[[bytes, p.Message], None],
        to_worker: Callable[[str, p.Message], None],
        allow: tuple[str, ...],
        step_timeout_s: float = 60.0,
        open_timeout_s: float = 600.0,
    ) -> None:
        self.peers = peers
        self._ids = ids
        self._to_client = to_client
        self._to_worker = to_worker
        self.allow = allow
        self.step_timeout_s = step_timeout_s
        self.open_timeout_s = open_timeout_s
        self.jobs: dict[str, Job] = {}
        self.finished: dict[str, Job] = {}  # by name, oldest first; state "closed" or "lost"
        self.calls: dict[int, JobCall] = {}
        self.totals = {
            "train_steps": 0, "train_step_errors": 0, "train_expired": 0, "train_idle_closed": 0,
        }  # fmt: skip
        # Where jobs are kept across restarts (`--state-dir`); None: nowhere.
        self.store: Store | None = None
        # How a `pipeline="auto"` open asks a partitioner where the job goes (set by the core:
        # `Catalogue.ask_plan`); None: such a job goes to one worker.
        self.ask_plan: Callable[..., None] | None = None
        # For the line per expired call: a client's steps to a stuck worker are not one each.
        self.log_throttle = LogThrottle(log)

    CLIENT_TYPES = (p.TrainOpen, p.TrainStep, p.TrainEval, p.TrainSave, p.TrainClose, p.Jobs)
    WORKER_TYPES = (
        p.JobOpened,
        p.TrainStepResult,
        p.TrainEvalResult,
        p.TrainSaved,
        p.TrainClosed,
    )

    # ================================================================== client side

    def on_client(self, addr: bytes, msg: p.Message, now: float) -> None:
        job_name = getattr(msg, "job", None)
        waiting = self.jobs.get(job_name) if isinstance(job_name, str) else None
        if waiting is not None:
            waiting.active = now  # its client is alive
        restoring = waiting is not None and waiting.state == "restoring"
        if waiting is not None and restoring and not isinstance(msg, p.TrainOpen):
            if len(waiting.held) >= MAX_HELD:
                raise fail(
                    Code.OVERLOADED,
                    f"training job {job_name!r} waits for its worker after a broker restart "
                    f"and already holds {MAX_HELD} commands; retry later",
                )
            waiting.held.append((addr, msg))
            return
        if isinstance(msg, p.TrainOpen):
            self._open(addr, msg, now)
        elif isinstance(msg, p.TrainStep):
            self._step(addr, msg, now)
        elif isinstance(msg, p.TrainEval):
            job = self._ready_job(msg.job)
            _check_batch(msg, "an evaluation")
            # Sent at once, like a step: one connection keeps the order, so the worker queues
            # it behind every step forwarded before it.
            cid = self._call("eval", job, addr, msg.id, now, msg.timeout_ms)
            self._to_worker(
                job.worker,
                p.TrainEval(id=cid, job=job.name, inputs=msg.inputs, tensors=msg.tensors),
            )
        elif isinstance(msg, p.TrainSave):
            job = self._ready_job(msg.job)
            if not msg.path:
                raise fail(Code.BAD_REQUEST, "train_save needs a checkpoint directory")
            cid = self._call("save", job, addr, msg.id, now, msg.timeout_ms)
            self._to_worker(job.worker, p.TrainSave(id=cid, job=job.name, path=msg.path))
        elif isinstance(msg, p.TrainClose):
            ended = self.finished.get(msg.job)
            if msg.job not in self.jobs and ended is not None:
                # Closed already, or lost with its worker: nothing is left to close, and a
                # client's close after the error that told it so (in a `finally`, say) must not
                # fail in its turn and hide that error.
                self._to_client(addr, p.TrainClosed(id=msg.id, job=msg.job))
                return
            job = self._job(msg.job)
            if job.state == "planning":  # on no worker yet: its open is answered as closed
                self._forget(job.name, Code.BAD_REQUEST, f"training job {job.name!r} was closed")
                self._to_client(addr, p.TrainClosed(id=msg.id, job=job.name))
                return
            job.state = "closing"
            # Answered once every worker holding a part has closed it: its name may then be
            # opened again on any of them.
            job.awaiting = set(job.holders)
            for w in job.holders:
                cid = self._call("close", job, addr, msg.id, now, msg.timeout_ms, worker=w)
                job.closes.add(cid)
                self._to_worker(w, p.TrainClose(id=cid, job=job.name))
        elif isinstance(msg, p.Jobs):
            self._to_client(addr, p.JobsReply(id=msg.id, jobs=self.status(now)))
        else:
            raise fail(Code.BAD_REQUEST, f"{msg.TYPE} is not a training message")

    def _job(self, name: str) -> Job:
        job = self.jobs.get(name)
        ended = self.finished.get(name)
        if job is None and ended is not None and ended.why:
            raise fail(Code.MODEL_NOT_FOUND, f"training job {name!r} {ended.why}")
        if job is None:
            known = ", ".join(sorted(self.jobs)) or "none"
            raise fail(Code.MODEL_NOT_FOUND, f"no training job {name!r} (open: {known})")
        return job

    def _ready_job(self, name: str) -> Job:
        job = self._job(name)
        if job.state != "ready":
            raise fail(Code.UNAVAILABLE, f"training job {name!r} is {job.state}")
        return job

    def _call(
        self,
        kind: str,
        job: Job,
        addr: bytes | None,  # None: the broker's own (answered to nobody)
        ref: int,
        now: float,
        timeout_ms: int | None,
        seq: int = 0,
        worker: str | None = None,
    ) -> int:
        default = self.open_timeout_s if kind == "open" else self.step_timeout_s
        timeout = timeout_ms / 1000 if timeout_ms else default
        cid = next(self._ids)
        to = job.worker if worker is None else worker
        self.calls[cid] = JobCall(kind, job.name, to, addr, ref, now + timeout, seq)
        return cid

    def committed(self) -> dict[str, int]:
        """The training bytes each worker's jobs hold (a pipelined job's, stage by stage)."""
        out: dict[str, int] = {}
        for job in self.jobs.values():
            if job.state == "planning":
                continue  # on no worker yet
            parts = {w: f for w, (_, f) in job.opened_rows.items()} or {job.worker: job.footprint}
            for w, f in parts.items():
                out[w] = out.get(w, 0) + f
        return out

    def place(self) -> str:
        """The ready worker with the most free training bytes (ties: by name)."""
        committed = self.committed()
        options = [
            (train_bytes_of(w) - committed.get(w.name, 0), w.name)
            for w in self.peers.values()
            if w.role == "worker" and w.ready and train_bytes_of(w) > 0
        ]
        if not options:
            raise fail(
                Code.UNAVAILABLE,
                "no ready worker takes training jobs (start workers with --train-bytes)",
            )
        return min(options, key=lambda o: (-o[0], o[1]))[1]

    def _open(self, addr: bytes, msg: p.TrainOpen, now: float) -> None:
        spec = msg.spec
        check_factory(spec.factory, self.allow)
        if msg.job in self.jobs:
            raise fail(Code.MODEL_EXISTS, f"training job {msg.job!r} is already open")
        if msg.batch < 1:
            raise fail(Code.BAD_REQUEST, f"batch must be positive, got {msg.batch}")
        if msg.chunk_bytes is not None and msg.chunk_bytes < 1:
            raise fail(Code.BAD_REQUEST, f"chunk_bytes must be positive, got {msg.chunk_bytes}")
        if msg.config is None and msg.resume is None:
            raise fail(Code.BAD_REQUEST, "give a training configuration, or resume= a checkpoint")
        if msg.pipeline == "auto":
            self._open_auto(addr, msg, now)
            return
        if msg.pipeline > 1:
            self._open_pipelined(addr, msg, now)
            return
        worker = self.place()
        job = Job(msg.job, worker, spec, msg.config, msg.batch, now)
        job.idle_close_s = msg.idle_close_s
        self.jobs[job.name] = job
        cid = self._call("open", job, addr, msg.id, now, msg.timeout_ms)
        self._to_worker(
            worker,
            p.TrainOpen(
                id=cid,
                job=job.name,
                spec=spec,
                config=msg.config,
                batch=msg.batch,
                resume=msg.resume,
                chunk_bytes=msg.chunk_bytes,
            ),
        )
        log.info("opening training job=%s worker=%s", job.name, worker)

    def _pipe_workers(self) -> list[Peer]:
        """The workers a pipelined job's stages may go to (ready, taking training jobs, with a
        peer endpoint), the most free training bytes first (ties: by name)."""
        committed = self.committed()
        return sorted(
            (w for w in self.peers.values()
             if w.role == "worker" and w.ready and train_bytes_of(w) > 0
             and w.info.peer_endpoint),
            key=lambda w: (committed.get(w.name, 0) - train_bytes_of(w), w.name),
        )  # fmt: skip

    def _open_auto(self, addr: bytes, msg: p.TrainOpen, now: float) -> None:
        """`pipeline="auto"`: one worker by memory flow, unless the job does not fit the free
        training bytes of the worker it would go to and, cut into stages, fits those of
        several: then pipelined over the fewest that hold it (a partitioner profiles the model
        and plans: `planners.pipeline_stages`). The job's name is taken meanwhile ("planning");
        a plan that fails leaves it to memory flow, which trains a job of any size."""
        if msg.resume is not None:
            raise fail(
                Code.BAD_REQUEST,
                'pipeline="auto" places a new job; to resume a checkpoint, say how: '
                "pipeline=N (--pipeline N), N of 2 or more, for a pipelined job's checkpoint, "
                "or 1 for a memory-flow job's",
            )
        assert msg.config is not None  # (the open's checks: a config, or resume)
        able = self._pipe_workers()
        if len(able) < 2 or self.ask_plan is None:
            self._open(addr, msgspec.structs.replace(msg, pipeline=1), now)
            return
        committed = self.committed()
        free = [max(0, train_bytes_of(w) - committed.get(w.name, 0)) for w in able]
        request = p.PlanAsk(
            spec=msg.spec, kind="pipeline", optimizer=dict(msg.config.optimizer),
            batch=msg.batch // msg.config.accumulate or 1, worker_bytes=free,
        )  # fmt: skip
        job = Job(msg.job, "", msg.spec, msg.config, msg.batch, now)  # on no worker yet
        job.state = "planning"
        self.jobs[job.name] = job
        timeout = msg.timeout_ms / 1000 if msg.timeout_ms else self.open_timeout_s
        # The open that follows gets what is left of the client's timeout, not a fresh one: a
        # job opened past it would be a job no client knows of.
        msg = msgspec.structs.replace(msg, timeout_ms=max(1, int(timeout * 1000)))
        job.deadline = now + timeout
        planned = functools.partial(self._planned, addr, msg, job)
        try:
            self.ask_plan(request, planned, now, job.deadline)
        except FlowmeshError as exc:  # no partitioner: memory flow needs no plan
            if self.jobs.get(job.name) is job:
                del self.jobs[job.name]
            log.info("training job=%s: no plan (%s), one worker", job.name, exc.reason)
            self._open(addr, msgspec.structs.replace(msg, pipeline=1), now)

    def _planned(
        self,
        addr: bytes,
        msg: p.TrainOpen,
        job: Job,
        answer: dict[str, Any] | None,
        error: tuple[str, str] | None,
        now: float,
    ) -> None:
        """The plan of a `pipeline="auto"` open came (or failed): open the job where it says."""
        if self.jobs.get(job.name) is not job:
            reason = f"training job {job.name!r} was closed before it was placed"
            self._to_client(addr, p.Error(id=msg.id, code=str(Code.BAD_REQUEST), reason=reason))
            return
        del self.jobs[job.name]
        left_ms = int((job.deadline - now) * 1000)
        if left_ms <= 0:
            reason = f"training job {job.name!r} was not placed within its open's timeout"
            if error is not None:
                reason += f" ({error[1]})"
            self._to_client(addr, p.Error(id=msg.id, code=str(Code.TIMEOUT), reason=reason))
            return
        msg = msgspec.structs.replace(msg, timeout_ms=left_ms)
        plan = answer["plan"] if answer is not None else None
        stages = len(plan.ranges) if plan is not None and plan.request.get("fits") else 1
        if error is not None:
            log.warning("training job=%s: planning failed (%s: %s), one worker", job.name, *error)
        elif plan is not None and not plan.request.get("fits"):
            log.info("training job=%s fits no pipeline of the free workers: memory flow",
                     job.name)  # fmt: skip
        elif stages > 1 and not self._still_fits(plan):
            # Planned on the workers' free bytes as they were: another job took some since (two
            # opened at once, say). Memory flow needs none of them.
            log.info("training job=%s: its plan no longer fits the free workers: memory flow",
                     job.name)  # fmt: skip
            stages = 1
        for n in (stages, 1) if stages > 1 else (1,):
            try:
                self._open(addr, msgspec.structs.replace(msg, pipeline=n), now)
            except FlowmeshError as exc:
                if n > 1:  # its workers went meanwhile, say: one worker, by memory flow
                    log.info("training job=%s: %s; one worker", job.name, exc.reason)
                    continue
                self._to_client(addr, p.Error(id=msg.id, code=str(exc.code), reason=exc.reason))
                return
            if n > 1:
                opened = self.jobs[msg.job]
                opened.auto = msg
                assert plan is not None and plan.range_footprint is not None
                # Its stages' bytes counted on their workers from now (`committed`), not once
                # they answer: a job planned meanwhile sees them taken.
                for w, (a, b), fp in zip(opened.workers, plan.ranges, plan.range_footprint,
                                         strict=True):  # fmt: skip
                    opened.opened_rows.setdefault(
                        w, (SubModelRow(blocks=[a, b], host_bytes=0, task_bytes=fp), fp)
                    )
            return

    def _still_fits(self, plan: Any) -> bool:
        """Whether a pipeline plan's stages fit the free training bytes of the workers it would
        go to now (stage i on the i-th most free, as `_open_pipelined` places them)."""
        committed = self.committed()
        free = [train_bytes_of(w) - committed.get(w.name, 0) for w in self._pipe_workers()]
        need = plan.range_footprint or ()
        return len(free) >= len(need) and all(f <= c for f, c in zip(need, free, strict=False))

    def _open_pipelined(self, addr: bytes, msg: p.TrainOpen, now: float) -> None:
        """A job over `msg.pipeline` workers: each opens its stage (`p.PipeOpen`); the job is
        ready, and the client answered, once every one has."""
        n = msg.pipeline
        assert isinstance(n, int)
        if msg.config is not None and msg.batch % msg.config.accumulate:
            raise fail(
                Code.BAD_REQUEST,
                f"batch {msg.batch} does not split into {msg.config.accumulate} micro-batches "
                "(accumulate: a pipeline's micro-batches)",
            )
        able = self._pipe_workers()
        if len(able) < n:
            raise fail(
                Code.UNAVAILABLE,
                f"a pipeline of {n} stages needs {n} ready workers that take training jobs "
                f"(--train-bytes) and have a peer endpoint; {len(able)} do",
            )
        workers = [w.name for w in able[:n]]
        peers = [
            p.PipePeer(worker=w, endpoint=self.peers[w].info.peer_endpoint, key=self.peers[w].key)
            for w in workers
        ]
        ticket = secrets.randbits(62) + 1
        job = Job(msg.job, workers[0], msg.spec, msg.config, msg.batch, now, workers=workers)
        job.idle_close_s = msg.idle_close_s
        job.awaiting = set(workers)
        self.jobs[job.name] = job
        for stage, w in enumerate(workers):
            cid = self._call("open", job, addr, msg.id, now, msg.timeout_ms, worker=w)
            self._to_worker(
                w,
                p.PipeOpen(
                    id=cid, job=job.name, spec=msg.spec, config=msg.config, batch=msg.batch,
                    stage=stage, ticket=ticket, peers=peers, resume=msg.resume,
                ),
            )  # fmt: skip
        log.info("opening pipelined training job=%s workers=%s", job.name, workers)

    def _close_everywhere(self, job: Job, but: str = "") -> None:
        """Tell every worker holding a part of `job` (except `but`) to close it, unanswered."""
        for w in job.holders:
            if w != but and w in self.peers:
                self._to_worker(w, p.TrainClose(id=next(self._ids), job=job.name))

    def _step(self, addr: bytes, msg: p.TrainStep, now: float) -> None:
        job = self._ready_job(msg.job)
        if msg.seq < 1:
            raise fail(Code.BAD_REQUEST, f"step seq must be positive, got {msg.seq}")
        if job.ledger.taken(msg.seq):
            self._retried(job, addr, msg, now)
            return
        _check_batch(msg, "a training step")
        job.ledger.take(msg.seq)
        job.step_sent(msg.seq, msg.tensors)
        cid = self._call("step", job, addr, msg.id, now, msg.timeout_ms, msg.seq)
        # A pipelined job's coordinator fails a step that outlives it, so that later ones go on.
        timeout = (msg.timeout_ms or int(self.step_timeout_s * 1000)) if job.workers else None
        self._to_worker(
            job.worker,
            p.TrainStep(
                id=cid, job=job.name, seq=msg.seq, inputs=msg.inputs, tensors=msg.tensors,
                timeout_ms=timeout,
            ),
        )  # fmt: skip

    def _retried(self, job: Job, addr: bytes, msg: p.TrainStep, now: float) -> None:
        """A step whose seq was taken: replay its answer, or answer it when it comes."""
        answer = job.ledger.answer(msg.seq)
        if isinstance(answer, p.TrainStepResult):
            self._to_client(
                addr,
                msgspec.structs.replace(answer, id=msg.id),  # the same job and seq
            )
            return
        if isinstance(answer, p.Error):
            self._to_client(addr, p.Error(id=msg.id, code=answer.code, reason=answer.reason))
            return
        for call in self.calls.values():
            if call.kind == "step" and call.job == job.name and call.seq == msg.seq:
                call.client, call.client_id = addr, msg.id  # the retry takes over the answer
                return
        if msg.seq in job.awaited:
            # Running on the worker since before a restart: answered when its result comes.
            self._call("step", job, addr, msg.id, now, msg.timeout_ms, msg.seq)
            return
        raise fail(
            Code.BAD_REQUEST,
            f"step seq {msg.seq} of job {job.name!r} was already taken (last seq "
            f"{job.last_seq}) and its answer is no longer known; it is not run twice",
        )

    # ================================================================== worker side

    def _pop(self, worker: str, ref: int, kind: str, job: str) -> JobCall | None:
        """The pending call `ref`, only if it is a `kind` call of `job` sent to `worker`."""
        call = self.calls.get(ref)
        if call is None:
            return None  # expired, or its job was closed or lost: nobody waits
        if (call.kind, call.worker, call.job) != (kind, worker, job):
            raise fail(Code.BAD_REQUEST, f"no pending {kind} call {ref} of {job!r} for {worker}")
        del self.calls[ref]
        return call

    def _answer(self, call: JobCall, msg: p.Message) -> None:
        if call.client is not None:
            self._to_client(call.client, msg)
            call.client = None

    def on_worker(self, worker: str, msg: p.Message, now: float) -> None:
        if isinstance(msg, p.JobOpened):
            name = msg.job.name
            call = self._pop(worker, msg.id, "open", name)
            job = self.jobs.get(name)
            if job is None or worker not in job.holders:
                # Opened after its call expired: nobody can reach it, so it must not hold the
                # worker's memory.
                self._to_worker(worker, p.TrainClose(id=next(self._ids), job=name))
                return
            if call is None:
                return
            if job.workers:
                job.awaiting.discard(worker)
                job.opened_rows[worker] = (msg.job.sub_models[0], msg.job.footprint)
                if job.awaiting:
                    return  # the other stages' answers are still to come
                rows = [job.opened_rows[w] for w in job.workers]
                job.sub_models = [r for r, _ in rows]
                job.footprint = sum(f for _, f in rows)
            else:
                job.sub_models, job.footprint = msg.job.sub_models, msg.job.footprint
            job.step = msg.job.step
            job.config = msg.job.config  # what the worker runs (from a checkpoint, say)
            if not self._keep_job(job):
                del self.jobs[job.name]
                self._close_everywhere(job)
                self._answer(
                    call,
                    p.Error(
                        id=call.client_id,
                        code=str(Code.INTERNAL),
                        reason=f"training job {job.name!r} could not be kept in the state store",
                    ),
                )
                return
            if job.state == "opening":  # not when a close was asked for meanwhile
                job.state = "ready"
            log.info("training job=%s open on worker(s)=%s", job.name, job.holders)
            self._answer(call, p.TrainOpened(id=call.client_id, job=self._job_status(job, now)))
        elif isinstance(msg, p.TrainStepResult):
            self._step_result(worker, msg, now)
        elif isinstance(msg, p.TrainEvalResult):
            call = self._pop(worker, msg.id, "eval", msg.job)
            if call is None:
                return
            self._answer(
                call,
                msgspec.structs.replace(msg, id=call.client_id),
            )
        elif isinstance(msg, p.TrainSaved):
            call = self._pop(worker, msg.id, "save", msg.job)
            job = self.jobs.get(msg.job)
            if job is not None and job.worker == worker:  # written, even if answered late
                job.saved_step, job.saved_path = msg.step, msg.path
                self._keep_job(job)
            if call is None:
                return
            self._answer(
                call, p.TrainSaved(id=call.client_id, job=msg.job, path=msg.path, step=msg.step)
            )
        elif isinstance(msg, p.TrainClosed):
            call = self._pop(worker, msg.id, "close", msg.job)
            job = self.jobs.get(msg.job)
            late = job is not None and msg.id in job.closes and worker in job.holders
            if call is None and not late:
                return  # a close nobody waits on (its job was lost, or is another now)
            if job is not None and job.workers:
                job.awaiting.discard(worker)
                if job.awaiting:
                    return  # other stages still closing
            self._forget(msg.job, Code.BAD_REQUEST, f"training job {msg.job!r} was closed")
            if call is not None:
                self._answer(call, p.TrainClosed(id=call.client_id, job=msg.job))
        else:
            raise fail(Code.BAD_REQUEST, f"{msg.TYPE} is not a training answer")

    def _step_result(self, worker: str, msg: p.TrainStepResult, now: float) -> None:
        call = self.calls.get(msg.id)
        if call is not None:
            if (call.kind, call.worker, call.job, call.seq) != ("step", worker, msg.job, msg.seq):
                raise fail(Code.BAD_REQUEST, f"no pending step {msg.id} of {msg.job!r}/{msg.seq}")
            del self.calls[msg.id]
        job = self.jobs.get(msg.job)
        if job is None or job.worker != worker or msg.seq > job.last_seq:
            return
        if msg.seq in job.awaited:
            # A step sent before a restart: its call, if a retry made one, is found by its seq.
            job.awaited.discard(msg.seq)
            for cid, c in list(self.calls.items()):
                if (c.kind, c.worker, c.job, c.seq) == ("step", worker, msg.job, msg.seq):
                    call = self.calls.pop(cid)
                    break
        # Counted even when its call expired: the step was applied all the same.
        job.step, job.last_loss = msg.step, msg.loss
        job.step_done(msg, now)
        self.totals["train_steps"] += 1
        self._keep(job, msg.seq, msg)
        if call is not None:
            self._answer(
                call,
                msgspec.structs.replace(msg, id=call.client_id),
            )

    def _keep(self, job: Job, seq: int, answer: p.Message) -> None:
        job.ledger.settle(seq, answer)

    def on_error(self, worker: str, msg: p.Error, now: float) -> bool:
        """A worker's error answer; False when it answers no training call."""
        call = self.calls.get(msg.id) if msg.id is not None else None
        if call is None and msg.id is not None:
            # A close's error after its call expired: the worker holds the job no more either
            # way (as an answer in time, it ends the job; nobody is waiting to be told).
            for job in list(self.jobs.values()):
                if msg.id in job.closes and worker in job.holders:
                    why = f"training job {job.name!r} was closed"
                    self._forget(job.name, Code.BAD_REQUEST, why)
                    return True
        if call is None or call.worker != worker:
            return False
        del self.calls[msg.id]  # type: ignore[arg-type]
        job = self.jobs.get(call.job)
        if call.kind == "open" and job is not None and job.state == "opening":
            del self.jobs[call.job]
            if job.workers:  # the other stages: closed, their open calls answered nobody
                self._close_everywhere(job, but=worker)
                for cid, c in list(self.calls.items()):
                    if c.job == job.name and c.kind == "open":
                        del self.calls[cid]
            if job.auto is not None and call.client is not None and call.deadline > now:
                # Too big after all (buffers the plan does not see), a cut the model refuses:
                # memory flow, within what is left of the client's timeout.
                log.info("training job=%s: worker=%s refused its stage (%s: %s); one worker",
                         job.name, worker, msg.code, msg.reason)  # fmt: skip
                left_ms = max(1, int((call.deadline - now) * 1000))
                again = msgspec.structs.replace(job.auto, pipeline=1, timeout_ms=left_ms)
                try:
                    self._open(call.client, again, now)
                except FlowmeshError as exc:
                    self._answer(call, p.Error(id=call.client_id, code=str(exc.code),
                                               reason=exc.reason))  # fmt: skip
                return True
        elif call.kind == "step" and job is not None:
            job.errors += 1
            job.rows.pop(call.seq, None)
            self.totals["train_step_errors"] += 1
            self._keep(job, call.seq, msg)
        elif call.kind == "close" and job is not None:
            # The worker does not hold it (any more): nothing is left to close.
            self._forget(call.job, Code.BAD_REQUEST, f"training job {call.job!r} was closed")
        self._answer(call, p.Error(id=call.client_id, code=msg.code, reason=msg.reason))
        return True

    def undelivered(self, ref: Any, reason: str) -> bool:
        """A job command could not be sent: fail its call now; False if it was none."""
        call = self.calls.pop(ref, None) if isinstance(ref, int) else None
        if call is None:
            return False
        if call.kind == "open":
            self.jobs.pop(call.job, None)
        self._answer(call, p.Error(id=call.client_id, code=str(Code.OVERLOADED), reason=reason))
        return True

    def _forget(self, name: str, code: Code, reason: str) -> None:
        """Drop job `name` and fail every call still waiting on it; its final figures are
        kept among the finished jobs (a close answers BAD_REQUEST to what still waited)."""
        job = self.jobs.pop(name, None)
        if job is not None:
            job.state = "closed" if code == Code.BAD_REQUEST else "lost"
            self.finished.pop(name, None)
            self.finished[name] = job
            while len(self.finished) > FINISHED_KEPT:
                del self.finished[next(iter(self.finished))]
        if job is not None and self.store is not None:
            try:
                self.store.drop_job(name)
            except Exception as exc:
                log.error("could not drop training job=%s from the store: %s", name, exc)
        for cid, call in list(self.calls.items()):
            if call.job == name:
                del self.calls[cid]
                self._answer(call, p.Error(id=call.client_id, code=str(code), reason=reason))
        for addr, msg in job.held if job is not None else ():
            ref = getattr(msg, "id", None)
            if isinstance(ref, int):
                self._to_client(addr, p.Error(id=ref, code=str(code), reason=reason))

    # ================================================================== restarts

    def _keep_job(self, job: Job) -> bool:
        """Write `job` to the store (when there is one); False if that failed."""
        if self.store is None:
            return True
        try:
            self.store.save_job(
                JobRecord(
                    name=job.name,
                    spec=job.spec.to_dict(),
                    config=job.config.to_dict() if job.config is not None else {},
                    batch=job.batch,
                    worker=job.worker,
                    saved_step=job.saved_step,
                    saved_path=job.saved_path,
                    workers=list(job.workers),
                    idle_close_s=job.idle_close_s,
                )
            )
        except Exception as exc:
            log.error("could not keep training job=%s: %s", job.name, exc)
            return False
        return True

    def restore(self, records: Mapping[str, JobRecord], now: float) -> None:
        """After a restart: the jobs the store kept, each waiting for its worker."""
        for rec in records.values():
            try:
                spec = ModelSpec.from_dict(rec.spec)
                check_factory(spec.factory, self.allow)
                config = TrainConfig.from_dict(rec.config) if rec.config else None
            except FlowmeshError as exc:
                log.error("not restoring training job=%s: %s", rec.name, exc.reason)
                if self.store is not None:
                    self.store.drop_job(rec.name)
                continue
            job = Job(rec.name, rec.worker, spec, config, rec.batch, now, workers=rec.workers)
            job.state = "restoring"
            job.awaiting = set(job.holders)  # the workers still to bring it back
            job.saved_step, job.saved_path = rec.saved_step, rec.saved_path
            job.idle_close_s = rec.idle_close_s
            self.jobs[job.name] = job
            log.info("restored training job=%s (waiting for workers=%s)", job.name, job.holders)

    def worker_joined(self, worker: str, held: list[p.HeldJob], now: float) -> None:
        """A worker registered afresh with the jobs it holds (its inventory's): a restored job
        it holds is taken up where it is, once every worker holding a part of it is back; one it
        should hold and does not is lost (the worker restarted); one nobody knows is closed
        there."""
        have = {item.name: item for item in held}
        for name, item in have.items():
            job = self.jobs.get(name)
            if job is None or worker not in job.awaiting or job.state != "restoring":
                log.info("closing training job=%s held by %s: not ours", name, worker)
                self._to_worker(worker, p.TrainClose(id=next(self._ids), job=name))
                continue
            job.awaiting.discard(worker)
            if job.workers:
                row = item.sub_models[0] if item.sub_models else SubModelRow(
                    blocks=[], host_bytes=0, task_bytes=item.footprint
                )  # (a worker that reports no rows)
                job.opened_rows[worker] = (row, item.footprint)
            if worker == job.worker:  # where its steps go: what they did is known there
                job.step, job.last_seq = item.step, item.seq
                job.awaited = set(item.running)
                self._replay(job, item)
            if job.awaiting:
                log.info("training job=%s: worker=%s is back, waiting for %s",
                         name, worker, sorted(job.awaiting))  # fmt: skip
                continue
            job.state = "ready"
            if job.workers:
                rows = [job.opened_rows[w] for w in job.workers]
                job.sub_models = [r for r, _ in rows if r.blocks]
                job.footprint = sum(f for _, f in rows)
            else:
                job.sub_models, job.footprint = list(item.sub_models), item.footprint
            log.info(
                "training job=%s taken up on worker=%s at step %d (seq %d, %d running)",
                name,
                job.holders,
                job.step,
                job.last_seq,
                len(job.awaited),
            )
            self._release(job, now)
        lost = [j for j in self.jobs.values() if j.state == "restoring" and worker in j.awaiting]
        for job in lost:
            log.warning("training job=%s lost: worker=%s came back without it", job.name, worker)
            self._close_everywhere(job, but=worker)
            self._forget(
                job.name,
                Code.WORKER_LOST,
                f"worker {worker} came back without training job {job.name!r} (it restarted); "
                f"{job.checkpoint_note()}",
            )

    def _replay(self, job: Job, item: p.HeldJob) -> None:
        """Keep the answers a worker brought back, for the steps its client sends again."""
        for r in item.results:
            if r.seq > job.last_seq:
                continue
            if isinstance(r, p.StepFailed):
                answer: p.Message = p.Error(id=0, code=r.code, reason=r.reason)
            else:
                answer = p.TrainStepResult(
                    id=0, job=job.name, seq=r.seq, loss=r.loss, step=r.step, metrics=r.metrics
                )
                job.last_loss = r.loss
            self._keep(job, r.seq, answer)

    def _release(self, job: Job, now: float) -> None:
        """Run the commands held for `job` while it waited, in the order they came."""
        held, job.held = job.held, []
        for addr, msg in held:
            try:
                self.on_client(addr, msg, now)
            except FlowmeshError as exc:
                ref = getattr(msg, "id", None)
                if isinstance(ref, int):
                    self._to_client(addr, p.Error(id=ref, code=str(exc.code), reason=exc.reason))

    def finish_restore(self) -> None:
        """The wait for workers after a restart is over: a job still waiting is lost."""
        for job in [j for j in self.jobs.values() if j.state == "restoring"]:
            log.warning("training job=%s lost: worker(s) %s did not come back after the restart",
                        job.name, sorted(job.awaiting))  # fmt: skip
            # The stages whose workers came back are closed: nobody can reach them now.
            back = [w for w in job.holders if w not in job.awaiting]
            for w in back:
                if w in self.peers:
                    self._to_worker(w, p.TrainClose(id=next(self._ids), job=job.name))
            self._forget(
                job.name,
                Code.WORKER_LOST,
                f"worker(s) {', '.join(sorted(job.awaiting))} did not come back with training "
                f"job {job.name!r} after the broker restarted; {job.checkpoint_note()}",
            )

    # ================================================================== time and loss

    def tick(self, now: float) -> None:
        for cid, call in list(self.calls.items()):
            if call.deadline > now or self.calls.get(cid) is not call:
                continue
            del self.calls[cid]
            self.totals["train_expired"] += 1
            reason = f"worker {call.worker} did not answer {call.kind} of {call.job!r} in time"
            if call.kind == "step":
                reason += f" (step seq {call.seq}; it may still be applied, and is not run twice)"
            job = self.jobs.get(call.job)
            if call.kind == "open" and job is not None and job.state == "opening":
                # It may open later: close it there, so it holds nothing nobody can reach.
                del self.jobs[call.job]
                self._close_everywhere(job)
                for other, c in list(self.calls.items()):
                    if c.job == job.name and c.kind == "open":
                        del self.calls[other]
            self.log_throttle.warning("training call expired: %s", reason)
            self._answer(call, p.Error(id=call.client_id, code=str(Code.TIMEOUT), reason=reason))
        self._close_idle(now)

    def _close_idle(self, now: float) -> None:
        """Close every ready job idle past its `idle_close_s` (module docstring), on its
        workers as a client's close would, answered to nobody."""
        busy = {c.job for c in self.calls.values()}
        for job in list(self.jobs.values()):
            if job.idle_close_s is None or job.state != "ready":
                continue
            if job.name in busy:
                job.active = now
                continue
            idle = now - max(job.active, job.opened)
            if idle < job.idle_close_s:
                continue
            log.warning("training job=%s closed: no call of it for %.0f s (its idle_close_s)",
                        job.name, idle)  # fmt: skip
            self.totals["train_idle_closed"] += 1
            job.why = (
                f"was closed by the broker after {job.idle_close_s:g} s without a call of it "
                f"(the idle_close_s it was opened with); {job.checkpoint_note()}"
            )
            job.state = "closing"
            job.awaiting = set(job.holders)
            for w in job.holders:
                cid = self._call("close", job, None, 0, now, None, worker=w)
                job.closes.add(cid)
                self._to_worker(w, p.TrainClose(id=cid, job=job.name))

    def worker_lost(self, worker: str) -> None:
        for job in [j for j in self.jobs.values() if worker in j.holders]:
            log.warning("training job=%s lost with worker=%s", job.name, worker)
            self._close_everywhere(job, but=worker)
            self._forget(
                job.name,
                Code.WORKER_LOST,
                f"worker {worker} was lost with training job {job.name!r}; {job.checkpoint_note()}",
            )

    # ================================================================== status

    def _job_status(self, job: Job, now: float) -> JobRow:
        return JobRow(
            name=job.name,
            worker=job.worker,
            state=job.state,
            factory=job.spec.factory,
            config=job.config,
            batch=job.batch,
            step=job.step,
            last_loss=job.last_loss,
            steps_per_s=round(job.steps_per_s(), 3),
            pending=sum(1 for c in self.calls.values() if c.job == job.name),
            sub_models=job.sub_models,
            footprint=job.footprint,
            saved_step=job.saved_step,
            saved_path=job.saved_path,
            errors=job.errors,
            age_s=round(now - job.opened, 3),
            samples_per_s=round(job.samples_per_s(), 3),
            samples=job.samples,
            tokens_per_s=round(job.tokens_per_s(), 3),
            tokens=job.tokens,
            step_bytes_in=job.step_bytes_in,
            step_bytes_out=job.step_bytes_out,
            step_memory_wait_s=round(job.step_memory_wait_s, 6),
            bytes_in=job.bytes_in,
            bytes_out=job.bytes_out,
            memory_wait_s=round(job.memory_wait_s, 6),
            pipeline=list(job.workers),
        )

    def status(self, now: float) -> list[JobRow]:
        return [self._job_status(self.jobs[n], now) for n in sorted(self.jobs)]

    def finished_status(self, now: float) -> list[JobRow]:
        """The jobs that ended, as they were at the end, the latest last."""
        return [self._job_status(job, now) for job in self.finished.values()]
