"""The executor in-process on a CPU stand-in: outputs, budget, layer-pipelined loads and
stream-ordered reuse of evicted memory.

Ordering is checked on a log of events (copies issued, markers waited on and set, blocks
computed) that a recording stand-in keeps across its threads, never on wall time.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from flowmesh.errors import Code, FlowmeshError
from flowmesh.spec import ModelSpec
from flowmesh.testing import assert_forward_close, assert_same_bits
from gpu_worker.device import CpuMarker, CpuStandIn
from gpu_worker.executor import Executor, State
from gpu_worker.host_tier import ALIGN, HostStage
from tests.support.stages import MIB, mlp, stage_of
from tests.support.waiting import until


def forward(ref: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return ref(x)


class Log:
    """Events from every thread of a recording stand-in, in the order they happened."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self._lock = threading.Lock()

    def add(self, kind: str, what: Any) -> None:
        with self._lock:
            self.events.append((kind, what))

    def has(self, kind: str, what: Any) -> bool:
        with self._lock:
            return any(k == kind and w is what for k, w in self.events)

    def index(self, kind: str, what: Any) -> int:
        with self._lock:
            for i, (k, w) in enumerate(self.events):
                if k == kind and (w is what or w == what):
                    return i
        raise AssertionError(f"no {kind} {what!r} in the log: {self.events}")


class LoggedMarker(CpuMarker):
    def __init__(self, log: Log, done: bool = False) -> None:
        super().__init__(done)
        self.log = log

    def set(self) -> None:
        self.log.add("set", self)  # before anyone waiting on it can go on
        super().set()

    def order_current(self) -> None:
        self.log.add("wait", self)  # before waiting, so a blocked wait is visible
        super().order_current()


class RecordingCpu(CpuStandIn):
    """A CPU stand-in that logs copies and markers; `before_copy` may hold a copy back."""

    def __init__(self, budget_bytes: int) -> None:
        super().__init__(budget_bytes)
        self.log = Log()
        self.before_copy: Callable[[Any], None] | None = None

    def new_marker(self, blocking: bool = False) -> LoggedMarker:
        return LoggedMarker(self.log)

    def copy_in(self, dst: Any, src: Any, after: list[Any], marker: Any, lane: int = 0) -> None:
        if self.before_copy is not None:
            self.before_copy(marker)
        self.log.add("copy", marker)  # issued; it still orders after `after` below
        super().copy_in(dst, src, after, marker, lane)


def log_computes(blocks: list[nn.Module], log: Log) -> None:
    for i, block in enumerate(blocks):
        block.register_forward_hook(lambda *_, i=i: log.add("computed", i))


def assert_bound_to_host_tier(ex: Executor, key: tuple[str, int], ref: nn.Module) -> None:
    for i, (block, want) in enumerate(zip(ex.stages[key].blocks, ref.children(), strict=True)):
        for name, tensor in want.state_dict().items():
            got = block.state_dict()[name]
            assert got.untyped_storage().data_ptr() == ex.device.arena.untyped_storage().data_ptr()
            # bit-exact: the arena copy of the host tier's bytes
            assert_same_bits(got, tensor, f"block {i} {name}")


async def test_load_then_run_equals_direct_forward() -> None:
    ex = Executor(CpuStandIn(8 * MIB))
    blocks, host, ref = stage_of(mlp("a"))
    ex.add_stage(("a", 0), blocks, host)
    info = await ex.load(("a", 0))
    assert info.nbytes == host.nbytes and ex.stages[("a", 0)].state is State.RESIDENT
    assert_bound_to_host_tier(ex, ("a", 0), ref)
    x = torch.randn(3, 256)
    out = await ex.run(("a", 0), [{"x": x}])
    assert_forward_close(out.parts[0][""], forward(ref, x))
    ex.close()


async def test_a_cold_run_computes_its_first_block_before_its_last_block_is_copied() -> None:
    # Layer-pipelined swap-in (the README: a load copies block by block): one copy per block,
    # and the copy of the last block is held back until block 0 has computed. An executor that
    # waited for the whole load before computing would never get there: the hold gives up and
    # the log shows the order.
    dev = RecordingCpu(8 * MIB)
    ex = Executor(dev, copy_chunk_bytes=1)
    blocks, host, ref = stage_of(mlp("a", depth=6))
    log_computes(blocks, dev.log)
    ex.add_stage(("a", 0), blocks, host)
    first_computed = threading.Event()
    blocks[0].register_forward_hook(lambda *_: first_computed.set())
    held: list[bool] = []

    def hold_last(marker: Any) -> None:
        if marker is ex.stages[("a", 0)].copies[-1].marker:
            held.append(first_computed.wait(10))

    dev.before_copy = hold_last
    loading = ex.load(("a", 0))
    copies = ex.stages[("a", 0)].copies
    assert len(copies) == sum(1 for r in host.regions if r.size) > 2
    x = torch.randn(2, 256)
    out = await ex.run(("a", 0), [{"x": x}])  # issued before the load completed
    await loading
    log = dev.log
    assert held == [True], "block 0 did not compute while the last block's copy was held back"
    assert log.index("computed", 0) < log.index("copy", copies[-1].marker)
    # And no block ever computed before the copy carrying its bytes had landed.
    for run in copies:
        for i in run.blocks:
            assert log.index("set", run.marker) < log.index("computed", i), f"block {i}"
    assert_forward_close(out.parts[0][""], forward(ref, x))
    ex.close()


async def test_a_run_waiting_for_bytes_does_not_keep_a_model_from_being_built() -> None:
    # A resident stage's forward takes the serving lock once; a run still waiting for a
    # block's bytes must wait outside it, or a deploy building a model (the lock's exclusive
    # side) would wait for that whole copy. The last block's copy is held back until a build
    # got through; a run holding the lock across its wait would keep the build out.
    from gpu_worker.model_code import building_model

    dev = RecordingCpu(8 * MIB)
    ex = Executor(dev, copy_chunk_bytes=1)
    blocks, host, ref = stage_of(mlp("a", depth=6))
    ex.add_stage(("a", 0), blocks, host)
    first_computed = threading.Event()
    blocks[0].register_forward_hook(lambda *_: first_computed.set())
    built: list[bool] = []

    def build_before_last_copy(marker: Any) -> None:
        if marker is not ex.stages[("a", 0)].copies[-1].marker:
            return
        assert first_computed.wait(10), "the run did not start computing"
        entered = threading.Event()

        def build() -> None:
            with building_model():
                entered.set()

        threading.Thread(target=build, daemon=True).start()
        built.append(entered.wait(5))

    dev.before_copy = build_before_last_copy
    loading = ex.load(("a", 0))
    x = torch.randn(2, 256)
    out = await ex.run(("a", 0), [{"x": x}])  # issued before the load completed
    await loading
    assert built == [True], "a model could not be built while a run waited for a copy"
    assert_forward_close(out.parts[0][""], forward(ref, x))
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
        assert_forward_close(part[""], forward(ref, x))  # batched: the same rows, other blocking
    ex.close()


async def test_budget_is_enforced_and_eviction_frees() -> None:
    spec_a, spec_b = mlp("a"), mlp("b", seed=1)
    blocks_a, host_a, ref_a = stage_of(spec_a)
    blocks_b, host_b, ref_b = stage_of(spec_b)
    ex = Executor(CpuStandIn(host_a.nbytes + host_a.nbytes // 2))
    reports: list[list[list[object]]] = []
    ex.on_residency = lambda: reports.append(ex.residency())
    ex.add_stage(("a", 0), blocks_a, host_a)
    ex.add_stage(("b", 0), blocks_b, host_b)
    await ex.load(("a", 0))
    with pytest.raises(FlowmeshError) as info:
        ex.load(("b", 0), keep=[("a", 0)])  # a must stay: b cannot fit beside it
    assert info.value.code is Code.NO_SPACE and "a/0" in info.value.reason
    assert ex.stages[("b", 0)].state is State.HOST  # a refused load holds nothing
    assert ex.resident() == [("a", 0)]  # and evicted nothing
    assert ex.evict(("a", 0)) == host_a.nbytes
    await ex.load(("b", 0))
    assert ex.resident() == [("b", 0)]
    assert ex.stats()["resident_stages"] == {"b/0": host_b.nbytes}
    assert ex.stats()["stage_bytes_peak"] == host_a.nbytes
    x = torch.randn(2, 256)
    assert_forward_close((await ex.run(("b", 0), [{"x": x}])).parts[0][""], forward(ref_b, x))
    # A run for a stage that is not on the device brings it back, making room itself (b is
    # idle): the worker owns its memory, the broker's view may lag.
    reports.clear()
    assert_forward_close((await ex.run(("a", 0), [{"x": x}])).parts[0][""], forward(ref_a, x))
    assert ex.resident() == [("a", 0)] and reports[-1] == [["a", 0, host_a.nbytes]]
    assert (ex.counters["implicit_loads"], ex.counters["evictions_chosen"]) == (1, 1)
    ex.close()


async def test_a_load_evicts_the_idle_stage_worth_least_never_a_busy_or_kept_one() -> None:
    specs = {
        name: mlp(name, seed=i) for i, name in enumerate(("hot", "once", "busy", "kept", "new"))
    }
    stages = {name: stage_of(spec) for name, spec in specs.items()}
    one = stages["hot"][1].nbytes
    ex = Executor(CpuStandIn(4 * one), compute_lanes=2)
    gate = Gate()
    blocks, _, ref = stages["busy"]
    states = [dict(c.state_dict()) for c in ref.children()]
    ex.add_stage(("busy", 0), [*blocks, gate], HostStage.build([*states, {}]))
    for name in ("hot", "once", "kept", "new"):
        ex.add_stage((name, 0), stages[name][0], stages[name][1])
    for name in ("hot", "once", "busy", "kept"):
        await ex.load((name, 0))
    x = torch.randn(1, 256)
    for _ in range(10):  # hot: ten requests
        await ex.run(("hot", 0), [{"x": x}])
    gate.release.set()
    await ex.run(("once", 0), [{"x": x}])  # once: one request, after hot's last
    gate.release.clear()
    held = ex.run(("busy", 0), [{"x": x}])  # busy: a run in flight
    assert await asyncio.to_thread(gate.entered.wait, 10)
    # Least recently used would evict hot; its value (rate x reload time) is ten times once's.
    await ex.load(("new", 0), keep=[("kept", 0)])
    assert sorted(ex.resident()) == [("busy", 0), ("hot", 0), ("kept", 0), ("new", 0)]
    # Nothing evictable is left but hot: the next load takes it; busy and kept stay.
    ex.evict(("new", 0))
    await ex.load(("once", 0), keep=[("kept", 0)])
    assert sorted(ex.resident()) == [("busy", 0), ("hot", 0), ("kept", 0), ("once", 0)]
    with pytest.raises(FlowmeshError) as err:  # only busy and kept could go: refused, untouched
        ex.load(("new", 0), keep=[("kept", 0), ("hot", 0), ("once", 0)])
    assert err.value.code is Code.NO_SPACE
    assert sorted(ex.resident()) == [("busy", 0), ("hot", 0), ("kept", 0), ("once", 0)]
    gate.release.set()
    assert_forward_close((await held).parts[0][""], forward(stages["busy"][2], x))
    ex.close()


class Vec(nn.Module):
    """One block of exactly `n` float32s (a fragmentation test needs exact sizes)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(n, device="meta"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w[: x.shape[-1]]


async def test_a_fragmented_arena_is_mended_by_evicting_the_idle_stage_worth_least() -> None:
    unit = MIB // 4  # floats in one MiB
    ex = Executor(CpuStandIn(4 * MIB))
    for name, units in (("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 2)):
        weights = torch.arange(units * unit, dtype=torch.float32) + ord(name)
        ex.add_stage((name, 0), [Vec(units * unit)], HostStage.build([{"w": weights}]))
    for name in "abcd":
        await ex.load((name, 0))
    x = torch.zeros(1, 8)
    await ex.run(("a", 0), [{"x": x}])  # a has been used; c never
    ex.evict(("b", 0))
    ex.evict(("d", 0))
    assert ex.memory.arena.free_bytes == 2 * MIB and ex.arena.largest_free == MIB
    # 2 MiB fit the budget but no range holds them: c goes (worth least), a stays.
    await ex.load(("e", 0))
    assert sorted(ex.resident()) == [("a", 0), ("e", 0)]
    assert ex.counters["evictions_chosen"] == 1
    out = await ex.run(("e", 0), [{"x": x}])
    assert_forward_close(out.parts[0][""][0], torch.arange(8, dtype=torch.float32) + ord("e"))
    ex.close()


class Gate(nn.Module):
    """Identity that blocks until released: holds a run in flight on purpose. Then `then`
    (a block taking time on a test's clock, say), if given."""

    def __init__(self, then: nn.Module | None = None) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()
        self.then = then

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        assert self.release.wait(10), "test never released the gate"
        return x if self.then is None else self.then(x)


def one_range_for_two(
    gate: Gate, **executor: Any
) -> tuple[RecordingCpu, Executor, nn.Module, nn.Module]:
    """Stages a and b of one size on a device that holds one of them (b can only go where a
    was); `gate` is a's block 1, so a's weights after it are still read once it opens. Returns
    the device, the executor (made with `executor`'s options), and a's and b's references."""
    blocks_a, _, ref_a = stage_of(mlp("a"))
    blocks_b, host_b, ref_b = stage_of(mlp("b", seed=1))
    blocks_a = [blocks_a[0], gate, *blocks_a[1:]]
    children = list(ref_a.children())
    host_a = HostStage.build([dict(b.state_dict()) for b in [children[0], gate, *children[1:]]])
    assert host_a.nbytes == host_b.nbytes
    dev = RecordingCpu(host_a.nbytes)
    ex = Executor(dev, compute_lanes=2, **executor)
    ex.add_stage(("a", 0), blocks_a, host_a)
    ex.add_stage(("b", 0), blocks_b, host_b)
    return dev, ex, ref_a, ref_b


async def evict_under_the_run(
    dev: RecordingCpu, ex: Executor, gate: Gate, a_run: Any, running: Any
) -> Any:
    """With a's run `running` held at `gate` (its marker `a_run`): evict a, load b into the
    same bytes, let the run go; b's copy must land only after the run. The run's output."""
    ex.evict(("a", 0))  # scheduled release while a run still reads a's bytes
    loading = ex.load(("b", 0))  # same bytes: its copy must order after the run
    b_copy = ex.stages[("b", 0)].copies[-1].marker
    # Either b's copy is waiting on a's run (right) or it has already landed (wrong): both are in
    # the log, so the gate opens only once the copy has shown which.
    await until(
        lambda: dev.log.has("wait", a_run) or dev.log.has("set", b_copy),
        "b's copy to wait on a's run or to land",
    )
    gate.release.set()
    out = await running
    await loading
    assert dev.log.index("set", a_run) < dev.log.index("set", b_copy), (
        "b's bytes landed in a's range while a's run was still reading it"
    )
    return out


async def test_evicted_bytes_are_reused_only_after_their_last_run() -> None:
    gate = Gate()
    dev, ex, ref_a, ref_b = one_range_for_two(gate)
    await ex.load(("a", 0))
    x = torch.randn(2, 256)
    running = ex.run(("a", 0), [{"x": x}])
    (a_run,) = ex.stages[("a", 0)].users
    assert await asyncio.to_thread(gate.entered.wait, 10)
    out = await evict_under_the_run(dev, ex, gate, a_run, running)
    assert_forward_close(out.parts[0][""], forward(ref_a, x))
    assert_forward_close((await ex.run(("b", 0), [{"x": x}])).parts[0][""], forward(ref_b, x))
    ex.close()


async def test_a_hot_stage_keeps_only_the_markers_that_can_still_matter() -> None:
    # One marker per run, forever, would grow without bound on a popular model (and evict checks
    # them all on the event loop): a finished run's marker is dropped.
    ex = Executor(CpuStandIn(8 * MIB), compute_lanes=2)
    blocks, host, ref = stage_of(mlp("a", width=64, depth=2))
    gate = Gate()
    blocks = [*blocks, gate]
    children = list(ref.children())
    host = HostStage.build([*(dict(c.state_dict()) for c in children), {}])
    ex.add_stage(("a", 0), blocks, host)
    await ex.load(("a", 0))
    st = ex.stages[("a", 0)]
    gate.release.set()
    x = torch.randn(1, 64)
    for _ in range(20):
        await ex.run(("a", 0), [{"x": x}])
    assert st.users == []
    await asyncio.gather(*(ex.run(("a", 0), [{"x": x}]) for _ in range(20)))
    assert st.users == []
    # A run still in flight keeps its marker: an eviction must order after it.
    gate.release.clear()
    gate.entered.clear()
    held = ex.run(("a", 0), [{"x": x}])
    assert await asyncio.to_thread(gate.entered.wait, 10)
    assert len(st.users) == 1 and not st.users[0].done()
    gate.release.set()
    assert_forward_close((await held).parts[0][""], forward(ref, x))
    assert st.users == []
    ex.close()


class LaggingCpu(CpuStandIn):
    """Completes a run's marker only when the test says the device got past it, as a GPU's
    event completes after the host has moved on."""

    def __init__(self, budget_bytes: int) -> None:
        super().__init__(budget_bytes)
        self.behind: list[CpuMarker] = []

    def mark_done(self, marker: CpuMarker) -> None:
        self.behind.append(marker)

    def catch_up(self) -> None:
        for m in self.behind:
            m.set()
        self.behind.clear()


async def test_markers_completed_after_their_run_settled_are_dropped_later() -> None:
    dev = LaggingCpu(8 * MIB)
    ex = Executor(dev)
    blocks, host, _ = stage_of(mlp("a", width=64, depth=2))
    ex.add_stage(("a", 0), blocks, host)
    await ex.load(("a", 0))
    st = ex.stages[("a", 0)]
    for _ in range(10):
        await ex.run(("a", 0), [{"x": torch.randn(1, 64)}])
        assert len(st.users) == 1  # this run's: the device is not past it yet
        dev.catch_up()
    ex.close()


async def test_a_separate_run_computes_each_part_on_its_own() -> None:
    """Requests of a model that takes one per forward, sent in one run: each part's output is
    its own forward's, not a slice of one forward over all of them."""

    class Centred(nn.Module):
        """Depends on the whole batch: x minus the batch's mean, then a Linear."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x - x.mean(dim=0, keepdim=True))

    source = Centred()
    ex = Executor(CpuStandIn(1 * MIB))
    ex.add_stage(("c", 0), [Centred().to("meta")], HostStage.build([dict(source.state_dict())]))
    await ex.load(("c", 0))
    xs = [torch.randn(rows, 4) for rows in (3, 1, 2)]
    out = await ex.run(("c", 0), [{"x": x} for x in xs], separate=True)
    assert out.rows == 6 and len(out.parts) == 3
    for x, part in zip(xs, out.parts, strict=True):
        assert_forward_close(part[""], forward(source, x))
    batched = await ex.run(("c", 0), [{"x": x} for x in xs])  # one forward over all rows
    # The model tells the two apart: centred on all six rows, the first part's output moves.
    assert (batched.parts[0][""] - out.parts[0][""]).abs().max() > 1e-2
    assert ex.counters["runs"] == 2
    ex.close()


async def test_model_error_fails_the_run_not_the_executor() -> None:
    ex = Executor(CpuStandIn(8 * MIB))
    blocks, host, ref = stage_of(mlp("a"))
    ex.add_stage(("a", 0), blocks, host)
    await ex.load(("a", 0))
    with pytest.raises(FlowmeshError) as info:
        await ex.run(("a", 0), [{"x": torch.randn(2, 7)}])
    assert info.value.code is Code.MODEL_ERROR and "block 0" in info.value.reason
    assert ex.stages[("a", 0)].users == []  # the failed run released its marker too
    x = torch.randn(1, 256)
    assert_forward_close((await ex.run(("a", 0), [{"x": x}])).parts[0][""], forward(ref, x))
    assert ex.counters["run_errors"] == 1
    ex.close()


async def test_an_output_viewing_the_arena_is_copied_before_the_bytes_are_released() -> None:
    class Weight(nn.Module):
        """Returns its own weight: an output that is a view of the arena."""

        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.arange(8.0).reshape(2, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w

    ex = Executor(CpuStandIn(1 * MIB))
    source = Weight()
    host = HostStage.build([dict(source.state_dict())])
    ex.add_stage(("w", 0), [Weight().to("meta")], host)
    await ex.load(("w", 0))
    out = (await ex.run(("w", 0), [{"x": torch.zeros(2, 1)}])).parts[0][""]
    arena = ex.device.arena.untyped_storage().data_ptr()
    assert out.untyped_storage().data_ptr() != arena
    ex.evict(("w", 0))
    ex.device.arena.fill_(0xFF)  # the next owner writes over the range
    assert_same_bits(out, source.w.detach())  # bit-exact: a copy of the weight's bytes
    ex.close()


async def test_two_copy_lanes_load_two_stages_side_by_side() -> None:
    """A load held on one copy lane does not hold up another stage's load on the other lane."""
    dev = RecordingCpu(16 * MIB)
    ex = Executor(dev, copy_lanes=2)
    blocks_a, host_a, ref_a = stage_of(mlp("a"))
    blocks_b, host_b, ref_b = stage_of(mlp("b", seed=1))
    ex.add_stage(("a", 0), blocks_a, host_a)
    ex.add_stage(("b", 0), blocks_b, host_b)
    release = threading.Event()
    held: list[Any] = []

    def hold_first(marker: Any) -> None:  # stage a's copies wait until released
        if any(marker is m for m in ex.stages[("a", 0)].ready):
            held.append(marker)
            release.wait(30)

    dev.before_copy = hold_first
    load_a = ex.load(("a", 0))
    load_b = ex.load(("b", 0))
    try:
        await until(lambda: bool(held), "stage a's copy to be held on its lane")
        await asyncio.wait_for(asyncio.shield(load_b), 5)  # one lane: b queues behind a
        assert not load_a.done()
    finally:
        release.set()
    await load_a
    x = torch.randn(2, 256)
    for key, ref in ((("a", 0), ref_a), (("b", 0), ref_b)):
        out = await ex.run(key, [{"x": x}])
        assert_forward_close(out.parts[0][""], forward(ref, x))
    ex.close()


async def test_a_model_traced_while_another_serves_does_not_disturb_its_runs() -> None:
    # torch.fx patches nn.Module.__call__ for the whole process while it traces: a serving run
    # calling its blocks meanwhile would go through the tracer and fail. Stage loads that trace
    # (a model that is not a plain chain) must exclude serving calls for that long.
    from flowmesh.modelio.profile import profile
    from flowmesh.spec import DEFAULT_ALLOW
    from gpu_worker.stage_loader import prepare_stage
    from partitioner.stage_plans import make_stage_plan
    from tests.support.toy_models import TOY_ALLOW

    dev = CpuStandIn(8 * MIB)
    ex = Executor(dev, compute_lanes=2)
    blocks, host, ref = stage_of(mlp("a", width=64, depth=4))
    ex.add_stage(("a", 0), blocks, host)
    await ex.load(("a", 0))
    allow = (*DEFAULT_ALLOW, *TOY_ALLOW)
    traced_spec = ModelSpec(name="r", factory="tests.support.toy_models:residual", seed=0)
    plan = make_stage_plan(traced_spec, 1, profile=profile(traced_spec, allow=allow))
    stop, traced = threading.Event(), [0]

    def trace_again_and_again() -> None:
        while not stop.wait(0.005):  # a deploy now and then, not back to back
            prepare_stage(traced_spec, plan, 0, dev, allow)
            traced[0] += 1

    tracer = threading.Thread(target=trace_again_and_again, daemon=True)
    tracer.start()
    x = torch.randn(2, 64)
    want = forward(ref, x)
    runs = 0
    try:
        while runs < 2000 and (traced[0] < 6 or runs < 400):
            outs = await asyncio.gather(*(ex.run(("a", 0), [{"x": x}]) for _ in range(4)))
            for out in outs:
                assert_forward_close(out.parts[0][""], want)
            runs += 4
    finally:
        stop.set()
        tracer.join(10)
        ex.close()
    assert traced[0] >= 6, "the stage was not traced often enough beside the runs"


def _openmp_max_threads() -> Callable[[], int]:
    """OpenMP's thread count for the calling thread, as the kernels that open a parallel region
    see it (torch loads OpenMP with its symbols global)."""
    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch's CPU parallel backend is not OpenMP here")
    try:
        return ctypes.CDLL(None).omp_get_max_threads  # type: ignore[no-any-return]
    except AttributeError:
        pytest.skip("OpenMP's symbols are not visible in this process")


async def test_compute_lanes_run_torch_with_the_process_thread_count() -> None:
    """A worker started with --threads 1 computes with one thread on its compute lanes too: a
    thread it starts must not fall back to OpenMP's default of every core (a GELU then ran on
    two cores, one of them spinning)."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: OpenMP's default is one thread already")
    omp_max_threads = _openmp_max_threads()

    class Recorder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.seen: list[int] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen.append(omp_max_threads())
            return self.lin(x)

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as gpu_worker's main does for --threads 1
    try:
        ex = Executor(CpuStandIn(1 * MIB), compute_lanes=2)
        block = Recorder().to("meta")
        ex.add_stage(("r", 0), [block], HostStage.build([dict(Recorder().state_dict())]))
        await ex.load(("r", 0))
        await asyncio.gather(*(ex.run(("r", 0), [{"x": torch.ones(1, 4)}]) for _ in range(8)))
        ex.close()
    finally:
        torch.set_num_threads(before)
    assert block.seen and set(block.seen) == {1}, block.seen


# ------------------------------------------------------------------ runs on the reader thread


class Clock:
    """A clock that moves only when a block says it took time (`Takes`): what a run measures
    is exactly what its blocks took, whatever this machine's speed or load."""

    def __init__(self) -> None:
        self.now = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


class Takes(nn.Module):
    """Identity that takes `fixed` seconds of `clock`, plus `per_row` seconds per row."""

    def __init__(self, clock: Clock, fixed: float, per_row: float = 0.0) -> None:
        super().__init__()
        self.clock, self.fixed, self.per_row = clock, fixed, per_row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.advance(self.fixed + self.per_row * x.shape[0])
        return x


def timed(
    clock: Clock, takes: float, quick_run_s: float, width: int = 64, **kw: Any
) -> tuple[Executor, list[nn.Module], nn.Module]:
    """An executor on `clock` whose stage a (an MLP, then a block taking `takes` seconds) is
    quick under `quick_run_s`; its blocks and the MLP's reference."""
    ex = Executor(CpuStandIn(8 * MIB), clock=clock, quick_run_s=quick_run_s, **kw)
    blocks, _, ref = stage_of(mlp("a", width=width, depth=2))
    blocks = [*blocks, Takes(clock, takes)]
    host = HostStage.build([*(dict(c.state_dict()) for c in ref.children()), {}])
    ex.add_stage(("a", 0), blocks, host)
    return ex, blocks, ref


async def test_a_quick_stage_runs_on_the_calling_thread_once_it_has_run_on_a_lane() -> None:
    ex, blocks, ref = timed(Clock(), takes=1.0, quick_run_s=2.0)
    x = torch.randn(3, 64)
    assert ex.run_here(("b", 0), [{"x": x}]) is None  # not on this worker: the loop says so
    await ex.load(("a", 0))
    assert ex.run_here(("a", 0), [{"x": x}]) is None  # never ran: how long it takes is unknown
    await ex.run(("a", 0), [{"x": x}])
    st = ex.stages[("a", 0)]
    assert (st.forward_s, st.row_s) == (1.0, 1.0 / 3)  # what its blocks took, exactly
    seen: list[int] = []
    blocks[0].register_forward_hook(lambda *_: seen.append(threading.get_ident()))
    out = await asyncio.to_thread(ex.run_here, ("a", 0), [{"x": x}, {"x": x[:1]}])
    assert out is not None and [set(p) for p in out.parts] == [{""}, {""}]
    assert_forward_close(out.parts[0][""], forward(ref, x))
    assert_forward_close(out.parts[1][""], forward(ref, x[:1]))
    assert seen and threading.get_ident() not in seen  # computed on the calling thread
    assert st.users == [] and st.inflight == 0
    assert ex.counters["runs"] == 2 and ex.counters["rows"] == 7
    ex.evict(("a", 0))
    assert ex.run_here(("a", 0), [{"x": x}]) is None  # evicted: the loop brings it back
    ex.close()


async def test_a_slow_stage_is_left_to_the_compute_lanes() -> None:
    ex, _, _ = timed(Clock(), takes=4.0, quick_run_s=2.0)
    await ex.load(("a", 0))
    x = torch.randn(1, 64)
    await ex.run(("a", 0), [{"x": x}])
    assert ex.stages[("a", 0)].forward_s == 4.0
    assert ex.run_here(("a", 0), [{"x": x}]) is None
    assert ex.counters["runs"] == 1
    ex.close()


async def test_a_forward_slowed_once_by_a_wait_leaves_its_stage_quick() -> None:
    # A wait for the GIL or for a core adds to a forward's time now and then: a stage is slow
    # only when every forward of the window was.
    clock = Clock()
    ex = Executor(CpuStandIn(1 * MIB), clock=clock, quick_run_s=2.0, forward_window=4)
    nap = Takes(clock, 1.0)
    ex.add_stage(("a", 0), [nap], HostStage.build([{}]))
    await ex.load(("a", 0))
    x = torch.randn(1, 4)

    async def run_taking(seconds: float) -> None:
        nap.fixed = seconds
        await ex.run(("a", 0), [{"x": x}])
        nap.fixed = 1.0

    def quick() -> bool:
        return ex.run_here(("a", 0), [{"x": x}]) is not None  # runs (taking 1 s) when it is

    await run_taking(1.0)
    assert quick()
    await run_taking(8.0)  # one forward waited long
    assert quick()
    for _ in range(4):  # every forward of the window slow: the stage has become slow
        await run_taking(8.0)
    assert not quick()
    await run_taking(1.0)  # fast again
    assert quick()
    ex.close()


@pytest.mark.parametrize(
    ("fixed", "per_row", "measured_rows", "quick_rows", "slow_rows"),
    [
        # Time grows with rows: a batch larger than those measured is not quick for it.
        (0.0, 1.0, 1, 2, 16),
        # Time is the forward's whatever the rows (a large model on a GPU): one row is as slow
        # as the batch measured.
        (15.0, 0.0, 16, None, 1),
    ],
)
async def test_a_run_is_expected_to_take_its_forwards_and_its_rows_at_least(
    fixed: float,
    per_row: float,
    measured_rows: int,
    quick_rows: int | None,
    slow_rows: int,
) -> None:
    clock = Clock()
    ex = Executor(CpuStandIn(1 * MIB), clock=clock, quick_run_s=10.0)
    ex.add_stage(("a", 0), [Takes(clock, fixed, per_row)], HostStage.build([{}]))
    await ex.load(("a", 0))
    await ex.run(("a", 0), [{"x": torch.randn(measured_rows, 4)}])
    if quick_rows is not None:
        assert ex.run_here(("a", 0), [{"x": torch.randn(quick_rows, 4)}]) is not None
    assert ex.run_here(("a", 0), [{"x": torch.randn(slow_rows, 4)}]) is None
    ex.close()


async def test_a_model_error_on_the_calling_thread_fails_that_run_only() -> None:
    ex, _, ref = timed(Clock(), takes=1.0, quick_run_s=4.0, width=256)
    await ex.load(("a", 0))
    x = torch.randn(1, 256)
    await ex.run(("a", 0), [{"x": x}])
    with pytest.raises(FlowmeshError) as info:
        await asyncio.to_thread(ex.run_here, ("a", 0), [{"x": torch.randn(2, 7)}])
    assert info.value.code is Code.MODEL_ERROR and "block 0" in info.value.reason
    st = ex.stages[("a", 0)]
    assert st.users == [] and st.inflight == 0  # the failed run released its marker too
    assert ex.counters["run_errors"] == 1
    out = await asyncio.to_thread(ex.run_here, ("a", 0), [{"x": x}])
    assert out is not None
    assert_forward_close(out.parts[0][""], forward(ref, x))
    ex.close()


async def test_bytes_evicted_under_a_run_on_the_calling_thread_are_reused_only_after_it() -> None:
    """The loop evicts a stage while another thread computes a run of it, and loads another
    stage into the same bytes: that copy must wait for the run's marker, as for a lane's run."""
    clock = Clock()
    gate = Gate(Takes(clock, 1.0))
    dev, ex, ref_a, ref_b = one_range_for_two(gate, clock=clock, quick_run_s=2.0)
    await ex.load(("a", 0))
    x = torch.randn(2, 256)
    gate.release.set()
    await ex.run(("a", 0), [{"x": x}])  # measured: quick from now on
    gate.release.clear()
    gate.entered.clear()
    running = asyncio.create_task(asyncio.to_thread(ex.run_here, ("a", 0), [{"x": x}]))
    assert await asyncio.to_thread(gate.entered.wait, 10)
    (a_run,) = ex.stages[("a", 0)].users
    out = await evict_under_the_run(dev, ex, gate, a_run, running)
    assert out is not None
    assert_forward_close(out.parts[0][""], forward(ref_a, x))
    assert_forward_close((await ex.run(("b", 0), [{"x": x}])).parts[0][""], forward(ref_b, x))
    ex.close()


async def test_a_run_of_many_forwards_is_quick_only_if_they_add_up_to_a_quick_run() -> None:
    """The broker groups queued requests of a model that takes one per forward into one run:
    such a run costs one forward per request."""
    ex, _, ref = timed(Clock(), takes=1.0, quick_run_s=4.0)
    await ex.load(("a", 0))
    x = torch.randn(1, 64)
    await ex.run(("a", 0), [{"x": x}, {"x": x}], separate=True)  # 1 s per forward
    assert ex.run_here(("a", 0), [{"x": x}] * 8, separate=True) is None  # 8 s
    out = await asyncio.to_thread(ex.run_here, ("a", 0), [{"x": x}, {"x": x}], True)  # 2 s
    assert out is not None and len(out.parts) == 2
    assert_forward_close(out.parts[1][""], forward(ref, x))
    ex.close()


async def test_a_load_given_up_and_made_again_settles_by_its_own_copy() -> None:
    """A stage evicted while its copy was in flight and loaded again at once: the first copy's
    end must not settle the second load (issue 20: the stage then stayed `loading` for ever,
    never to be evicted by the worker's own choice)."""
    dev = RecordingCpu(MIB)
    ex = Executor(dev, compute_lanes=1)
    key = ("a", 0)
    blocks, host, ref = stage_of(mlp("a", 64, 2))
    ex.add_stage(key, blocks, host)
    release, held = threading.Event(), threading.Event()

    def hold_the_first(marker: Any) -> None:
        if not held.is_set():
            held.set()
            release.wait(30)

    dev.before_copy = hold_the_first
    first = ex.load(key)
    assert await asyncio.to_thread(held.wait, 10)
    ex.evict(key)
    with pytest.raises(FlowmeshError) as given_up:
        await first
    assert given_up.value.code == Code.NOT_RESIDENT
    second = ex.load(key)
    release.set()
    await asyncio.wait_for(second, 30)
    await until(lambda: ex.stages[key].state is State.RESIDENT, "the second load to settle")
    x = torch.randn(2, 64)
    assert_forward_close((await ex.run(key, [{"x": x}])).parts[0][""], forward(ref, x))
    ex.close()


async def test_a_failed_copy_fails_the_runs_waiting_on_it() -> None:
    """A load whose copy raised: the runs sent meanwhile fail instead of waiting for ever on
    blocks that never come, and serving is idle again (a training compute on the CPU stand-in
    waits for that)."""
    dev = RecordingCpu(MIB)
    ex = Executor(dev, compute_lanes=1)
    key = ("a", 0)
    blocks, host, _ = stage_of(mlp("a", 64, 2))
    ex.add_stage(key, blocks, host)

    def fail(marker: Any) -> None:
        raise RuntimeError("the copy engine is gone")

    dev.before_copy = fail
    load = ex.load(key)
    run = ex.run(key, [{"x": torch.randn(2, 64)}])
    with pytest.raises(FlowmeshError) as failed:
        await load
    assert failed.value.code == Code.INTERNAL and "copy engine" in failed.value.reason
    with pytest.raises(FlowmeshError) as stranded:
        await asyncio.wait_for(run, 30)
    assert stranded.value.code == Code.NOT_RESIDENT
    assert not ex.memory.serving_busy() and ex.stages[key].state is State.HOST
    dev.before_copy = None
    x = torch.randn(2, 64)
    await ex.load(key)  # a later load of the stage is as good as ever
    assert (await ex.run(key, [{"x": x}])).parts[0][""].shape == (2, 64)
    ex.close()


@pytest.mark.parametrize("held", ["waiting for its copy", "computing"])
async def test_a_run_never_computes_on_the_bytes_of_a_later_load_of_its_stage(held: str) -> None:
    """A run is in flight (waiting for its stage's copy, or computing); the stage is evicted
    under it and loaded again at other offsets, whose copy waits on a previous user. The second
    load binds the stage's modules to its own ranges at once: the first run must not compute on
    them (still unwritten), but on its own bytes, or fail as evicted (the broker then runs it
    again)."""
    gate = Gate()
    blocks, _, ref = stage_of(mlp("a", 64, 2))
    children = list(ref.children())
    blocks = [blocks[0], gate, *blocks[1:]]  # the weights after the gate are read once it opens
    host = HostStage.build([dict(b.state_dict()) for b in [children[0], gate, *children[1:]]])
    size = host.nbytes
    dev = RecordingCpu(3 * size)
    ex = Executor(dev, compute_lanes=1, copy_lanes=2)
    key = ("a", 0)
    ex.add_stage(key, blocks, host)
    release, copying = threading.Event(), threading.Event()

    def hold_the_first(marker: Any) -> None:
        if not copying.is_set():
            copying.set()
            release.wait(30)

    if held == "computing":
        gate.release.set()
        await ex.load(key)
        gate.release.clear()
    else:
        dev.before_copy = hold_the_first
        ex.load(key).add_done_callback(lambda f: f.exception())  # at 0; its copy held
    # Whatever takes the rest of the arena next orders after a marker this test holds.
    (rest,) = ex.memory.alloc_serving([2 * size])
    previous_user = CpuMarker()
    ex.memory.free(rest, [previous_user], "serving")
    x = torch.randn(2, 64)
    run = ex.run(key, [{"x": x}])
    if held == "computing":
        assert await asyncio.to_thread(gate.entered.wait, 10)
    else:
        assert await asyncio.to_thread(copying.wait, 10)
    ex.evict(key)
    pinned = ex.memory.alloc_serving([size])  # the first range goes to someone else
    again = ex.load(key)  # elsewhere: bound now, copied once the previous user is done
    bound = ex.stages[key].copies[-1].marker
    await until(lambda: dev.log.has("copy", bound), "the second load to bind and copy")
    release.set()
    gate.release.set()
    try:
        out = await asyncio.wait_for(run, 30)
    except FlowmeshError as exc:
        assert exc.code == Code.NOT_RESIDENT, exc
    else:
        assert_forward_close(out.parts[0][""], forward(ref, x), "a run on its own bytes")
    previous_user.set()
    await asyncio.wait_for(again, 30)
    assert_forward_close((await ex.run(key, [{"x": x}])).parts[0][""], forward(ref, x))
    for ext in pinned:
        ex.memory.free(ext, [], "serving")
    ex.close()


async def test_a_copy_of_a_load_given_up_neither_binds_nor_copies_after_a_later_load() -> None:
    """With two copy lanes, a stage's first copy may still be queued behind another stage's
    when the stage is evicted and loaded again on the other lane. The first copy, starting
    last, must leave the stage bound to the second load's ranges (its runs answer right), not
    to its own, which by then belong to someone else."""
    allowed: set[Any] = set()
    gate = threading.Condition()

    def hold_unless_allowed(marker: Any) -> None:
        with gate:
            assert gate.wait_for(lambda: marker in allowed, 30), "copy never allowed"

    def allow(key: tuple[str, int]) -> None:
        with gate:
            allowed.add(ex.stages[key].copies[0].marker)
            gate.notify_all()

    stages = {
        "big": stage_of(mlp("big", 96, 2)),
        "b": stage_of(mlp("b", 64, 2, seed=1)),
        "a": stage_of(mlp("a", 64, 2, seed=2)),
    }
    size = stages["a"][1].nbytes
    dev = RecordingCpu(8 * size)
    ex = Executor(dev, compute_lanes=1, copy_lanes=2)
    for n, (blocks, host, _) in stages.items():
        ex.add_stage((n, 0), blocks, host)
    dev.before_copy = hold_unless_allowed
    big = ex.load(("big", 0))  # lane 0, held
    b = ex.load(("b", 0))  # lane 1, held
    first = ex.load(("a", 0))  # lane 1 (fewer bytes queued), behind b: not started
    first.add_done_callback(lambda f: f.exception())
    first_allow = ex.stages[("a", 0)].copies[0].marker
    spacer = ex.memory.alloc_serving([ALIGN])  # a's range stays apart from the free tail
    allow(("big", 0))
    await asyncio.wait_for(big, 30)
    await until(lambda: ex._queued[0] == 0, "lane 0 to be free")
    ex.evict(("a", 0))
    (taken,) = ex.memory.alloc_serving([size])  # a's first range, now another stage's
    again = ex.load(("a", 0))  # elsewhere, on lane 0
    allow(("a", 0))
    await asyncio.wait_for(again, 30)
    x = torch.randn(2, 64)
    ref = stages["a"][2]
    assert_forward_close((await ex.run(("a", 0), [{"x": x}])).parts[0][""], forward(ref, x))
    allow(("b", 0))
    with gate:
        allowed.add(first_allow)  # a's first copy, which starts now, last
        gate.notify_all()
    await asyncio.wait_for(b, 30)
    await until(lambda: not any(ex._queued), "every copy to end")
    dev.arena[taken.offset : taken.offset + taken.size].zero_()  # its new owner writes it
    out = await ex.run(("a", 0), [{"x": x}])
    assert_forward_close(out.parts[0][""], forward(ref, x), "a run after the first copy ended")
    for ext in (*spacer, taken):
        ex.memory.free(ext, [], "serving")
    ex.close()
