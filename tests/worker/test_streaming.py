"""A model streamed through one device: all its stages on one executor whose budget holds only
some of them. Each run brings its stage in, prefetches the next while it computes, and makes
room from the stages that already ran in this pass (`Executor._victims`).

Ordering is checked on what is resident after each call (evictions happen when a load is
issued, on the loop) and on a recording stand-in's log, never on wall time.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from flowmesh.modelio.build import build_meta, build_seeded
from flowmesh.testing import assert_forward_close
from gpu_worker.device import CpuStandIn
from gpu_worker.executor import Executor, State
from gpu_worker.host_tier import HostStage
from tests.support.stages import mlp

STAGES = 4


class NotedCpu(CpuStandIn):
    """A CPU stand-in that calls `before_copy(marker)` as each copy is issued."""

    def __init__(self, budget_bytes: int) -> None:
        super().__init__(budget_bytes)
        self.before_copy = lambda marker: None

    def copy_in(self, dst: Any, src: Any, after: list[Any], marker: Any, lane: int = 0) -> None:
        self.before_copy(marker)
        super().copy_in(dst, src, after, marker, lane)


def split(ex: Executor, name: str = "m") -> nn.Module:
    """Add the example MLP (depth 3: [Linear, GELU] x 3, Linear) to `ex` as STAGES stages of
    one Linear each; returns the whole model as built for reference."""
    spec = mlp(name, depth=3)
    ref = build_seeded(spec)
    children, meta = list(ref.children()), list(build_meta(spec).children())
    cuts = [(0, 2), (2, 4), (4, 6), (6, 7)]
    for i, (a, b) in enumerate(cuts):
        host = HostStage.build([dict(c.state_dict()) for c in children[a:b]])
        ex.add_stage((name, i), meta[a:b], host)
    return ref


def budget_for(stages: float) -> int:
    """A budget of about `stages` of `split`'s stages (each one Linear of 256 x 256)."""
    return int(stages * (256 * 256 + 256) * 4) + 4096


async def one_pass(ex: Executor, x: torch.Tensor, resident: list[set[int]] | None = None) -> Any:
    """x through stages 0..3 in turn, as the broker runs a streamed replica; `resident`: what
    is on the device right after each run was handed in. With `resident`, each load is also
    seen through before the next run (a run may finish before the loop marks its stage's load
    done, and a stage still loading is no victim: the choices would depend on timing)."""
    for i in range(STAGES):
        fut = ex.run(("m", i), [{"x": x}])
        if resident is not None:
            resident.append({k[1] for k in ex.resident()})
        x = (await fut).parts[0][""]
        if resident is not None:
            for st in ex.stages.values():
                if st.loading is not None and not st.loading.done():
                    await st.loading
    return x


def forward(ref: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return ref(x)


async def test_a_streamed_model_is_exact_and_keeps_what_its_next_pass_needs_first() -> None:
    ex = Executor(NotedCpu(budget_for(3.5)))  # three stages fit, not four
    ref = split(ex)
    x = torch.randn(5, 256)
    seen: list[set[int]] = []
    assert_forward_close(await one_pass(ex, x, seen), forward(ref, x))
    # Each run prefetched the next stage; the fourth evicted the one that ran last (1), not the
    # least recently used (0), which the next pass needs first.
    assert seen == [{0, 1}, {0, 1, 2}, {0, 2, 3}, {0, 2, 3}]
    assert (ex.counters["prefetches"], ex.counters["implicit_loads"]) == (3, 1)
    loads = ex.counters["loads"]
    seen = []
    x = torch.randn(5, 256)
    assert_forward_close(await one_pass(ex, x, seen), forward(ref, x))
    # Stage 0 was still there; its prefetch of 1 evicted 3 (needed furthest ahead), not 2.
    assert seen == [{0, 1, 2}, {0, 1, 2}, {0, 2, 3}, {0, 2, 3}]
    assert ex.counters["loads"] - loads == 2  # least recently used would copy all four again
    assert ex.stage_bytes_peak <= ex.memory.serving_bytes
    ex.close()


async def test_the_next_stage_is_copied_while_the_one_before_computes() -> None:
    dev = NotedCpu(budget_for(2.5))
    ex = Executor(dev)
    ref = split(ex)
    copied = threading.Event()
    held: list[bool] = []

    def note(marker: Any) -> None:
        if any(marker is m for m in ex.stages[("m", 1)].ready):
            copied.set()

    dev.before_copy = note
    # Stage 0's first block waits for stage 1's copy to be issued: an executor that copied
    # stage 1 only once its run came would never get there (the hold gives up).
    ex.stages[("m", 0)].blocks[0].register_forward_hook(lambda *_: held.append(copied.wait(10)))
    x = torch.randn(2, 256)
    out = await one_pass(ex, x)
    assert held == [True], "stage 1 was not copied while stage 0 computed"
    assert_forward_close(out, forward(ref, x))
    ex.close()


async def test_a_prefetched_stage_is_evicted_last_for_another_models_run() -> None:
    ex = Executor(NotedCpu(budget_for(2.5)))  # two stages fit
    split(ex)
    spec_b = mlp("b", depth=3)  # a stage of the same shape as m's
    ref_b, meta_b = build_seeded(spec_b), list(build_meta(spec_b).children())
    host_b = HostStage.build([dict(c.state_dict()) for c in list(ref_b.children())[:2]])
    ex.add_stage(("b", 0), meta_b[:2], host_b)
    x = torch.randn(2, 256)
    await ex.run(("m", 0), [{"x": x}])  # brings 0 in and prefetches 1, whose run is to come
    for k in (("m", 0), ("m", 1)):  # both loads seen through (see `one_pass`)
        await ex.stages[k].loading
    assert ex.stages[("m", 1)].next_up and ex.stages[("m", 1)].state is State.RESIDENT
    # Another model's run needs one stage's room: m/1, never run, is worth less than m/0 by
    # value, but the run that is about to use it keeps it; m/0 goes.
    await ex.run(("b", 0), [{"x": x}])
    assert {k for k in ex.resident()} == {("m", 1), ("b", 0)}
    out = await ex.run(("m", 1), [{"": x}])
    assert not ex.stages[("m", 1)].next_up and out.rows == 2
    ex.close()
