"""Direct runs on one worker: which announced runs wait for activations from the previous
stage's worker, and the `Hop`s that arrived before their run was announced.

A multi-stage batch is announced to every stage's worker at once (`Run` with a ticket); the
activations then go from each stage's worker straight to the next one's, in micro-batches, and
only the last stage answers the broker. Plain logic, no sockets: the worker process feeds it
what arrives and acts on what it returns.

A Hop is taken only for a run the broker announced, with that run's ticket, for this stage and a
chunk not seen yet, and under CURVE keys only from the key the Run names (`from_key`). One that
comes before its run's announcement (the two travel on different connections) waits here, within
bounds: runs, bytes per run and in all, and time (`expire`, on the worker's clock, whether or not
more Hops come). What does not fit is refused (a run's own bytes) or pushes out the oldest runs'
(the others); a run whose early Hops were dropped could never finish, so its Run fails at once
when it comes. One for a run given up (`cancel`) is dropped quietly, as the stage before may not
have heard yet.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError

# What a Hop kept before its Run costs besides its tensors' bytes (the message's own objects),
# so that Hops without tensors are bounded as well.
HOP_OVERHEAD = 1024
# The bytes of Hops kept before their Run: one run's, and all runs' together.
EARLY_RUN_BYTES = 64 << 20
EARLY_BYTES = 256 << 20
# Runs remembered as given up (Hops still on their way are dropped quietly), and as having lost
# early Hops (their Run fails when it comes).
REMEMBERED = 1024


@dataclass
class DirectRun:
    msg: p.Run
    seen: set[int] = field(default_factory=set)  # chunks taken
    done: int = 0  # chunks computed (and passed on, or kept for the answer)
    outputs: dict[int, dict[str, Any]] = field(default_factory=dict)  # last stage: per chunk
    compute_s: float = 0.0
    wait_s: float = 0.0

    @property
    def last(self) -> bool:
        return not self.msg.next_peer


@dataclass
class _Early:
    """The Hops of one run not announced yet, with the key of the connection each came on."""

    since: float
    hops: list[tuple[p.Hop, str]] = field(default_factory=list)
    nbytes: int = 0


def hop_bytes(hop: p.Hop) -> int:
    """What keeping `hop` costs: its tensors' bytes, its model's name, the message itself."""
    tensors = sum(getattr(t, "nbytes", 0) for t in hop.tensors.values())
    return HOP_OVERHEAD + len(hop.model) + tensors


class DirectRuns:
    def __init__(
        self,
        max_early: int = 256,
        early_ttl_s: float = 30.0,
        max_run_bytes: int = EARLY_RUN_BYTES,
        max_early_bytes: int = EARLY_BYTES,
    ) -> None:
        self.runs: dict[int, DirectRun] = {}
        # By (run, ticket), oldest first; and what was lost by (run, ticket): a forged Hop,
        # which cannot know the ticket, neither takes a real run's room nor fails it.
        self._early: OrderedDict[tuple[int, int], _Early] = OrderedDict()
        self.early_bytes = 0
        self._lost: OrderedDict[tuple[int, int], FlowmeshError] = OrderedDict()
        self._cancelled: deque[int] = deque(maxlen=REMEMBERED)
        self.max_early = max_early
        self.early_ttl_s = early_ttl_s
        self.max_early_bytes = max_early_bytes
        self.max_run_bytes = min(max_run_bytes, max_early_bytes)
        self.counters = {"hops_in": 0, "hops_early": 0, "hops_dropped": 0, "direct_runs": 0}

    def announce(self, msg: p.Run) -> tuple[DirectRun, list[p.Hop]]:
        """A Run with a ticket: its state, and the Hops for it that came first (checked)."""
        if msg.chunks < 1:
            raise FlowmeshError(Code.BAD_REQUEST, f"run {msg.id}: chunks must be >= 1")
        if msg.id in self.runs:
            raise FlowmeshError(Code.BAD_REQUEST, f"run {msg.id} was announced already")
        entry = self._early.pop((msg.id, msg.ticket), None)
        early = entry.hops if entry is not None else []
        if entry is not None:
            self.early_bytes -= entry.nbytes
        for key in [k for k in self._early if k[0] == msg.id]:  # other tickets': forged
            forged = self._early.pop(key)
            self.early_bytes -= forged.nbytes
            self.counters["hops_dropped"] += len(forged.hops)
        lost = self._lost.pop((msg.id, msg.ticket), None)
        if lost is not None:
            self.counters["hops_dropped"] += len(early)
            self._cancelled.append(msg.id)  # its Hops still on their way
            raise lost
        run = self.runs[msg.id] = DirectRun(msg)
        self.counters["direct_runs"] += 1
        taken = [h for h, sender in early if self._check(run, h, sender)]
        self.counters["hops_dropped"] += len(early) - len(taken)
        return run, taken

    def accept(self, hop: p.Hop, now: float | None = None, sender: str = "") -> DirectRun | None:
        """The run `hop` belongs to, or None: kept until its Run comes, or dropped. `sender`:
        the key of the connection it came on (under CURVE keys). Raises TOO_LARGE for an
        early Hop that would take its run over `max_run_bytes`."""
        self.counters["hops_in"] += 1
        run = self.runs.get(hop.id)
        if run is not None:
            if not self._check(run, hop, sender):
                raise FlowmeshError(
                    Code.FORBIDDEN,
                    f"hop for run {hop.id}: wrong ticket, stage, chunk or sender",
                )
            return run
        if hop.id in self._cancelled or (hop.id, hop.ticket) in self._lost:
            self.counters["hops_dropped"] += 1
            return None
        now = time.monotonic() if now is None else now
        self.expire(now)
        cost = hop_bytes(hop)
        key = (hop.id, hop.ticket)
        entry = self._early.get(key)
        held = entry.nbytes if entry is not None else 0
        if held + cost > self.max_run_bytes:
            reason = (
                f"run {hop.id}: its activations that came before its Run would take "
                f"{held + cost} bytes, over the {self.max_run_bytes} bytes a run may keep waiting"
            )
            self.counters["hops_dropped"] += 1
            self._drop(key, FlowmeshError(Code.TOO_LARGE, reason))
            raise FlowmeshError(Code.TOO_LARGE, reason)
        while True:
            if entry is None and len(self._early) >= self.max_early:
                bound = f"{self.max_early} runs"
            elif self.early_bytes + cost > self.max_early_bytes:
                bound = f"{self.max_early_bytes} bytes"
            else:
                break
            # The oldest other run's make room (this run's fit alone: max_run_bytes).
            oldest = next(k for k in self._early if k != key)
            reason = (
                f"run {oldest[0]}: its activations that came before its Run were dropped to make "
                f"room for newer runs' (at most {bound} wait)"
            )
            self._drop(oldest, FlowmeshError(Code.OVERLOADED, reason))
        if entry is None:
            entry = self._early[key] = _Early(now)
        entry.hops.append((hop, sender))
        entry.nbytes += cost
        self.early_bytes += cost
        self.counters["hops_early"] += 1
        return None

    def expire(self, now: float) -> None:
        """Drop the early Hops of runs not announced within `early_ttl_s`: the worker calls it
        on its clock, so that they go even if no Hop comes after them."""
        while self._early:
            key, entry = next(iter(self._early.items()))
            if entry.since + self.early_ttl_s >= now:
                return
            reason = (
                f"run {key[0]}: its activations waited {now - entry.since:.1f} s for its Run, "
                f"over {self.early_ttl_s:.0f} s"
            )
            self._drop(key, FlowmeshError(Code.TIMEOUT, reason))

    def reset(self) -> None:
        """Forget every run, early Hop and what was remembered of them: the broker that
        announced them is gone (it restarted, or lost this worker), will neither wait for nor
        cancel them, and a new one may number its runs afresh."""
        self.runs.clear()
        self._early.clear()
        self.early_bytes = 0
        self._lost.clear()
        self._cancelled.clear()

    def _drop(self, key: tuple[int, int], why: FlowmeshError) -> None:
        """Forget the early Hops of run `key[0]` with ticket `key[1]`; its Run, if it comes
        with that ticket, fails with `why`."""
        entry = self._early.pop(key, None)
        if entry is not None:
            self.early_bytes -= entry.nbytes
            self.counters["hops_dropped"] += len(entry.hops)
        self._lost[key] = why
        if len(self._lost) > REMEMBERED:
            self._lost.popitem(last=False)

    def _check(self, run: DirectRun, hop: p.Hop, sender: str) -> bool:
        ok = (
            run.msg.from_peer
            and sender == run.msg.from_key  # both "" without keys
            and hop.ticket == run.msg.ticket
            and (hop.model, hop.stage) == (run.msg.model, run.msg.stage)
            and 0 <= hop.chunk < run.msg.chunks
            and hop.chunk not in run.seen
        )
        if ok:
            run.seen.add(hop.chunk)
        return ok

    def live(self, run: DirectRun) -> bool:
        """Whether `run` is still kept: not finished, failed or cancelled, nor forgotten with its
        broker (`reset`). By identity: a new broker may have announced a run of the same id."""
        return self.runs.get(run.msg.id) is run

    def finished(self, run: DirectRun) -> bool:
        """One more chunk computed: True once all of them are (the run is forgotten)."""
        run.done += 1
        if run.done < run.msg.chunks:
            return False
        if self.live(run):
            del self.runs[run.msg.id]
        return True

    def cancel(self, run_id: int) -> None:
        self.runs.pop(run_id, None)
        for key in [k for k in self._early if k[0] == run_id]:
            self.early_bytes -= self._early.pop(key).nbytes
        self._cancelled.append(run_id)
