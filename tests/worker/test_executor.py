"""The executor in-process on a CPU stand-in: exact outputs, budget, layer-pipelined loads and
stream-ordered reuse of evicted memory."""

import asyncio
import threading

import pytest
import torch
from torch import nn

from flowmesh.build import build_meta, build_seeded
from flowmesh.errors import Code, FlowmeshError
from flowmesh.spec import ModelSpec
from gpu_worker.device import CpuStandIn
from gpu_worker.executor import Executor, State
from gpu_worker.host_tier import HostStage

MIB = 1 << 20


def stage_of(spec: ModelSpec) -> tuple[list[nn.Module], HostStage, nn.Module]:
    """Whole-model stage of a Sequential example: meta blocks, host tier, CPU reference."""
    ref = build_seeded(spec)
    host = HostStage.build([dict(b.state_dict()) for b in ref.children()])
    return list(build_meta(spec).children()), host, ref


def mlp(name: str, width: int = 256, depth: int = 4, seed: int = 0) -> ModelSpec:
    return ModelSpec(
        name=name,
        factory="flowmesh.examples:mlp",
        kwargs={"width": width, "depth": depth},
        seed=seed,
    )


async def test_load_then_run_equals_direct_forward() -> None:
    ex = Executor(CpuStandIn(8 * MIB))
    blocks, host, ref = stage_of(mlp("a"))
    ex.add_stage(("a", 0), blocks, host)
    info = await ex.load(("a", 0))
    assert info.nbytes == host.nbytes and ex.stages[("a", 0)].state is State.RESIDENT
    x = torch.randn(3, 256)
    out = await ex.run(("a", 0), [{"x": x}])
    assert torch.equal(out.parts[0][""], ref(x))
    ex.close()


async def test_run_during_load_waits_block_by_block() -> None:
    ex = Executor(CpuStandIn(8 * MIB))
    blocks, host, ref = stage_of(mlp("a", depth=6))
    ex.add_stage(("a", 0), blocks, host)
    loading = ex.load(("a", 0))
    x = torch.randn(2, 256)
    out = await ex.run(("a", 0), [{"x": x}])  # issued before the load completed
    await loading
    assert torch.equal(out.parts[0][""], ref(x))
    ex.close()


async def test_batch_of_parts_is_split_back() -> None:
    ex = Executor(CpuStandIn(8 * MIB))
    blocks, host, ref = stage_of(mlp("a"))
    ex.add_stage(("a", 0), blocks, host)
    await ex.load(("a", 0))
    xs = [torch.randn(n, 256) for n in (1, 3, 2)]
    out = await ex.run(("a", 0), [{"x": x} for x in xs])
    for x, part in zip(xs, out.parts, strict=True):
        assert part[""].shape == (x.shape[0], 256)
        torch.testing.assert_close(part[""], ref(x), rtol=1e-5, atol=1e-6)
    ex.close()


async def test_budget_is_enforced_and_eviction_frees() -> None:
    spec_a, spec_b = mlp("a"), mlp("b", seed=1)
    blocks_a, host_a, _ = stage_of(spec_a)
    blocks_b, host_b, ref_b = stage_of(spec_b)
    ex = Executor(CpuStandIn(host_a.nbytes + host_a.nbytes // 2))
    ex.add_stage(("a", 0), blocks_a, host_a)
    ex.add_stage(("b", 0), blocks_b, host_b)
    await ex.load(("a", 0))
    with pytest.raises(FlowmeshError) as info:
        ex.load(("b", 0))
    assert info.value.code is Code.NO_SPACE
    assert ex.evict(("a", 0)) > 0
    await ex.load(("b", 0))
    x = torch.randn(2, 256)
    assert torch.equal((await ex.run(("b", 0), [{"x": x}])).parts[0][""], ref_b(x))
    assert ex.arena.peak <= ex.arena.capacity
    with pytest.raises(FlowmeshError) as info:
        ex.run(("a", 0), [{"x": x}])
    assert info.value.code is Code.NOT_RESIDENT
    ex.close()


class Gate(nn.Module):
    """Identity that blocks until released: holds a run in flight on purpose."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        assert self.release.wait(10), "test never released the gate"
        return x


async def test_evicted_bytes_are_reused_only_after_their_last_run() -> None:
    spec_a, spec_b = mlp("a"), mlp("b", seed=1)
    blocks_a, host_a, ref_a = stage_of(spec_a)
    blocks_b, host_b, ref_b = stage_of(spec_b)
    gate = Gate()
    # The gate is block 1 of a; a's weights after it are still read once the gate opens.
    blocks_a = [blocks_a[0], gate, *blocks_a[1:]]
    ref_children = list(ref_a.children())
    with_gate = [ref_children[0], nn.Identity(), *ref_children[1:]]
    host_a = HostStage.build([dict(b.state_dict()) for b in with_gate])
    ex = Executor(CpuStandIn(host_a.nbytes), compute_lanes=2)
    ex.add_stage(("a", 0), blocks_a, host_a)
    ex.add_stage(("b", 0), blocks_b, host_b)
    await ex.load(("a", 0))
    x = torch.randn(2, 256)
    running = ex.run(("a", 0), [{"x": x}])
    assert await asyncio.to_thread(gate.entered.wait, 10)
    ex.evict(("a", 0))  # scheduled release while a run still reads a's bytes
    loading = ex.load(("b", 0))  # same bytes; its copy must wait for the run
    finished, _ = await asyncio.wait({loading}, timeout=0.3)
    assert not finished, "b's copy completed while a's run was still reading those bytes"
    gate.release.set()
    out = await running
    await loading
    assert torch.equal(out.parts[0][""], ref_a(x))
    assert torch.equal((await ex.run(("b", 0), [{"x": x}])).parts[0][""], ref_b(x))
    ex.close()


async def test_model_error_fails_the_run_not_the_executor() -> None:
    ex = Executor(CpuStandIn(8 * MIB))
    blocks, host, ref = stage_of(mlp("a"))
    ex.add_stage(("a", 0), blocks, host)
    await ex.load(("a", 0))
    with pytest.raises(FlowmeshError) as info:
        await ex.run(("a", 0), [{"x": torch.randn(2, 7)}])
    assert info.value.code is Code.MODEL_ERROR and "block 0" in info.value.reason
    x = torch.randn(1, 256)
    assert torch.equal((await ex.run(("a", 0), [{"x": x}])).parts[0][""], ref(x))
    assert ex.counters["run_errors"] == 1
    ex.close()


async def test_run_during_a_block_by_block_load_is_exact() -> None:
    # One copy per block: the run computes each block as soon as that block has landed.
    ex = Executor(CpuStandIn(8 * MIB), copy_chunk_bytes=1)
    blocks, host, ref = stage_of(mlp("a", depth=6))
    ex.add_stage(("a", 0), blocks, host)
    loading = ex.load(("a", 0))
    assert len(ex.stages[("a", 0)].copies) == sum(1 for r in host.regions if r.size)
    x = torch.randn(2, 256)
    out = await ex.run(("a", 0), [{"x": x}])
    await loading
    assert torch.equal(out.parts[0][""], ref(x))
    ex.close()
