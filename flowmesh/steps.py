"""A training job's steps as every side of the mesh sees them: one step's outcome
(`StepResult`), and the ledger of a job's steps by sequence number (`StepLedger`).

A client numbers a job's steps (`seq` 1, 2, ...). The broker forwards a step, and the worker runs
it, only if its `seq` is above every `seq` already taken (gaps are allowed: a client may fail to
send a step it numbered), so no step is ever applied twice. A step whose `seq` was taken is
answered from the ledger instead: its answer when it is still known (the latest `keep` of them),
or when it finishes if it is still running. The broker and the worker each keep one ledger per
job, with bounds of their own (`broker.training`, `gpu_worker.core`); a restarted broker takes
the worker's up from its registration.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Generic, TypeVar

A = TypeVar("A")


@dataclass
class StepResult:
    """One training step's outcome, or an evaluation's: its loss (summed over micro-batches),
    the job's step count with it (the steps applied, this one included), and the worker's
    metrics (tasks, bytes moved, seconds, grad_norm when clipping, accuracy for an
    evaluation of class targets)."""

    loss: float
    step: int
    metrics: dict[str, float] = field(default_factory=dict)
    # A step's: each sub-model's activation policy (`gpu_worker.activation_keep`) in it.
    activations: list[str] = field(default_factory=list)


class StepLedger(Generic[A]):
    """One job's steps by `seq`: the highest taken (`last`), those still running, and the
    answers of the latest `keep` steps that finished (`A`: whatever an answer is on that side),
    oldest first."""

    __slots__ = ("answers", "keep", "last", "running")

    def __init__(self, keep: int, last: int = 0) -> None:
        if keep < 1:
            raise ValueError(f"a ledger keeps at least one answer, not {keep}")
        self.keep = keep
        self.last = last
        self.running: set[int] = set()
        self.answers: OrderedDict[int, A] = OrderedDict()

    def taken(self, seq: int) -> bool:
        """Whether `seq` may no longer run (it, or a later one, was taken)."""
        return seq <= self.last

    def take(self, seq: int) -> None:
        """`seq` runs now: nothing at or below it may run after it."""
        if seq <= self.last:
            raise ValueError(f"step seq {seq} was already taken (last {self.last})")
        self.last = seq

    def start(self, seq: int) -> None:
        """`seq` is running: its answer comes later (`settle`)."""
        self.running.add(seq)

    def settle(self, seq: int, answer: A) -> None:
        """`seq` finished with `answer`, kept for a step sent again; the oldest answer beyond
        `keep` is forgotten. An answer recorded again keeps its place."""
        self.running.discard(seq)
        self.answers[seq] = answer
        while len(self.answers) > self.keep:
            self.answers.popitem(last=False)

    def answer(self, seq: int) -> A | None:
        """The answer of `seq`, if it finished and is still kept."""
        return self.answers.get(seq)
