"""Devices a worker drives: a CUDA GPU, or a CPU stand-in with the same code paths.

A device gives the executor four things: an arena of exactly the budget, host buffers (pinned on
CUDA), a copy lane that moves host bytes into arena ranges, and markers that order work across
lanes. On CUDA the copy lane is a CUDA stream and markers are events, so a run waits for its
weights on the GPU, never on the host. On the CPU stand-in the copy lane is a thread doing real
memcpy into the arena and markers are thread events.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from gpu_worker.host_slab import PAGE, HostSlab
from gpu_worker.memory import Marker
from gpu_worker.resident_room import FREE_SHARE, ResidentRoom

log = logging.getLogger("flowmesh.worker.device")

_HERE = contextlib.nullcontext()

# Default size of the pinned host tier on CUDA, as a multiple of the device budget (the host tier
# keeps every stage deployed to the worker, resident or not), within the bounds below.
HOST_TIER_PER_BUDGET = 2
HOST_TIER_MIN = 256 << 20
HOST_TIER_MAX_OF_RAM = 0.5  # never pin more than this share of the machine's memory by default


# Guards a CpuMarker's flag against its (rare) waiters: one lock for all of them, held for a
# few bytecodes.
_MARKERS = threading.Lock()


class CpuMarker:
    """Done when the task that owns it finished its part.

    A flag, and a threading.Event only once some thread has to wait for it: every serving run
    makes one, and almost none is ever waited for, so the Event (a Condition, a lock and their
    set-up) is not made for nothing."""

    __slots__ = ("_done", "_event")

    def __init__(self, done: bool = False) -> None:
        self._done = done
        self._event: threading.Event | None = None

    def set(self) -> None:
        with _MARKERS:
            self._done = True
            event = self._event
        if event is not None:
            event.set()

    def done(self) -> bool:
        return self._done

    def recorded(self) -> bool:
        """Whether it was marked (on the CPU, marked is done)."""
        return self._done

    def wait(self, timeout: float | None = None) -> bool:
        if self._done:
            return True
        with _MARKERS:
            if self._done:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def order_current(self) -> None:
        # A CPU thread runs its work as it issues it: ordering means waiting.
        self.wait()


# What a CPU stand-in's stash waits for: nothing (`CpuStandIn.stash_out`).
_LANDED = CpuMarker(done=True)


class CudaMarker:
    """A CUDA event, plus a host flag saying it has been recorded.

    `cudaStreamWaitEvent` on an event that is not recorded yet does not wait, so a consumer first
    waits (on the host, briefly) for the producer to have *enqueued* its work, then makes its own
    stream wait on the event: the GPU orders the work, the host never waits for the copy itself.
    """

    def __init__(self, blocking: bool = False) -> None:
        # `blocking`: a host thread waiting on it sleeps until the GPU gets there, instead of
        # spinning a core all that time (CUDA's default while it has fewer contexts than
        # cores): for training's lanes, whose waits last a task's kernels; serving's spin, a
        # few microseconds sooner awake.
        self.event = torch.cuda.Event(blocking=blocking)
        self._recorded = threading.Event()

    def record(self, stream: torch.cuda.Stream) -> None:
        self.event.record(stream)
        self._recorded.set()

    def done(self) -> bool:
        return self._recorded.is_set() and self.event.query()

    def recorded(self) -> bool:
        """Whether it was recorded on some stream (its work may still be running)."""
        return self._recorded.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        if not self._recorded.wait(timeout):
            return False
        self.event.synchronize()
        return True

    def order_current(self) -> None:
        self._recorded.wait()
        torch.cuda.current_stream().wait_event(self.event)


# The training executor's copy lane (a stream of its own on CUDA), apart from serving's lanes.
TRAIN_LANE = -1
# Its write-back lane: device-to-host copies, on a stream apart from the host-to-device ones.
TRAIN_WRITE_LANE = -2
# Its stashes' lane: activations and gradients to the host between tasks, apart from the
# write-backs (which a task's extent and answer wait for).
TRAIN_STASH_LANE = -3


class Device:
    kind = "abstract"
    copy_lanes = 1
    # Largest single host->device copy of a load. Smaller copies let a run start computing on
    # the first blocks sooner; each copy has a fixed cost.
    copy_chunk_bytes = 64 << 20

    def __init__(self, budget_bytes: int, prefault: bool = True) -> None:
        self.budget_bytes = budget_bytes
        self.prefault = prefault
        self.prefault_s: float | None = None  # seconds the arena took to fault in at start
        self.arena: torch.Tensor
        # Device memory beside the arena where training's stashes may stay between their tasks
        # (`gpu_worker.resident_room`); None: a stash is never copied (the stand-in's default).
        self.resident_room: ResidentRoom | None = None

    def _prefault_arena(self) -> None:
        """Touch (zero) every page of the arena once, now, so that no load pays for first use.

        On the CPU stand-in `torch.empty` maps pages lazily: the first copy into each range would
        take the page faults (issue 8 measured ~260 ms for 200 MB), on the single copy lane. On
        CUDA the memory is real already; it is zeroed too so that a first copy is like any other.
        The time is in `info()["prefault_s"]`.
        """
        if not self.prefault:
            return
        t = time.perf_counter()
        self.arena.zero_()
        self._sync()
        self.prefault_s = time.perf_counter() - t
        log.info(
            "arena of %d bytes on %s faulted in (prefault): %.3f s",
            self.budget_bytes,
            getattr(self, "name", self.kind),
            self.prefault_s,
        )

    def _sync(self) -> None:
        pass

    def sync(self) -> None:
        """Wait until every stream's work queued on the device so far has run."""
        self._sync()

    @functools.cached_property
    def torch_device(self) -> torch.device:
        return self.arena.device  # the arena is never replaced

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        raise NotImplementedError

    def new_marker(self, blocking: bool = False) -> Any:
        """A marker to record later; `blocking`: a host thread waiting on it sleeps meanwhile
        (on CUDA; `CudaMarker`)."""
        raise NotImplementedError

    def done_marker(self) -> Any:
        raise NotImplementedError

    def copy_in(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        after: list[Marker],
        marker: Any,
        lane: int = 0,
    ) -> None:
        """On copy lane `lane`: order after `after`, copy, then mark `marker`."""
        raise NotImplementedError

    def mark_copied(self, marker: Any, lane: int = 0) -> None:
        """Mark `marker` at the current point of copy lane `lane` (after what it issued)."""
        marker.set()

    def stash_out(self, t: torch.Tensor, lane: int) -> tuple[torch.Tensor, Any]:
        """Start moving `t` (device memory of torch's, not the arena's) to the host on copy lane
        `lane`, after the calling thread's compute work so far: (its host copy, a marker set
        once the copy is in). The calling thread goes on computing meanwhile."""
        raise NotImplementedError

    def stash_in(
        self,
        host: torch.Tensor,
        landed: Any,
        into: torch.Tensor,
        after: list[Marker],
        lane: int,
    ) -> tuple[torch.Tensor, Any]:
        """Start bringing `host` (a `stash_out` copy, in once `landed` is) back into the arena
        bytes `into` (at least its bytes, aligned for its dtype) on copy lane `lane`, ordered
        after `after` (those bytes' previous users) too: (the tensor there, a marker set once
        it is). Whoever computes with it orders its work after that marker first."""
        raise NotImplementedError

    def compute(self, serving: bool = False) -> contextlib.AbstractContextManager[None]:
        """Where this thread's compute runs; `serving`: inference, ahead of training. On the
        CPU: right here (one reusable no-op context, entered on every run)."""
        return _HERE

    def mark_done(self, marker: Any) -> None:
        """Complete `marker` at the current point of this thread's compute work."""
        raise NotImplementedError

    def wait_computed(self) -> None:
        """Wait, asleep, until this thread's compute work queued so far has run (on the CPU it
        has when the thread gets here)."""

    def info(self) -> dict[str, Any]:
        return {"prefault_s": self.prefault_s}  # None: prefault switched off


class CpuStandIn(Device):
    kind = "cpu"
    # Copy threads: on two shared cores a second memcpy thread only competes with the first and
    # with compute (scripts/bench_coldstart.py --lanes measures it); raise with --copy-lanes.
    copy_lanes = 1
    # On the CPU, copies and compute share the cores (nothing to overlap) and each copy wakes
    # torch's helper threads: few, large copies are fastest.
    copy_chunk_bytes = 1 << 30

    def __init__(
        self,
        budget_bytes: int,
        prefault: bool = True,
        stash_copies: bool = False,
        resident_bytes: int = 0,
    ) -> None:
        super().__init__(budget_bytes, prefault)
        # torch.empty leaves pages untouched; the OS would commit them as ranges are first used.
        self.arena = torch.empty(budget_bytes, dtype=torch.uint8)
        self.name = "cpu"
        # Training's stashes copied out and back into the arena as a device's are (the tests
        # of that path), but for `resident_bytes` of them at once, which stay where they are
        # as a device's resident room keeps them; else they all stay where they are, which is
        # host memory already.
        self.stash_copies = stash_copies
        if stash_copies:
            self.resident_room = ResidentRoom(resident_bytes)
        self._prefault_arena()

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """Plain memory, faulted in now (one byte written per page).

        The stage loader writes every tensor right away (HostStage.build), which faults in all
        but the pages of a training slab's gradient and optimizer sections; those are touched
        here too, so a first step does not pay for them.
        """
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if self.prefault and nbytes:
            buf[::PAGE].zero_()
        return buf

    def new_marker(self, blocking: bool = False) -> CpuMarker:
        return CpuMarker()  # a CPU thread's wait sleeps anyway

    def done_marker(self) -> CpuMarker:
        return CpuMarker(done=True)

    def copy_in(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        after: list[Marker],
        marker: CpuMarker,
        lane: int = 0,
    ) -> None:
        for m in after:
            m.order_current()  # type: ignore[attr-defined]
        dst.copy_(src)
        marker.set()

    def mark_done(self, marker: CpuMarker) -> None:
        marker.set()  # CPU work is complete when the thread gets here

    def stash_out(self, t: torch.Tensor, lane: int) -> tuple[torch.Tensor, CpuMarker]:
        if self.stash_copies:
            return t.clone(), _LANDED
        return t, _LANDED  # host memory is where it already is

    def stash_in(
        self,
        host: torch.Tensor,
        landed: CpuMarker,
        into: torch.Tensor,
        after: list[Marker],
        lane: int,
    ) -> tuple[torch.Tensor, CpuMarker]:
        if not self.stash_copies:
            return host, landed  # the stash is where the compute reads it already
        for m in after:
            m.order_current()  # type: ignore[attr-defined]
        dev = arena_tensor(into, host)
        dev.copy_(host)
        return dev, _LANDED

    def info(self) -> dict[str, Any]:
        # No pinned host tier here: host copies are plain memory (the worker's `host_bytes`).
        # Its figures are still reported, as zero, so that every worker kind exports the same
        # series (scripts/grafana_dashboard.json plots them for every worker).
        return {**super().info(), "host_tier_bytes": 0, "host_tier_used_bytes": 0}


class CudaDevice(Device):
    kind = "cuda"
    # The copy engine runs beside the SMs and a memcpy call costs microseconds: copy in pieces
    # small enough that compute on the first blocks overlaps the transfer of the rest.
    copy_chunk_bytes = 32 << 20
    # Host-to-device copy lanes (streams): GPUs have two or more copy engines.
    copy_lanes = 2

    def __init__(
        self,
        index: int,
        budget_bytes: int,
        host_tier_bytes: int | None = None,
        prefault: bool = True,
        resident_bytes: int | None = None,
    ) -> None:
        super().__init__(budget_bytes, prefault)
        self.index = index
        self.name = f"cuda:{index}"
        torch.cuda.set_device(index)
        self.arena = torch.empty(budget_bytes, dtype=torch.uint8, device=self.name)
        # One stream per copy lane (lane TRAIN_LANE: the training executor's): loads of
        # different stages proceed side by side instead of queueing on one stream.
        self._copy_streams: dict[int, torch.cuda.Stream] = {}
        self.copy_stream = self.lane_stream(0)
        self._local = threading.local()
        self._prefault_arena()
        # The host tier: one pinned slab of a fixed size, reserved now, sub-allocated per stage.
        size = host_tier_bytes or default_host_tier_bytes(budget_bytes)
        t = time.perf_counter()
        self.host_slab = HostSlab(pinned_slab(size))
        log.info(
            "pinned host tier of %d bytes reserved in %.3f s (--host-tier-bytes)",
            size,
            time.perf_counter() - t,
        )
        if resident_bytes is None:
            free, _total = torch.cuda.mem_get_info(index)
            resident_bytes = int(free * FREE_SHARE)
        self.resident_room = ResidentRoom(resident_bytes)
        log.info(
            "training stashes may keep %d bytes on the device beside the arena "
            "(--train-resident-bytes)",
            resident_bytes,
        )

    def _sync(self) -> None:
        torch.cuda.synchronize(self.index)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A range of the pinned slab; it goes back when the buffer and its views are dropped."""
        return self.host_slab.take(nbytes)

    def new_marker(self, blocking: bool = False) -> CudaMarker:
        return CudaMarker(blocking)

    def done_marker(self) -> CudaMarker:
        m = CudaMarker()
        m.record(torch.cuda.current_stream(self.index))
        return m

    def lane_stream(self, lane: int) -> torch.cuda.Stream:
        stream = self._copy_streams.get(lane)
        if stream is None:
            stream = self._copy_streams[lane] = torch.cuda.Stream(device=self.index)
        return stream

    def copy_in(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        after: list[Marker],
        marker: CudaMarker,
        lane: int = 0,
    ) -> None:
        stream = self.lane_stream(lane)
        with torch.cuda.stream(stream):
            for m in after:
                m.order_current()  # type: ignore[attr-defined]
            dst.copy_(src, non_blocking=True)
            marker.record(stream)

    def mark_copied(self, marker: CudaMarker, lane: int = 0) -> None:
        marker.record(self.lane_stream(lane))

    def copy_out(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], marker: CudaMarker, lane: int = 0
    ) -> None:
        """Enqueue each (pinned host, device) pair's copy to the host on `lane`'s stream, after
        the work enqueued so far on the calling thread's stream, and record `marker` after
        them: the host does not wait, and the calling stream goes on computing meanwhile."""
        stream = self.lane_stream(lane)
        try:
            stream.wait_stream(torch.cuda.current_stream(self.index))
            with torch.cuda.stream(stream):
                for host, dev in pairs:
                    host.copy_(dev, non_blocking=True)
        finally:
            marker.record(stream)

    def stash_out(self, t: torch.Tensor, lane: int) -> tuple[torch.Tensor, CudaMarker]:
        if not t.is_cuda:  # a model's output it made on the host: in the host tier already
            return t, self.done_marker()
        # The values its conjugate and negative bits stand for: torch's device-to-host copy
        # applies them to the destination on the host, before a non-blocking copy landed.
        t = t.resolve_conj().resolve_neg()
        # torch's pinned allocator: the block is not handed out again before the copies that
        # used it ran (it records an event on their streams). Its strides `t`'s where `t` is
        # dense (a transposed or channels-last activation stays so: the same kernels read it
        # back as read it first), else contiguous (one copy, no staging through pageable
        # memory that would block this thread).
        layout = torch.preserve_format if dense(t) else torch.contiguous_format
        host = torch.empty_like(t, device="cpu", pin_memory=True, memory_format=layout)
        landed = CudaMarker(blocking=True)  # `TrainingJob._stash` may wait for it, asleep
        self.copy_out([(host, t)], landed, lane)
        # `t` was made on the compute stream and is read on the lane's: torch's allocator must
        # not give its block to the compute stream's next tensor before the copy read it.
        t.record_stream(self.lane_stream(lane))
        return host, landed

    def stash_in(
        self,
        host: torch.Tensor,
        landed: CudaMarker,
        into: torch.Tensor,
        after: list[Marker],
        lane: int,
    ) -> tuple[torch.Tensor, CudaMarker]:
        # The arena's bytes, not torch's allocator's: accounted in the task's extent, and no
        # block made on the copy lane's stream for the compute stream to hand back.
        dev = arena_tensor(into, host)
        stream = self.lane_stream(lane)
        there = CudaMarker()
        with torch.cuda.stream(stream):
            for m in (*after, landed):
                m.order_current()  # type: ignore[attr-defined]
            dev.copy_(host, non_blocking=True)
            there.record(stream)
        return dev, there

    @contextlib.contextmanager
    def compute(self, serving: bool = False) -> Iterator[None]:
        # One stream per compute thread: runs of different models overlap on the GPU. Serving
        # threads get a high-priority stream: the GPU schedules their kernels ahead of pending
        # training kernels, so training fills the gaps (lower number = higher priority).
        stream = getattr(self._local, "stream", None)
        if stream is None:
            torch.cuda.set_device(self.index)
            priority = -1 if serving else 0
            stream = self._local.stream = torch.cuda.Stream(device=self.index, priority=priority)
        with torch.cuda.stream(stream):
            yield

    def mark_done(self, marker: CudaMarker) -> None:
        """Record `marker` after the calling thread's compute work: on the stream it is in, or,
        called outside `compute()` (a `finally` after it), on the thread's own compute stream.
        The default stream would not do: the streams torch makes are non-blocking, so an event
        recorded there is not ordered after their kernels, and whoever reuses the bytes those
        kernels write would not wait for them."""
        stream = torch.cuda.current_stream(self.index)
        own = getattr(self._local, "stream", None)
        if own is not None and stream == torch.cuda.default_stream(self.index):
            stream = own
        marker.record(stream)

    def wait_computed(self) -> None:
        """A blocking event after the current stream's work, waited on: the thread sleeps
        until the GPU gets there (`Stream.synchronize` would spin a core for as long)."""
        marker = CudaMarker(blocking=True)
        self.mark_done(marker)
        marker.event.synchronize()

    def info(self) -> dict[str, Any]:
        return {**super().info(), **self.host_slab.stats(), **gpu_info(self.index)}


def dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill one range of memory, each once, in some order of its
    dimensions (contiguous, channels-last, transposed): what `empty_like` keeps the strides of."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape, strict=True)):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def arena_tensor(into: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A tensor over the arena bytes `into` (aligned for `like`'s dtype), shaped as `like`, with
    its strides where it is dense (`stash_out`'s host copies are: one range), else contiguous.
    Not a view: a view of the arena would share its version counter, which every copy into any
    of its ranges moves, so that autograd, having saved the tensor, would refuse its backward."""
    shape = tuple(like.shape)
    if dense(like):
        stride = tuple(like.stride())
    else:
        stride, n = [], 1
        for size in reversed(shape):
            stride.insert(0, n)
            n *= size
    offset = into.storage_offset() // like.element_size()
    t = torch.empty(0, dtype=like.dtype, device=into.device)
    return t.set_(into.untyped_storage(), offset, shape, stride)


def default_host_tier_bytes(budget_bytes: int) -> int:
    """HOST_TIER_PER_BUDGET x the budget, at least HOST_TIER_MIN, at most HOST_TIER_MAX_OF_RAM of
    the machine's memory (the bound wins)."""
    size = max(HOST_TIER_PER_BUDGET * budget_bytes, HOST_TIER_MIN)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return size
    return min(size, int(ram * HOST_TIER_MAX_OF_RAM) // PAGE * PAGE)


def pinned_slab(nbytes: int) -> torch.Tensor:
    """`nbytes` of page-locked host memory, exactly (no power-of-two rounding).

    Plain memory, faulted in, then registered with cudaHostRegister. If registration is not
    available, PyTorch's pinned allocator (which rounds up to a power of two) is the fallback.
    """
    nbytes = -(-nbytes // PAGE) * PAGE
    slab = torch.zeros(nbytes, dtype=torch.uint8)  # zeroing faults every page in now
    err: Any = None
    try:
        err = torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), nbytes, 0)
        code = int(getattr(err, "value", err))
    except Exception as exc:  # no binding in this torch build
        code, err = -1, exc
    if code == 0:
        # Unregister before the memory is freed. The slab tensor lives as long as its HostSlab,
        # which every live range keeps alive; at exit the process lets go of it all at once.
        weakref.finalize(slab, _unregister, slab.data_ptr()).atexit = False
        return slab
    log.warning("cudaHostRegister of %d bytes failed (%s): using the pinned allocator", nbytes, err)
    _clear_cuda_error()
    del slab
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as exc:
        raise ValueError(
            f"cannot pin a {nbytes}-byte host tier ({exc}); lower --host-tier-bytes"
        ) from None


def _clear_cuda_error() -> None:
    """Best effort: reset the runtime's last error after a failed cudaHostRegister, or the next
    kernel launch check in torch would report it. torch does not bind cudaGetLastError."""
    with contextlib.suppress(Exception), open("/proc/self/maps") as maps:
        for path in {line.split()[-1] for line in maps if "libcudart" in line}:
            ctypes.CDLL(path).cudaGetLastError()


def _unregister(ptr: int) -> None:
    with contextlib.suppress(Exception):
        torch.cuda.cudart().cudaHostUnregister(ptr)


_nvml_ready: bool | None = None


def _nvml() -> object | None:
    """The pynvml module once initialised; None without a driver (figures are optional)."""
    global _nvml_ready
    try:
        import pynvml

        if _nvml_ready is None:
            pynvml.nvmlInit()
            _nvml_ready = True
        return pynvml if _nvml_ready else None
    except Exception:
        _nvml_ready = False
        return None


def gpu_info(index: int) -> dict[str, Any]:
    """Memory and utilisation from NVML; empty when NVML is not usable."""
    nvml: Any = _nvml()
    if nvml is None:
        return {}
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        mem = nvml.nvmlDeviceGetMemoryInfo(handle)
        util = nvml.nvmlDeviceGetUtilizationRates(handle)
        name = nvml.nvmlDeviceGetName(handle)
    except Exception:
        return {}
    return {
        "gpu_name": name.decode() if isinstance(name, bytes) else name,
        "gpu_total_bytes": int(mem.total),
        "gpu_used_bytes": int(mem.used),
        "gpu_util_pct": int(util.gpu),
    }


def discover_gpus() -> list[dict[str, Any]]:
    """GPUs visible through NVML (index, name, total bytes); [] without GPUs or driver."""
    nvml: Any = _nvml()
    if nvml is None:
        return []
    out = []
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            name = nvml.nvmlDeviceGetName(h)
            out.append(
                {
                    "index": i,
                    "name": name.decode() if isinstance(name, bytes) else name,
                    "total_bytes": int(nvml.nvmlDeviceGetMemoryInfo(h).total),
                }
            )
    except Exception:
        return out
    return out


def open_device(
    spec: str,
    budget_bytes: int | None,
    host_tier_bytes: int | None = None,
    prefault: bool = True,
    resident_bytes: int | None = None,
) -> Device:
    """'cpu' (a stand-in; budget required) or 'cuda:N' (budget defaults to 80% of free memory).

    `host_tier_bytes`: size of the pinned host tier on CUDA (default: default_host_tier_bytes);
    the CPU stand-in keeps plain host memory. `prefault`: fault the arena in now (see
    Device._prefault_arena); off only to measure what it saves. `resident_bytes`: device
    memory beside the arena that training's stashes may stay in on CUDA (default: FREE_SHARE
    of the GPU memory free once the arena is reserved; 0: every stash goes to the host tier);
    the stand-in's stashes stay where they are anyway.
    """
    if spec == "cpu":
        if not budget_bytes:
            raise ValueError("a CPU stand-in device needs --memory-budget")
        return CpuStandIn(budget_bytes, prefault=prefault)
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"{spec}: CUDA is not available in this torch build / machine")
        index = int(spec.split(":", 1)[1]) if ":" in spec else 0
        if budget_bytes is None:
            free, _total = torch.cuda.mem_get_info(index)
            budget_bytes = int(free * 0.8)  # activations live outside the arena
        return CudaDevice(
            index, budget_bytes, host_tier_bytes, prefault=prefault, resident_bytes=resident_bytes
        )
    raise ValueError(f"unknown device {spec!r}: use 'cpu' or 'cuda:N'")
