"""The executor in-process on a CPU stand-in, when a load goes wrong: a copy that fails after
its stage was evicted, and a waiting load that can never be placed. Each must end with its own
outcome; nothing may be left waiting for ever on a marker no one will set."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from flowmesh.errors import Code, FlowmeshError
from flowmesh.testing import assert_forward_close
from gpu_worker.device import CpuStandIn
from gpu_worker.executor import Executor, State
from gpu_worker.host_tier import HostStage
from gpu_worker.memory import DeviceMemory
from tests.support.stages import mlp, stage_of
from tests.support.waiting import until


def forward(ref: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return ref(x)


class FailingCpu(CpuStandIn):
    """A CPU stand-in whose `before_copy(marker)` runs on the copy lane before each copy, and
    may hold it back or raise in its place."""

    def __init__(self, budget_bytes: int) -> None:
        super().__init__(budget_bytes)
        self.before_copy: Callable[[Any], None] | None = None

    def copy_in(self, dst: Any, src: Any, after: list[Any], marker: Any, lane: int = 0) -> None:
        if self.before_copy is not None:
            self.before_copy(marker)
        super().copy_in(dst, src, after, marker, lane)


class FailAfterEvict:
    """`before_copy` for stage `key`'s last copy: held until `evicted` is set, then it raises
    (the copy engine failing after the broker's Evict landed)."""

    def __init__(self, ex: Executor, key: tuple[str, int]) -> None:
        self.ex, self.key = ex, key
        self.entered, self.evicted = threading.Event(), threading.Event()

    def __call__(self, marker: Any) -> None:
        if marker is not self.ex.stages[self.key].copies[-1].marker or self.entered.is_set():
            return
        self.entered.set()
        self.evicted.wait(30)
        raise RuntimeError("the copy engine is gone")


def unstick(markers: list[Any]) -> None:
    """Set what the failed copy left unset, so that a copy lane blocked on it (without the fix)
    ends and the test fails on its assertion instead of holding the interpreter's exit."""
    for m in markers:
        if not m.done():
            m.set()


async def test_a_copy_failing_after_its_stage_was_evicted_lets_the_next_owner_load() -> None:
    """Room for one stage: a's last copy fails after a was evicted under it, and b takes a's
    ranges, ordered after a's markers. b must load and run right; before the fix, the markers
    a's copy never reached stayed unset and b's copy waited on them for ever, holding its lane."""
    a_blocks, a_host, _ = stage_of(mlp("a", 64, 2))
    b_blocks, b_host, b_ref = stage_of(mlp("b", 64, 2, seed=1))
    assert a_host.nbytes == b_host.nbytes
    dev = FailingCpu(a_host.nbytes)
    ex = Executor(dev, compute_lanes=1, copy_chunk_bytes=1)
    ex.add_stage(("a", 0), a_blocks, a_host)
    ex.add_stage(("b", 0), b_blocks, b_host)
    hold = FailAfterEvict(ex, ("a", 0))
    dev.before_copy = hold
    a_load = ex.load(("a", 0))
    a_ready = list(ex.stages[("a", 0)].ready)
    assert len(ex.stages[("a", 0)].copies) > 1  # its last copy fails after earlier ones landed
    try:
        assert await asyncio.to_thread(hold.entered.wait, 10)
        ex.evict(("a", 0))
        hold.evicted.set()
        with pytest.raises(FlowmeshError) as given_up:
            await a_load
        assert given_up.value.code == Code.NOT_RESIDENT
        b_load = ex.load(("b", 0))  # a's ranges: the arena holds one stage
        info = await asyncio.wait_for(asyncio.shield(b_load), 10)
        assert info.nbytes == b_host.nbytes
        assert ex.stages[("b", 0)].state is State.RESIDENT
        assert ex.stages[("a", 0)].state is State.HOST
        assert all(m.done() for m in a_ready)
        x = torch.randn(2, 64)
        out = await ex.run(("b", 0), [{"x": x}])
        assert_forward_close(out.parts[0][""], forward(b_ref, x))
        await until(lambda: not any(ex._queued), "every copy to end")
    finally:
        unstick(a_ready)
        ex.close()


async def test_a_run_of_a_load_whose_copy_failed_after_an_eviction_fails_as_evicted() -> None:
    """A run sent while a's copy was in flight waits on the block of a's last copy; a is
    evicted and that copy then fails. The run must fail NOT_RESIDENT (the broker runs it again),
    neither wait for ever nor compute on the bytes the failed copy left; a later load of a is as
    good as ever."""
    blocks, host, ref = stage_of(mlp("a", 64, 2))
    dev = FailingCpu(2 * host.nbytes)
    ex = Executor(dev, compute_lanes=1, copy_chunk_bytes=1)
    key = ("a", 0)
    ex.add_stage(key, blocks, host)
    hold = FailAfterEvict(ex, key)
    dev.before_copy = hold
    load = ex.load(key)
    load.add_done_callback(lambda f: f.exception())
    ready = list(ex.stages[key].ready)
    x = torch.randn(2, 64)
    try:
        run = ex.run(key, [{"x": x}])
        assert await asyncio.to_thread(hold.entered.wait, 10)
        ex.evict(key)
        hold.evicted.set()
        with pytest.raises(FlowmeshError) as stranded:
            await asyncio.wait_for(run, 10)
        assert stranded.value.code == Code.NOT_RESIDENT
        assert all(m.done() for m in ready)
        dev.before_copy = None
        await asyncio.wait_for(ex.load(key), 10)
        assert_forward_close((await ex.run(key, [{"x": x}])).parts[0][""], forward(ref, x))
    finally:
        unstick(ready)
        ex.close()


async def test_a_waiting_load_that_still_cannot_be_placed_fails_no_space() -> None:
    """A load waited for training's borrowed bytes; once they are back the arena still has no
    contiguous range for its block (another holder sits in the middle), and no idle stage to
    evict. It fails NO_SPACE, saying why, not NOT_RESIDENT as if the broker had evicted it; its
    claim on training's memory is withdrawn and it holds no bytes."""
    lin = nn.Linear(256, 256)
    host = HostStage.build([dict(lin.state_dict())])
    size = host.nbytes  # one block of this many bytes
    mem = DeviceMemory(2 * size, 0, 4096)
    ex = Executor(CpuStandIn(2 * size), memory=mem, compute_lanes=1)
    key = ("a", 0)
    ex.add_stage(key, [nn.Linear(256, 256, device="meta")], host)
    borrowed = mem.alloc_training(mem.round(3 * size // 4))
    assert borrowed is not None and borrowed.offset == 0
    (pinned,) = mem.alloc_serving([size // 2])  # right after it: no whole-block range is left
    try:
        load = ex.load(key)
        assert ex.stages[key].waiting and mem.claims == 1
        mem.free(borrowed, [], "training")
        with pytest.raises(FlowmeshError) as refused:
            await asyncio.wait_for(load, 10)
        assert refused.value.code == Code.NO_SPACE, refused.value
        assert refused.value.reason.startswith(f"cannot place 'a'/0: need {mem.round(size)} ")
        assert "contiguous bytes" in refused.value.reason
        st = ex.stages[key]
        assert st.state is State.HOST and not st.waiting
        assert mem.claims == 0 and mem.used["serving"] == pinned.size
    finally:
        mem.free(pinned, [], "serving")
        ex.close()
