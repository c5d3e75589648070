"""One worker's stage of a pipelined training job, driven by messages (issue 23 §2).

The broker opens the job's stages on as many workers (`p.PipeOpen`) and sends each step
(`p.TrainStep`) to stage 0's worker, the step's coordinator. From there the step goes worker
to worker over the peer sockets, as `p.PipeHop`s carrying the job's ticket:

- the coordinator sends the step's targets to the last stage ("target"), then each
  micro-batch's input through its own forward; each stage passes its output on ("act", with
  the job's RNG state), the last one computes the loss and its backward and sends its input's
  gradient back ("grad"), and each stage passes the gradient of its own input back in turn;
  every stage runs what comes in the order it comes, so the last one runs each micro-batch's
  backward right after its forward, and the coordinator keeps at most as many micro-batches in
  flight as there are stages, starting the next one's forward as each backward ends here
  (1F1B's bound: a stage holds the activations of at most that many micro-batches, not of all
  of the step's as in GPipe's fill-drain; the gradients add up in the same order either way);
- a model whose forwards draw random numbers (dropout) has its micro-batches' forwards run one
  after the other across the stages: the last stage sends the RNG state back to the
  coordinator ("rng"), which starts the next micro-batch from it, so every forward draws what
  it would in one process. A model that drew nothing in a step has its forwards overlap in the
  steps that follow (`random` off); one that draws after all is put back to the first way;
- once a stage's backwards are done: a stage borrowing a tied weight sends its gradient to the
  weight's owner ("tied_grad"), and an owner waits for its borrowers'; with a clip, every stage
  sends its gradients' norms to the coordinator ("norms"), which sends back the global norm
  ("total"); the stage updates, an owner sends the new value of a lent weight to its borrowers
  ("tied_value"), and the stage reports to the coordinator ("done", the loss from the last
  stage). The coordinator answers the broker once every stage is done, and only then begins the
  next step (a synchronous update, as GPipe's flush).

An evaluation (`on_eval`) waits for the step under way to end, like a step, and runs its
micro-batches' forwards in eval mode through the stages, the last one summing their losses;
nothing changes, the RNG state included. Its micro-batches are the step's count, but none has
more rows than a step's micro-batch at the batch the job was opened for (`batch`): that is
what each stage's memory was planned for, as memory flow bounds its evaluations. A save
(`on_save`) waits likewise; the coordinator asks every stage to write its part of the
checkpoint ("save": `gpu_worker.pipe_checkpoint`) and answers once each has ("saved").
Evaluations and saves have a deadline as steps do: a hop lost on the way fails the one under
way with TIMEOUT, and what was queued behind it goes on, where it waited for ever.

A failure on any stage ("fail") fails the step everywhere ("abort"): no stage updates from it
(a failure in an update breaks the job: its stages no longer agree). Plain logic: `on_step` and
`on_hop` are called on the job's own thread, where the stage computes; `send(stage, hop)` and
`answer(msg)` take what goes out. A hop this stage sends itself is handled after the one being
handled, never inside it.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from gpu_worker.model_code import MODEL_CODE_LOCK
from gpu_worker.pipe_checkpoint import save_stage
from gpu_worker.pipe_stage import PipeStage, job_rng, micro_batches, split_rows, total_norm
from gpu_worker.train_job import RngState

log = logging.getLogger("gpu_worker.pipe_runner")

# How long a step may take from its start on the coordinator when its TrainStep names no
# timeout: past it (a hop lost with its worker still alive, say), it fails everywhere.
STEP_TIMEOUT_S = 120.0


def rng_tensors(rng: RngState) -> dict[str, torch.Tensor]:
    out = {"rng": rng[0]}
    if rng[1] is not None:
        out["rng_cuda"] = rng[1]
    return out


def _tensor(t: Any) -> torch.Tensor:
    """A received tensor (a `TensorRef` off the wire, a tensor in process)."""
    return t.tensor() if hasattr(t, "tensor") else t


def rng_of(tensors: dict[str, Any]) -> RngState:
    cuda = tensors.get("rng_cuda")
    state = _tensor(tensors["rng"]).to("cpu", torch.uint8).clone()
    return state, (_tensor(cuda).to("cpu", torch.uint8).clone() if cuda is not None else None)


def _failure(exc: BaseException) -> FlowmeshError:
    if isinstance(exc, FlowmeshError):
        return exc
    return FlowmeshError(Code.INTERNAL, f"{type(exc).__name__}: {exc}")


@dataclass
class _Step:
    seq: int
    serial: bool = True  # the coordinator's: forwards one after the other
    sent: int = 0  # the coordinator's: micro-batches whose forward it began
    # The coordinator's, forwards one after the other: where the next one starts, once known.
    next_rng: RngState | None = None
    held: int = 0  # the most micro-batches whose activations this stage held at once
    bwd: int = 0  # backwards done here (the last stage: its forward-loss-backwards)
    drew: bool = False
    targets: list[torch.Tensor] | None = None
    early: list[p.PipeHop] = field(default_factory=list)  # acts before the targets came
    tied_in: int = 0
    sent_norms: bool = False
    total: torch.Tensor | None = None
    updated: bool = False
    values_in: int = 0
    loss: float = 0.0
    failed: bool = False
    ended: bool = False
    deadline: float = math.inf  # the coordinator's: when it fails if not answered
    # The coordinator's: the broker's call, the inputs, what came back from the stages.
    call: int = 0
    inputs: list[Any] = field(default_factory=list)
    norms: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    norms_in: int = 0
    done: int = 0
    drew_any: bool = False
    result: float = 0.0
    grad_norm: float | None = None


@dataclass
class _Eval:
    """An evaluation under way: on the coordinator, its call and deadline; on the last stage,
    its targets, each micro-batch's share of the rows, and the sums so far."""

    ref: int
    targets: list[torch.Tensor] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    done: int = 0
    loss: float = 0.0
    right: int = 0
    counted: int = 0
    deadline: float = math.inf


@dataclass
class _Save:
    """The coordinator's save under way: its call (which its stages' hops carry as their
    `seq`, so that a late answer to a save given up is not counted for the next one)."""

    ref: int
    path: str
    deadline: float = math.inf
    answers: int = 0
    code: str = ""
    reason: str = ""


def _deadline_s(timeout_ms: int | None) -> float:
    return timeout_ms / 1000 if timeout_ms else STEP_TIMEOUT_S


def save_to(
    stage: PipeStage, path: str, step: int, rng: RngState | None, save_id: str = ""
) -> None:
    save_stage(stage, path, step, rng, save_id)


class PipeRunner:
    """Stage `stage.stage` of pipelined job `stage.job` on this worker."""

    def __init__(
        self,
        stage: PipeStage,
        ticket: int,
        send: Callable[[int, p.PipeHop], None],
        answer: Callable[[p.Message], None],
        step_count: int = 0,
        save: Callable[[PipeStage, str, int, RngState | None, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        batch: int | None = None,
    ) -> None:
        if len(stage.ranges) < 2:
            raise FlowmeshError(Code.BAD_REQUEST, "a pipelined job has at least two stages")
        self.stage = stage
        self.job = stage.job
        self.ticket = ticket
        self.n = len(stage.ranges)
        self._send = send
        self._answer = answer
        self.coordinator = stage.first
        self.micros = stage.config.accumulate
        # The most rows of an evaluation's micro-batch: a step's, at the batch the job was
        # opened for (None: as many as the evaluation's rows split into `micros`).
        self.eval_rows = max(1, batch // self.micros) if batch else None
        self.clip = stage.config.clip_grad_norm is not None
        self.step_count = step_count  # steps applied
        self.last_seq = 0  # the last step begun here
        self.current: _Step | None = None
        self.later: list[p.PipeHop] = []  # hops of a step after the current one
        # The coordinator's: steps (a TrainStep, inputs, targets) and saves (its id and path)
        # not begun, in the order they came; the save under way.
        self.queued: deque[tuple[Any, ...]] = deque()
        self._saving: _Save | None = None
        self._save = save or save_to
        # The evaluation under way (coordinator, last stage), early hops of one not begun here
        # (last stage), and the highest evaluation id ended here: later hops of it are dropped.
        self._eval: _Eval | None = None
        self._eval_early: list[p.PipeHop] = []
        self._eval_ended = 0
        self.broken: str | None = None
        self.random = True
        self.rng: RngState = job_rng(stage.config.seed)
        self._local: deque[p.PipeHop] = deque()
        self._busy = False
        self.clock = clock

    # -- entry points ------------------------------------------------------------------------

    def on_step(self, msg: p.TrainStep, inputs: Any, targets: torch.Tensor) -> None:
        """The broker's step (stage 0 only): begun now, or once the one under way has ended."""
        if not self.coordinator:
            raise FlowmeshError(Code.BAD_REQUEST, f"job {self.job!r}: steps go to stage 0")
        self.queued.append(("step", msg, inputs, targets))
        self._drain(self._next)

    def on_eval(self, msg: p.TrainEval, inputs: Any, targets: torch.Tensor) -> None:
        """The broker's evaluation (stage 0 only), after every step sent before it: the loss
        (and accuracy for class targets) of the model as it is, changing nothing."""
        if not self.coordinator:
            raise FlowmeshError(Code.BAD_REQUEST, f"job {self.job!r}: evaluations go to stage 0")
        self.queued.append(("eval", msg, inputs, targets))
        self._drain(self._next)

    def on_tick(self) -> None:
        """The coordinator: a step, evaluation or save past its deadline fails (TIMEOUT), so
        that what is queued behind it goes on (`timeout_ms` of its message, else
        STEP_TIMEOUT_S)."""
        self._drain(self._check_deadline)

    @property
    def under_way(self) -> bool:
        """Whether the coordinator has a step, evaluation or save under way (one to tick)."""
        return self.current is not None or self._eval is not None or self._saving is not None

    def _check_deadline(self) -> None:
        if not self.coordinator:
            return
        now = self.clock()
        ev, save = self._eval, self._saving
        if ev is not None and now >= ev.deadline:
            self._eval_failed(ev, FlowmeshError(
                Code.TIMEOUT,
                f"job {self.job!r}: an evaluation did not end within its time on the "
                f"pipeline's {self.n} workers (one of them did not answer); nothing changed",
            ))  # fmt: skip
        if save is not None and now >= save.deadline:
            self._saving = None
            self._answer(p.Error(
                id=save.ref, code=str(Code.TIMEOUT),
                reason=f"job {self.job!r}: the save to {save.path!r} did not end within its "
                f"time on the pipeline's {self.n} workers (one of them did not answer): "
                "it may be incomplete there; save again",
            ))  # fmt: skip
            self._next()
        step = self.current
        if step is None or now < step.deadline:
            return
        late = FlowmeshError(
            Code.TIMEOUT,
            f"job {self.job!r}: step seq {step.seq} did not end within its time on the "
            f"pipeline's {self.n} workers (one of them did not answer); "
            + ("the job is broken" if step.updated else "it was applied on none"),
        )
        self._fail(step, late)

    def on_save(self, ref: int, path: str, timeout_ms: int | None = None) -> None:
        """The broker's save (stage 0 only), after every step sent before it."""
        if not self.coordinator:
            raise FlowmeshError(Code.BAD_REQUEST, f"job {self.job!r}: saves go to stage 0")
        self.queued.append(("save", ref, path, timeout_ms))
        self._drain(self._next)

    def on_hop(self, hop: p.PipeHop) -> None:
        """A hop from another stage's worker (its ticket checked by the caller, or here)."""
        if hop.ticket != self.ticket or hop.job != self.job:
            raise FlowmeshError(Code.NOT_ALLOWED, f"job {self.job!r}: a hop of another job")
        self._drain(lambda: self._take(hop))

    def _drain(self, first: Callable[[], None]) -> None:
        if self._busy:  # called from inside a handler: later, in order
            raise AssertionError("PipeRunner entered twice")
        self._busy = True
        try:
            # Model code sets torch's process-wide generator (`gpu_worker.model_code`).
            with MODEL_CODE_LOCK:
                first()
                while self._local:
                    self._take(self._local.popleft())
        finally:
            self._busy = False

    def _hop(self, to: int, kind: str, seq: int, micro: int = 0, **kw: Any) -> None:
        hop = p.PipeHop(
            id=0, job=self.job, ticket=self.ticket, seq=seq, stage=self.stage.stage,
            kind=kind, micro=micro, **kw,
        )  # fmt: skip
        if to == self.stage.stage:
            self._local.append(hop)
        else:
            self._send(to, hop)

    # -- the coordinator ---------------------------------------------------------------------

    def _next(self) -> None:
        """Begin the next queued step if none is under way."""
        while self.current is None and self._saving is None and self._eval is None and self.queued:
            item = self.queued.popleft()
            if item[0] == "eval":
                self._begin_eval(*item[1:])
                continue
            if item[0] == "save":
                _, ref, path, timeout_ms = item
                self._saving = _Save(ref, path, self.clock() + _deadline_s(timeout_ms))
                # One id for the save's files on every stage: a resume never takes two saves'
                # files for one (`gpu_worker.pipe_checkpoint`).
                save_id = secrets.token_hex(8)
                for s in range(self.n):
                    self._hop(s, "save", ref, path=path, save_id=save_id)
                return
            _, msg, inputs, targets = item
            if self.broken is not None:
                self._answer(p.Error(id=msg.id, code=str(Code.MODEL_ERROR), reason=self.broken))
                continue
            step = self.current = _Step(msg.seq, serial=self.random, call=msg.id)
            step.deadline = self.clock() + _deadline_s(msg.timeout_ms)
            self.last_seq = msg.seq
            try:
                step.inputs = micro_batches(inputs, self.micros)
                ys = list(targets.chunk(self.micros)) if self.micros > 1 else [targets]
                if len(ys) != self.micros or len(step.inputs) != self.micros:
                    raise FlowmeshError(
                        Code.BAD_REQUEST,
                        f"job {self.job!r}: a batch of {targets.shape[0]} rows cannot make "
                        f"{self.micros} micro-batches",
                    )
                self._hop(self.n - 1, "target", step.seq,
                          tensors={f"y{i}": y for i, y in enumerate(ys)})  # fmt: skip
                step.next_rng = self.rng
                self._feed(step)
            except Exception as exc:
                self._fail(step, _failure(exc))

    def _begin_eval(self, msg: p.TrainEval, inputs: Any, targets: torch.Tensor) -> None:
        """The coordinator: the evaluation's micro-batches (the step's count, the last one
        shorter when the rows do not split evenly; more, of a step's micro-batch, when it has
        more rows than the job's batch) through stage 0, on to the others."""
        rows = int(targets.shape[0])
        size = max(1, -(-rows // self.micros))
        if self.eval_rows is not None:
            size = min(size, self.eval_rows)
        ys = list(targets.split(size))
        xs = split_rows(inputs, size)
        ev = self._eval = _Eval(msg.id, deadline=self.clock() + _deadline_s(msg.timeout_ms))
        try:
            self._hop(self.n - 1, "target", msg.id, evaluating=True,
                      values=[len(y) / rows for y in ys],
                      tensors={f"y{i}": y for i, y in enumerate(ys)})  # fmt: skip
            for m, x in enumerate(xs):
                y = self.stage.evaluate(x, self.rng)
                self._hop(1, "act", msg.id, m, tensors={"x": y}, evaluating=True)
        except Exception as exc:
            self._eval_failed(ev, _failure(exc))

    def _take_eval(self, hop: p.PipeHop) -> None:
        """A hop of an evaluation: forwards on, the last stage's losses, the end, a failure."""
        if hop.kind in ("done", "fail"):  # the coordinator
            ev = self._eval
            if ev is None or ev.ref != hop.seq:
                return
            if hop.kind == "fail":
                self._eval_failed(ev, FlowmeshError(hop.code or Code.INTERNAL, hop.reason))
                return
            right, counted = int(hop.values[0]), int(hop.values[1])
            metrics = {"nonfinite": float(not math.isfinite(hop.loss))}
            if counted:
                metrics["accuracy"] = right / counted
            self._eval = None
            self._answer(p.TrainEvalResult(id=ev.ref, job=self.job, loss=hop.loss,
                                           step=self.step_count, metrics=metrics))  # fmt: skip
            self._next()
            return
        if hop.seq <= self._eval_ended:
            return  # of an evaluation that ended (failed) here already
        if hop.kind == "abort":
            self._eval_ended = max(self._eval_ended, hop.seq)
            self._eval = None
            self._eval_early = [h for h in self._eval_early if h.seq != hop.seq]
            return
        try:
            if not self.stage.is_last:
                if hop.kind == "act":
                    y = self.stage.evaluate(_tensor(hop.tensors["x"]), self.rng)
                    self._hop(self.stage.stage + 1, "act", hop.seq, hop.micro,
                              tensors={"x": y}, evaluating=True)  # fmt: skip
                return
            if hop.kind == "target":
                ys = [_tensor(hop.tensors[f"y{i}"]) for i in range(len(hop.values))]
                self._eval = _Eval(hop.seq, ys, list(hop.values))
                early = [h for h in self._eval_early if h.seq == hop.seq]
                self._eval_early = [h for h in self._eval_early if h.seq != hop.seq]
                for h in early:
                    self._last_eval(h)
            elif hop.kind == "act":
                if self._eval is None or self._eval.ref != hop.seq:
                    self._eval_early.append(hop)
                else:
                    self._last_eval(hop)
        except Exception as exc:
            err = _failure(exc)
            self._eval, self._eval_ended = None, max(self._eval_ended, hop.seq)
            self._hop(0, "fail", hop.seq, code=str(err.code), reason=err.reason, evaluating=True)

    def _last_eval(self, hop: p.PipeHop) -> None:
        ev = self._eval
        assert ev is not None
        out = self.stage.evaluate(_tensor(hop.tensors["x"]), self.rng)
        loss, right, counted = self.stage.eval_loss(out, ev.targets[hop.micro],
                                                    ev.weights[hop.micro])  # fmt: skip
        ev.loss, ev.right, ev.counted = ev.loss + loss, ev.right + right, ev.counted + counted
        ev.done += 1
        if ev.done == len(ev.targets):
            self._eval, self._eval_ended = None, max(self._eval_ended, ev.ref)
            self._hop(0, "done", ev.ref, loss=ev.loss, values=[ev.right, ev.counted],
                      evaluating=True)  # fmt: skip

    def _eval_failed(self, ev: _Eval, exc: FlowmeshError) -> None:
        """The coordinator: an evaluation failed on some stage; the last stage drops it."""
        self._hop(self.n - 1, "abort", ev.ref, evaluating=True, reason=exc.reason)
        self._eval = None
        self._answer(p.Error(id=ev.ref, code=str(exc.code), reason=exc.reason))
        self._next()

    def _feed(self, step: _Step) -> None:
        """The coordinator: begin the forwards of the next micro-batches, keeping as many in
        flight as there are stages (those whose backward has not run here), each one after
        the last stage has sent the RNG state it starts from when forwards run one after the
        other."""
        while step.sent < self.micros and step.sent - step.bwd < self.n:
            rng = self.rng
            if step.serial:
                if step.next_rng is None:
                    return
                rng, step.next_rng = step.next_rng, None
            self._forward_first(step, step.sent, rng)

    def _forward_first(self, step: _Step, m: int, rng: RngState) -> None:
        step.sent = m + 1
        y, after = self.stage.forward(m, step.inputs[m], rng)
        step.drew |= not torch.equal(after[0], rng[0])
        self._hop(1, "act", step.seq, m, tensors={"x": y, **rng_tensors(after)})

    # -- every stage -------------------------------------------------------------------------

    def _take(self, hop: p.PipeHop) -> None:
        if hop.evaluating:
            self._take_eval(hop)
            return
        if hop.kind == "abort":
            self._aborted(hop.seq, hop.reason, hop.updated)
            return
        if hop.kind == "save":  # between steps: the coordinator sends it when all are done
            try:
                rng = self.rng if self.coordinator else None
                self._save(self.stage, hop.path, self.step_count, rng, hop.save_id)
                self._hop(0, "saved", hop.seq)
            except Exception as exc:
                err = _failure(exc)
                self._hop(0, "saved", hop.seq, code=str(err.code), reason=err.reason)
            return
        if hop.kind == "saved":
            self._saved(hop)
            return
        step = self.current
        if step is None and not self.coordinator and hop.seq > self.last_seq:
            step = self.current = _Step(hop.seq)
            self.last_seq = hop.seq
        if step is None or hop.seq != step.seq:
            if hop.seq > self.last_seq or (step is not None and hop.seq > step.seq):
                self.later.append(hop)  # its step begins here after the current one
            return  # else a step given up
        if step.failed:
            return
        try:
            self._handle(step, hop)
        except Exception as exc:
            self._fail(step, _failure(exc))

    def _handle(self, step: _Step, hop: p.PipeHop) -> None:
        kind, stage = hop.kind, self.stage
        if kind == "target":
            step.targets = [_tensor(hop.tensors[f"y{i}"]) for i in range(self.micros)]
            early, step.early = step.early, []
            for h in early:
                self._handle(step, h)
        elif kind == "act":
            x, rng = _tensor(hop.tensors["x"]), rng_of(hop.tensors)
            if not stage.is_last:
                y, after = stage.forward(hop.micro, x, rng)
                step.drew |= not torch.equal(after[0], rng[0])
                self._hop(stage.stage + 1, "act", step.seq, hop.micro,
                          tensors={"x": y, **rng_tensors(after)})  # fmt: skip
            elif step.targets is None:
                step.early.append(hop)
            else:
                _, dx, after = stage.last(hop.micro, x, step.targets[hop.micro], rng)
                step.drew |= not torch.equal(after[0], rng[0])
                self._hop(0, "rng", step.seq, hop.micro, tensors=rng_tensors(after))
                assert dx is not None
                self._hop(stage.stage - 1, "grad", step.seq, hop.micro, tensors={"g": dx})
                step.bwd += 1
                self._maybe_end(step)
        elif kind == "grad":
            dx = stage.backward(hop.micro, _tensor(hop.tensors["g"]))
            if not stage.first:
                assert dx is not None
                self._hop(stage.stage - 1, "grad", step.seq, hop.micro, tensors={"g": dx})
            step.bwd += 1
            if self.coordinator:
                self._feed(step)  # one out, the next one in
            self._maybe_end(step)
        elif kind == "rng":  # the coordinator's: where the next forward starts
            rng = rng_of(hop.tensors)
            if hop.micro + 1 == self.micros:
                self.rng = rng
            elif step.serial:
                step.next_rng = rng
                self._feed(step)
        elif kind == "tied_grad":
            stage.add_tied_grads({n: _tensor(t) for n, t in hop.tensors.items()})
            step.tied_in += 1
            self._maybe_end(step)
        elif kind == "norms":
            step.norms += [(o, torch.tensor(v, dtype=torch.float32))
                           for o, v in zip(hop.orders, hop.values, strict=True)]  # fmt: skip
            step.norms_in += 1
            if step.norms_in == self.n:
                total = float(total_norm(step.norms))
                step.grad_norm = total
                for s in range(self.n):
                    self._hop(s, "total", step.seq, values=[total])
        elif kind == "total":
            step.total = torch.tensor(hop.values[0], dtype=torch.float32)
            self._maybe_end(step)
        elif kind == "tied_value":
            stage.set_tied_values({n: _tensor(t) for n, t in hop.tensors.items()})
            step.values_in += 1
            self._maybe_end(step)
        elif kind == "done":
            step.done += 1
            step.result += hop.loss
            step.drew_any |= hop.drew
            if step.done == self.n:
                self._answered(step)
        elif kind == "fail":
            self._fail(step, FlowmeshError(hop.code or Code.INTERNAL, hop.reason), hop.updated)

    def _maybe_end(self, step: _Step) -> None:
        """Once every backward has run here: tied gradients and norms out, the update, tied
        values out, done."""
        stage = self.stage
        if step.ended or step.bwd < self.micros or step.tied_in < len(stage.borrowers):
            return
        if not step.sent_norms:
            step.sent_norms = True
            stage.settle_tied()
            tied = stage.tied_grads()
            for owner, names in stage.owners.items():
                self._hop(owner, "tied_grad", step.seq, tensors={
                    k: g for k, g in tied.items() if k.rpartition("@")[0] in names})  # fmt: skip
            if self.clip:
                norms = stage.norms()
                self._hop(0, "norms", step.seq, orders=[o for o, _ in norms],
                          values=[float(v) for _, v in norms])  # fmt: skip
        if self.clip and step.total is None:
            return
        if not step.updated:
            step.updated = True  # a failure from here on breaks the job
            step.held = stage.held_peak
            step.loss = stage.update(step.total)
            values = stage.tied_values()
            for borrower, names in stage.borrowers.items():
                self._hop(borrower, "tied_value", step.seq,
                          tensors={n: values[n] for n in names})  # fmt: skip
        if step.values_in < len(stage.owners):
            return
        step.ended = True
        self._hop(0, "done", step.seq, loss=step.loss, drew=step.drew)
        if not self.coordinator:
            self.step_count += 1
            self._ended()

    def _answered(self, step: _Step) -> None:
        """The coordinator: every stage is done with the step."""
        self.step_count += 1
        if step.serial and not step.drew_any:
            self.random = False
        elif not step.serial and step.drew_any:
            log.warning(
                "job=%s drew random numbers in step %d with its forwards overlapping: they run "
                "one after the other from the next step",
                self.job,
                step.seq,
            )
            self.random = True
        metrics = {
            "pipeline_stages": float(self.n),
            "serial_forwards": float(step.serial),
            # Micro-batches whose activations stage 0 held at once (at most the stages).
            "held_micro_batches": float(step.held),
            "nonfinite": float(not math.isfinite(step.result)),
        }
        if step.grad_norm is not None:  # as a memory-flow job reports it
            metrics["grad_norm"] = step.grad_norm
        self._answer(
            p.TrainStepResult(
                id=step.call, job=self.job, seq=step.seq, loss=step.result, step=self.step_count,
                metrics=metrics,
            )
        )  # fmt: skip
        self._ended()

    def _ended(self) -> None:
        """The current step is over here: the next one begins (hops that came early)."""
        self.current = None
        if self.coordinator:
            self._next()
            return
        if self.later:
            seq = min(h.seq for h in self.later)
            hops = [h for h in self.later if h.seq == seq]
            self.later = [h for h in self.later if h.seq != seq]
            self._local.extend(hops)

    def _saved(self, hop: p.PipeHop) -> None:
        save = self._saving
        if save is None or hop.seq != save.ref:
            return  # of a save given up (its deadline passed)
        save.answers += 1
        if hop.code and not save.code:
            save.code, save.reason = hop.code, f"stage {hop.stage}: {hop.reason}"
        if save.answers < self.n:
            return
        self._saving = None
        if save.code:
            self._answer(p.Error(id=save.ref, code=save.code, reason=save.reason))
        else:
            self._answer(
                p.TrainSaved(id=save.ref, job=self.job, path=save.path, step=self.step_count)
            )
        self._next()

    # -- failures ----------------------------------------------------------------------------

    def _fail(self, step: _Step, exc: FlowmeshError, updated: bool = False) -> None:
        updated = updated or step.updated
        if not self.coordinator:
            step.failed = True
            self._hop(0, "fail", step.seq, code=str(exc.code), reason=exc.reason,
                      updated=updated)  # fmt: skip
            return
        for s in range(1, self.n):
            self._hop(s, "abort", step.seq, reason=exc.reason, updated=updated)
        self._aborted(step.seq, exc.reason, updated)
        self._answer(p.Error(id=step.call, code=str(exc.code), reason=exc.reason))
        self._ended()

    def _aborted(self, seq: int, reason: str, updated: bool) -> None:
        step = self.current
        if updated and self.broken is None:
            self.broken = (
                f"job {self.job!r} is broken: step {seq} failed after a stage's update "
                f"({reason}); reopen it from a checkpoint"
            )
        self.later = [h for h in self.later if h.seq != seq]
        if step is not None and step.seq == seq:
            self.stage.abort()
            if not self.coordinator:
                self._ended()
        elif not self.coordinator:
            self.last_seq = max(self.last_seq, seq)
