"""Direct runs on one worker: which announced runs wait for activations from the previous
stage's worker, and the `Hop`s that arrived before their run was announced.

A multi-stage batch is announced to every stage's worker at once (`Run` with a ticket); the
activations then go from each stage's worker straight to the next one's, in micro-batches, and
only the last stage answers the broker. Plain logic, no sockets: the worker process feeds it
what arrives and acts on what it returns.

A Hop is taken only for a run the broker announced, with that run's ticket, for this stage and a
chunk not seen yet, and under CURVE keys only from the key the Run names (`from_key`). One that
comes before its run's announcement (the two travel on different connections) waits here, a
bounded number of them for a bounded time; one for a run given up (`cancel`) is dropped quietly,
as the stage before may not have heard yet.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError


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


class DirectRuns:
    def __init__(self, max_early: int = 256, early_ttl_s: float = 30.0) -> None:
        self.runs: dict[int, DirectRun] = {}
        # Hops before their Run, with the key of the connection each came on.
        self._early: OrderedDict[int, tuple[float, list[tuple[p.Hop, str]]]] = OrderedDict()
        self._cancelled: deque[int] = deque(maxlen=1024)
        self.max_early = max_early
        self.early_ttl_s = early_ttl_s
        self.counters = {"hops_in": 0, "hops_early": 0, "hops_dropped": 0, "direct_runs": 0}

    def announce(self, msg: p.Run) -> tuple[DirectRun, list[p.Hop]]:
        """A Run with a ticket: its state, and the Hops for it that came first (checked)."""
        if msg.chunks < 1:
            raise FlowmeshError(Code.BAD_REQUEST, f"run {msg.id}: chunks must be >= 1")
        if msg.id in self.runs:
            raise FlowmeshError(Code.BAD_REQUEST, f"run {msg.id} was announced already")
        run = self.runs[msg.id] = DirectRun(msg)
        self.counters["direct_runs"] += 1
        _, early = self._early.pop(msg.id, (0.0, []))
        taken = [h for h, sender in early if self._check(run, h, sender)]
        self.counters["hops_dropped"] += len(early) - len(taken)
        return run, taken

    def accept(self, hop: p.Hop, now: float | None = None, sender: str = "") -> DirectRun | None:
        """The run `hop` belongs to, or None: kept until its Run comes, or dropped. `sender`:
        the key of the connection it came on (under CURVE keys)."""
        self.counters["hops_in"] += 1
        run = self.runs.get(hop.id)
        if run is not None:
            if not self._check(run, hop, sender):
                raise FlowmeshError(
                    Code.FORBIDDEN,
                    f"hop for run {hop.id}: wrong ticket, stage, chunk or sender",
                )
            return run
        if hop.id in self._cancelled:
            self.counters["hops_dropped"] += 1
            return None
        now = time.monotonic() if now is None else now
        while self._early and (
            len(self._early) >= self.max_early
            or next(iter(self._early.values()))[0] + self.early_ttl_s < now
        ):
            _, (_, dropped) = self._early.popitem(last=False)
            self.counters["hops_dropped"] += len(dropped)
        self._early.setdefault(hop.id, (now, []))[1].append((hop, sender))
        self.counters["hops_early"] += 1
        return None

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

    def finished(self, run: DirectRun) -> bool:
        """One more chunk computed: True once all of them are (the run is forgotten)."""
        run.done += 1
        if run.done < run.msg.chunks:
            return False
        self.runs.pop(run.msg.id, None)
        return True

    def cancel(self, run_id: int) -> None:
        self.runs.pop(run_id, None)
        self._early.pop(run_id, None)
        self._cancelled.append(run_id)
