"""What a training step's answer reports of the step (issue 23 §4), in-process on a CPU stand-in
with real torch: the bytes its copies moved between the host tier and the arena, its wait for
arena memory, and each sub-model's activation policy.

The bytes are checked against copies seen happen, not against the executor's own sums: a twin
job (same model, seed, data) is driven task by task on this thread, as the executor drives it,
under a torch function mode that sees every `Tensor.copy_` into the arena (in) and into the
host tier's slabs (out)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from flowmesh import protocol as p
from flowmesh.modelio.chain import chain_of
from flowmesh.reports import SubModelRow
from flowmesh.spec import ModelSpec
from gpu_worker.device import CpuStandIn
from gpu_worker.train_config import TrainConfig
from gpu_worker.train_executor import TrainingExecutor, open_job, step_answer
from gpu_worker.train_job import TrainingJob
from tests.support.torch_threads import one_thread  # noqa: F401 (fixture)

KIB = 1 << 10
STEPS = 4


def net() -> nn.Module:
    """Parameters, a buffer (BatchNorm's statistics) and an optimizer with state."""
    torch.manual_seed(7)
    return nn.Sequential(
        nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(),
        nn.Linear(32, 32), nn.ReLU(),
        nn.Linear(32, 5),
    )  # fmt: skip


def twin(cfg: TrainConfig, dev: CpuStandIn) -> TrainingJob:
    blocks = chain_of(net())
    job = TrainingJob("j", blocks, [(0, 3), (3, 5), (5, 6)], cfg, dev)
    # Gradients as on a device: `Copies` counts every copy into the arena, and the stand-in's
    # copy of a fresh gradient into its view (`fresh_grads`) is no transfer.
    job.fresh_grads = False
    return job


def data(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 5, (8,), generator=g))] * steps


class Copies(TorchFunctionMode):
    """Bytes of every `Tensor.copy_` into the arena (in) and into a slab of the host tier
    (out), from anywhere else."""

    def __init__(self, arena: torch.Tensor, job: TrainingJob) -> None:
        super().__init__()
        self.arena = arena.untyped_storage().data_ptr()
        self.slabs = {sub.slab.untyped_storage().data_ptr() for sub in job.subs}
        self.bytes_in = self.bytes_out = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.copy_:
            dst, src = args[0], args[1]
            to = dst.untyped_storage().data_ptr()
            frm = src.untyped_storage().data_ptr()
            if to == self.arena and frm != self.arena:
                self.bytes_in += dst.numel() * dst.element_size()
            elif to in self.slabs and frm not in self.slabs:
                self.bytes_out += dst.numel() * dst.element_size()
        return func(*args, **(kwargs or {}))


def copies_by_hand(job: TrainingJob, dev: CpuStandIn) -> list[tuple[int, int]]:
    """Each step's (bytes in, bytes out), its tasks run one after another at the arena's start:
    the copies the executor's copy lane makes (`plan.copies`), then the task's compute."""
    arena = dev.arena
    out = []
    for rid, (x, y) in enumerate(data(), start=1):
        seen = Copies(arena, job)
        job.begin_step(rid, x, y)
        with seen:
            for task in job.plan_step(rid):
                plan = job.copy_plan(task, 0)
                for offset, src in plan.copies:
                    arena[offset : offset + src.numel()].copy_(src)
                job.run(task, 0, plan, arena)
        job.finish_step(rid)
        out.append((seen.bytes_in, seen.bytes_out))
    return out


CONFIGS = {
    "adam": TrainConfig({"name": "adam", "lr": 0.01}, seed=1),
    "sgd-clip-accumulate": TrainConfig(
        {"name": "sgd", "lr": 0.05, "momentum": 0.9}, clip_grad_norm=0.5, accumulate=2, seed=2
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_steps_answer_reports_the_bytes_its_copies_moved(name: str) -> None:
    cfg = CONFIGS[name]
    alone = CpuStandIn(64 * KIB)
    by_hand = copies_by_hand(twin(cfg, alone), alone)
    assert all(b_in > 0 and b_out > 0 for b_in, b_out in by_hand), by_hand
    dev = CpuStandIn(64 * KIB)
    job = twin(cfg, dev)
    with TrainingExecutor(dev) as ex:
        ex.open(job)
        results = [f.result(timeout=120) for f in [ex.submit("j", x, y) for x, y in data()]]
    msg = p.TrainStep(id=1, job="j", seq=1)
    answers = [step_answer(msg, r) for r in results]
    assert [(a.bytes_in, a.bytes_out) for a in answers] == by_hand
    # The answer is a valid message as it travels.
    assert p.decode(p.encode(answers[-1])) == answers[-1]


def spec(i: int) -> ModelSpec:
    return ModelSpec(
        name=f"mlp{i}",
        factory="flowmesh.examples:mlp",
        kwargs={"width": 32, "depth": 4, "in_features": 8, "out_features": 5},
        seed=i,
    )


def mlp_job(name: str, dev: CpuStandIn, i: int) -> TrainingJob:
    cfg = TrainConfig({"name": "adam", "lr": 0.01}, seed=i)
    return open_job(name, spec(i), cfg, dev, batch=8, target_bytes=32 * KIB)


def test_a_job_alone_never_waits_for_memory_and_jobs_that_share_it_do() -> None:
    # A budget of about one task: the next task of a job is given the bytes its predecessor
    # freed when that one's compute was ordered, so a job alone never waits as a head.
    budget = mlp_job("probe", CpuStandIn(1 << 20), 0).largest_task()
    dev = CpuStandIn(budget)
    alone = mlp_job("a", dev, 0)
    assert alone.parts >= 3
    with TrainingExecutor(dev) as ex:
        ex.open(alone)
        solo = [f.result(timeout=120) for f in [ex.submit("a", x, y) for x, y in data()]]
    assert [r.metrics["memory_wait_s"] for r in solo] == [0.0] * STEPS

    dev = CpuStandIn(budget)
    jobs = [mlp_job(n, dev, i) for i, n in enumerate("ab")]
    with TrainingExecutor(dev) as ex:
        for job in jobs:
            ex.open(job)
        futures = [ex.submit(n, x, y) for x, y in data() for n in "ab"]
        shared = [f.result(timeout=120) for f in futures]
    waits = [r.metrics["memory_wait_s"] for r in shared]
    # Each head waited while the other job's task held the only room; never longer than its
    # step took.
    assert sum(waits) > 0, waits
    assert all(0 <= r.metrics["memory_wait_s"] <= r.metrics["seconds"] for r in shared)
    answers = [step_answer(p.TrainStep(id=1, job="a", seq=1), r) for r in shared]
    assert [a.memory_wait_s for a in answers] == waits


def test_each_sub_model_reports_its_activation_policy() -> None:
    job = mlp_job("a", CpuStandIn(1 << 20), 0)
    rows = [SubModelRow(**s) for s in job.sub_model_info()]
    assert len(rows) == job.parts >= 3
    # Every sub-model but the last recomputes its forward in the backward (`plan_step`).
    assert [r.activations for r in rows] == ["recompute"] * (job.parts - 1) + ["none"]
