"""Memory flow between training jobs: which sub-model task gets device memory next.

Pure, deterministic bookkeeping (no torch, no threads): the training executor feeds it events
(a task was copied in, started, finished, failed) and asks it what to admit and what to run; the
unit tests drive it the same way with a fake allocator.

Each job is a chain of tasks run strictly in order (a task consumes what the one before it
produced). Across jobs, tasks interleave: whenever memory frees, the next ready task of *any* job
is admitted, so the bytes one job's sub-model releases flow to another job's (seed 000's memory
flow). The rules:

- **In-order admission, bounded look-ahead.** A job's tasks are admitted in chain order, at most
  `prefetch + 1` at a time: the head (the first unfinished task) and up to `prefetch` following
  ones whose copy-in then overlaps the head's compute. Since the head of every job that holds
  memory can always run, admitted work always drains and no set of jobs deadlocks on memory.
- **Copy-ready.** A task copies host data in before it runs; a look-ahead task is admitted only
  when no unfinished earlier task of its job writes a host region it reads (`reads`/`writes` are
  opaque keys chosen by the job), so a prefetch never reads a stale copy.
- **Heads first, then oldest first.** Candidates are tried heads before look-aheads, each group
  in the order they became candidates; a candidate that does not fit is skipped so smaller ones
  can back-fill, but after `max_skips` skips it blocks all admissions until it fits (no
  starvation of large sub-models by small ones) or is no candidate any more (serving took back
  an earlier task's memory: that task goes first).
- **Compute order.** Runnable tasks (copied, and the head of their chain) run oldest admission
  first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

ANY = "*"  # a read key that conflicts with every write of the job (a checkpoint reads it all)
# Decisions `FlowScheduler.log` keeps: the most recent ones only, since a worker trains for days
# (four events per task, tens of tasks a second), and tests read a run of a few hundred.
LOG_KEPT = 10_000


class Phase(Enum):
    PENDING = "pending"  # waiting for memory
    ADMITTED = "admitted"  # holds memory; copy-in issued
    COPIED = "copied"  # copy-in issued and done (CPU) or ordered (CUDA): may run
    RUNNING = "running"
    DONE = "done"
    DROPPED = "dropped"  # its request failed before it ran


@dataclass(eq=False)
class Task:
    """One unit of device work of one job: bring data in, compute, write back, release."""

    job: str
    request: int  # the request (training step, checkpoint) it belongs to
    kind: str
    nbytes: int
    reads: frozenset[Hashable] = frozenset()
    writes: frozenset[Hashable] = frozenset()
    sub: int = 0  # sub-model index
    micro: int = 0  # micro-batch index within the step
    last: bool = False  # the request's final task: its end completes the request
    phase: Phase = Phase.PENDING
    seq: int = -1  # position in the job's chain, set by `push`
    candidate_since: int = -1  # tick at which it became a candidate for admission
    admitted_at: int = -1
    skips: int = 0
    payload: Any = field(default=None, repr=False)  # the executor's per-task data

    @property
    def label(self) -> str:
        return f"{self.job}#{self.request}:{self.kind}{self.sub}.{self.micro}"


class FlowScheduler:
    def __init__(self, prefetch: int = 1, max_skips: int = 8) -> None:
        if prefetch < 0 or max_skips < 0:
            raise ValueError("prefetch and max_skips must be non-negative")
        self.prefetch = prefetch
        self.max_skips = max_skips
        self.chains: dict[str, deque[Task]] = {}  # unfinished tasks of each job, in order
        self._seq: dict[str, int] = {}
        self._tick = 0
        self._blocking: Task | None = None  # a starved candidate holding admissions back
        # (event, task label) in the order decided, the last LOG_KEPT: "admit", "run", "done",
        # "drop", "reclaim"
        self.log: deque[tuple[str, str]] = deque(maxlen=LOG_KEPT)

    # -- jobs and tasks ------------------------------------------------------------------

    def add_job(self, job: str) -> None:
        if job in self.chains:
            raise ValueError(f"job {job!r} is already scheduled")
        self.chains[job] = deque()
        self._seq[job] = 0

    def remove_job(self, job: str) -> list[Task]:
        """Forget a job; returns its tasks that hold memory (the caller frees them). A running
        task stays the caller's to finish."""
        chain = self.chains.pop(job, deque())
        self._seq.pop(job, None)
        if self._blocking is not None and self._blocking.job == job:
            self._blocking = None
        held = []
        for t in chain:
            if t.phase in (Phase.ADMITTED, Phase.COPIED):
                held.append(t)
            if t.phase is not Phase.RUNNING:
                t.phase = Phase.DROPPED
        return held

    def push(self, tasks: Iterable[Task]) -> None:
        """Append tasks (one request's, in order) to their job's chain."""
        for t in tasks:
            chain = self.chains[t.job]
            t.seq = self._seq[t.job]
            self._seq[t.job] += 1
            t.phase = Phase.PENDING
            chain.append(t)

    def pending(self, job: str | None = None) -> int:
        """Unfinished tasks (of one job, or of all)."""
        if job is not None:
            return len(self.chains.get(job, ()))
        return sum(len(c) for c in self.chains.values())

    # -- admission -----------------------------------------------------------------------

    def _window(self, chain: deque[Task]) -> list[Task]:
        return [chain[i] for i in range(min(len(chain), self.prefetch + 1))]

    @staticmethod
    def _copy_ready(task: Task, earlier: list[Task]) -> bool:
        for e in earlier:
            if e.phase is Phase.DONE:
                continue
            if ANY in task.reads and e.writes:
                return False
            if task.reads & e.writes:
                return False
        return True

    def candidates(self) -> list[Task]:
        """Tasks that may be admitted now, in the order they will be tried."""
        heads: list[Task] = []
        ahead: list[Task] = []
        for chain in self.chains.values():
            window = self._window(chain)
            for i, t in enumerate(window):
                if t.phase is not Phase.PENDING:
                    continue
                if not self._copy_ready(t, window[:i]):
                    break
                if t.candidate_since < 0:
                    t.candidate_since = self._tick
                    self._tick += 1
                (heads if i == 0 else ahead).append(t)
                break  # in-order admission: nothing past the first pending task
        heads.sort(key=lambda t: t.candidate_since)
        ahead.sort(key=lambda t: t.candidate_since)
        return heads + ahead

    def admit(self, try_alloc: Callable[[Task], bool]) -> list[Task]:
        """Admit candidates that `try_alloc` finds memory for (it allocates when it returns True).

        Loops until nothing more fits: admitting a task can make the next task of its job a
        candidate."""
        admitted: list[Task] = []
        while True:
            progress = False
            candidates = self.candidates()
            if self._blocking is not None and self._blocking not in candidates:
                # Serving took back the memory of an earlier task of its job (`unadmit`): that
                # one is in line again, and until it is admitted the starved task is no
                # candidate. Held for it, admissions would be held for ever (issue 20's hang).
                self._blocking = None
            for t in candidates:
                if self._blocking is not None and t is not self._blocking:
                    continue
                if try_alloc(t):
                    t.phase = Phase.ADMITTED
                    t.admitted_at = self._tick
                    self._tick += 1
                    if t is self._blocking:
                        self._blocking = None
                    self.log.append(("admit", t.label))
                    admitted.append(t)
                    progress = True
                    break  # the candidate set changed: recompute it
                t.skips += 1
                if t.skips > self.max_skips and self._blocking is None:
                    self._blocking = t
            if not progress:
                return admitted

    def unadmit(self) -> list[Task]:
        """Take memory back from every admitted task that has not started (serving needs it):
        they become candidates again, first in line. Returns them; the caller frees their
        memory."""
        taken = []
        for chain in self.chains.values():
            for t in chain:
                if t.phase in (Phase.ADMITTED, Phase.COPIED):
                    t.phase = Phase.PENDING
                    self.log.append(("reclaim", t.label))
                    taken.append(t)
        return taken

    # -- running -------------------------------------------------------------------------

    def copied(self, task: Task) -> None:
        if task.phase is Phase.ADMITTED:
            task.phase = Phase.COPIED

    def next_runnable(self) -> Task | None:
        """The oldest-admitted copied task that heads its chain, or None."""
        best: Task | None = None
        for chain in self.chains.values():
            if chain and chain[0].phase is Phase.COPIED:
                t = chain[0]
                if best is None or t.admitted_at < best.admitted_at:
                    best = t
        return best

    def started(self, task: Task) -> None:
        assert task.phase is Phase.COPIED, f"{task.label} started in phase {task.phase}"
        task.phase = Phase.RUNNING
        self.log.append(("run", task.label))

    def finished(self, task: Task) -> None:
        chain = self.chains.get(task.job)
        task.phase = Phase.DONE
        self.log.append(("done", task.label))
        if chain and chain[0] is task:
            chain.popleft()

    def drop_request(self, job: str, request: int) -> list[Task]:
        """Remove a failed request's unfinished tasks; returns those holding memory."""
        chain = self.chains.get(job)
        if chain is None:
            return []
        held, keep = [], deque()
        for t in chain:
            if t.request == request and t.phase is not Phase.RUNNING:
                if t.phase in (Phase.ADMITTED, Phase.COPIED):
                    held.append(t)
                t.phase = Phase.DROPPED
                self.log.append(("drop", t.label))
                if t is self._blocking:
                    self._blocking = None
            else:
                keep.append(t)
        self.chains[job] = keep
        return held
