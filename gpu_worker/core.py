"""The worker's logic, as plain code; the process shell is `gpu_worker.service`.

`WorkerCore` is a plain class, as the broker's `BrokerCore` is. Each event (a decoded message from
the broker or from a peer, a piece of work finished, a clock tick) changes its state and appends
to `out` what must happen next, in order:

- `Send`: a message to the broker; `AllowPeer`: a key the peer socket may take (the run that
  names it is announced, or the pipelined job that names it opens), `ReleasePeers`: those a
  pipelined job named, once it is closed here;
- work for the shell to do, on its sockets, executors and threads: `SendHop` (a direct run's
  activations to the next stage's worker), `RunStage`, `RunChunk`,
  `LoadStage`, `EvictStage`, `DropStage`, `FreeKV`, `PrepareStage`, `AddStage`, `OpenJob`,
  `SubmitStep`, `Evaluate`, `SaveJob`, `CloseJob`, and for a stage of a pipelined job
  (`gpu_worker.pipe_runner`) `PipeStep`, `PipeEval`, `PipeSave` and `PipeHopIn`.

The shell drains `out` (`drain`), does each item, and feeds back what each piece of work ended
with (`finished`: its result, or the exception it failed with). Tests drive it in-process with
exact expectations: no sockets, no threads, no clock of its own (`now` is passed in).

What it owns:

- **The job ledger**: each training job's steps by `seq` (`flowmesh.steps.StepLedger`): a job's
  steps are submitted in arrival order, which is the order the training executor runs them in,
  and a `seq` at or below one taken is refused (never applied twice). The latest answers and
  the seqs still running go into the registration's inventory, so that a broker that restarted
  replays the answer of a step its client sends again instead of running it twice.
- **Direct runs** (`gpu_worker.direct`): stage 0 cuts its inputs into micro-batches
  (`tensor_split`), each stage computes each micro-batch as it comes and passes it on to the next
  stage's worker, and the last stage merges them (`cat`) and answers the broker.
- **Runs' parts**: a Run's tensors, one map per part, checked against its parts, and the parts
  of a RunResult.
- **Generation**: a Run with `gen` is one iteration (one part, chunks=1): stage 0 takes 'ids',
  the last stage answers 'tokens' (one sampled token per sequence); the KV cache is the
  executor's, and `FreeSeqs` drops sequences from it (`FreeKV`, not answered), or with `park`
  preempts them, parking their KV in host memory where that pays (answered `SeqsParked`).
- **Opening a job**: which spec, configuration, checkpoint and chunk target (`job_opening`).
- **The broker's epoch**: a broker that registered us afresh (`registered_again`) forgot what it
  asked before: a stage or job still being prepared for it is dropped when ready.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.eviction import StageKey
from flowmesh.logs import LogThrottle
from flowmesh.roots import Roots
from flowmesh.spec import DEFAULT_ALLOW, ModelSpec, check_factory
from flowmesh.steps import StepLedger, StepResult
from gpu_worker.direct import DirectRun, DirectRuns
from gpu_worker.executor import LoadInfo, RunOutput
from gpu_worker.run_rows import concat_parts, split_rows
from gpu_worker.train_executor import TrainConfig, config_from, read_meta, step_answer

# Step answers kept per training job for the registration's inventory (see `WorkerCore`).
KEEP_RESULTS = 32

# A step's answer as the inventory carries it.
Answer = p.StepOk | p.StepFailed


# ---------------------------------------------------------------------- what goes out


@dataclass
class Send:
    """A message to the broker."""

    msg: p.Message


@dataclass
class SendHop:
    """A direct run's micro-batch, to the next stage's worker (`run.msg.next_peer`); None
    comes back once it went (the micro-batch is done here)."""

    run: DirectRun
    hop: p.Hop


@dataclass
class AllowPeer:
    """The peer socket may take this key: a direct run names it as its previous stage's (for a
    while), or a pipelined job's open here names it as one of its stages' (while what that
    open opened is open: `holder`, `pipe_holder`)."""

    key: str
    holder: str = ""


@dataclass
class ReleasePeers:
    """What a pipelined job's open (`holder`) opened is no longer open here: the keys it named
    are not allowed on its account (another open of the same name holds its own)."""

    holder: str


def pipe_holder(msg: p.PipeOpen) -> str:
    """One open of a pipelined job: its name and the broker's id of that open (a job closed
    and opened again under its name, or opened twice, is another holder)."""
    return f"{msg.job}#{msg.id}"


@dataclass
class RunStage:
    """A Run through a stage on the executor; its RunOutput comes back."""

    msg: p.Run
    parts: list[dict[str, Any]]


@dataclass
class RunChunk:
    """One micro-batch of a direct run through this worker's stage; its RunOutput comes back."""

    run: DirectRun
    chunk: int
    tensors: dict[str, Any]


@dataclass
class LoadStage:
    """A Load on the executor; its LoadInfo comes back."""

    msg: p.Load
    keep: list[StageKey]


@dataclass
class EvictStage:
    msg: p.Evict


@dataclass
class DropStage:
    msg: p.DropStage


@dataclass
class FreeKV:
    """Drop the KV of sequences that ended (`p.FreeSeqs`): nothing comes back; or, with `park`,
    preempt them: (parked, dropped) comes back, answered `SeqsParked`."""

    msg: p.FreeSeqs


@dataclass
class PrepareStage:
    """Read a stage's weights into the host tier (on a thread); (blocks, host stage) comes back."""

    msg: p.DeployStage
    spec: ModelSpec
    epoch: int
    started: float


@dataclass
class AddStage:
    """A prepared stage, for the executor to hold; `kv_share`: its spec's (generation)."""

    key: StageKey
    blocks: Any
    host: Any
    kv_share: float = 0.5


@dataclass
class OpenJob:
    """Open a training job (on the thread that opens jobs), or a stage of a pipelined one
    (`p.PipeOpen`); its `p.OpenedJob` comes back."""

    msg: p.TrainOpen | p.PipeOpen
    epoch: int


@dataclass
class CloseJob:
    """Close a training job (on the thread that opens jobs, so a close never overtakes the open
    before it); None comes back. `answer`: the broker asked (else it forgot the job)."""

    msg: p.TrainClose
    answer: bool = True


@dataclass
class SubmitStep:
    """A training step for the training executor; its StepResult comes back. `ledger`: the
    job's when it was submitted (a job closed and opened again meanwhile has another)."""

    msg: p.TrainStep
    ledger: StepLedger[Answer]
    inputs: Any
    targets: torch.Tensor


@dataclass
class Evaluate:
    """An evaluation for the training executor; its StepResult comes back."""

    msg: p.TrainEval
    inputs: Any
    targets: torch.Tensor


@dataclass
class SaveJob:
    """A checkpoint of a job into `path`; (the path as the client wrote it, the step) comes
    back."""

    msg: p.TrainSave
    path: Path


@dataclass
class PipeStep:
    """A step of a pipelined job, for its coordinator (the job's thread); answered by the
    runner (`WorkerCore.pipe_answered`)."""

    msg: p.TrainStep
    inputs: Any
    targets: torch.Tensor


@dataclass
class PipeEval:
    """An evaluation of a pipelined job, for its coordinator (after the steps before it)."""

    msg: p.TrainEval
    inputs: Any
    targets: torch.Tensor


@dataclass
class PipeSave:
    """A save of a pipelined job, for its coordinator (after the steps sent before it)."""

    msg: p.TrainSave


@dataclass
class PipeHopIn:
    """A hop of a pipelined job from another stage's worker, for the job's thread."""

    hop: p.PipeHop


Work = (
    SendHop
    | RunStage
    | RunChunk
    | LoadStage
    | EvictStage
    | DropStage
    | FreeKV
    | PrepareStage
    | AddStage
    | OpenJob
    | CloseJob
    | SubmitStep
    | Evaluate
    | SaveJob
    | PipeStep
    | PipeEval
    | PipeSave
    | PipeHopIn
)
Action = Send | AllowPeer | ReleasePeers | Work


@dataclass
class JobOpening:
    """What a TrainOpen asks for, checked: built by the shell's thread (`gpu_worker.training`)."""

    spec: ModelSpec
    config: TrainConfig
    resume: Path | None
    target_bytes: int


@dataclass(eq=False)
class WorkerCore:
    name: str
    train_bytes: int = 0
    roots: Roots = field(default_factory=lambda: Roots.of(None, None, "worker"))
    allow: tuple[str, ...] = DEFAULT_ALLOW
    direct: DirectRuns = field(default_factory=DirectRuns)
    keep_results: int = KEEP_RESULTS
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("worker"))

    def __post_init__(self) -> None:
        # For lines logged per message: whoever reaches our sockets cannot flood the log.
        self.log_throttle = LogThrottle(self.log)
        self.out: list[Action] = []
        # The job ledger: each open training job's steps (see the module docstring).
        self.jobs: dict[str, StepLedger[Answer]] = {}
        # The stages of pipelined jobs held here, by job: what the broker opened them with
        # (their ticket and their peers), once open; the steps handed to their coordinators,
        # by the broker's call id: (their job, their seq).
        self.pipes: dict[str, p.PipeOpen] = {}
        self.pipe_steps: dict[int, tuple[str, int]] = {}
        # What each stage was built from (`protocol.stage_digest`), reported with it.
        self.digests: dict[StageKey, str] = {}
        self.last_load = 0  # id of the last Load handled, carried by each `Resident` report
        # Bumped when a broker registers us afresh (see the module docstring).
        self.epoch = 0

    def drain(self) -> list[Action]:
        out, self.out = self.out, []
        return out

    def _send(self, msg: p.Message) -> None:
        self.out.append(Send(msg))

    def _fail(self, ref: int | None, exc: BaseException) -> None:
        if not isinstance(exc, FlowmeshError):
            self.log_throttle.error("command %s failed: %r", ref, exc)
        self._send(p.error_for(exc, ref))

    def registered_again(self) -> None:
        """A broker that did not know us (it restarted, or lost us) had our inventory with the
        registration, adopts what it knows and tells us to drop the rest (`DropStage`,
        `TrainClose`). What is still being prepared was asked for by the broker before: it is
        dropped when ready. Its direct runs it will neither wait for nor cancel."""
        self.epoch += 1
        self.direct.reset()

    def tick(self, now: float) -> None:
        """Hops kept for runs not announced go when they are too old, whether or not more Hops
        come (`DirectRuns.expire`)."""
        self.direct.expire(now)

    # ================================================================== the broker's messages

    def handle(self, msg: p.Message, now: float) -> None:
        """One message from the broker. Raises what refuses it (the shell answers the error)."""
        if isinstance(msg, p.Run):
            if msg.ticket:
                self._direct_run(msg)
            else:
                self.out.append(RunStage(msg, run_parts(msg)))
        elif isinstance(msg, p.CancelRun):
            self.direct.cancel(msg.id)
        elif isinstance(msg, p.Load):
            self._load(msg)
        elif isinstance(msg, p.Evict):
            self.out.append(EvictStage(msg))
        elif isinstance(msg, p.DeployStage):
            self._deploy_stage(msg, now)
        elif isinstance(msg, p.DropStage):
            self.out.append(DropStage(msg))
            self.digests.pop((msg.model, msg.stage), None)
        elif isinstance(msg, p.FreeSeqs):
            self.out.append(FreeKV(msg))
        elif isinstance(msg, p.TrainStep):
            self._train_step(msg)
        elif isinstance(msg, p.TrainEval):
            self._train_eval(msg)
        elif isinstance(msg, p.TrainOpen):
            self.out.append(OpenJob(msg, self.epoch))
        elif isinstance(msg, p.PipeOpen):
            self._pipe_open(msg)
        elif isinstance(msg, p.TrainSave):
            self._train_save(msg)
        elif isinstance(msg, p.TrainClose):
            self.out.append(CloseJob(msg))
        elif isinstance(msg, p.Error):
            self.log.warning("broker answered %s: %s %s", msg.id, msg.code, msg.reason)
        else:
            raise FlowmeshError(Code.BAD_REQUEST, f"a worker does not take {msg.TYPE}")

    def _load(self, msg: p.Load) -> None:
        keep = []
        for k in msg.keep:
            if len(k) != 2 or not isinstance(k[0], str) or not isinstance(k[1], int):
                raise FlowmeshError(
                    Code.BAD_REQUEST, f"load keep: expected [model, stage], got {k!r}"
                )
            keep.append((k[0], k[1]))
        # Reported with the `Resident` the load causes (the shell reports after each one, even
        # when nothing changed: the broker's expectation of what it evicts is settled by it).
        self.last_load = msg.id
        self.out.append(LoadStage(msg, keep))

    def _check_files(self, spec: ModelSpec) -> None:
        """A spec's files are read only under this worker's roots."""
        if spec.weights is not None:
            self.roots.readable(spec.weights, "weights")
        if spec.hf is not None:
            self.roots.readable(spec.hf, "hf directory")

    def _deploy_stage(self, msg: p.DeployStage, now: float) -> None:
        spec = msg.spec  # checked on receipt, as the plan is
        check_factory(spec.factory, self.allow, f"worker {self.name}")
        self._check_files(spec)
        self.out.append(PrepareStage(msg, spec, self.epoch, now))

    # ================================================================== direct runs

    def _direct_run(self, msg: p.Run) -> None:
        """A stage of a direct run: stage 0 cuts its inputs into micro-batches and computes
        them; a later stage computes each micro-batch as it arrives from the stage before."""
        if not msg.parts:
            raise FlowmeshError(Code.BAD_REQUEST, "a run needs parts")
        if msg.gen is not None and (msg.chunks != 1 or len(msg.parts) != 1):
            # Its sequences' tokens are not rows to cut: each iteration goes whole.
            raise FlowmeshError(
                Code.BAD_REQUEST, f"run {msg.id}: a generation run has one part and one chunk"
            )
        if not msg.from_peer:
            merged, _ = concat_parts(run_parts(msg), torch.device("cpu"))
            rows = sum(r for _, r in msg.parts)
            if not 1 <= msg.chunks <= rows:
                raise FlowmeshError(
                    Code.BAD_REQUEST, f"run {msg.id}: {msg.chunks} chunks of {rows} rows"
                )
        if msg.from_key:
            self.out.append(AllowPeer(msg.from_key))
        run, early = self.direct.announce(msg)
        if msg.from_peer:
            for hop in early:
                self._direct_chunk(run, hop.chunk, hop.tensors)
            return
        pieces = {n: torch.tensor_split(t, msg.chunks, dim=0) for n, t in merged.items()}
        for i in range(msg.chunks):
            run.seen.add(i)
            self._direct_chunk(run, i, {n: ts[i] for n, ts in pieces.items()})

    def on_peer(self, msg: p.Message, key: str, now: float) -> None:
        """What another worker sent to our peer socket: activations, nothing else. `key`: the
        sender's CURVE key ("" without keys). Raises what refuses it."""
        if isinstance(msg, p.Error):
            self.log_throttle.warning("a peer answered %s: %s %s", msg.id, msg.code, msg.reason)
            return
        if isinstance(msg, p.PipeHop):
            pipe = self.pipes.get(msg.job)
            if pipe is None or msg.ticket != pipe.ticket or not msg.stage < len(pipe.peers):
                raise FlowmeshError(Code.NOT_ALLOWED, f"no pipelined job {msg.job!r} here")
            sender = pipe.peers[msg.stage]
            if sender.key and key != sender.key:
                raise FlowmeshError(
                    Code.NOT_ALLOWED, f"job {msg.job!r}: stage {msg.stage}'s hop from another key"
                )
            self.out.append(PipeHopIn(msg))
            return
        if not isinstance(msg, p.Hop):
            raise FlowmeshError(Code.BAD_REQUEST, f"a worker's peer socket takes no {msg.TYPE}")
        run = self.direct.accept(msg, now, sender=key)
        if run is not None:
            self._direct_chunk(run, msg.chunk, msg.tensors)

    def _direct_chunk(self, run: DirectRun, chunk: int, tensors: dict[str, Any]) -> None:
        if self.direct.live(run):  # else given up (failed, or cancelled by the broker)
            self.out.append(RunChunk(run, chunk, tensors))

    def _chunk_done(self, work: RunChunk, out: RunOutput) -> None:
        run, msg = work.run, work.run.msg
        if not self.direct.live(run):
            return
        run.compute_s += out.compute_s
        run.wait_s += out.wait_s
        if run.last:
            run.outputs[work.chunk] = out.parts[0]
        else:
            hop = p.Hop(
                id=msg.id,
                ticket=msg.ticket,
                model=msg.model,
                stage=msg.stage + 1,
                chunk=work.chunk,
                tensors={n: t.contiguous() for n, t in out.parts[0].items()},
            )
            self.out.append(SendHop(run, hop))  # done here once it went
            return
        if self.direct.finished(run):
            self._direct_answer(run)

    def _direct_answer(self, run: DirectRun) -> None:
        msg = run.msg
        try:
            chunks = [run.outputs[i] for i in range(msg.chunks)]
            names = list(chunks[0])
            merged = {n: torch.cat([c[n] for c in chunks], dim=0) for n in names}
            parts = split_rows(merged, [r for _, r in msg.parts])
        except Exception as exc:
            # (`finished` already let the run go, so `_direct_failed` would take it as
            # answered: the error is its one answer.)
            self._fail(msg.id, exc)
            return
        self._send(
            p.RunResult(
                id=msg.id,
                model=msg.model,
                stage=msg.stage,
                tensors=parts,
                info=p.RunInfo(compute_s=run.compute_s, wait_s=run.wait_s),
            )
        )

    def _direct_failed(self, run: DirectRun, exc: BaseException) -> None:
        if not self.direct.live(run):
            return  # failed once already (one answer per run), or a forgotten broker's
        self.direct.cancel(run.msg.id)
        self._fail(run.msg.id, exc)

    # ================================================================== training jobs

    def _trains(self) -> None:
        if self.train_bytes <= 0:
            raise FlowmeshError(
                Code.UNAVAILABLE, f"worker {self.name} takes no training jobs (--train-bytes 0)"
            )

    def _ledger(self, job: str) -> StepLedger[Answer]:
        self._trains()
        ledger = self.jobs.get(job)
        if ledger is None:
            raise FlowmeshError(Code.MODEL_NOT_FOUND, f"no training job {job!r} here")
        return ledger

    def job_opening(self, msg: p.TrainOpen) -> JobOpening:
        """What `msg` asks to open, checked (on the shell's thread that opens jobs: reading a
        checkpoint's configuration takes a file)."""
        self._trains()
        spec = msg.spec
        check_factory(spec.factory, self.allow, f"worker {self.name}")
        self._check_files(spec)
        resume = None if msg.resume is None else self.roots.readable(msg.resume, "checkpoint")
        if msg.config is not None:
            config = msg.config
        elif resume is not None:
            config = config_from(read_meta(resume))
        else:
            raise FlowmeshError(Code.BAD_REQUEST, "a training job needs a configuration")
        # Chunk target: half the training bytes, so that one sub-model task computes while the
        # next is brought in.
        target = msg.chunk_bytes or self.train_bytes // 2
        return JobOpening(spec, config, resume, target)

    def _train_step(self, msg: p.TrainStep) -> None:
        ledger = self._ledger(msg.job)
        if ledger.taken(msg.seq):
            raise FlowmeshError(
                Code.BAD_REQUEST,
                f"step seq {msg.seq} of {msg.job!r} was already taken (last {ledger.last}); "
                "not run twice",
            )
        pipe = self.pipes.get(msg.job)
        if pipe is not None and pipe.stage != 0:
            raise FlowmeshError(
                Code.BAD_REQUEST, f"job {msg.job!r}: its steps go to its stage 0's worker"
            )
        ledger.take(msg.seq)  # even a step refused below: a seq is never run twice
        inputs, targets = step_batch(msg, "a training step")
        rows = int(targets.shape[0]) if targets.dim() else 0
        if pipe is not None and rows > pipe.batch:  # (a memory-flow job's says so on submit)
            raise FlowmeshError(
                Code.BAD_REQUEST,
                f"a batch of {rows} is over the batch of {pipe.batch} job {msg.job!r} was "
                "opened for (its micro-batches were sized for that many rows): send at most "
                f"{pipe.batch}, or open a job for {rows}",
            )
        ledger.start(msg.seq)
        if pipe is not None:
            self.pipe_steps[msg.id] = (msg.job, msg.seq)
            self.out.append(PipeStep(msg, inputs, targets))
        else:
            self.out.append(SubmitStep(msg, ledger, inputs, targets))

    def _pipe_open(self, msg: p.PipeOpen) -> None:
        self._trains()
        check_factory(msg.spec.factory, self.allow, f"worker {self.name}")
        self._check_files(msg.spec)
        if len(msg.peers) < 2 or msg.stage >= len(msg.peers):
            raise FlowmeshError(
                Code.BAD_REQUEST, f"stage {msg.stage} of a pipeline of {len(msg.peers)} workers"
            )
        # (A job of that name still open here is refused on the thread that opens jobs, after
        # any close the broker sent before this open: `WorkerHands.open_pipe`.)
        if msg.resume is not None:
            self.roots.readable(msg.resume, "checkpoint")
        elif msg.config is None:
            raise FlowmeshError(Code.BAD_REQUEST, "a training job needs a configuration")
        for peer in msg.peers:
            if peer.key:
                self.out.append(AllowPeer(peer.key, pipe_holder(msg)))
        self.out.append(OpenJob(msg, self.epoch))

    def pipe_answered(self, job: str, msg: p.Message) -> None:
        """The coordinator of pipelined job `job` answered a step (`TrainStepResult`, or an
        `Error` with the step's id)."""
        ledger = self.jobs.get(job)
        step = self.pipe_steps.pop(getattr(msg, "id", -1), None)
        if ledger is not None and step is not None:
            _, seq = step
            answer: Answer
            if isinstance(msg, p.TrainStepResult):
                answer = p.StepOk(seq=seq, loss=msg.loss, step=msg.step, metrics=dict(msg.metrics))
            else:
                assert isinstance(msg, p.Error)
                answer = p.StepFailed(seq=seq, code=msg.code, reason=msg.reason)
            ledger.settle(seq, answer)
        self._send(msg)

    def _train_eval(self, msg: p.TrainEval) -> None:
        self._ledger(msg.job)
        inputs, targets = step_batch(msg, "an evaluation")
        if msg.job in self.pipes:
            self.out.append(PipeEval(msg, inputs, targets))
            return
        # Submitted in arrival order, as steps are: it runs after every step that came first.
        self.out.append(Evaluate(msg, inputs, targets))

    def _train_save(self, msg: p.TrainSave) -> None:
        self._ledger(msg.job)
        if msg.job in self.pipes:
            self.roots.writable(msg.path, "checkpoint")  # each stage checks its own roots too
            self.out.append(PipeSave(msg))
            return
        self.out.append(SaveJob(msg, self.roots.writable(msg.path, "checkpoint")))

    # ================================================================== work finished

    def finished(self, work: Work, result: Any, now: float) -> None:
        """`work` ended with `result`: what it returned, or the exception it failed with."""
        failed = isinstance(result, BaseException)
        if isinstance(work, RunChunk | SendHop):
            if failed:
                self._direct_failed(work.run, result)
            elif isinstance(work, RunChunk):
                self._chunk_done(work, result)
            else:
                self.direct.finished(work.run)
        elif isinstance(work, SubmitStep):
            self._step_done(work, result)
        elif isinstance(work, PipeStep) and failed:
            # Failed before its runner took it (its job closed meanwhile): answered as the
            # runner's errors are, so that the step is no longer counted as in flight.
            self.pipe_answered(work.msg.job, p.error_for(result, work.msg.id))
        elif isinstance(work, PipeHopIn):
            if failed:  # a hop has no id to answer: the step it belongs to fails on its own
                self.log_throttle.error("a pipelined job's hop failed: %r", result)
        elif isinstance(work, OpenJob):
            self._job_opened(work, result)
        elif isinstance(work, CloseJob):
            self._job_closed(work, result)
        elif isinstance(work, PrepareStage):
            self._stage_prepared(work, result, now)
        elif isinstance(work, FreeKV):
            m = work.msg
            if failed:  # FreeSeqs has no id to answer with an error
                self.log_throttle.error("freeing sequences failed: %r", result)
                result = ([], list(m.seqs))  # none of them is parked
            if m.park:
                parked, dropped = result
                self._send(
                    p.SeqsParked(model=m.model, stage=m.stage, parked=parked, dropped=dropped)
                )
        elif failed:
            self._fail(getattr(getattr(work, "msg", None), "id", None), result)
        elif isinstance(work, RunStage):
            if not result.answered:  # else answered from its compute lane already
                self._send(run_result(work.msg, result))
        elif isinstance(work, LoadStage):
            self._send(loaded(work.msg, result))
        elif isinstance(work, Evaluate):
            m = work.msg
            r: StepResult = result
            self._send(
                p.TrainEvalResult(id=m.id, job=m.job, loss=r.loss, step=r.step, metrics=r.metrics)
            )
        elif isinstance(work, SaveJob):
            path, step = result
            self._send(p.TrainSaved(id=work.msg.id, job=work.msg.job, path=path, step=step))

    def _stage_prepared(self, work: PrepareStage, result: Any, now: float) -> None:
        msg = work.msg
        if isinstance(result, BaseException):
            self._fail(msg.id, result)
            return
        if work.epoch != self.epoch:
            self.log.info(
                "stage prepared for a broker that forgot it, dropped model=%s stage=%d",
                msg.model,
                msg.stage,
            )
            return
        blocks, host = result
        key = (msg.model, msg.stage)
        self.out.append(AddStage(key, blocks, host, work.spec.kv_share))
        self.digests[key] = p.stage_digest(msg.spec, msg.plan, msg.stage)
        self.log.info("stage ready model=%s stage=%d bytes=%d", msg.model, msg.stage, host.nbytes)
        self._send(
            p.StageReady(
                id=msg.id,
                model=msg.model,
                stage=msg.stage,
                nbytes=host.nbytes,
                seconds=now - work.started,
            )
        )

    def _job_opened(self, work: OpenJob, result: Any) -> None:
        msg = work.msg
        failed = isinstance(result, BaseException) or work.epoch != self.epoch
        if failed and isinstance(msg, p.PipeOpen):
            self.out.append(ReleasePeers(pipe_holder(msg)))  # what `_pipe_open` allowed for it
        if isinstance(result, BaseException):
            self._fail(msg.id, result)
            return
        if work.epoch != self.epoch:
            self.log.info("training job opened for a broker that forgot it, closed job=%s", msg.job)
            self.out.append(CloseJob(p.TrainClose(id=0, job=msg.job), answer=False))
            return

        self.jobs[msg.job] = StepLedger(self.keep_results)
        if isinstance(msg, p.PipeOpen):
            self.pipes[msg.job] = msg
        self.log.info("training job open job=%s sub_models=%d", msg.job, len(result.sub_models))
        self._send(p.JobOpened(id=msg.id, job=result))

    def _job_closed(self, work: CloseJob, result: Any) -> None:
        msg = work.msg
        self.jobs.pop(msg.job, None)
        opened = self.pipes.pop(msg.job, None)
        if opened is not None:
            self.out.append(ReleasePeers(pipe_holder(opened)))
        # Its steps still in its runner are never answered now (`WorkerHands` drops them).
        for sid in [i for i, (job, _) in self.pipe_steps.items() if job == msg.job]:
            del self.pipe_steps[sid]
        if not work.answer:
            return
        if isinstance(result, BaseException):
            self._fail(msg.id, result)
        else:
            self._send(p.TrainClosed(id=msg.id, job=msg.job))

    def _step_done(self, work: SubmitStep, result: Any) -> None:
        msg = work.msg
        # Kept for the inventory: a broker that restarted meanwhile replays the answer of a
        # step its client sends again, instead of running it twice.
        if isinstance(result, BaseException):
            err = p.error_for(result)
            work.ledger.settle(msg.seq, p.StepFailed(seq=msg.seq, code=err.code, reason=err.reason))
            self._fail(msg.id, result)
            return
        r: StepResult = result
        work.ledger.settle(
            msg.seq, p.StepOk(seq=msg.seq, loss=r.loss, step=r.step, metrics=dict(r.metrics))
        )
        self._send(step_answer(msg, r))


# ---------------------------------------------------------------------- pure helpers


def run_parts(msg: p.Run) -> list[dict[str, Any]]:
    """A Run's inputs, part by part (`Run.tensors[k]`: part k's by name)."""
    if not msg.parts or len(msg.tensors) != len(msg.parts):
        raise FlowmeshError(
            Code.BAD_REQUEST,
            f"a run of {len(msg.parts)} parts carries tensors for {len(msg.tensors)}",
        )
    if any(not part for part in msg.tensors):
        raise FlowmeshError(Code.BAD_REQUEST, "every part of a run needs its tensors")
    return msg.tensors  # type: ignore[return-value]  # decoded: one name -> ref map per part


def run_result(msg: p.Run, out: RunOutput) -> p.RunResult:
    """The answer to `msg`: each part's outputs. Safe on any thread."""
    tensors = list(out.parts)
    return p.RunResult(
        id=msg.id,
        model=msg.model,
        stage=msg.stage,
        tensors=tensors,
        info=p.RunInfo(compute_s=out.compute_s, wait_s=out.wait_s),
    )


def loaded(msg: p.Load, info: LoadInfo) -> p.Loaded:
    return p.Loaded(
        id=msg.id, model=msg.model, stage=msg.stage, nbytes=info.nbytes, seconds=info.seconds
    )


def step_batch(msg: p.TrainStep | p.TrainEval, what: str) -> tuple[Any, torch.Tensor]:
    """(inputs, targets) of a step or an evaluation: one tensor, or the keyword inputs by name
    (`p.batch_names`)."""
    missing = [n for n in p.batch_names(msg.inputs) if n not in msg.tensors]
    if missing:
        raise FlowmeshError(Code.BAD_REQUEST, f"{what} needs tensors {missing}")
    # Copies: the request keeps its batch until it ends, and model code may write its input
    # in place; a received frame is read-only.
    t = {name: ref.tensor().clone() for name, ref in msg.tensors.items()}
    if msg.inputs is None:
        return t["inputs"], t["targets"]
    return {name: t[name] for name in msg.inputs}, t["targets"]
