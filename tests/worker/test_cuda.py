"""The executor on a real GPU: pinned host tier, copy stream, events. Skipped without CUDA;
run on a GPU machine with `pytest tests/worker/test_cuda.py`."""

from __future__ import annotations

import asyncio

import pytest
import torch

from gpu_worker.device import CudaDevice
from gpu_worker.executor import Executor
from gpu_worker.host_tier import HostStage
from tests.worker.test_executor import MIB, Gate, mlp, stage_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def gpu_reference(ref: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return ref.to("cuda")(x.to("cuda")).cpu()


async def test_cuda_load_and_run_match_a_direct_gpu_forward() -> None:
    dev = CudaDevice(0, 64 * MIB)
    assert dev.host_buffer(16).is_pinned()
    ex = Executor(dev, copy_chunk_bytes=1)  # one copy per block: layer-pipelined
    blocks, host, ref = stage_of(mlp("a", depth=6))
    host = HostStage.build([dict(b.state_dict()) for b in ref.children()], allocate=dev.host_buffer)
    ex.add_stage(("a", 0), blocks, host)
    loading = ex.load(("a", 0))
    x = torch.randn(4, 256)
    out = await ex.run(("a", 0), [{"x": x}])  # issued before the load finished
    await loading
    assert torch.equal(out.parts[0][""], gpu_reference(ref, x))
    ex.close()


async def test_cuda_reuse_of_evicted_memory_waits_for_the_last_run() -> None:
    dev = CudaDevice(0, 8 * MIB)
    spec_a, spec_b = mlp("a"), mlp("b", seed=1)
    blocks_a, _, ref_a = stage_of(spec_a)
    blocks_b, _, ref_b = stage_of(spec_b)
    gate = Gate()
    children = list(ref_a.children())
    host_a = HostStage.build(
        [dict(children[0].state_dict()), {}, *[dict(c.state_dict()) for c in children[1:]]],
        allocate=dev.host_buffer,
    )
    host_b = HostStage.build(
        [dict(c.state_dict()) for c in ref_b.children()], allocate=dev.host_buffer
    )
    ex = Executor(dev, compute_lanes=2)
    ex.add_stage(("a", 0), [blocks_a[0], gate, *blocks_a[1:]], host_a)
    ex.add_stage(("b", 0), blocks_b, host_b)
    await ex.load(("a", 0))
    x = torch.randn(2, 256)
    running = ex.run(("a", 0), [{"x": x}])
    assert await asyncio.to_thread(gate.entered.wait, 10)
    ex.evict(("a", 0))
    loading = ex.load(("b", 0))
    finished, _ = await asyncio.wait({loading}, timeout=0.3)
    assert not finished
    gate.release.set()
    out = await running
    await loading
    assert torch.equal(out.parts[0][""], gpu_reference(ref_a, x))
    assert torch.equal((await ex.run(("b", 0), [{"x": x}])).parts[0][""], gpu_reference(ref_b, x))
    ex.close()
