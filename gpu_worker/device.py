"""Devices a worker drives: a CUDA GPU, or a CPU stand-in with the same code paths.

A device gives the executor four things: an arena of exactly the budget, host buffers (pinned on
CUDA), a copy lane that moves host bytes into arena ranges, and markers that order work across
lanes. On CUDA the copy lane is a CUDA stream and markers are events, so a run waits for its
weights on the GPU, never on the host. On the CPU stand-in the copy lane is a thread doing real
memcpy into the arena and markers are thread events.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from gpu_worker.memory import Marker


class CpuMarker:
    """Done when the task that owns it finished its part."""

    def __init__(self, done: bool = False) -> None:
        self._event = threading.Event()
        if done:
            self._event.set()

    def set(self) -> None:
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def order_current(self) -> None:
        # A CPU thread runs its work as it issues it: ordering means waiting.
        self._event.wait()


class CudaMarker:
    """A CUDA event, plus a host flag saying it has been recorded.

    `cudaStreamWaitEvent` on an event that is not recorded yet does not wait, so a consumer first
    waits (on the host, briefly) for the producer to have *enqueued* its work, then makes its own
    stream wait on the event: the GPU orders the work, the host never waits for the copy itself.
    """

    def __init__(self) -> None:
        self.event = torch.cuda.Event()
        self._recorded = threading.Event()

    def record(self, stream: torch.cuda.Stream) -> None:
        self.event.record(stream)
        self._recorded.set()

    def done(self) -> bool:
        return self._recorded.is_set() and self.event.query()

    def wait(self, timeout: float | None = None) -> bool:
        if not self._recorded.wait(timeout):
            return False
        self.event.synchronize()
        return True

    def order_current(self) -> None:
        self._recorded.wait()
        torch.cuda.current_stream().wait_event(self.event)


class Device:
    kind = "abstract"
    # Largest single host->device copy of a load. Smaller copies let a run start computing on
    # the first blocks sooner; each copy has a fixed cost.
    copy_chunk_bytes = 64 << 20

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.arena: torch.Tensor

    @property
    def torch_device(self) -> torch.device:
        return self.arena.device

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        raise NotImplementedError

    def new_marker(self) -> Any:
        raise NotImplementedError

    def done_marker(self) -> Any:
        raise NotImplementedError

    def copy_in(
        self, dst: torch.Tensor, src: torch.Tensor, after: list[Marker], marker: Any
    ) -> None:
        """On the copy lane: order after `after`, copy, then mark `marker`."""
        raise NotImplementedError

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        yield

    def mark_done(self, marker: Any) -> None:
        """Complete `marker` at the current point of this thread's compute work."""
        raise NotImplementedError

    def info(self) -> dict[str, Any]:
        return {}


class CpuStandIn(Device):
    kind = "cpu"
    # On the CPU, copies and compute share the cores (nothing to overlap) and each copy wakes
    # torch's helper threads: few, large copies are fastest.
    copy_chunk_bytes = 1 << 30

    def __init__(self, budget_bytes: int) -> None:
        super().__init__(budget_bytes)
        # torch.empty leaves pages untouched; the OS commits them as ranges are first used.
        self.arena = torch.empty(budget_bytes, dtype=torch.uint8)
        self.name = "cpu"

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def new_marker(self) -> CpuMarker:
        return CpuMarker()

    def done_marker(self) -> CpuMarker:
        return CpuMarker(done=True)

    def copy_in(
        self, dst: torch.Tensor, src: torch.Tensor, after: list[Marker], marker: CpuMarker
    ) -> None:
        for m in after:
            m.order_current()  # type: ignore[attr-defined]
        dst.copy_(src)
        marker.set()

    def mark_done(self, marker: CpuMarker) -> None:
        marker.set()  # CPU work is complete when the thread gets here


class CudaDevice(Device):
    kind = "cuda"
    # The copy engine runs beside the SMs and a memcpy call costs microseconds: copy in pieces
    # small enough that compute on the first blocks overlaps the transfer of the rest.
    copy_chunk_bytes = 32 << 20

    def __init__(self, index: int, budget_bytes: int) -> None:
        super().__init__(budget_bytes)
        self.index = index
        self.name = f"cuda:{index}"
        torch.cuda.set_device(index)
        self.arena = torch.empty(budget_bytes, dtype=torch.uint8, device=self.name)
        self.copy_stream = torch.cuda.Stream(device=index)
        self._local = threading.local()

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def new_marker(self) -> CudaMarker:
        return CudaMarker()

    def done_marker(self) -> CudaMarker:
        m = CudaMarker()
        m.record(torch.cuda.current_stream(self.index))
        return m

    def copy_in(
        self, dst: torch.Tensor, src: torch.Tensor, after: list[Marker], marker: CudaMarker
    ) -> None:
        with torch.cuda.stream(self.copy_stream):
            for m in after:
                m.order_current()  # type: ignore[attr-defined]
            dst.copy_(src, non_blocking=True)
            marker.record(self.copy_stream)

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        # One stream per compute thread: runs of different models overlap on the GPU.
        stream = getattr(self._local, "stream", None)
        if stream is None:
            torch.cuda.set_device(self.index)
            stream = self._local.stream = torch.cuda.Stream(device=self.index)
        with torch.cuda.stream(stream):
            yield

    def mark_done(self, marker: CudaMarker) -> None:
        marker.record(torch.cuda.current_stream(self.index))

    def info(self) -> dict[str, Any]:
        return gpu_info(self.index)


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


def open_device(spec: str, budget_bytes: int | None) -> Device:
    """'cpu' (a stand-in; budget required) or 'cuda:N' (budget defaults to 80% of free memory)."""
    if spec == "cpu":
        if not budget_bytes:
            raise ValueError("a CPU stand-in device needs --memory-budget")
        return CpuStandIn(budget_bytes)
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"{spec}: CUDA is not available in this torch build / machine")
        index = int(spec.split(":", 1)[1]) if ":" in spec else 0
        if budget_bytes is None:
            free, _total = torch.cuda.mem_get_info(index)
            budget_bytes = int(free * 0.8)  # activations live outside the arena
        return CudaDevice(index, budget_bytes)
    raise ValueError(f"unknown device {spec!r}: use 'cpu' or 'cuda:N'")
