"""No cold-start tail: the device arena is faulted in when a worker opens it, host buffers are
faulted in as they are made, and on CUDA the host tier is one pinned slab whose ranges go back
when a stage's host buffer is dropped.

Memory is observed through which pages of a buffer are resident (mincore(2), which no other
thread of the process can disturb as its resident size could) and the process's minor page faults
(getrusage), never through wall time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import resource
import threading

import pytest
import torch
from torch import nn

from flowmesh.errors import Code, FlowmeshError
from gpu_worker.device import CpuStandIn, CudaDevice, open_device
from gpu_worker.executor import Executor
from gpu_worker.host_slab import PAGE, HostSlab
from gpu_worker.host_tier import HostStage

MIB = 1 << 20
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def resident_share(buf: torch.Tensor) -> float:
    """The share of `buf`'s whole pages that are in memory now."""
    page = os.sysconf("SC_PAGE_SIZE")
    lo = -(-buf.data_ptr() // page) * page
    hi = (buf.data_ptr() + buf.numel() * buf.element_size()) // page * page
    pages = (hi - lo) // page
    vec = ctypes.create_string_buffer(pages)
    if LIBC.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in vec.raw) / pages


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# ---------------------------------------------------------------- the arena, on the CPU stand-in


def test_cpu_arena_is_resident_as_soon_as_the_device_opens() -> None:
    dev = CpuStandIn(96 * MIB)
    assert resident_share(dev.arena) == 1.0
    info = dev.info()
    assert isinstance(info["prefault_s"], float) and info["prefault_s"] > 0
    del dev


def test_cpu_arena_without_prefault_stays_untouched() -> None:
    # The control for the test above (a measure that always grew would prove nothing), and the
    # comparison the benchmark makes.
    dev = CpuStandIn(96 * MIB, prefault=False)
    assert resident_share(dev.arena) < 0.25
    assert dev.info()["prefault_s"] is None
    assert open_device("cpu", MIB, prefault=False).prefault_s is None
    assert open_device("cpu", MIB).prefault_s is not None


def stage(dev: CpuStandIn, nbytes: int) -> tuple[list[nn.Module], HostStage]:
    width = int((nbytes / 4 / 2) ** 0.5)
    tensors = [{"weight": torch.ones(width, width)} for _ in range(2)]
    with torch.device("meta"):
        blocks: list[nn.Module] = [nn.Linear(width, width, bias=False) for _ in range(2)]
    return blocks, HostStage.build(tensors, allocate=dev.host_buffer)


@pytest.mark.parametrize("prefault", [True, False])
async def test_first_load_takes_no_page_faults_on_a_prefaulted_arena(prefault: bool) -> None:
    # A worker's arena is made as its process starts; in this process, earlier tests freed
    # memory that malloc would hand out again with its pages still mapped: given back first.
    gc.collect()
    LIBC.malloc_trim(0)
    dev = CpuStandIn(40 * MIB, prefault=prefault)
    ex = Executor(dev, compute_lanes=1)
    blocks, host = stage(dev, 32 * MIB)
    ex.add_stage(("a", 0), blocks, host)
    pages = host.nbytes // PAGE
    f0 = minor_faults()
    await ex.load(("a", 0))
    faults = minor_faults() - f0
    ex.close()
    if prefault:
        assert faults < 0.1 * pages, f"{faults} page faults loading {pages} pages"
    else:  # the cost prefault moves to the start: a first copy faults its whole range in
        assert faults > 0.5 * pages, f"only {faults} page faults loading {pages} pages"


def test_cpu_host_buffers_are_resident_as_they_are_made() -> None:
    assert resident_share(CpuStandIn(MIB).host_buffer(64 * MIB)) == 1.0
    # the control: a measure that always said resident would prove nothing
    assert resident_share(CpuStandIn(MIB, prefault=False).host_buffer(64 * MIB)) < 0.25


# ---------------------------------------------------------------- the slab allocator, fake slab


def fake_slab(nbytes: int = MIB) -> HostSlab:
    return HostSlab(torch.zeros(nbytes, dtype=torch.uint8))


def span(slab: HostSlab, buf: torch.Tensor) -> tuple[int, int]:
    lo = buf.data_ptr() - slab.slab.data_ptr()
    return lo, lo + buf.numel()


def test_buffers_are_disjoint_ranges_of_the_slab() -> None:
    slab = fake_slab()
    a, b = slab.take(1000), slab.take(3 * PAGE + 1)
    assert (a.numel(), b.numel()) == (1000, 3 * PAGE + 1)
    (a0, a1), (b0, b1) = span(slab, a), span(slab, b)
    assert 0 <= a0 < a1 <= slab.capacity and 0 <= b0 < b1 <= slab.capacity
    assert a1 <= b0 or b1 <= a0
    assert a0 % PAGE == 0 and b0 % PAGE == 0
    b.fill_(7)  # the buffer is the slab's memory, not a copy
    assert int(slab.slab[b0:b1].sum()) == 7 * b.numel()
    assert slab.stats()["host_tier_used_bytes"] == PAGE + 4 * PAGE
    assert slab.stats()["host_tier_buffers"] == 2


def test_dropping_a_buffer_returns_its_range() -> None:
    slab = fake_slab()
    a, b = slab.take(MIB // 2), slab.take(MIB // 4)
    with pytest.raises(FlowmeshError):
        slab.take(MIB // 2)
    del a
    c = slab.take(MIB // 2)  # where a was
    del b, c
    assert slab.used_bytes == 0 and slab.stats()["host_tier_buffers"] == 0
    whole = slab.take(MIB)  # freed ranges coalesced
    assert span(slab, whole) == (0, MIB)


def test_memory_still_in_use_after_its_buffer_object_died_keeps_the_range() -> None:
    slab = fake_slab()
    buf = slab.take(4 * PAGE)
    view = buf[PAGE:]  # a view keeps its base tensor object alive, but:
    param = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
    param.data = buf[PAGE:]  # shares the storage only (what a training job does with its slab)
    del buf, view
    gc.collect()
    assert slab.used_bytes == 4 * PAGE
    other = slab.take(slab.capacity - 4 * PAGE)  # the rest fits; the held range is not reused
    param.data.fill_(1)
    assert int(other.sum()) == 0
    del param
    assert slab.used_bytes == other.numel()


def test_a_full_slab_is_a_clear_error_not_a_silent_buffer() -> None:
    slab = fake_slab()
    keep = slab.take(MIB - PAGE)
    with pytest.raises(FlowmeshError) as err:
        slab.take(2 * PAGE)
    assert err.value.code is Code.NO_SPACE
    assert "--host-tier-bytes" in str(err.value) and str(MIB) in str(err.value)
    assert slab.stats()["host_tier_buffers"] == 1  # nothing was handed out
    del keep


def test_a_buffer_dropped_on_another_thread_while_the_slab_is_busy_comes_back_later() -> None:
    slab = fake_slab()
    bufs = [slab.take(PAGE)]
    with slab._lock:  # as if `take` were running, or the GC ran inside it
        threading.Thread(target=bufs.clear).start()  # the last reference dies over there
        for _ in range(100):
            if slab._returned:
                break
            threading.Event().wait(0.01)
        assert len(slab._returned) == 1  # queued, not freed under the allocator's feet
    assert slab.used_bytes == 0


def test_a_slab_must_be_flat_bytes() -> None:
    with pytest.raises(ValueError):
        HostSlab(torch.zeros(4, 4, dtype=torch.uint8))


class SlabCpu(CpuStandIn):
    """A CPU stand-in whose host tier is a (fake, unpinned) slab, as CudaDevice's is pinned."""

    def __init__(self, budget_bytes: int, host_tier_bytes: int) -> None:
        super().__init__(budget_bytes)
        self.host_slab = HostSlab(torch.zeros(host_tier_bytes, dtype=torch.uint8))

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return self.host_slab.take(nbytes)


async def test_a_stage_gives_its_host_range_back_when_the_worker_drops_or_replaces_it() -> None:
    dev = SlabCpu(8 * MIB, 4 * MIB)
    ex = Executor(dev, compute_lanes=1)
    blocks, host = stage(dev, MIB)
    used = dev.host_slab.used_bytes
    assert used >= host.nbytes
    ex.add_stage(("a", 0), blocks, host)
    del host
    await ex.load(("a", 0))
    out = await ex.run(("a", 0), [{"x": torch.ones(1, blocks[0].in_features)}])
    assert float(out.parts[0][""][0, 0]) == blocks[0].in_features ** 2  # two blocks of ones
    ex.add_stage(("a", 0), *stage(dev, MIB))  # a redeploy replaces the stage
    gc.collect()
    assert dev.host_slab.used_bytes == used  # the old buffer went back, the new one holds as much
    ex.drop_stage(("a", 0))
    gc.collect()
    assert dev.host_slab.used_bytes == 0
    ex.close()


# ---------------------------------------------------------------- CUDA


@needs_cuda
def test_cuda_host_buffers_come_from_one_pinned_slab_and_go_back_on_drop() -> None:
    dev = CudaDevice(0, 8 * MIB, host_tier_bytes=16 * MIB)
    info = dev.info()
    assert info["prefault_s"] > 0 and info["host_tier_bytes"] >= 16 * MIB
    base, cap = dev.host_slab.slab.data_ptr(), dev.host_slab.capacity
    a, b = dev.host_buffer(MIB), dev.host_buffer(2 * MIB + 1)
    for buf in (a, b):
        assert buf.is_pinned()
        assert base <= buf.data_ptr() and buf.data_ptr() + buf.numel() <= base + cap
    assert dev.info()["host_tier_used_bytes"] == MIB + 2 * MIB + PAGE
    a.fill_(3)
    dst = dev.arena[: a.numel()]
    dst.copy_(a, non_blocking=True)
    torch.cuda.synchronize()
    assert int(dst.sum()) == 3 * MIB
    del a, b
    assert dev.info()["host_tier_used_bytes"] == 0
    with pytest.raises(FlowmeshError) as err:
        dev.host_buffer(17 * MIB)
    assert err.value.code is Code.NO_SPACE
