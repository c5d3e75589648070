"""Serving claims back what training borrowed, and training still finishes: the path of the
demo's hang (issue 20: both training jobs of the worker that served the most loads stopped for
good while serving went on).

The scheduler's starvation guard held every admission for a look-ahead task that a reclaim had
made no candidate at all (its head was back in line): nothing was ever admitted again. And
serving's stages could sit in training's guaranteed bytes, so that once serving went idle no
range was left for a task that the guarantee promised would fit. Each is shown exactly (the
scheduler and the arena alone, then a real serving executor and training executor on one CPU
stand-in, the racy points held by the test), then the demo's mix runs with randomised timing
(pauses at the lanes' racy points, never waited on for an outcome): it found both hangs, and a
load placed while another waited for training taking the bytes the waiting one needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.build import build_meta, build_seeded
from flowmesh.spec import ModelSpec
from flowmesh.testing import assert_forward_close
from gpu_worker.device import CpuStandIn
from gpu_worker.executor import Executor
from gpu_worker.host_tier import ALIGN, HostStage
from gpu_worker.memory import DeviceMemory, OutOfSpace
from gpu_worker.train_config import TrainConfig
from gpu_worker.train_executor import TrainingExecutor, open_job
from gpu_worker.train_scheduler import FlowScheduler, Task
from tests.support.torch_threads import one_thread  # noqa: F401  (autouse)
from tests.support.waiting import until

KIB = 1 << 10


# -- the scheduler alone -----------------------------------------------------------------------


def test_a_reclaim_never_leaves_admissions_held_for_a_task_that_is_no_candidate() -> None:
    s = FlowScheduler(prefetch=1, max_skips=2)
    s.add_job("a")
    head, ahead = Task("a", 1, "t", 4, sub=0), Task("a", 1, "t", 4, sub=1)
    s.push([head, ahead])
    room = [4]

    def alloc(t: Task) -> bool:
        if t.nbytes > room[0]:
            return False
        room[0] -= t.nbytes
        return True

    assert s.admit(alloc) == [head]
    for _ in range(3):  # the look-ahead does not fit beside its head: past max_skips, it starves
        assert s.admit(alloc) == []
    # Serving claims memory before the head computed: both are candidates-to-be again, and
    # only the head can be one now (in-order admission).
    assert s.unadmit() == [head]
    room[0] = 100
    assert s.candidates() == [head]
    assert s.admit(alloc) == [head, ahead], "admissions stayed held for a task that is no candidate"


# -- the arena alone ---------------------------------------------------------------------------


def test_serving_never_takes_training_s_guaranteed_bytes() -> None:
    """Training borrows, serving places its ranges around what training holds; once training's
    tasks are gone, a task of its whole guarantee still finds one range."""
    mem = DeviceMemory(serving_bytes=4 * KIB, train_bytes=2 * KIB, align=256)
    t1 = mem.alloc_training(KIB)
    (s1,) = mem.alloc_serving([2 * KIB])
    t2 = mem.alloc_training(KIB)
    assert t1 is not None and t2 is not None
    got = []
    # No room below training's bytes beside what training borrowed: the executor claims then.
    with contextlib.suppress(OutOfSpace):
        got = mem.alloc_serving([KIB])
    for ext in (t1, t2):
        mem.free(ext, [], "training")
    assert mem.used["serving"] <= mem.serving_bytes
    big = mem.alloc_training(2 * KIB)
    assert big is not None, f"free ranges {mem.arena.free_extents()}: the guarantee is split"
    for ext in (s1, *got):
        mem.free(ext, [], "serving")
    mem.free(big, [], "training")
    assert mem.arena.free_extents() == [(0, 6 * KIB)]


def test_random_serving_placements_leave_training_its_guarantee() -> None:
    rng = random.Random(5)
    for _ in range(300):
        mem = DeviceMemory(serving_bytes=16 * KIB, train_bytes=8 * KIB, align=256)
        serving: list[Any] = []
        training: list[Any] = []
        for _ in range(40):
            if rng.random() < 0.5:
                ext = mem.alloc_training(rng.randrange(1, 8) * 512)
                if ext is not None:
                    training.append(ext)
            elif rng.random() < 0.3 and training:
                mem.free(training.pop(rng.randrange(len(training))), [], "training")
            elif rng.random() < 0.3 and serving:
                mem.free(serving.pop(rng.randrange(len(serving))), [], "serving")
            else:
                n = rng.randrange(1, 6) * 512
                if mem.used["serving"] + mem.round(n) > mem.serving_bytes:
                    continue  # the executor evicts first: serving stays within its budget
                # Else it would claim, and training give back: not modelled here.
                with contextlib.suppress(OutOfSpace):
                    serving += mem.alloc_serving([n])
        for ext in training:
            mem.free(ext, [], "training")
        assert mem.alloc_training(8 * KIB) is not None, mem.arena.free_extents()


# -- a serving executor and a training executor on one arena -----------------------------------


class Blob(nn.Module):
    """A serving stage of exactly `nbytes` device bytes (its one buffer)."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.register_buffer("b", torch.zeros(nbytes, dtype=torch.uint8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def blob_stage(nbytes: int) -> tuple[list[nn.Module], HostStage]:
    return [Blob(nbytes)], HostStage.build([{"b": torch.zeros(nbytes, dtype=torch.uint8)}])


TWO_SUBS = ModelSpec(
    name="two",
    factory="flowmesh.examples:mlp",
    kwargs={"width": 24, "depth": 4, "in_features": 8, "out_features": 5},
    seed=7,
)
CFG = TrainConfig({"name": "adam", "lr": 0.01}, seed=1)


def steps_of(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(n)
    ]


def solo_losses(spec: ModelSpec, target: int, data: list[Any]) -> list[float]:
    dev = CpuStandIn(1 << 20)
    with TrainingExecutor(dev) as ex:
        job = open_job(spec.name, spec, CFG, dev, batch=8, target_bytes=target)
        ex.open(job)
        return [f.result(120).loss for f in [ex.submit(job.name, x, y) for x, y in data]]


def round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def state_of(trainer: TrainingExecutor, mem: DeviceMemory) -> str:
    """What a stuck trainer looks like: its counters, the arena and every chain's head."""
    heads = {
        job: [(t.label, t.phase.value, t.skips) for t in list(chain)[:2]]
        for job, chain in trainer.sched.chains.items()
    }
    blocking = trainer.sched._blocking
    return (
        f"counters {trainer.counters}; memory {mem.stats()} claims {mem.claims} busy {mem.busy} "
        f"lent {mem.lent}; free {mem.arena.free_extents()}; heads {heads}; blocking "
        f"{blocking.label if blocking else None}"
    )


async def all_done(
    futures: list[Any], trainer: TrainingExecutor, mem: DeviceMemory, when: str
) -> list[Any]:
    """The steps' results; a trainer that stopped fails the test with its state."""
    try:
        return await asyncio.wait_for(
            asyncio.gather(*(asyncio.wrap_future(f) for f in futures)), 60
        )
    except TimeoutError:
        raise AssertionError(f"training stopped {when}: {state_of(trainer, mem)}") from None


async def test_a_reclaim_while_a_look_ahead_starves_does_not_stop_training() -> None:
    """The demo's hang, step by step: a job's head is admitted and waits to compute (serving is
    busy), its look-ahead does not fit and starves; a serving load claims memory and takes the
    head's back. Training must go on once serving is quiet."""
    target, steps = 32 * KIB, 12
    dev = CpuStandIn(1 << 20)
    job = open_job("two", TWO_SUBS, CFG, dev, batch=8, target_bytes=target)
    first, second = job.plan_step(0)[:2]  # forward of sub-model 0, then the last sub-model
    f0, l1, train = round_up(first.nbytes), round_up(second.nbytes), round_up(job.largest_task())
    # The arena's layout: stage X at 0, the head's range right after it. Neither the gap X
    # leaves when evicted nor the tail after the head holds the look-ahead; stage Y (the whole
    # serving budget) fits only once the head's range is given back.
    serving = round_up(train - f0 + (l1 + f0 - train) // 2)
    x = (serving + train - f0) // 2 // ALIGN * ALIGN
    assert l1 > x and l1 > serving + train - x - f0 and serving > x, (f0, l1, train, serving, x)
    mem = DeviceMemory(serving, train, ALIGN)
    ex = Executor(dev, compute_lanes=1, memory=mem)
    trainer = TrainingExecutor(dev, memory=mem)
    data = steps_of(11, steps)
    try:
        for key, n in ((("x", 0), x), (("y", 0), serving)):
            blocks, host = blob_stage(n)
            ex.add_stage(key, blocks, host)
        await asyncio.wait_for(ex.load(("x", 0)), 60)
        mem.serving_started()  # a serving run in flight: training computes nothing meanwhile
        trainer.open(job)
        futures = [trainer.submit("two", xb, yb) for xb, yb in data]
        await until(lambda: trainer.sched.pending("two") == 3 * steps, "every step's tasks")
        await until(lambda: trainer.counters["tasks_admitted"] == 1, "the head's admission")
        ex.evict(("x", 0))
        await asyncio.wait_for(ex.load(("y", 0)), 60)
        assert ex.counters["load_waits"] == 1 and trainer.counters["tasks_reclaimed"] == 1
        assert trainer.counters["tasks_started"] == 0
        mem.serving_ended()
        done = await all_done(futures, trainer, mem, "after serving took the head's memory")
    finally:
        trainer.close()
        ex.close()
    torch.testing.assert_close(
        [r.loss for r in done], solo_losses(TWO_SUBS, target, data), rtol=1e-5, atol=1e-6
    )


# -- the demo's mix, with randomised timing ----------------------------------------------------

# Serving: three stages, two of which fit the serving budget at once (every other load evicts).
SERVED = [
    ModelSpec(
        name=f"s{w}", factory="flowmesh.examples:mlp", kwargs={"width": w, "depth": 2}, seed=w
    )
    for w in (32, 40, 48)
]
# Training: jobs cut into two and three sub-models whose footprints together exceed the training
# bytes, so that they take turns and borrow from serving.
TRAINED = [
    (TWO_SUBS, 32 * KIB),
    (
        ModelSpec(
            name="three",
            factory="flowmesh.examples:mlp",
            kwargs={"width": 24, "depth": 4, "in_features": 8, "out_features": 5},
            seed=8,
        ),
        16 * KIB,
    ),
]
MIX_ROUNDS, MIX_OPS, MIX_STEPS = 6, 60, 6


class Jitter:
    """Random pauses of up to `most_s` at the lanes' racy points (a copy starting, a compute's
    marker being set), so that each round interleaves serving and training differently."""

    def __init__(self, rng: random.Random, most_s: float = 0.001) -> None:
        self._rng, self._most, self._lock = rng, most_s, threading.Lock()

    def pause(self) -> None:
        with self._lock:
            pause = self._rng.random() * self._most if self._rng.random() < 0.5 else 0.0
        if pause:
            time.sleep(pause)

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def jittered(*args: Any, **kwargs: Any) -> Any:
            self.pause()
            return fn(*args, **kwargs)

        return jittered


async def mix_round(
    seed: int, train: int, expected: dict[str, list[float]], data: dict[str, Any]
) -> dict[str, int]:
    """One round: serving traffic of MIX_OPS random operations, beside every job's steps sent
    at once; returns the arena's counters."""
    rng = random.Random(seed)
    refs = {s.name: build_seeded(s) for s in SERVED}
    hosts = {
        n: HostStage.build([dict(b.state_dict()) for b in r.children()]) for n, r in refs.items()
    }
    sizes = sorted(h.nbytes for h in hosts.values())
    serving = round_up(sizes[-1] + sizes[-2])
    dev = CpuStandIn(serving + train)
    jitter = Jitter(rng)
    dev.copy_in = jitter.wrap(dev.copy_in)  # type: ignore[method-assign]
    dev.mark_done = jitter.wrap(dev.mark_done)  # type: ignore[method-assign]
    mem = DeviceMemory(serving, train, ALIGN)
    ex = Executor(dev, compute_lanes=rng.choice((1, 2)), memory=mem)
    trainer = TrainingExecutor(dev, memory=mem)
    runs: list[tuple[str, torch.Tensor, asyncio.Future[Any]]] = []
    try:
        for s in SERVED:
            ex.add_stage((s.name, 0), list(build_meta(s).children()), hosts[s.name])
        futures = {}
        for spec, target in TRAINED:
            trainer.open(open_job(spec.name, spec, CFG, dev, batch=8, target_bytes=target))
            futures[spec.name] = [trainer.submit(spec.name, x, y) for x, y in data[spec.name]]
        for _ in range(MIX_OPS):
            name = rng.choice(SERVED).name
            roll = rng.random()
            try:
                if roll < 0.6:
                    x = torch.randn(rng.choice((1, 2, 4)), int(name[1:]))
                    runs.append((name, x, ex.run((name, 0), [{"x": x}])))
                elif roll < 0.8:
                    ex.evict((name, 0))  # as the broker's Evict: maybe under runs, or a load
                else:
                    load = ex.load((name, 0))
                    load.add_done_callback(lambda f: f.exception())  # evicted meanwhile: fine
            except FlowmeshError as exc:  # every other stage busy: the broker sends it later
                assert exc.code in (Code.NO_SPACE, Code.NOT_RESIDENT), exc
            await asyncio.sleep(rng.random() * 0.002)  # random pacing (a new interleaving)
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(f for _, _, f in runs), return_exceptions=True), 60
        )
        for (name, x, _), out in zip(runs, outcomes, strict=True):
            if isinstance(out, BaseException):
                # A run whose stage was evicted under it (the broker sends it again); no other.
                assert isinstance(out, FlowmeshError) and out.code == Code.NOT_RESIDENT, out
                continue
            with torch.inference_mode():
                assert_forward_close(out.parts[0][""], refs[name](x))
        results = {
            n: await all_done(fs, trainer, mem, f"in round {seed}") for n, fs in futures.items()
        }
        for n, rs in results.items():
            torch.testing.assert_close([r.loss for r in rs], expected[n], rtol=1e-5, atol=1e-6)
        # What the demo checks: the stages holding (or promised) bytes never exceeded the budget.
        assert ex.stage_bytes_peak <= serving, (ex.stage_bytes_peak, serving)
        return {**mem.stats(), "tasks_reclaimed": trainer.counters["tasks_reclaimed"]}
    finally:
        trainer.close()
        ex.close()


def largest_task(spec: ModelSpec, target: int) -> int:
    dev = CpuStandIn(1 << 20)
    return open_job(spec.name, spec, CFG, dev, batch=8, target_bytes=target).largest_task()


async def test_serving_under_eviction_beside_borrowing_jobs_never_stops_training() -> None:
    """The demo's mix in-process, MIX_ROUNDS times with random interleavings: serving runs,
    loads and evictions (random order and pauses) beside training jobs that borrow serving's
    bytes; every run answers correctly, every job finishes with its solo losses, and serving
    stays within its budget."""
    data = {spec.name: steps_of(20 + i, MIX_STEPS) for i, (spec, _) in enumerate(TRAINED)}
    expected = {spec.name: solo_losses(spec, t, data[spec.name]) for spec, t in TRAINED}
    totals: dict[str, int] = {}
    train = max(round_up(largest_task(spec, target)) for spec, target in TRAINED)
    for seed in range(MIX_ROUNDS):
        for k, v in (await mix_round(seed, train, expected, data)).items():
            totals[k] = totals.get(k, 0) + v
    # The path under test was taken: serving claimed memory and training gave some back.
    assert totals["memory_claims"] > 0 and totals["tasks_reclaimed"] > 0, totals
    assert totals["train_borrowed_peak"] > 0, totals


async def test_a_load_placed_while_another_waits_leaves_it_its_bytes() -> None:
    """A load waits for training to give back what it borrowed; a later load that fits must not
    take the bytes the waiting one was promised: the stages holding or awaiting bytes never add
    up to more than the serving budget (the demo counts them: `stage_bytes_peak`)."""
    unit = 4 * KIB
    mem = DeviceMemory(8 * unit, 4 * unit, ALIGN)
    dev = CpuStandIn(12 * unit)
    ex = Executor(dev, compute_lanes=1, memory=mem)
    try:
        for name, units in (("a", 3), ("w", 4), ("z", 2)):
            blocks, host = blob_stage(units * unit)
            ex.add_stage((name, 0), blocks, host)
        await asyncio.wait_for(ex.load(("a", 0)), 30)  # at 0
        borrowed = mem.alloc_training(2 * unit)  # right after it: in serving's part
        assert borrowed is not None and mem.lent
        waiting = ex.load(("w", 0))  # 4 units within the budget, but no 4 in one piece
        assert ex.stages[("w", 0)].waiting
        placed = ex.load(("z", 0))
        assert ex.stage_bytes_peak <= mem.serving_bytes, ex.stats()
        mem.free(borrowed, [], "training")  # training gives back: the waiting load goes on
        await asyncio.wait_for(asyncio.gather(waiting, placed), 30)
        assert ex.stage_bytes() <= mem.serving_bytes and ex.stage_bytes_peak <= mem.serving_bytes
        assert not mem.claims
    finally:
        ex.close()
