"""One owner of device memory: serving stages and training tasks share one arena, inference first.

`DeviceMemory` is driven directly (pure bookkeeping); then a real serving `Executor` and a real
`TrainingExecutor` share one CPU stand-in: training borrows the serving budget while serving is
quiet, a serving load claims it back without waiting for training to compute, and both give the
results they give alone. Ordering is shown by counters and states, never by wall time.
"""

from __future__ import annotations

import asyncio

import torch

from flowmesh.modelio.build import build_meta, build_seeded
from flowmesh.spec import ModelSpec
from flowmesh.testing import assert_forward_close
from gpu_worker.device import CpuStandIn
from gpu_worker.executor import Executor, State
from gpu_worker.host_tier import ALIGN, HostStage
from gpu_worker.memory import DeviceMemory
from gpu_worker.train_config import TrainConfig
from gpu_worker.train_executor import TrainingExecutor, open_job
from gpu_worker.train_job import StepResult
from tests.support.torch_threads import one_thread  # noqa: F401  (autouse)
from tests.support.waiting import until

KIB = 1 << 10


# -- DeviceMemory ------------------------------------------------------------------------------


def test_training_borrows_free_serving_bytes_until_serving_claims() -> None:
    mem = DeviceMemory(serving_bytes=4 * KIB, train_bytes=2 * KIB, align=256)
    claimed: list[int] = []
    woken: list[str] = []
    mem.on_claim.append(lambda: claimed.append(mem.claims))
    mem.wake_serving.append(lambda: woken.append("serving"))
    mem.wake_training.append(lambda: woken.append("training"))

    borrowed = [mem.alloc_training(2 * KIB) for _ in range(3)]  # 6 KiB: all of the arena
    assert all(e is not None for e in borrowed)
    assert mem.used == {"serving": 0, "training": 6 * KIB}
    assert mem.stats()["train_borrowed_peak"] == 4 * KIB
    assert mem.alloc_training(256) is None  # full

    mem.claim()  # a serving load that did not fit
    assert claimed == [1]
    mem.free(borrowed[0], [], "training", reclaimed=True)
    assert woken == ["serving"]
    assert mem.alloc_training(256) is None, "training admits nothing while serving claims"
    (ext,) = mem.alloc_serving([2 * KIB])
    mem.unclaim()
    assert woken == ["serving", "training"]
    assert mem.used == {"serving": 2 * KIB, "training": 4 * KIB}
    assert mem.stats()["train_reclaimed_bytes"] == 2 * KIB
    mem.free(ext, [], "serving")
    assert woken[-1] == "training"


def test_serving_busy_follows_loads_runs_and_claims() -> None:
    mem = DeviceMemory(1024, 1024)
    quiet: list[bool] = []
    mem.wake_training.append(lambda: quiet.append(True))
    assert not mem.serving_busy()
    mem.serving_started()
    mem.serving_started()
    mem.serving_ended()
    assert mem.serving_busy() and not quiet
    mem.serving_ended()
    assert not mem.serving_busy() and quiet == [True]
    mem.claim()
    assert mem.serving_busy()
    mem.unclaim()
    assert not mem.serving_busy()


# -- serving and training executors on one arena ---------------------------------------------


SERVE = ModelSpec(
    name="served",
    factory="flowmesh.examples:mlp",
    kwargs={"width": 64, "depth": 4, "in_features": 8, "out_features": 5},
    seed=3,
)


def train_spec(i: int) -> ModelSpec:
    return ModelSpec(
        name=f"t{i}",
        factory="flowmesh.examples:mlp",
        kwargs={"width": 24, "depth": 4, "in_features": 8, "out_features": 5},
        seed=40 + i,
    )


CFG = TrainConfig({"name": "adam", "lr": 0.01}, seed=1)
STEPS = 8


def batches(i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + i)
    return [
        (torch.randn(8, 8, generator=g), torch.randint(0, 5, (8,), generator=g))
        for _ in range(STEPS)
    ]


def solo_losses(i: int, train_bytes: int) -> list[float]:
    dev = CpuStandIn(train_bytes)
    with TrainingExecutor(dev) as ex:
        job = open_job(f"t{i}", train_spec(i), CFG, dev, batch=8, target_bytes=train_bytes // 2)
        ex.open(job)
        return [f.result(120).loss for f in [ex.submit(job.name, x, y) for x, y in batches(i)]]


async def test_a_serving_load_takes_back_what_training_borrowed_without_waiting_for_it() -> None:
    ref = build_seeded(SERVE)
    host = HostStage.build([dict(b.state_dict()) for b in ref.children()])
    serving = host.nbytes  # the serving budget holds the stage exactly
    train = 24 * KIB
    dev = CpuStandIn(serving + train)
    mem = DeviceMemory(serving, train, ALIGN)
    ex = Executor(dev, compute_lanes=1, memory=mem)
    ex.add_stage(("served", 0), list(build_meta(SERVE).children()), host)
    expected = [solo_losses(i, train) for i in range(5)]

    trainer = TrainingExecutor(dev, memory=mem)
    try:
        jobs = [
            open_job(f"t{i}", train_spec(i), CFG, dev, batch=8, target_bytes=train // 2)
            for i in range(5)
        ]
        for job in jobs:
            trainer.open(job)
        # Serving holds training's computes back (the CPU rule) while every step is queued:
        # training takes memory for what it may prefetch, also from the idle serving budget.
        mem.serving_started()
        futures = {
            job.name: [trainer.submit(job.name, x, y) for x, y in batches(i)]
            for i, job in enumerate(jobs)
        }
        await until(lambda: mem.used["training"] > train, "training to borrow serving bytes")
        started = trainer.counters["tasks_started"]
        await until(
            lambda: trainer.counters["tasks_started"] == started and not trainer._computing,
            "the compute lane to drain",
        )

        # The load does not fit beside what training borrowed: it claims, and training gives
        # back every range of a task that has not computed, without computing anything.
        load = ex.load(("served", 0))
        assert ex.stages[("served", 0)].state is State.LOADING
        x = torch.randn(4, 8)
        run = ex.run(("served", 0), [{"x": x}])
        await asyncio.wait_for(load, 60)
        out = await asyncio.wait_for(run, 60)
        with torch.inference_mode():
            assert_forward_close(out.parts[0][""], ref(x))
        assert ex.counters["load_waits"] == 1
        assert trainer.counters["tasks_started"] == started, "serving waited for a training compute"
        assert trainer.counters["tasks_reclaimed"] > 0
        assert mem.stats()["train_reclaimed_bytes"] > 0
        assert mem.used["serving"] == mem.round(serving)
        assert mem.arena.peak <= mem.capacity

        # Serving quiet again: training goes on in what is left, with the results it has alone.
        mem.serving_ended()
        results: dict[str, list[StepResult]] = {}
        for name, fs in futures.items():
            results[name] = [await asyncio.wrap_future(f) for f in fs]
        for i, job in enumerate(jobs):
            torch.testing.assert_close(
                [r.loss for r in results[job.name]], expected[i], rtol=1e-5, atol=1e-6
            )
        assert trainer.stats()["resident_peak"] <= mem.capacity
    finally:
        trainer.close()
        ex.close()


def test_closed_executors_leave_the_memory_they_shared_as_they_found_it() -> None:
    """Each executor listens to the worker's memory (serving's claims and wakes); closed, it
    listens no more: the memory may outlive it, and would keep it alive."""
    dev = CpuStandIn(2 << 20)
    mem = DeviceMemory(1 << 20, 1 << 20, ALIGN)
    before = (list(mem.on_claim), list(mem.wake_serving), list(mem.wake_training))
    serving = Executor(dev, compute_lanes=1, memory=mem)
    trainer = TrainingExecutor(dev, memory=mem)
    assert (list(mem.on_claim), list(mem.wake_serving), list(mem.wake_training)) != before
    trainer.close()
    serving.close()
    assert (mem.on_claim, mem.wake_serving, mem.wake_training) == before
