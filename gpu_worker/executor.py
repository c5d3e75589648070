"""The worker's executor: loads, evictions and runs of many stages, concurrently, on one device.

Plain class, no sockets: the worker process feeds it commands in arrival order and sends what its
futures return; tests drive it in-process.

- `load` takes arena ranges at once (in command order, so an EVICT that precedes a LOAD has
  already freed its bytes) and queues the block-by-block copy on the copy lane. The executor
  owns its memory: a load that does not fit the serving budget, or finds no contiguous range,
  evicts idle stages itself, those worth least first (`flowmesh.value.stage_value`: the rate of
  rows it ran times the seconds its bytes take to come back; least recently used among equals),
  never one with a run in flight, one still loading, or one the caller asked to keep.
  `on_residency` tells the worker process whenever its own choice changed what is resident.
- `run` queues a batch on a compute lane. The lane waits for each block's copy just before it
  computes that block, so a cold request starts computing while later blocks are still in flight.
  A run for a stage that is not on the device brings it back first (a load like any other).
  A run whose model's next stage is here but not on the device (a streamed model: several of its
  stages on this worker, more than its budget holds) also starts that stage's copy (`prefetch`),
  so that it overlaps this run's compute; the room is made from the stages that already ran in
  this pass first (`_victims`), never from the run's own stage.
- `run_here` computes a run on the calling thread instead (the worker's reader thread), for a
  resident stage whose run is expected to take under `quick_run_s` (QUICK_RUN_S unless told):
  a hand-off to a lane would cost more.
- `evict` returns the stage's ranges immediately, ordered after the stage's copies and runs: the
  next owner waits on their markers (stream order), never on a global synchronisation. A stage
  holding live sequences' KV is evicted last (its value counts the KV bytes), and its sequences
  are preempted, not lost: each one's KV is parked in host memory (`park_seqs`, copied back by
  its next step) or dropped, to be recomputed from its tokens by the broker, whichever the
  measured costs say is cheaper (`kv_preempt`).

Device memory belongs to one `DeviceMemory` shared with the worker's training executor. A load
that does not fit while training holds ranges it borrowed does not fail: it *claims* memory,
training gives back every range it can at once, and the load goes ahead (in arrival order) as
soon as it fits. Runs sent for a stage whose load waits simply wait on its blocks' markers.

Torch work and copies never run on the event-loop thread.

Every method runs on the event loop but `run_here`. What a run admitted there shares with the
loop (a stage's state, generation, users and in-flight count, the run counters) changes under
`_lock`: an eviction either sees the run among the stage's users, and orders the bytes' next
owner after it, or the run sees the stage gone and is not admitted.

A stage's modules view one load's ranges at a time (`Stage.bound`): a stage evicted under its
run and loaded again elsewhere fails the run as evicted (the broker runs it again), never lets
it compute on bytes the new load has not written yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from torch import nn

from flowmesh.errors import Code, FlowmeshError
from flowmesh.eviction import StageKey, eviction_order
from flowmesh.messages import GenStep
from flowmesh.modelio.decode import ATTENTION, HEADS, Packed, block_step, kv_shape
from flowmesh.modelio.decode import KV_BLOCK as KV_TOKENS
from flowmesh.modelio.inputs import call_model
from flowmesh.modelio.sampling import at_draw, new_generator, sample
from flowmesh.modelio.token_limits import TokenLimits, limits_of
from flowmesh.threads import TorchLanes, run_one, torch_pool
from flowmesh.value import ArrivalRate, stage_value
from gpu_worker.device import Device
from gpu_worker.host_tier import ALIGN, BlockRegion, HostStage, view_of
from gpu_worker.kv_cache import Restore, SeqKV, StageKV, blocks_for, new_blocks_after
from gpu_worker.memory import DeviceMemory, Extent, OutOfSpace
from gpu_worker.model_code import SERVING_CALLS
from gpu_worker.run_rows import (
    checked_parts,
    concat_parts,
    gen_input,
    named_outputs,
    on_device,
    part_rows,
    split_rows,
)

log = logging.getLogger("worker")

# A run of a resident stage expected to take less than this (`Stage.expected_s`) is computed by
# the thread that read it (`Executor.run_here`). Handing it to a compute lane costs a thread
# wake-up and the GIL's trips between the two threads: on a busy host, more than a small model's
# forward (scripts/bench_broker.py). Longer runs go to the lanes, so that the reader is back at
# its socket within about this long.
QUICK_RUN_S = 0.002

KV_PREEMPT = ("auto", "swap", "recompute")  # `Executor(kv_preempt=...)`

# A stage's forward and row times are the fastest of this many recent runs. Waiting for the GIL
# or for a core only ever adds to a run's time, and on a busy host it added more than the forward
# (a tiny model measured 70 us alone, 150-1,000 us in a mesh under load). A smoothed mean of that
# wrongly sent its grouped runs to the lanes, where they waited longer still and were measured
# slower again: the runs stayed there. A stage that really got slower counts once this many
# runs in a row were.
FORWARD_WINDOW = 16

# How long an iteration that follows another (`GenStep.follows`) waits for it on its lane: that
# one is computing or queued just before it, so this only bounds a wait that something else
# went wrong in (the follower then fails instead of holding its lane).
FOLLOW_WAIT_S = 120.0
# How long KV placement that found training's borrowed ranges in the way keeps claiming them
# back (training admits nothing meanwhile) for the broker's next try; a placement that
# succeeds stops the claim at once.
KV_CLAIM_S = 5.0


@dataclass(eq=False)
class GenTail:
    """A stage's latest generation iteration, for the one sent to follow it: `done` is set once
    it ended (after its answer went out), `ok` whether it drew its tokens (each sequence's is
    then its `SeqKV.token`). The follower, placed while it runs, is run right after it by the
    same compute lane (`then`): no thread hand-off between two tokens."""

    run: int
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    _next: tuple[Any, ...] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def then(self, job: tuple[Any, ...]) -> bool:
        """Run `job` (`flowmesh.threads.run_one`'s arguments) on this iteration's lane as soon
        as it ends; False when it has ended already."""
        with self._lock:
            if self.done.is_set():
                return False
            self._next = job
            return True

    def end(self, ok: bool) -> None:
        with self._lock:
            self.ok = ok
            self.done.set()

    def take_next(self) -> tuple[Any, ...] | None:
        """The job to run next on this lane (once it ended: none comes after that)."""
        with self._lock:
            job, self._next = self._next, None
            return job


class FollowedFailed(FlowmeshError):
    """The iteration a follower was sent after did not run here, or failed: the follower changed
    nothing (its sequences' KV stays as that iteration left it)."""

    def __init__(self, reason: str) -> None:
        super().__init__(Code.NOT_RESIDENT, reason)


class State(Enum):
    HOST = "host"
    LOADING = "loading"
    RESIDENT = "resident"


@dataclass
class LoadInfo:
    nbytes: int
    seconds: float


@dataclass
class RunOutput:
    parts: list[dict[str, torch.Tensor]]
    compute_s: float
    wait_s: float
    rows: int
    # The run's `on_lane` answered it from the compute lane (see `Executor.run`).
    answered: bool = False


@dataclass
class Stage:
    key: StageKey
    blocks: list[nn.Module]
    host: HostStage
    state: State = State.HOST
    extents: list[Extent | None] = field(default_factory=list)
    ready: list[Any] = field(default_factory=list)  # one marker per block: its copy is done
    # Markers of this residency's runs that may still read its bytes. A finished run's marker is
    # dropped (see `run`): a hot stage would otherwise collect one per run, and `evict` checks
    # them all on the event loop.
    users: list[Any] = field(default_factory=list)
    inflight: int = 0
    loading: asyncio.Future[LoadInfo] | None = None
    generation: int = 0
    copies: list[CopyRun] = field(default_factory=list)
    # Waiting for training to give ranges back (state LOADING, no extents yet).
    waiting: bool = False
    load_t0: float = 0.0
    # Generations whose load was given up before its copy was issued: a run that waited on
    # their markers finds nothing to compute with.
    abandoned: set[int] = field(default_factory=set)
    # What keeping it is worth: rows run per second (decayed) and when it was last used.
    rate: ArrivalRate = field(default_factory=ArrivalRate)
    last_used: float = 0.0
    keep: frozenset[StageKey] = frozenset()  # stages its waiting load may not evict
    # Prefetched by the run of the stage before it (`Executor.run`), its own run not come yet:
    # evicted last, and never for another prefetch.
    next_up: bool = False
    # Compute seconds of one forward, and per row, each the fastest of the last `forward_window`
    # runs (0: none ran yet). See `expected_s`.
    forward_s: float = 0.0
    row_s: float = 0.0
    recent: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=FORWARD_WINDOW))
    # The generation (load) whose ranges each block's tensors view: -1 none (yet, or while the
    # copy lane binds it), None a block without tensors. A stage evicted under a run and loaded
    # again at other offsets is bound to the new ranges at once, before their bytes are in: the
    # run, seeing another generation before or after it computed a block, fails (`_forward`).
    bound: list[int | None] = field(init=False, default_factory=list)
    bound_all: int = -1  # the generation every block is bound to (-1: none, or some not yet)
    # Held by the copy lane that binds the blocks: one load at a time, never a given-up one.
    binding: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # Its latest generation iteration placed here: what the next one may follow.
    gen_tail: GenTail | None = None
    # What the stage's inputs can take, when its first block embeds a language model's token
    # ids (`flowmesh.modelio.token_limits`): every run is checked against it before computing.
    limits: TokenLimits | None = field(init=False, default=None)
    # Generation: the share of the serving budget the model's KV may take on this worker, and
    # this stage's KV cache (made at its first generation run, freed with its residency).
    kv_share: float = 0.5
    kv: StageKV | None = None

    @property
    def live_kv(self) -> bool:
        return self.kv is not None and bool(self.kv.seqs)

    def __post_init__(self) -> None:
        self.bound = [-1 if r.slots else None for r in self.host.regions]
        self.limits = limits_of(self.blocks[0]) if self.blocks else None

    def expected_s(self, forwards: int, rows: int) -> float:
        """What a run of `forwards` forwards over `rows` rows in all takes at least: each of its
        forwards as long as the fastest one, each of its rows as long as the fastest per row.
        Forwards alone would take a large batch for as quick as a small one; rows alone, a
        model whose forward costs the same whatever its rows (a large model on a GPU) for quick
        on one row. 0: not known yet."""
        return max(forwards * self.forward_s, rows * self.row_s)

    def measured(self, compute_s: float, forwards: int, rows: int) -> None:
        self.recent.append((compute_s / forwards, compute_s / max(1, rows)))
        self.forward_s = min(f for f, _ in self.recent)
        self.row_s = min(r for _, r in self.recent)


@dataclass
class CopyRun:
    """One host->device copy carrying consecutive blocks (contiguous on both sides)."""

    blocks: list[int]
    dst: int
    src: int
    nbytes: int
    after: list[Any] = field(default_factory=list)
    marker: Any = None


def plan_copies(
    regions: list[BlockRegion], extents: list[Extent | None], chunk_bytes: int
) -> list[CopyRun]:
    """Group the blocks of a load into as few copies as contiguity and `chunk_bytes` allow.

    Each copy has a fixed cost (a CUDA memcpy call, or waking the CPU copy's helper threads), so
    small blocks travel together; copies stay at most `chunk_bytes` long so that a run can start
    on the first blocks while the rest are in flight.
    """
    runs: list[CopyRun] = []
    for i, (region, ext) in enumerate(zip(regions, extents, strict=True)):
        if not region.slots:
            continue
        run = runs[-1] if runs else None
        if ext is None:  # only tied tensors: nothing to copy, ready with the copy before it
            if run is None:
                runs.append(CopyRun([i], 0, 0, 0))
            else:
                run.blocks.append(i)
            continue
        if (
            run is not None
            and (
                run.nbytes == 0
                or (run.dst + run.nbytes == ext.offset and run.src + run.nbytes == region.offset)
            )
            and run.nbytes + region.size <= chunk_bytes
        ):
            if run.nbytes == 0:
                run.dst, run.src = ext.offset, region.offset
            run.blocks.append(i)
            run.nbytes += region.size
            run.after.extend(ext.after)
        else:
            runs.append(CopyRun([i], ext.offset, region.offset, region.size, list(ext.after)))
    return runs


class Executor:
    def __init__(
        self,
        device: Device,
        compute_lanes: int = 2,
        copy_chunk_bytes: int | None = None,
        memory: DeviceMemory | None = None,
        copy_lanes: int | None = None,
        eviction: str = "value",
        *,
        clock: Callable[[], float] = time.perf_counter,
        quick_run_s: float = QUICK_RUN_S,
        forward_window: int = FORWARD_WINDOW,
        kv_preempt: str = "auto",
        park_bytes: int | None = None,
    ) -> None:
        """`clock`: seconds on a monotonic clock, for the runs' and loads' times and the stages'
        rates (read on the lanes and the reader thread too). `quick_run_s`: the longest run
        computed on the caller's thread (`run_here`); `forward_window`: the runs a stage's
        forward time is the fastest of (see FORWARD_WINDOW).

        `kv_preempt`: what a preempted sequence's KV becomes (`park_seqs`): "auto" (parked when
        copying it out and back costs less than recomputing it, by the stage's measured row time
        and this worker's copy bandwidth), "swap" (always parked, room allowing) or "recompute"
        (always dropped). `park_bytes`: the host memory parked KV may take here (default: the
        serving budget)."""
        if eviction not in ("value", "lru"):
            raise ValueError(f"eviction {eviction!r}: expected value or lru")
        if kv_preempt not in KV_PREEMPT:
            raise ValueError(f"kv_preempt {kv_preempt!r}: expected one of {', '.join(KV_PREEMPT)}")
        self.kv_preempt = kv_preempt
        self.eviction = eviction  # "lru": least recently used alone (a benchmark's ablation)
        self.clock = clock
        self.quick_run_s = quick_run_s
        self.forward_window = forward_window
        self.device = device
        self.copy_chunk_bytes = copy_chunk_bytes or device.copy_chunk_bytes
        self.memory = memory if memory is not None else DeviceMemory(device.budget_bytes, 0, ALIGN)
        if self.memory.capacity > device.budget_bytes:
            raise ValueError("device memory larger than the device's arena")
        self.arena = self.memory.arena
        self.park_bytes = self.memory.serving_bytes if park_bytes is None else park_bytes
        # Where the device's arena starts (it is never replaced): `_off_arena` asks every run.
        self._arena_ptr = device.arena.untyped_storage().data_ptr()
        self.stages: dict[StageKey, Stage] = {}
        # What runs admitted by `run_here` (on another thread) share with the loop: see the
        # module docstring. Held for bookkeeping only, never across a copy or a forward.
        self._lock = threading.Lock()
        self._waiting: deque[StageKey] = deque()  # loads waiting for training's ranges, in order
        self._loop: asyncio.AbstractEventLoop | None = None
        # A claim of training's borrowed ranges for KV blocks (`_claim_for_kv`), and its end.
        self._kv_claim: asyncio.TimerHandle | None = None
        self.memory.wake_serving.append(self._wake)
        # Copy lanes: a load goes to the lane with the fewest bytes queued, all of a stage's
        # copies on one lane (its blocks' markers stay in order).
        self.copy_lanes = max(1, copy_lanes or device.copy_lanes)
        self._copies = [torch_pool(1, f"copy-{i}") for i in range(self.copy_lanes)]
        self._queued = [0] * self.copy_lanes
        self._warm_lanes()
        self._waiter = torch_pool(1, "copy-wait")
        self._compute = TorchLanes(compute_lanes, "compute")
        self.compute_lanes = compute_lanes
        self._tasks: set[asyncio.Task[None]] = set()
        # Called (on the event loop) when the executor's own choice changed what is resident.
        self.on_residency: Callable[[], None] | None = None
        self.bandwidth = 0.0  # bytes/s of this worker's loads, smoothed (0: none measured yet)
        # Highest sum of the sizes of the stages holding device bytes, taken at every load. It is
        # counted from the stages' states, not from the arena, so it exceeds the budget if a
        # stage still counts as resident after its bytes went to another.
        self.stage_bytes_peak = 0
        self.counters = {
            "loads": 0,
            "evictions": 0,
            "runs": 0,
            "run_errors": 0,
            "bytes_loaded": 0,
            "rows": 0,
            "load_waits": 0,  # loads that waited for training to give memory back
            "evictions_chosen": 0,  # idle stages evicted to make room for a load
            "implicit_loads": 0,  # stages brought back because a run asked for them
            "prefetches": 0,  # next stages loaded while the stage before them computed
            "gen_runs": 0,  # iterations of generation
            "kv_refused": 0,  # iterations whose KV blocks could not be placed
            # Preempted sequences (their stage evicted, or the broker's FreeSeqs with park):
            # KV parked in host memory, or dropped to be recomputed; parked KV copied back.
            "kv_parked": 0,
            "kv_dropped": 0,
            "kv_restored": 0,
        }

    # ------------------------------------------------------------------ stages

    def add_stage(
        self, key: StageKey, blocks: list[nn.Module], host: HostStage, kv_share: float = 0.5
    ) -> None:
        """Hold a prepared stage; `kv_share`: its model's `ModelSpec.kv_share`."""
        if key in self.stages:
            self.drop_stage(key)
        self.stages[key] = Stage(
            key, blocks, host, recent=deque(maxlen=self.forward_window), kv_share=kv_share
        )

    def drop_stage(self, key: StageKey) -> None:
        if key in self.stages:
            self.evict(key, park=False)
            del self.stages[key]

    def _stage(self, key: StageKey) -> Stage:
        try:
            return self.stages[key]
        except KeyError:
            raise FlowmeshError(
                Code.MODEL_NOT_FOUND, f"stage {key[1]} of {key[0]!r} is not on this worker"
            ) from None

    # ------------------------------------------------------------------ load / evict

    def load(
        self, key: StageKey, keep: Collection[StageKey] = (), *, prefetch: bool = False
    ) -> asyncio.Future[LoadInfo]:
        """Start copying a stage in; the future resolves when all its bytes are on the device.

        Room is made here (see the module docstring); `keep`: stages not to evict for it;
        `prefetch`: a guess (`run`'s next stage), which never evicts a stage prefetched before.
        Raises NO_SPACE, having evicted nothing, when the serving budget cannot be met even by
        evicting every evictable stage; or, having evicted them all, when the arena still has no
        contiguous range for a block.
        """
        st = self._stage(key)
        if st.state is not State.HOST:
            assert st.loading is not None
            return st.loading
        self._loop = loop = asyncio.get_running_loop()
        st.keep = frozenset((key, *keep))
        got = self._make_room(st, prefetch)
        # One marker per block, made before the bytes have a place: a run sent right after the
        # load waits on them, whether the copy is issued now or once training gave memory back.
        st.ready = [
            self.device.new_marker() if r.slots else self.device.done_marker()
            for r in st.host.regions
        ]
        st.users = []
        st.state = State.LOADING
        st.generation += 1
        st.load_t0 = self.clock()
        st.loading = loop.create_future()
        self.memory.serving_started()
        st.loading.add_done_callback(lambda _: self.memory.serving_ended())
        st.last_used = self.clock()
        self._changed()
        if got is None:
            st.waiting = True
            self.counters["load_waits"] += 1
            self._waiting.append(key)
            self.memory.claim()
            loop.call_soon(self._retry_waiting)  # in case training freed before the claim
        else:
            self._issue(st, got)
        return st.loading

    def _alloc(self, st: Stage) -> list[Extent]:
        return self.memory.alloc_serving([r.size for r in st.host.regions if r.size])

    def _need(self, st: Stage) -> int:
        return sum(self.memory.round(r.size) for r in st.host.regions if r.size)

    def _victims(
        self,
        keep: frozenset[StageKey],
        key: StageKey | None = None,
        prefetch: bool = False,
        live: bool = True,
    ) -> list[Stage]:
        """Stages this executor may evict, the one worth least first.

        For a load of `key` while other stages of its model are here (a streamed model, whose
        passes go through its stages in order): first those that already ran in this pass
        (lower index, the last one to run first: needed again furthest ahead), then other
        models' stages, then the ones this pass still needs (highest index first). A stage
        prefetched for a run not come yet goes last, and never for another `prefetch`.

        A stage holding live sequences' KV goes after all of those (evicting it preempts them:
        the broker keeps it unless its model must go, see `evict`), and never for a prefetch
        or when not `live` (room for another model's KV blocks)."""
        now = self.clock()
        bw = self.bandwidth or 1e9
        with self._lock:  # a run admitted on the reader thread updates rates and counts
            idle = [
                s
                for s in self.stages.values()
                if s.state is State.RESIDENT and s.key not in keep and not _computing(s)
            ]
            if self.eviction == "lru":
                order = eviction_order(idle)
            else:
                order = eviction_order(
                    idle,
                    lambda s: stage_value(
                        s.rate.at(now), s.host.nbytes, bw, s.kv.nbytes if s.kv else 0
                    ),
                )
        if key is not None:
            mine = sorted((s for s in order if s.key[0] == key[0]), key=lambda s: -s.key[1])
            order = (
                [s for s in mine if s.key[1] < key[1]]
                + [s for s in order if s.key[0] != key[0]]
                + [s for s in mine if s.key[1] > key[1]]
            )
        later = [s for s in order if s.next_up]
        order = [s for s in order if not s.next_up] + ([] if prefetch else later)
        live_kv = [s for s in order if s.live_kv] if live and not prefetch else []
        return [s for s in order if not s.live_kv] + live_kv

    def _evict_for(self, victim: Stage) -> None:
        self.evict(victim.key)
        self.counters["evictions_chosen"] += 1
        self._changed()

    def _promised(self) -> int:
        """Serving bytes in use, and those the loads waiting for training are promised: a later
        load must not take them (it would leave a waiting one over the budget)."""
        waiting = {k for k in self._waiting if k in self.stages and self.stages[k].waiting}
        return self.memory.used["serving"] + sum(self._need(self.stages[k]) for k in waiting)

    def _make_room(self, st: Stage, prefetch: bool = False) -> list[Extent] | None:
        """Ranges for `st`, evicting what it takes; None: wait for training to give back."""
        where = f"{st.key[0]!r}/{st.key[1]}"
        need, budget = self._need(st), self.memory.serving_bytes
        victims = self._victims(st.keep, st.key, prefetch)
        promised = self._promised()
        if promised + need - budget > sum(self._need(v) for v in victims):
            busy = sorted(f"{k[0]}/{k[1]}" for k in self.resident() if k != st.key)
            raise FlowmeshError(
                Code.NO_SPACE,
                f"cannot place {where} ({need} bytes): serving budget {budget}, {promised} in use "
                f"by or promised to stages that are busy, kept or waiting ({busy})",
            )
        while self._promised() + need > budget:
            self._evict_for(victims.pop(0))
        while True:  # by the budget it fits; the arena may still have no contiguous range
            try:
                return self._alloc(st)
            except OutOfSpace as exc:
                if self.memory.lent:
                    return None  # training gives back what it borrowed here (`claim`)
                if not victims:
                    raise FlowmeshError(Code.NO_SPACE, f"cannot place {where}: {exc}") from None
                self._evict_for(victims.pop(0))

    def _changed(self) -> None:
        if self.on_residency is not None:
            self.on_residency()

    def _issue(self, st: Stage, got: list[Extent]) -> None:
        """The stage's ranges are taken: plan and start its copies."""
        it = iter(got)
        st.extents = [next(it) if r.size else None for r in st.host.regions]
        st.copies = plan_copies(st.host.regions, st.extents, self.copy_chunk_bytes)
        for run in st.copies:
            # A block is ready when the copy carrying it is: the run's first block's marker is
            # the copy's, the others are marked right after it on the copy lane.
            run.marker = st.ready[run.blocks[0]]
        self.stage_bytes_peak = max(self.stage_bytes_peak, self.stage_bytes())
        self._start_copy(st, st.generation, st.load_t0)

    def _wake(self) -> None:
        """Training freed a range (on its driver thread): retry waiting loads on the loop."""
        loop = self._loop
        if self._waiting and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._retry_waiting)

    def _retry_waiting(self) -> None:
        while self._waiting:
            st = self.stages.get(self._waiting[0])
            if st is None or not st.waiting:
                self._waiting.popleft()
                continue
            try:
                got = self._alloc(st)
            except OutOfSpace as exc:
                if self.memory.lent:
                    return  # training still gives ranges back: the next free retries
                # Training holds nothing of serving's bytes and it still does not fit: the
                # serving stages themselves are fragmented. Evict the idle one worth least and
                # try again.
                victims = self._victims(st.keep, st.key)
                if victims:
                    self._evict_for(victims[0])
                    continue
                self._waiting.popleft()
                fut = st.loading
                if fut is not None and not fut.done():
                    # Before `evict`, which would fail it as evicted while loading instead.
                    where = f"{st.key[0]!r}/{st.key[1]}"
                    fut.set_exception(FlowmeshError(Code.NO_SPACE, f"cannot place {where}: {exc}"))
                    fut.exception()  # retrieved: a run's implicit load may have no one awaiting it
                self.evict(st.key)
                continue
            self._waiting.popleft()
            st.waiting = False
            self.memory.unclaim()
            self._issue(st, got)

    def _warm_lanes(self) -> None:
        """One small copy on each lane now: the first load of a worker would otherwise also pay
        for starting the lane's thread and torch's helper threads (up to 3.6x a later load)."""
        n = min(1 << 20, self.arena.capacity)
        src = torch.zeros(n, dtype=torch.uint8)
        for lane, pool in enumerate(self._copies):
            marker = self.device.new_marker()
            dst = self.device.arena[:n]  # nothing is allocated yet: no owner to order after
            pool.submit(self.device.copy_in, dst, src, [], marker, lane).result()
            marker.wait()

    def _mark_copied(self, marker: Any, lane: int = 0) -> None:
        """Mark `marker` at the current point of copy lane `lane` (after the copies issued)."""
        self.device.mark_copied(marker, lane)

    def _start_copy(self, st: Stage, generation: int, t0: float) -> None:
        loop = asyncio.get_running_loop()
        extents, ready = list(st.extents), list(st.ready)
        lane = min(range(self.copy_lanes), key=self._queued.__getitem__)
        self._queued[lane] += st.host.nbytes
        copied = loop.run_in_executor(
            self._copies[lane], self._copy_blocks, st, extents, st.copies, ready, lane, generation
        )

        async def finish() -> None:
            try:
                await copied
                await loop.run_in_executor(self._waiter, _wait_all, ready)
            except Exception as exc:  # a failed copy fails the load, not the worker
                self._finish_load(st, generation, exc, t0, ready, lane)
            else:
                self._finish_load(st, generation, None, t0, ready, lane)
            finally:
                self._queued[lane] -= st.host.nbytes

        task = loop.create_task(finish())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _copy_blocks(
        self,
        st: Stage,
        extents: list[Extent | None],
        runs: list[CopyRun],
        ready: list[Any],
        lane: int,
        generation: int,
    ) -> None:
        arena, host = self.device.arena, st.host
        for n, run in enumerate(runs):
            with st.binding:
                # Evicted since it was issued, maybe loaded again and bound elsewhere (with two
                # lanes that copy may have run first): bind nothing, copy nothing, only let
                # whoever waits on these blocks go (their next owners order after that).
                gone = st.generation != generation
                if not gone:
                    st.bound_all = -1  # an earlier load's runs must check block by block
                    for i in run.blocks:
                        self._bind(st, i, extents)
                        st.bound[i] = generation
            if gone:
                for i in (i for later in runs[n:] for i in later.blocks):
                    if not ready[i].done():
                        self._mark_copied(ready[i], lane)
                return
            if run.nbytes == 0:
                self._mark_copied(run.marker, lane)  # aliases only: nothing to move
            else:
                dst = arena[run.dst : run.dst + run.nbytes]
                src = host.buffer[run.src : run.src + run.nbytes]
                self.device.copy_in(dst, src, run.after, run.marker, lane)
            for i in run.blocks:
                if ready[i] is not run.marker:
                    self._mark_copied(ready[i], lane)
        with st.binding:  # unless a later load (which evicted this one) may be binding them now
            if st.generation == generation:
                st.bound_all = generation

    def _bind(self, st: Stage, i: int, extents: list[Extent | None]) -> None:
        """Point block i's tensors at its range (before the copy: a run waiting on the block's
        marker finds it wired). A run of an earlier load may be computing with the block: it
        is marked unbound first, so that the run sees the change (`Stage.bound`)."""
        arena, host = self.device.arena, st.host
        views = {}
        for s in host.regions[i].slots:
            if s.alias is None:
                ext = extents[i]
                assert ext is not None
                views[s.name] = view_of(arena, ext.offset + s.offset, s)
            else:  # tied to a tensor of an earlier block: share its bytes
                ab, ai = s.alias
                first, owner = host.regions[ab].slots[ai], extents[ab]
                assert owner is not None
                views[s.name] = view_of(arena, owner.offset + first.offset, first)
        st.bound[i] = -1
        st.blocks[i].load_state_dict(views, assign=True, strict=True)

    def _finish_load(
        self,
        st: Stage,
        generation: int,
        exc: BaseException | None,
        t0: float,
        ready: list[Any],
        lane: int,
    ) -> None:
        """Settle load `generation` once its copy on `lane` ended; `ready`: its blocks' markers."""
        if exc is not None:
            # Whatever the stage became since, the copy stopped part-way: markers it left unset
            # would hold for ever the runs waiting on them and, had the stage been evicted
            # meanwhile, the next owner of its ranges (`evict` orders it after them). The runs
            # of this generation must fail (it is abandoned first), never compute on what the
            # copy left in the bytes.
            self._abandon(st, generation, ready, lane)
        fut = st.loading
        if fut is None or fut.done() or st.generation != generation:
            # Given up since (its future failed then): `st.loading`, if any, is a later load's,
            # settled by that load's own copy, not this one's.
            return
        if exc is not None:
            fut.set_exception(FlowmeshError(Code.INTERNAL, f"load failed: {exc}"))
            self.evict(st.key)
            return
        seconds = self.clock() - t0
        st.state = State.RESIDENT
        self.counters["loads"] += 1
        self.counters["bytes_loaded"] += st.host.nbytes
        if seconds > 0 and st.host.nbytes:
            bw = st.host.nbytes / seconds
            self.bandwidth = bw if not self.bandwidth else 0.8 * self.bandwidth + 0.2 * bw
        fut.set_result(LoadInfo(st.host.nbytes, seconds))

    def _abandon(
        self,
        st: Stage,
        generation: int | None = None,
        ready: list[Any] | None = None,
        lane: int = 0,
    ) -> None:
        """The stage's blocks will not come for load `generation` (default: the current one,
        whose markers are `st.ready`): wake the runs waiting on its markers `ready`, which then
        find the generation abandoned. They are marked on copy lane `lane`: after whatever part
        of the copy it issued, which may still be writing the bytes."""
        if generation is None:
            generation, ready = st.generation, st.ready
        assert ready is not None
        st.abandoned.add(generation)
        if len(st.abandoned) > 8:  # runs of older generations have long been answered
            # A stale load's copy fails after later ones were given up: its runs are waiting.
            st.abandoned.discard(min(st.abandoned - {generation}))
        for m in ready:
            if not m.done():
                self._mark_copied(m, lane)

    def evict(self, key: StageKey, park: bool = True) -> int:
        """Give the stage's device bytes back now; their next owner waits for its last users.
        Its live sequences are preempted (`park`: their KV parked where that pays, see
        `park_seqs`; else, or when the stage is dropped, their KV goes)."""
        st = self._stage(key)
        if st.state is State.HOST:
            return 0
        if st.waiting:
            # Nothing was placed or copied: wake the runs waiting on its markers, which then
            # find their generation abandoned, and stop claiming training's memory.
            st.waiting = False
            self._abandon(st)
            self.memory.unclaim()
        with self._lock:  # no run is admitted on the reader thread while the bytes go
            after = [*st.ready, *st.users]
            extents = st.extents
            st.state, st.extents, st.users = State.HOST, [], []
            st.gen_tail = None  # its live sequences go: no iteration follows one from before
            st.generation += 1
            st.next_up = False
        freed = 0
        for ext in extents:
            if ext is not None:
                freed += ext.size
                self.memory.free(ext, after, "serving")
        if st.kv is not None:
            # Parked sequences go on where they were when the stage is back; the others' next
            # step fails NOT_RESIDENT and the broker starts them again from their tokens.
            if park:
                held = list(st.kv.seqs)
                freed += st.kv.release(held, after + self._park(st, held, after))
            else:
                freed += st.kv.free_all(after)
            if not st.kv.parked:
                st.kv = None
        if st.loading is not None and not st.loading.done():
            st.loading.set_exception(FlowmeshError(Code.NOT_RESIDENT, "evicted while loading"))
            st.loading.exception()  # mark retrieved: nobody may be waiting on it
        self.counters["evictions"] += 1
        return freed

    # ------------------------------------------------------------------ run

    def run(
        self,
        key: StageKey,
        parts: list[Mapping[str, Any]],
        separate: bool = False,
        on_lane: Callable[[RunOutput], bool] | None = None,
        gen: GenStep | None = None,
        run_id: int = 0,
    ) -> asyncio.Future[RunOutput]:
        """Run one batch (the parts are concatenated along dim 0) through a loaded stage; with
        `separate`, each part through the stage on its own, one after the other (requests of a
        model that takes one per forward, sent together: one hand-off for all of them).

        `on_lane(output)` is called on the compute lane as soon as the run is computed, before
        the loop hears of it: True when it answered the run from there (`output.answered`),
        so that the answer does not wait for the loop to wake up.

        `gen`: an iteration of generation (`_run_gen`): one part, one tensor (stage 0: the
        packed token ids; later: the hidden states of those tokens); the sequences' KV blocks
        are placed here, on the loop, before it is queued (NO_SPACE, changing nothing, when
        they cannot be). `run_id` names it for an iteration that follows it (`GenStep.follows`:
        its token ids are the ones the run it follows draws, taken on the lane once that one
        is done)."""
        st = self._stage(key)
        if st.state is State.HOST:
            # Evicted since the broker last heard (the worker chooses its evictions): bring it
            # back; the run waits on its blocks' markers like any run sent during a load.
            try:
                self.load(key)
            except FlowmeshError as exc:
                raise FlowmeshError(
                    Code.NOT_RESIDENT, f"{key[0]!r}/{key[1]} is not loaded: {exc.reason}"
                ) from None
            self.counters["implicit_loads"] += 1
        restores: list[Restore] = []
        follows: GenTail | None = None
        if gen is not None:
            x = gen_input(f"{st.key[0]!r}/{st.key[1]}", st.limits, parts, gen)
            if gen.follows:
                follows = self._followed(st, gen)
            seqs, placed, restores = self._place_kv(st, gen)
        with self._lock:
            done = self._admit(st, len(parts))
            ready, generation = list(st.ready), st.generation
        self._prefetch_next(key)
        self.memory.serving_started()
        loop = asyncio.get_running_loop()
        if gen is None:
            fut = self._compute.submit(
                loop,
                self._run_and_answer,
                on_lane,
                st,
                ready,
                [[p] for p in parts] if separate else [parts],
                done,
                generation,
            )
        else:
            self.counters["gen_runs"] += 1
            after = new_blocks_after(placed)
            if restores:
                self.counters["kv_restored"] += len(restores)
            tail = GenTail(run_id)
            fut = loop.create_future()
            args = (follows, tail, on_lane, st, ready, x, gen, seqs, after, done, generation)
            job = (loop, fut, self._run_gen_after, (*args, restores))
            # Right after the iteration it follows, on its lane, when that one still runs.
            if follows is None or not follows.then(job):
                self._compute.submit(loop, _run_chain, job)
            st.gen_tail = tail  # queued: what the next iteration may follow

        def settle(f: asyncio.Future[RunOutput]) -> None:
            self.memory.serving_ended()
            failed = f.cancelled() or f.exception() is not None
            # (A follower whose iteration failed ran nothing: the KV is that one's to settle.)
            if failed and not f.cancelled() and isinstance(f.exception(), FollowedFailed):
                pass
            elif failed and gen is not None and st.kv is not None:
                # Its sequences fail (the broker does not restart them, v1): their KV goes now.
                st.kv.free((s.seq for s in gen.seqs), [done])
            self._finish_run(
                st, done, None if failed else f.result(), len(parts) if separate else 1
            )

        fut.add_done_callback(settle)
        return fut

    def _prefetch_next(self, key: StageKey) -> None:
        """Start copying in the stage after `key` when it is here but not on the device (a
        streamed model: several of its stages on this worker, more than the budget holds), so
        that its copy overlaps this run's compute. `key` is in flight, so never its victim. No
        room (the runs in flight hold it): its own run brings it in, as any evicted stage."""
        nxt = self.stages.get((key[0], key[1] + 1))
        if nxt is None or nxt.state is not State.HOST:
            return
        try:
            self.load(nxt.key, (key,), prefetch=True)
        except FlowmeshError:
            return
        nxt.next_up = True
        self.counters["prefetches"] += 1

    def run_here(
        self, key: StageKey, parts: list[Mapping[str, Any]], separate: bool = False
    ) -> RunOutput | None:
        """`run`, computed on the calling thread, which is not the event loop's (the worker's
        reader thread): for a resident stage, when the run is expected to take under
        `quick_run_s`. Returns None, having done nothing, for any other run (of a stage loading,
        evicted, unknown or never run yet, or too long), which the caller then hands to `run` on
        the loop. Raises what a run's future would."""
        st = self.stages.get(key)
        if st is None:
            return None
        with self._lock:
            forwards = len(parts) if separate else 1
            expected = st.expected_s(forwards, part_rows(parts))
            if st.state is not State.RESIDENT or not 0.0 < expected < self.quick_run_s:
                return None
            nxt = self.stages.get((key[0], key[1] + 1))
            if nxt is not None and nxt.state is State.HOST:
                return None  # `run` prefetches it, on the loop
            done = self._admit(st, len(parts))
            ready, generation = list(st.ready), st.generation
        self.memory.serving_started()
        out = None
        try:
            batches = [[p] for p in parts] if separate else [parts]
            out = self._run_blocks(st, ready, batches, done, generation)
            return out
        finally:
            self.memory.serving_ended()
            self._finish_run(st, done, out, forwards)

    def _admit(self, st: Stage, requests: int) -> Any:
        """Count a run in (under `_lock`); returns the marker of its end on the device."""
        now = self.clock()
        st.rate.add(now, requests)
        st.last_used = now
        st.inflight += 1
        st.next_up = False
        done = self.device.new_marker()
        # Runs that are past their marker no longer read the bytes: keep only those that may.
        st.users = [m for m in st.users if not m.done()]
        st.users.append(done)
        return done

    def _finish_run(self, st: Stage, done: Any, out: RunOutput | None, forwards: int) -> None:
        """Count a run of `forwards` forwards out; `out` None: it failed."""
        with self._lock:
            st.inflight -= 1
            if done.done():  # else a later run or the eviction still finds it in `users`
                with contextlib.suppress(ValueError):  # gone if evicted (and maybe reloaded)
                    st.users.remove(done)
            self.counters["runs"] += 1
            if out is None:
                self.counters["run_errors"] += 1
                return
            self.counters["rows"] += out.rows
            st.measured(out.compute_s, forwards, out.rows)

    def _run_and_answer(self, on_lane: Callable[[RunOutput], bool] | None, *args: Any) -> RunOutput:
        out = self._run_blocks(*args)
        if on_lane is not None:
            try:
                out.answered = on_lane(out)
            except Exception:  # the loop answers instead, as for a run without on_lane
                log.exception("answering a run from its compute lane")
        return out

    def _run_blocks(
        self,
        st: Stage,
        ready: list[Any],
        batches: list[list[Mapping[str, Any]]],
        done: Any,
        generation: int,
    ) -> RunOutput:
        """Each batch of parts (concatenated) through the stage's blocks, one batch after the
        other: one batch for a run, one per part for a separate run."""
        dev = self.device
        marked = False
        try:
            if st.limits is not None:  # every part, before any of them computes
                batches = [checked_parts(st.limits, parts) for parts in batches]
            with torch.inference_mode(), dev.compute(serving=True):
                t0 = self.clock()
                wait_s = 0.0
                outputs: list[tuple[dict[str, torch.Tensor], list[int]]] = []
                total = 0
                device = dev.torch_device
                try:
                    for parts in batches:
                        inputs, rows = concat_parts(parts, device)
                        x, waited = self._forward(st, ready, inputs, generation)
                        wait_s += waited
                        outputs.append((self._off_arena(named_outputs(x)), rows))
                        total += sum(rows)
                finally:
                    # Past this point of the compute stream the run no longer reads the stage's
                    # bytes (whatever happened): their later owners order after this marker, not
                    # after the outputs' trip to the host, which waits for the device.
                    dev.mark_done(done)
                    marked = True
                parts_out = []
                on_host = dev.kind == "cpu"
                for out, rows in outputs:
                    host = out if on_host else {n: t.to("cpu") for n, t in out.items()}
                    parts_out.extend(split_rows(host, rows))
                compute_s = self.clock() - t0 - wait_s
                return RunOutput(parts_out, compute_s, wait_s, total)
        finally:
            if not marked:  # the compute lane itself failed: nothing of the run was queued
                dev.mark_done(done)

    def _forward(
        self,
        st: Stage,
        ready: list[Any],
        x: Any,
        generation: int,
        step: Callable[[int, Any], Any] | None = None,
    ) -> tuple[Any, float]:
        """`x` through the stage's blocks, each once its bytes are in; returns the output and
        the seconds spent waiting for them. `step(k, x)`: how block k computes (a generation
        run's), instead of its own forward."""
        blocks = st.blocks
        wait_s = 0.0
        i = 0
        while i < len(blocks):
            if not ready[i].done():  # still copying in (a resident stage's never are)
                tw = self.clock()
                ready[i].order_current()
                wait_s += self.clock() - tw
            # This block and the ones after it whose bytes are already in run under one hold
            # of the lock (for a resident stage: all of them, one hold per forward); a block
            # still loading is waited for outside it, so a builder never waits on a copy.
            end = i + 1
            while end < len(blocks) and ready[end].done():
                end += 1
            if generation in st.abandoned:
                raise _evicted(st)
            with SERVING_CALLS.shared():  # not while a model is traced
                if _rebound(st, i, end, generation):
                    raise _evicted(st)
                for k in range(i, end):
                    try:
                        if step is not None:
                            x = step(k, x)
                        else:
                            x = call_model(blocks[k], x) if k == 0 else blocks[k](x)
                    except Exception as exc:
                        if _rebound(st, k, k + 1, generation):
                            raise _evicted(st) from None
                        where = traceback.extract_tb(exc.__traceback__)[-1]
                        raise FlowmeshError(
                            Code.MODEL_ERROR,
                            f"{st.key[0]}: block {k} raised {type(exc).__name__}: {exc} "
                            f"({where.filename.rsplit('/', 1)[-1]}:{where.lineno})",
                        ) from None
            # Loaded again elsewhere while these blocks computed: they may have read bytes the
            # new load has not written yet.
            if _rebound(st, i, end, generation):
                raise _evicted(st)
            i = end
        return x, wait_s

    # ------------------------------------------------------------------ generation

    def _kv(self, st: Stage) -> StageKV:
        """The stage's KV cache, made at its first generation run (BAD_REQUEST for blocks that
        generation does not run)."""
        if st.kv is None:
            where = f"{st.key[0]!r}/{st.key[1]}"
            st.kv = StageKV(where, kv_shape(st.blocks), self.memory, self.device.arena)
        return st.kv

    def _place_kv(self, st: Stage, gen: GenStep) -> tuple[list[SeqKV], list[Extent], list[Restore]]:
        """Ranges for the blocks the iteration adds, within the model's KV share of the serving
        budget, making room in the budget by evicting idle stages of other models as a load does
        (one holding live KV only when the broker says the model starves: `evict_live`).
        Returns each step's sequence, the new ranges and the parked sequences' bytes to copy
        back into them.
        Raises, having changed nothing: TOO_BIG for a sequence whose KV could never fit here,
        NO_SPACE when the blocks do not fit now (other sequences hold the room)."""
        kv = self._kv(st)
        new = kv.need(gen.seqs)
        if not new:
            return *kv.grow(gen.seqs, []), []
        size = self.memory.round(kv.block_bytes)
        need, budget = new * size, self.memory.serving_bytes
        model = st.key[0]
        cap = int(st.kv_share * budget)
        where = kv.where
        longest = max(gen.seqs, key=lambda s: s.start + s.count)
        alone = blocks_for(longest.start + longest.count) * size
        if alone > cap:
            self.counters["kv_refused"] += 1
            raise FlowmeshError(
                Code.TOO_BIG,
                f"{where}: sequence {longest.seq} needs {alone} bytes of KV at "
                f"{longest.start + longest.count} tokens ({size} per block of "
                f"{KV_TOKENS} tokens), over its model's share here: kv_share "
                f"{st.kv_share} x serving budget {budget} = {cap} bytes",
            )
        held = sum(s.kv.nbytes for s in self.stages.values() if s.key[0] == model and s.kv)
        if held + need > cap:
            self.counters["kv_refused"] += 1
            raise FlowmeshError(
                Code.NO_SPACE,
                f"{where}: KV of {model!r} would take {held + need} bytes on this worker "
                f"({held} held, {new} more blocks of {size}), over its share: kv_share "
                f"{st.kv_share} x serving budget {budget} = {cap} bytes",
            )
        # Never this model's stages: they run the iteration, before and after this one. Stages
        # holding other models' live sequences only for a model starved of room (`evict_live`).
        mine = frozenset(k for k in self.stages if k[0] == model)
        victims = self._victims(mine, live=gen.evict_live)
        promised = self._promised()
        if promised + need - budget > sum(self._need(v) for v in victims):
            self.counters["kv_refused"] += 1
            raise FlowmeshError(
                Code.NO_SPACE,
                f"{where}: {new} KV blocks ({need} bytes) do not fit: serving budget {budget}, "
                f"{promised} in use by or promised to stages and KV that stay "
                f"({held} of it this model's KV)",
            )
        while self._promised() + need > budget:
            self._evict_for(victims.pop(0))
        while True:  # by the budget it fits; the arena may still have no range for a block
            try:
                placed = self.memory.alloc_serving([kv.block_bytes] * new)
                break
            except OutOfSpace as exc:
                if not victims:
                    self.counters["kv_refused"] += 1
                    if self.memory.lent:
                        # Training borrowed serving's free ranges: claimed back, as a stage
                        # load claims them, for the broker's next try (the run cannot wait
                        # here: it is placed on the loop, and answers NO_SPACE at once).
                        lent = self.memory.lent
                        self._claim_for_kv()
                        raise FlowmeshError(
                            Code.NO_SPACE,
                            f"{where}: cannot place {new} KV blocks while training holds "
                            f"{lent} bytes of serving's memory; claimed back: {exc}",
                        ) from None
                    raise FlowmeshError(
                        Code.NO_SPACE, f"{where}: cannot place {new} KV blocks: {exc}"
                    ) from None
                self._evict_for(victims.pop(0))
        self._unclaim_for_kv()
        grown, restores = kv.grow(gen.seqs, placed)
        return grown, placed, restores

    def _claim_for_kv(self) -> None:
        """Claim training's borrowed ranges back (`DeviceMemory.claim`) for KV_CLAIM_S, or
        until a placement succeeds; one claim at a time."""
        if self._kv_claim is not None:
            return
        self.memory.claim()
        self._kv_claim = asyncio.get_running_loop().call_later(KV_CLAIM_S, self._unclaim_for_kv)

    def _unclaim_for_kv(self) -> None:
        handle, self._kv_claim = self._kv_claim, None
        if handle is not None:
            handle.cancel()
            self.memory.unclaim()

    def free_seqs(self, key: StageKey, seqs: list[int]) -> int:
        """Drop the KV of `seqs` on stage `key` (those held or parked); their ranges' next
        owner waits for the stage's runs that may still read them. Returns the bytes freed."""
        st = self.stages.get(key)
        if st is None or st.kv is None:
            return 0
        with self._lock:
            after = [m for m in st.users if not m.done()]
        return st.kv.free(seqs, after)

    def park_seqs(self, key: StageKey, seqs: list[int]) -> tuple[list[int], list[int]]:
        """Preempt `seqs` of stage `key`: give their device ranges back, each one's KV parked
        in host memory (its next step, from where it stopped, copies it back) or dropped (to
        be recomputed from its tokens), by `kv_preempt`. Returns (parked, dropped): sequences
        already parked count as parked, those not held here as dropped."""
        st = self.stages.get(key)
        if st is None or st.kv is None:
            return [], list(seqs)
        with self._lock:
            after = [m for m in st.users if not m.done()]
        held = [s for s in seqs if s in st.kv.seqs]
        st.kv.release(held, after + self._park(st, held, after))
        parked = [s for s in seqs if s in st.kv.parked]
        return parked, [s for s in seqs if s not in st.kv.parked]

    def _park(self, st: Stage, seqs: list[int], after: list[Any]) -> list[Any]:
        """Park those of held `seqs` whose KV costs less to copy out and back than to
        recompute (and fits the host room left), the copy queued on a compute lane after
        `after`; the others are dropped. Their device ranges stay held: the caller releases
        them after the markers returned (the copy out's; `st.kv.release`)."""
        kv = st.kv
        assert kv is not None
        bw = self.bandwidth or 1e9
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        marker = self.device.new_marker()
        room = self.park_bytes - sum(s.kv.parked_bytes for s in self.stages.values() if s.kv)
        for seq in seqs:
            held = kv.seqs[seq]
            nbytes = len(held.extents) * kv.block_bytes
            copy_s, recompute_s = 2 * nbytes / bw, held.tokens * st.row_s
            if (
                not nbytes
                or self.kv_preempt == "recompute"
                or (self.kv_preempt == "auto" and st.row_s and copy_s > recompute_s)
                or nbytes > room
            ):
                self.counters["kv_dropped"] += 1
                continue
            try:
                host = self.device.host_buffer(nbytes)
            except FlowmeshError:  # the pinned host tier is full: recompute it
                self.counters["kv_dropped"] += 1
                continue
            room -= nbytes
            blocks = kv.park(seq, host, marker)
            size = kv.block_bytes
            pairs += [(host[i * size : (i + 1) * size], b) for i, b in enumerate(blocks)]
            self.counters["kv_parked"] += 1
        if not pairs:
            return []
        fut = self._compute.submit(asyncio.get_running_loop(), self._copy_out, pairs, after, marker)
        fut.add_done_callback(_log_failure)
        return [marker]

    def _copy_out(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: list[Any], marker: Any
    ) -> None:
        """On a compute lane: parked sequences' blocks to their host buffers, after the runs
        that wrote them; `marker` done once the bytes are out."""
        dev = self.device
        try:
            with torch.inference_mode(), dev.compute(serving=True):
                for m in after:
                    m.order_current()
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=dev.kind != "cpu")
        finally:
            dev.mark_done(marker)

    def _followed(self, st: Stage, gen: GenStep) -> GenTail:
        """The iteration `gen` follows, checked: the latest placed on this stage, of the same
        sequences, one token each, on a stage that draws the tokens it then takes in. Raises
        FollowedFailed (changing nothing) when it cannot follow it."""
        where = f"{st.key[0]!r}/{st.key[1]}"
        if not (st.blocks and isinstance(st.blocks[-1], HEADS) and st.limits is not None):
            raise FlowmeshError(
                Code.BAD_REQUEST,
                f"{where}: only a stage that takes token ids and draws the next ones may run an "
                "iteration that follows another",
            )
        if any(s.count != 1 for s in gen.seqs):
            raise FlowmeshError(
                Code.BAD_REQUEST, f"{where}: an iteration that follows another is one token each"
            )
        tail = st.gen_tail
        if tail is None or tail.run != gen.follows:
            raise FollowedFailed(
                f"{where}: iteration {gen.follows}, which this one follows, did not run here"
            )
        if tail.done.is_set() and not tail.ok:
            raise FollowedFailed(
                f"{where}: iteration {gen.follows}, which this one follows, failed"
            )
        return tail

    def _run_gen_after(
        self,
        follows: GenTail | None,
        tail: GenTail,
        on_lane: Callable[[RunOutput], bool] | None,
        st: Stage,
        ready: list[Any],
        x: torch.Tensor,
        gen: GenStep,
        seqs: list[SeqKV],
        *rest: Any,
    ) -> RunOutput:
        """`_run_gen`, once the iteration it follows (if any) is done, its tokens taken in as
        this one's; `tail` is set when it ends (after its answer went out from here, so that the
        one following it never answers first)."""
        ok = False
        try:
            if follows is not None:
                # Before anything of the device is held: that iteration may still need it.
                if not follows.done.wait(FOLLOW_WAIT_S):
                    raise FollowedFailed(
                        f"iteration {follows.run}, which this one follows, did not end within "
                        f"{FOLLOW_WAIT_S:.0f} s"
                    )
                if not follows.ok:
                    raise FollowedFailed(f"iteration {follows.run}, which this one follows, failed")
                drawn = [s.token for s in seqs]
                if any(t is None for t in drawn):
                    raise FollowedFailed(
                        f"iteration {follows.run}, which this one follows, drew no token for "
                        "one of its sequences"
                    )
                x = torch.tensor(drawn, dtype=torch.int64)
            out = self._run_gen(on_lane, st, ready, x, gen, seqs, *rest)
            ok = True
            return out
        finally:
            tail.end(ok)

    def _run_gen(
        self,
        on_lane: Callable[[RunOutput], bool] | None,
        st: Stage,
        ready: list[Any],
        x: torch.Tensor,
        gen: GenStep,
        seqs: list[SeqKV],
        after: list[Any],
        done: Any,
        generation: int,
        restores: list[Restore] = (),  # type: ignore[assignment]
    ) -> RunOutput:
        """One iteration of generation through the stage (on a compute lane): the hidden
        states of its tokens out, or on the last stage one sampled token per sequence
        (`tokens`). Parked sequences' bytes (`restores`) are copied back into their new blocks
        first."""
        dev = self.device
        marked = False
        try:
            with torch.inference_mode(), dev.compute(serving=True):
                t0 = self.clock()
                for m in after:  # the new blocks' last users, before we write them
                    m.order_current()
                for r in restores:
                    r.after.order_current()  # the park's copy out
                    size = r.block_bytes
                    for i, block in enumerate(r.blocks):
                        block.copy_(r.host[i * size : (i + 1) * size], non_blocking=True)
                packed = Packed([s.start for s in gen.seqs], [s.count for s in gen.seqs])
                caches = [s.cache for s in seqs]
                layer_of, n = [], 0
                for block in st.blocks:
                    layer_of.append(n)
                    n += isinstance(block, ATTENTION)
                blocks = st.blocks

                def step(k: int, h: Any) -> Any:
                    return block_step(blocks[k], h, packed, caches, layer_of[k])

                try:
                    out, wait_s = self._forward(
                        st, ready, on_device(x, dev.torch_device), generation, step
                    )
                    if isinstance(blocks[-1], HEADS):
                        generators = []
                        for s, seq in zip(gen.seqs, seqs, strict=True):
                            if s.sampling.temperature > 0:
                                if seq.generator is None:
                                    seq.generator = new_generator(s.sampling, out.device)
                                    seq.seed = seq.generator.initial_seed()
                                at_draw(seq.generator, seq.seed, s.drawn)
                            generators.append(seq.generator)
                        tokens = sample(out, [s.sampling for s in gen.seqs], generators)
                        outputs = {"tokens": tokens}
                    else:
                        outputs = {"": out}
                finally:
                    dev.mark_done(done)  # past it, the run reads no arena bytes
                    marked = True
                if dev.kind != "cpu":
                    outputs = {n: t.to("cpu") for n, t in outputs.items()}
                if "tokens" in outputs:  # what an iteration following this one takes in
                    for seq, t in zip(seqs, outputs["tokens"].tolist(), strict=True):
                        seq.token = t
                compute_s = self.clock() - t0 - wait_s
                result = RunOutput([outputs], compute_s, wait_s, packed.total)
        finally:
            if not marked:
                dev.mark_done(done)
        if on_lane is not None:
            try:
                result.answered = on_lane(result)
            except Exception:  # the loop answers instead
                log.exception("answering a run from its compute lane")
        return result

    def _off_arena(self, outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Outputs that view the arena (a block returning a weight) are copied, on the compute
        lane before the run's marker: an eviction may hand those bytes to another stage."""
        arena_ptr = self._arena_ptr
        return {
            name: t.clone() if t.untyped_storage().data_ptr() == arena_ptr else t
            for name, t in outputs.items()
        }

    # ------------------------------------------------------------------ introspection

    def resident(self) -> list[StageKey]:
        return [k for k, s in self.stages.items() if s.state is not State.HOST]

    def residency(self) -> list[list[Any]]:
        """[[model, stage, nbytes], ...] of the stages holding device bytes (loading included)."""
        return [
            [k[0], k[1], s.host.nbytes] for k, s in self.stages.items() if s.state is not State.HOST
        ]

    def stage_bytes(self) -> int:
        """Device bytes of the stages that hold arena ranges (loading or resident)."""
        return sum(s.host.nbytes for s in self.stages.values() if s.state is not State.HOST)

    def stats(self) -> dict[str, Any]:
        kvs = [s.kv for s in self.stages.values() if s.kv is not None]
        return {
            **self.counters,
            "budget_bytes": self.memory.serving_bytes,
            "resident_bytes": self.memory.used["serving"],
            "peak_bytes": self.memory.peak["serving"],
            # What holds the bytes, as the stages see it (the arena's figures above cannot exceed
            # the budget by construction; these can, if the bookkeeping is wrong).
            "resident_stages": {
                f"{k[0]}/{k[1]}": s.host.nbytes
                for k, s in self.stages.items()
                if s.state is not State.HOST
            },
            "stage_bytes_peak": self.stage_bytes_peak,
            "largest_free": self.arena.largest_free,
            "host_bytes": sum(s.host.nbytes for s in self.stages.values()),
            "inflight": sum(s.inflight for s in self.stages.values()),
            "stages": {f"{k[0]}/{k[1]}": s.state.value for k, s in self.stages.items()},
            # Generation's KV cache: bytes and blocks held (in the serving budget, counted in
            # resident_bytes too), and the sequences holding them, over all stages here.
            "kv_bytes": sum(kv.nbytes for kv in kvs),
            "kv_blocks": sum(kv.blocks for kv in kvs),
            "kv_seqs": len({q for kv in kvs for q in kv.seqs}),
            # Preempted sequences' KV parked in host memory here (`park_seqs`).
            "kv_parked_bytes": sum(kv.parked_bytes for kv in kvs),
            "kv_parked_seqs": len({q for kv in kvs for q in kv.parked}),
            # The same bytes per stage ("model/stage", beside resident_stages), for the broker's
            # eviction choice: a stage's resident bytes there are its weights + its live KV.
            # Only stages holding some: one entry per stage at most, as resident_stages.
            "kv_stage_bytes": {
                f"{k[0]}/{k[1]}": s.kv.nbytes
                for k, s in self.stages.items()
                if s.kv is not None and s.kv.nbytes
            },
        }

    def close(self) -> None:
        for pool in (self._compute, *self._copies, self._waiter):
            pool.shutdown(wait=False, cancel_futures=True)
        self._unclaim_for_kv()  # training beside it admits again
        # Off the memory, which may outlive this executor: a new list, not this one changed
        # (another thread may be calling its listeners).
        self.memory.wake_serving = [f for f in self.memory.wake_serving if f != self._wake]


def _run_chain(job: tuple[Any, ...]) -> None:
    """On a compute lane: generation iteration `job`, then each one that follows it (attached
    by `GenTail.then` while the one before ran), each settling its own future."""
    while job is not None:
        run_one(*job)
        job = job[3][1].take_next()  # (loop, fut, fn, (follows, tail, ...))


def _computing(st: Stage) -> bool:
    """Whether a run of `st` may still read its bytes. A run answered from its compute lane is
    counted out on the loop a moment later; past its marker it reads nothing of the stage, so
    the stage may go (a load that comes right after the answer finds the room)."""
    return st.inflight > 0 and not all(m.done() for m in st.users)


def _log_failure(f: asyncio.Future[Any]) -> None:
    if not f.cancelled() and f.exception() is not None:
        log.error("parking KV failed: %r", f.exception())


def _rebound(st: Stage, lo: int, hi: int, generation: int) -> bool:
    """Whether one of blocks [lo, hi) is not bound to the ranges of load `generation`."""
    if st.bound_all == generation:  # a resident stage's runs: one comparison
        return False
    bound = st.bound
    return any(bound[k] not in (generation, None) for k in range(lo, hi))


def _evicted(st: Stage) -> FlowmeshError:
    return FlowmeshError(Code.NOT_RESIDENT, f"{st.key[0]!r}/{st.key[1]} was evicted")


def _wait_all(markers: list[Any]) -> None:
    for m in markers:
        m.wait()
