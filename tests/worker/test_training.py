"""The training executor in-process on a CPU stand-in: exact against plain PyTorch, memory flow
between jobs within the budget, isolation of failing jobs, checkpoints; the scheduler's rules.

Every training result is compared with `torch.testing.assert_close` (the README's exactness
rule, flowmesh/testing.py), never bit for bit, at rtol 1e-5 / atol 1e-6.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F

from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.build import build_seeded
from flowmesh.modelio.chain import chain_of
from flowmesh.modelio.inputs import declared_inputs
from flowmesh.reference import train
from flowmesh.spec import ModelSpec
from gpu_worker.device import CpuStandIn
from gpu_worker.train_checkpoint import read_meta
from gpu_worker.train_config import TrainConfig
from gpu_worker.train_executor import TrainingExecutor, open_job
from gpu_worker.train_job import StepResult, TrainingJob
from gpu_worker.train_scheduler import ANY, LOG_KEPT, FlowScheduler, Task
from tests.support.torch_threads import one_thread  # noqa: F401 (fixture)
from tests.support.train_cases import (
    CASES,
    KIB,
    LOCAL,
    MIB,
    SPECS,
    STEPS,
    Data,
    blocks_of,
    boom_net,
    build,
    close,
    data_for,
    even_ranges,
    plain_step_loop,
    seeded,
)


def flow_run(job: TrainingJob, data: Data, ex: TrainingExecutor | None = None) -> list[StepResult]:
    """All steps submitted at once (several in flight), results in order."""
    own = ex is None
    ex = ex or TrainingExecutor(job.device)
    try:
        if job.name not in ex.jobs:
            ex.open(job)
        futures = [ex.submit(job.name, x, y) for x, y in data]
        return [f.result(timeout=120) for f in futures]
    finally:
        if own:
            ex.close()


def assert_same_model(job: TrainingJob, reference: nn.Module) -> None:
    expected = reference.state_dict()
    got = job.state_dict()
    covered = [n for n in expected if n in got]
    params = {n for n, _ in reference.named_parameters()}
    assert params <= set(covered), f"parameters missing from the job: {params - set(covered)}"
    for n in covered:
        close(got[n], expected[n], f"tensor {n} after training")


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh-grads", "arena-grads"])
@pytest.mark.parametrize(
    ("kind", "optimizer", "parts", "clip", "accumulate"),
    CASES,
    ids=[f"{c[0]}-{c[1]['name']}-k{c[2]}-clip{c[3]}-acc{c[4]}" for c in CASES],
)
def test_steps_match_plain_pytorch(
    kind: str,
    optimizer: dict[str, Any],
    parts: int,
    clip: float | None,
    accumulate: int,
    fresh: bool,
) -> None:
    """`fresh`: the CPU stand-in's gradients made afresh by the backward, or a device's, into
    zeroed arena views (`TrainingJob.fresh_grads`): both give plain PyTorch's steps."""
    cfg = TrainConfig(optimizer, clip_grad_norm=clip, accumulate=accumulate, seed=21)
    data = data_for(kind)
    model = build(kind)
    blocks = blocks_of(kind, model)
    job = TrainingJob("job", blocks, even_ranges(len(blocks), parts), cfg, CpuStandIn(8 * MIB))
    assert job.fresh_grads  # the stand-in's default
    job.fresh_grads = fresh
    if kind == "gpt2":  # the tied weight is owned by the first sub-model, borrowed by the last
        assert job.tensors["transformer.wte.weight"].owner == 0
        assert "transformer.wte.weight" in job.subs[-1].borrowed
    results = flow_run(job, data)

    reference = build(kind)
    expected = plain_step_loop(reference, cfg, data)
    close([r.loss for r in results], expected, "per-step losses")
    assert [r.step for r in results] == list(range(1, STEPS + 1))
    assert_same_model(job, reference)
    if clip is not None:  # the clip was really exercised
        assert any(r.metrics["grad_norm"] > clip for r in results)
    if kind == "unused":
        close(job.state_dict()["2.spare.weight"], build(kind).state_dict()["2.spare.weight"])


# -- memory flow -----------------------------------------------------------------------------


def mlp_spec(i: int) -> ModelSpec:
    return ModelSpec(
        name=f"mlp{i}",
        factory="flowmesh.examples:mlp",
        kwargs={"width": 56, "depth": 5, "in_features": 8, "out_features": 5},
        seed=30 + i,
    )


def test_memory_flow_interleaves_jobs_within_budget() -> None:
    budget = 150 * KIB
    cfgs = [
        TrainConfig({"name": "adam", "lr": 0.01}, seed=1),
        TrainConfig({"name": "adamw", "lr": 0.01, "weight_decay": 0.01}, seed=2),
        TrainConfig({"name": "sgd", "lr": 0.05, "momentum": 0.9}, accumulate=2, seed=3),
        TrainConfig({"name": "adam", "lr": 0.01}, clip_grad_norm=0.5, seed=4),
    ]
    steps = 6
    data = [data_for("mlp", steps, seed=i) for i in range(4)]

    def jobs(dev: CpuStandIn) -> list[TrainingJob]:
        return [
            open_job(f"j{i}", mlp_spec(i), cfg, dev, batch=8, target_bytes=60 * KIB)
            for i, cfg in enumerate(cfgs)
        ]

    solo = []
    for i, job in enumerate(jobs(CpuStandIn(budget))):
        solo.append(([r.loss for r in flow_run(job, data[i])], job.state_dict()))

    dev = CpuStandIn(budget)
    together = jobs(dev)
    for job in together:  # gradients in the arena too, as on a device (`fresh_grads`)
        job.fresh_grads = False
    footprints = [j.footprint() for j in together]
    assert all(f > budget for f in footprints), "each job alone must exceed the budget"
    assert sum(footprints) >= 3 * budget
    assert all(j.parts >= 3 for j in together)

    # Where a task's tensors really live while it computes: inside the arena, not elsewhere.
    lo = dev.arena.untyped_storage().data_ptr()
    hi = lo + budget
    seen: list[bool] = []

    def in_arena(t: torch.Tensor) -> bool:
        return lo <= t.data_ptr() < hi

    for job in together:
        for sub in job.subs:
            for module in sub.modules:
                module.register_forward_pre_hook(
                    lambda m, _: seen.extend(in_arena(p) for p in m.parameters(recurse=False))
                )
            if sub.optimizer is not None:
                sub.optimizer.register_step_pre_hook(
                    lambda opt, *_: seen.extend(
                        in_arena(t)
                        for g in opt.param_groups
                        for p in g["params"]
                        for t in [
                            *([p.grad] if p.grad is not None else []),
                            *(v for v in opt.state[p].values() if v.dim()),
                        ]
                    )
                )

    with TrainingExecutor(dev) as ex:
        for job in together:
            ex.open(job)
        futures = {
            job.name: [ex.submit(job.name, x, y) for x, y in data[i]]
            for i, job in enumerate(together)
        }
        results = {n: [f.result(timeout=120) for f in fs] for n, fs in futures.items()}
        log = list(ex.sched.log)
        stats = ex.stats()

    for i, job in enumerate(together):
        close([r.loss for r in results[job.name]], solo[i][0], f"{job.name} losses vs solo")
        for n, t in job.state_dict().items():
            close(t, solo[i][1][n], f"{job.name} {n} vs solo")
    assert seen and all(seen), "a task computed on tensors outside the arena"
    assert stats["reserved_peak"] <= budget
    assert stats["resident_peak"] <= budget, "two tasks used the same bytes at once"
    assert stats["resident_peak"] > budget // 2, "the arena was never under pressure"
    assert stats["reserved_bytes"] == 0 and stats["resident_bytes"] == 0
    # Interleaving: computes alternate between jobs, and several jobs hold memory at once.
    runs = [label.split("#")[0] for event, label in log if event == "run"]
    switches = sum(a != b for a, b in pairwise(runs))
    assert switches > 4 * steps, f"computes barely interleave: {switches} switches"
    # ... and the counter a worker reports in its heartbeat says the same.
    assert stats["job_switches"] == switches and stats["tasks_started"] == len(runs)
    holding: dict[str, str] = {}
    running: dict[str, str] = {}
    most = prefetched = 0
    for event, label in log:
        job = label.split("#")[0]
        if event == "admit":
            holding[label] = job
            prefetched += job in running  # copied in while its job's previous task computes
        elif event == "run":
            running[job] = label
        elif event in ("done", "drop"):
            holding.pop(label, None)
            running.pop(job, None)
        most = max(most, len(set(holding.values())))
    assert most >= 3, f"at most {most} jobs held memory at once"
    assert prefetched > 0, "no task was brought in while its predecessor computed"


def test_a_held_range_leaves_memory_flow_the_rest_and_refuses_what_would_not_fit() -> None:
    """A pipelined stage's range (`TrainingExecutor.hold`) at the arena's top: a memory-flow
    job beside it trains exactly, its tasks' ranges all below it; a hold that would leave an
    open job too little for its largest task is refused (TOO_BIG, naming the job), and so is a
    job opened over what the hold leaves; released, the bytes serve tasks again."""
    cfg = TrainConfig({"name": "adam", "lr": 0.01}, seed=5)
    budget = 256 * KIB
    dev = CpuStandIn(budget)
    data = data_for("mlp", 4)
    with TrainingExecutor(dev) as ex:
        job = local_job("j", build_seeded(SPECS["mlp"]), cfg, dev, 3)
        need = job.largest_task()
        ex.open(job)
        with pytest.raises(FlowmeshError) as refused:
            ex.hold("stage 0 of job 'p'", budget - need + 4096, 5.0)
        assert refused.value.code == Code.TOO_BIG and "job 'j'" in refused.value.reason
        held = ex.hold("stage 0 of job 'p'", budget - need - 4096, 5.0)
        assert held.offset + held.size == budget and ex.memory.held_bytes == held.size
        given: list[Any] = []
        alloc = ex.memory.alloc_training

        def recorded(nbytes: int) -> Any:
            ext = alloc(nbytes)
            given.append(ext)
            return ext

        ex.memory.alloc_training = recorded  # type: ignore[method-assign]
        results = flow_run(job, data, ex)
        reference = build_seeded(SPECS["mlp"])
        close([r.loss for r in results], plain_step_loop(reference, cfg, data), "beside a hold")
        assert given and all(e.offset + e.size <= held.offset for e in given if e is not None)
        whole = local_job("whole", build_seeded(SPECS["mlp"]), cfg, dev, 1)
        assert whole.largest_task() > budget - held.size
        with pytest.raises(FlowmeshError, match="pipelined stages hold") as over:
            ex.open(whole)
        assert over.value.code == Code.TOO_BIG
        ex.release(held)
        assert ex.memory.held_bytes == 0
        ex.open(whole)
        assert ex.step("whole", *data[0]).step == 1


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh-grads", "arena-grads"])
def test_a_sparse_embedding_gradient_trains_as_plain_pytorch(fresh: bool) -> None:
    """`nn.Embedding(sparse=True)` gives a sparse gradient: made afresh on the stand-in it is
    made dense, as a device's zeroed view accumulates it (copied into its view, with two
    micro-batches, and stepped), and both equal plain PyTorch's SGD on the sparse one."""

    def model() -> nn.Module:
        torch.manual_seed(3)
        return nn.Sequential(nn.Embedding(20, 8, sparse=True), nn.Flatten(), nn.Linear(24, 5))

    cfg = TrainConfig({"name": "sgd", "lr": 0.1}, accumulate=2, seed=5)
    g = torch.Generator().manual_seed(4)
    data = [
        (torch.randint(0, 20, (8, 3), generator=g), torch.randint(0, 5, (8,), generator=g))
        for _ in range(4)
    ]
    dev = CpuStandIn(MIB)
    job = local_job("sparse", model(), cfg, dev, 2)
    job.fresh_grads = fresh
    results = flow_run(job, data)
    reference = model()
    close([r.loss for r in results], plain_step_loop(reference, cfg, data), "sparse losses")
    assert_same_model(job, reference)


# -- isolation -------------------------------------------------------------------------------


def local_job(name: str, model: nn.Module, cfg: TrainConfig, dev: CpuStandIn, parts: int = 2):
    blocks = chain_of(model)
    return TrainingJob(name, blocks, even_ranges(len(blocks), parts), cfg, dev, inputs=None)


def test_failing_jobs_are_isolated() -> None:
    cfg = TrainConfig({"name": "adam", "lr": 0.01}, seed=5)
    steps, bad = 6, 3
    data = data_for("mlp", steps, seed=9)
    boom_data = [(x.clone(), y) for x, y in data]
    boom_data[bad][0][0, 0] = 12345.0
    nan_data = [(x.clone(), y) for x, y in data]
    nan_data[bad][0][1, 2] = float("nan")
    wrong_data = [(x if i != bad else x[:, :6], y) for i, (x, y) in enumerate(data)]
    target_data = [(x, y if i != bad else y + 10) for i, (x, y) in enumerate(data)]

    budget = 96 * KIB
    dev = CpuStandIn(budget)
    mlp = build_seeded(SPECS["mlp"])
    jobs = {
        "healthy": (local_job("healthy", build_seeded(SPECS["mlp"]), cfg, dev, 3), data),
        "boom": (local_job("boom", seeded(boom_net, 7), cfg, dev, 3), boom_data),
        "nan": (local_job("nan", build_seeded(SPECS["mlp"]), cfg, dev, 2), nan_data),
        "targets": (local_job("targets", build_seeded(SPECS["mlp"]), cfg, dev, 2), target_data),
    }
    inputs = declared_inputs(SPECS["mlp"], mlp)
    blocks = chain_of(mlp)
    jobs["shape"] = (
        TrainingJob("shape", blocks, even_ranges(len(blocks), 2), cfg, dev, inputs=inputs),
        wrong_data,
    )
    with TrainingExecutor(dev) as ex:
        for job, _ in jobs.values():
            ex.open(job)
        futures = {n: [ex.submit(n, x, y) for x, y in d] for n, (_, d) in jobs.items()}
        outcomes: dict[str, list[Any]] = {}
        for n, fs in futures.items():
            outcomes[n] = []
            for f in fs:
                try:
                    outcomes[n].append(f.result(timeout=120).loss)
                except FlowmeshError as exc:
                    outcomes[n].append(exc)
        stats = ex.stats()

    codes = {
        "boom": (Code.MODEL_ERROR, "boom: the model's own code failed"),
        "nan": (Code.MODEL_ERROR, "the loss is nan"),
        "shape": (Code.BAD_REQUEST, "input 'x'"),
        "targets": (Code.BAD_REQUEST, "loss 'cross_entropy' failed"),
    }
    for n, (code, words) in codes.items():
        err = outcomes[n][bad]
        assert isinstance(err, FlowmeshError), f"{n}: step {bad} did not fail"
        assert err.code == code and words in err.reason, (n, err)
        assert all(not isinstance(v, Exception) for i, v in enumerate(outcomes[n]) if i != bad)
    assert stats["reserved_bytes"] == 0 and stats["resident_bytes"] == 0
    # the wrong shape is refused when submitted: three steps failed on the device
    assert stats["resident_peak"] <= budget and stats["step_errors"] == 3

    # The healthy job is its solo run; a failed step leaves no trace on the others (no BN,
    # no dropout): they equal solo runs that skip it.
    for n, (job, d) in jobs.items():
        kept = d if n == "healthy" else [b for i, b in enumerate(d) if i != bad]
        make = (lambda: seeded(boom_net, 7)) if n == "boom" else lambda: build_seeded(SPECS["mlp"])
        solo_job = local_job(n, make(), cfg, CpuStandIn(budget), job.parts)
        expected = [r.loss for r in flow_run(solo_job, kept)]
        close([v for v in outcomes[n] if not isinstance(v, Exception)], expected, n)
        for name, t in job.state_dict().items():
            close(t, solo_job.state_dict()[name], f"{n} {name}")


def test_failure_after_a_partial_update_breaks_only_that_job() -> None:
    # Recompute forced: the failure is the recompute's, in a backward after an update.
    cfg = TrainConfig({"name": "sgd", "lr": 0.05}, seed=5, activations="recompute")
    dev = CpuStandIn(MIB)
    job = local_job("half", seeded(lambda: boom_net(in_backward=True), 7), cfg, dev, 3)
    other = local_job("other", build_seeded(SPECS["mlp"]), cfg, dev, 3)
    x, y = data_for("mlp", 1)[0]
    poisoned = x.clone()
    poisoned[0, 0] = 12345.0
    with TrainingExecutor(dev) as ex:
        ex.open(job)
        ex.open(other)
        ex.step("half", x, y)
        with pytest.raises(FlowmeshError) as info:
            ex.step("half", poisoned, y)  # forward passes, the recompute raises after an update
        assert info.value.code == Code.MODEL_ERROR
        with pytest.raises(FlowmeshError) as broken:
            ex.step("half", x, y)
        assert broken.value.code == Code.BAD_REQUEST and "broken" in broken.value.reason
        assert ex.step("other", x, y).step == 1
        assert ex.stats()["reserved_bytes"] == 0


def test_nonfinite_loss_is_reported_when_not_stopping() -> None:
    cfg = TrainConfig({"name": "sgd", "lr": 0.05}, seed=5, stop_on_nonfinite=False)
    dev = CpuStandIn(MIB)
    job = local_job("j", build_seeded(SPECS["mlp"]), cfg, dev, 2)
    x, y = data_for("mlp", 1)[0]
    x = x.clone()
    x[0, 0] = float("inf")
    with TrainingExecutor(dev) as ex:
        ex.open(job)
        result = ex.step("j", x, y)
    assert result.metrics["nonfinite"] == 1.0  # applied, as plain PyTorch would


def test_closing_a_job_fails_its_queue_and_frees_its_memory() -> None:
    cfg = TrainConfig({"name": "adam", "lr": 0.01}, seed=5)
    dev = CpuStandIn(64 * KIB)
    data = data_for("mlp", 8)
    with TrainingExecutor(dev) as ex:
        for name in ("stay", "go"):
            ex.open(local_job(name, build_seeded(SPECS["mlp"]), cfg, dev, 3))
        stay = [ex.submit("stay", x, y) for x, y in data]
        go = [ex.submit("go", x, y) for x, y in data]
        ex.close_job("go")
        assert [f.result(timeout=120).step for f in stay] == list(range(1, 9))
        failed = [f for f in go if f.exception(timeout=120) is not None]
        assert failed and all(f.exception().code == Code.BAD_REQUEST for f in failed)
        assert "go" not in ex.stats()["jobs"] and ex.stats()["jobs"]["stay"]["last_loss"]
        assert ex.stats()["reserved_bytes"] == 0 and ex.stats()["resident_bytes"] == 0
        assert ex.submit("go", *data[0]).exception().code == Code.MODEL_NOT_FOUND


def test_job_larger_than_any_task_fits_and_a_task_over_the_budget_is_refused() -> None:
    cfg = TrainConfig({"name": "adam", "lr": 0.01})
    job = local_job("big", build_seeded(SPECS["mlp"]), cfg, CpuStandIn(4 * KIB), 1)
    with TrainingExecutor(job.device) as ex, pytest.raises(FlowmeshError) as info:
        ex.open(job)
    assert info.value.code == Code.TOO_BIG


# -- checkpoints -----------------------------------------------------------------------------


def test_checkpoint_resume_continues_the_same_run(tmp_path: Path) -> None:
    cfg = TrainConfig({"name": "adam", "lr": 0.01}, seed=8)
    data = data_for("mixed", STEPS, seed=4)
    half = STEPS // 2
    make, seed = LOCAL["mixed"]

    dev = CpuStandIn(MIB)
    whole = local_job("run", seeded(make, seed), cfg, dev, 2)
    with TrainingExecutor(dev) as ex:
        ex.open(whole)
        first = [ex.submit("run", x, y) for x, y in data[:half]]
        saved = ex.save("run", tmp_path / "ckpt")  # ordered after the first half
        rest = [ex.submit("run", x, y) for x, y in data[half:]]
        uninterrupted = [f.result(timeout=120).loss for f in first + rest]
        assert saved.result(timeout=60) == tmp_path / "ckpt"

    meta = read_meta(tmp_path / "ckpt")
    assert meta["step"] == half and meta["config"] == cfg.to_dict()
    assert (tmp_path / "ckpt" / "state.safetensors").is_file()

    # A fresh job of the same model, cut differently, from the checkpoint (other init seed:
    # everything must come from the file).
    dev2 = CpuStandIn(MIB)
    resumed = local_job("again", seeded(make, seed + 100), cfg, dev2, 3)
    from gpu_worker.train_checkpoint import load_checkpoint

    assert load_checkpoint(resumed, tmp_path / "ckpt") == half
    results = flow_run(resumed, data[half:])
    close([r.loss for r in results], uninterrupted[half:], "losses after resuming")
    assert results[-1].step == STEPS
    for n, t in resumed.state_dict().items():
        close(t, whole.state_dict()[n], f"{n} after resuming")


@pytest.mark.parametrize(
    "kind, parts, computed",
    [
        # One sub-model: the first step's one task computes; the next reads what it wrote.
        ("mlp", 1, 1),
        # Forward 0, forward 1, last 2 and backward 1 compute; backward 0 copies in the tied
        # weight's gradient that last 2 wrote back to sub-model 0's slab, so it waits.
        ("gpt2", 3, 4),
    ],
)
def test_held_write_backs_hold_the_answer_and_every_reader_of_what_they_write(
    tmp_path: Path, kind: str, parts: int, computed: int
) -> None:
    """Write-backs to the host tier run on the executor's write lane, after the compute: with
    that lane held, the tasks of a step still compute, but its answer, the next tasks' copies
    of what it wrote (its updated parameters, a tied weight's gradient in its owner's slab)
    and a checkpoint all wait for them; let go, everything equals plain PyTorch."""
    cfg = TrainConfig({"name": "adam", "lr": 0.01}, seed=21)
    data = data_for(kind)
    model = build(kind)
    blocks = blocks_of(kind, model)
    dev = CpuStandIn(8 * MIB)
    job = TrainingJob("job", blocks, even_ranges(len(blocks), parts), cfg, dev)
    held = threading.Event()
    with TrainingExecutor(dev) as ex:
        ex.open(job)
        assert ex._write is not None
        ex._write.submit(held.wait)  # the lane's one thread: every write-back queues behind
        try:
            steps = [ex.submit("job", x, y) for x, y in data]
            saved = ex.save("job", tmp_path / "ckpt")
            deadline = time.monotonic() + 60
            while ex.counters["tasks"] < computed and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)  # what would run next if nothing waited for the write-backs
            assert ex.counters["tasks"] == computed
            assert not any(f.done() for f in steps) and not saved.done()
        finally:
            held.set()
        results = [f.result(timeout=120) for f in steps]
        assert saved.result(timeout=60) == tmp_path / "ckpt"
        assert ex.stats()["resident_bytes"] == 0

    reference = build(kind)
    close([r.loss for r in results], plain_step_loop(reference, cfg, data), "per-step losses")
    assert_same_model(job, reference)
    assert read_meta(tmp_path / "ckpt")["step"] == len(data)
    on_disk = load_file(str(tmp_path / "ckpt" / "state.safetensors"))
    for n, t in job.state_dict().items():
        if n in on_disk:
            close(on_disk[n], t, f"{n} in the checkpoint")


def test_a_step_whose_last_task_writes_nothing_is_answered_after_the_earlier_write_backs(
    tmp_path: Path,
) -> None:
    """Sub-model 0 holds no tensor (a Flatten), so the step's last task (its backward) writes
    nothing back: the step is still answered only once sub-model 1's update is in the host
    tier (the write lane is first in first out)."""

    def make() -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 5))

    cfg = TrainConfig({"name": "adam", "lr": 0.01}, seed=3)
    data = data_for("mlp", 4)
    dev = CpuStandIn(MIB)
    blocks = chain_of(seeded(make, 7))
    job = TrainingJob("job", blocks, [(0, 1), (1, len(blocks))], cfg, dev)
    assert job.subs[0].owned == []
    held = threading.Event()
    with TrainingExecutor(dev) as ex:
        ex.open(job)
        ex._write.submit(held.wait)
        try:
            steps = [ex.submit("job", x, y) for x, y in data]
            deadline = time.monotonic() + 60
            # Step 1's forward 0, last 1 and backward 0, and step 2's forward 0 (it reads
            # nothing step 1 wrote back); step 2's last 1 waits for step 1's update of 1.
            while ex.counters["tasks"] < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)
            assert ex.counters["tasks"] == 4 and not steps[0].done()
        finally:
            held.set()
        results = [f.result(timeout=120) for f in steps]
    reference = seeded(make, 7)
    close([r.loss for r in results], plain_step_loop(reference, cfg, data), "per-step losses")
    assert_same_model(job, reference)


# -- the scheduler's rules, exactly ------------------------------------------------------------


def task(job: str, n: int, kind: str = "t", reads: str = "", writes: str = "") -> Task:
    return Task(
        job, 1, kind, n, frozenset(reads.split()), frozenset(writes.split()), sub=n, micro=0
    )


class Pool:
    """A fake allocator: a byte counter."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.used = capacity, 0

    def __call__(self, t: Task) -> bool:
        if self.used + t.nbytes > self.capacity:
            return False
        self.used += t.nbytes
        return True


def test_scheduler_admits_in_order_heads_first_and_prefetches_one() -> None:
    s = FlowScheduler(prefetch=1)
    for j in ("a", "b"):
        s.add_job(j)
    s.push([task("a", 4), task("a", 3), task("a", 2)])
    s.push([task("b", 5), task("b", 1)])
    pool = Pool(12)
    got = [t.label for t in s.admit(pool)]
    # heads a4, b5 first; then the look-aheads, oldest candidate first: a3 (a candidate since
    # a4 was admitted) fits, b1 then does not; a2 is beyond a's window of two
    assert got == ["a#1:t4.0", "b#1:t5.0", "a#1:t3.0"]
    assert pool.used == 12
    a4 = s.chains["a"][0]
    s.copied(a4)
    assert s.next_runnable() is a4
    s.started(a4)
    s.finished(a4)
    pool.used -= 4
    assert [t.label for t in s.admit(pool)] == ["b#1:t1.0", "a#1:t2.0"]


def test_scheduler_keeps_only_its_last_decisions() -> None:
    """A worker trains for days: the decision log is the last LOG_KEPT, not every one made."""
    s = FlowScheduler(prefetch=0)
    s.add_job("a")
    pool = Pool(10)
    for _ in range(LOG_KEPT // 3 + 1):  # three decisions each: admit, run, done
        s.push([task("a", 1)])
        (t,) = s.admit(pool)
        s.copied(t)
        s.started(t)
        s.finished(t)
        pool.used -= t.nbytes
    # 3 x (LOG_KEPT // 3 + 1) made: the first task's admit and run are the two forgotten
    assert len(s.log) == LOG_KEPT
    assert [e for e, _ in list(s.log)[:4]] == ["done", "admit", "run", "done"]


def test_scheduler_holds_a_prefetch_that_reads_what_an_earlier_task_writes() -> None:
    s = FlowScheduler(prefetch=2)
    s.add_job("a")
    first = task("a", 1, reads="P:0", writes="P:0 G:0")
    s.push([first, task("a", 2, reads="P:1", writes="P:1"), task("a", 3, reads="P:0")])
    pool = Pool(100)
    # the third reads P:0, which the unfinished first writes: no stale prefetch
    assert [t.sub for t in s.admit(pool)] == [1, 2]
    s.copied(first)
    s.started(first)
    s.finished(first)
    assert [t.sub for t in s.admit(pool)] == [3]
    s.push([task("a", 0, kind="save", reads=ANY)])  # a checkpoint reads everything
    assert s.admit(pool) == []  # the second task, unfinished, writes P:1


def test_scheduler_stops_backfilling_around_a_starved_task() -> None:
    s = FlowScheduler(prefetch=0, max_skips=2)
    for j in ("big", "s1", "s2"):
        s.add_job(j)
    s.push([task("big", 8)])
    s.push([task("s1", 3) for _ in range(5)])
    s.push([task("s2", 3) for _ in range(5)])
    pool = Pool(10)
    pool.used = 4  # something else holds memory
    admitted = []
    for _ in range(4):
        got = s.admit(pool)
        admitted += [t.job for t in got]
        for t in got:  # each small task finishes at once and returns its bytes
            s.copied(t)
            s.started(t)
            s.finished(t)
            pool.used -= t.nbytes
    # two small tasks back-fill while the big one is skipped; past max_skips, nothing more
    assert admitted == ["s1", "s2"], "small jobs kept back-filling past the starved one"
    pool.used = 0
    assert [t.job for t in s.admit(pool)] == ["big"]


def test_scheduler_drops_a_failed_request_and_returns_held_memory() -> None:
    s = FlowScheduler(prefetch=1)
    s.add_job("a")
    s.push([task("a", 2), task("a", 2)])
    nxt = Task("a", 2, "t", 2)
    s.push([nxt])
    s.admit(Pool(100))
    head = s.chains["a"][0]
    s.copied(head)
    s.started(head)
    held = s.drop_request("a", 1)
    s.finished(head)
    assert [t.sub for t in held] == [2] and list(s.chains["a"]) == [nxt]
    assert s.candidates() == [nxt]


# -- evaluation --------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "parts", "accumulate"), [("mixed", 3, 2), ("gpt2", 2, 1)])
def test_eval_matches_plain_pytorch_and_leaves_later_steps_unchanged(
    kind: str, parts: int, accumulate: int
) -> None:
    """Dropout, BatchNorm and a buffer that moves in train mode: an eval between steps must use
    eval mode, update nothing and not advance the job's RNG stream."""
    cfg = TrainConfig({"name": "adam", "lr": 0.01}, accumulate=accumulate, seed=21)
    data = data_for(kind, 6)
    held_out = data_for(kind, 1, seed=99)[0]

    def job_of(name: str) -> TrainingJob:
        model = build(kind)
        blocks = blocks_of(kind, model)
        return TrainingJob(name, blocks, even_ranges(len(blocks), parts), cfg, CpuStandIn(8 * MIB))

    with_eval, without = job_of("with"), job_of("without")
    with TrainingExecutor(with_eval.device) as ex:
        ex.open(with_eval)
        futures = [ex.submit("with", x, y) for x, y in data[:3]]
        evaluated = ex.evaluate("with", *held_out)  # queued behind the three steps
        futures += [ex.submit("with", x, y) for x, y in data[3:]]
        steps = [f.result(timeout=120) for f in futures]
        ev = evaluated.result(timeout=120)
    plain = [r.loss for r in flow_run(without, data)]

    reference = build(kind)
    plain_step_loop(reference, cfg, data[:3])
    reference.eval()
    with torch.no_grad():
        out = reference(held_out[0])
        logits = out.logits if kind == "gpt2" else out
        expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), held_out[1].reshape(-1))
    assert ev.step == 3
    close(ev.loss, expected.item(), "eval loss against plain PyTorch")
    right = (logits.argmax(-1) == held_out[1]).float().mean().item()
    close(ev.metrics["accuracy"], right, "eval accuracy")
    close([r.loss for r in steps], plain, "steps around an eval vs a run without it")
    for name, t in without.state_dict().items():
        close(with_eval.state_dict()[name], t, f"{name} (buffers included) after the eval")


# -- loss factories ----------------------------------------------------------------------------

SMOOTHED = {"factory": "flowmesh.losses:label_smoothing", "kwargs": {"eps": 0.2}}


@pytest.mark.parametrize("loss", ["flowmesh.losses:label_smoothing", SMOOTHED])
def test_a_loss_factory_trains_like_plain_pytorch(loss: Any) -> None:
    """A factory from the allow-list (flowmesh.losses is allowed on every worker), with and
    without kwargs, through three sub-models of the example MLP with clipping."""
    cfg = TrainConfig({"name": "adamw", "lr": 0.01}, loss=loss, clip_grad_norm=0.5, seed=3)
    eps = 0.2 if isinstance(loss, dict) else 0.1
    data = data_for("mlp")
    model = build("mlp")
    blocks = blocks_of("mlp", model)
    job = TrainingJob("smooth", blocks, even_ranges(len(blocks), 3), cfg, CpuStandIn(MIB))
    results = flow_run(job, data)

    reference = build("mlp")
    expected = train(
        reference,
        cfg.optimizer,
        data,
        loss=lambda out, y: F.cross_entropy(out, y, label_smoothing=eps),
        clip=0.5,
    )
    close([r.loss for r in results], expected, "per-step losses with label smoothing")
    assert_same_model(job, reference)


def test_mse_and_huber_losses_on_regression_targets() -> None:
    g = torch.Generator().manual_seed(9)
    data = [(torch.randn(8, 8, generator=g), 3 * torch.randn(8, 5, generator=g)) for _ in range(6)]
    for loss, fn in [
        ("mse", F.mse_loss),
        ({"factory": "flowmesh.losses:huber", "kwargs": {"delta": 0.5}}, None),
    ]:
        cfg = TrainConfig({"name": "sgd", "lr": 0.05, "momentum": 0.9}, loss=loss)
        model = build("mlp")
        blocks = blocks_of("mlp", model)
        job = TrainingJob("reg", blocks, even_ranges(len(blocks), 2), cfg, CpuStandIn(MIB))
        results = flow_run(job, data)
        reference = build("mlp")
        loss_fn = fn if fn is not None else partial(F.huber_loss, delta=0.5)
        expected = train(reference, cfg.optimizer, data, loss=loss_fn)
        close([r.loss for r in results], expected, f"per-step losses with {loss}")


@pytest.mark.parametrize(
    ("loss", "code", "says"),
    [
        ("json:loads", Code.NOT_ALLOWED, "the worker refused loss factory 'json:loads'"),
        ("tests.worker.test_training:dropout_net", Code.NOT_ALLOWED, "not in the worker's"),
        ("hinge", Code.BAD_REQUEST, "expected one of cross_entropy, mse"),
        ({"factory": "flowmesh.losses:label_smoothing", "extra": 1}, Code.BAD_REQUEST, "nothing"),
        ({"factory": "flowmesh.losses:label_smoothing", "kwargs": {"eps": 2}}, Code.BAD_REQUEST,
         "eps must be a number in [0, 1)"),
        ({"factory": "flowmesh.losses:label_smoothing", "kwargs": {"bad": 1}}, Code.BAD_REQUEST,
         "unexpected keyword argument"),
        ("flowmesh.losses:missing", Code.BAD_REQUEST, "is not a callable"),
        ("flowmesh.losses:Loss", Code.BAD_REQUEST, "failed on the worker"),
    ],
)  # fmt: skip
def test_a_refused_or_broken_loss_fails_the_open(loss: Any, code: Code, says: str) -> None:
    model = build("mlp")
    blocks = blocks_of("mlp", model)
    with pytest.raises(FlowmeshError) as info:
        cfg = TrainConfig({"name": "adam", "lr": 0.01}, loss=loss)
        TrainingJob("refused", blocks, [(0, len(blocks))], cfg, CpuStandIn(MIB))
    assert info.value.code == code and says in info.value.reason, info.value.reason


def test_a_loss_that_returns_no_scalar_fails_the_step_alone(tmp_path: Path) -> None:
    """A worker's own --allow admits test modules; a loss returning per-row values is a clear
    error of that step, and the job keeps training afterwards."""
    loss = {"factory": "tests.worker.test_training:per_row_loss", "kwargs": {}}
    cfg = TrainConfig({"name": "adam", "lr": 0.01}, loss=loss)
    model = build("mlp")
    blocks = blocks_of("mlp", model)
    job = TrainingJob(
        "rows", blocks, even_ranges(len(blocks), 2), cfg, CpuStandIn(MIB),
        allow=("flowmesh.examples", "tests.worker.test_training"),
    )  # fmt: skip
    with TrainingExecutor(job.device) as ex:
        ex.open(job)
        with pytest.raises(FlowmeshError) as info:
            ex.step("rows", *data_for("mlp", 1)[0], timeout=60)
    assert info.value.code == Code.MODEL_ERROR
    assert "returned a torch.float32 tensor of shape (8,)" in info.value.reason


def per_row_loss() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return lambda out, y: F.cross_entropy(out, y, reduction="none")


def test_a_checkpoint_keeps_the_loss_and_resumes_with_it(tmp_path: Path) -> None:
    from gpu_worker.train_checkpoint import load_checkpoint
    from gpu_worker.train_executor import config_from

    cfg = TrainConfig({"name": "adam", "lr": 0.01}, loss=SMOOTHED, seed=2)
    data = data_for("mlp", 8, seed=6)
    model = build("mlp")
    blocks = blocks_of("mlp", model)
    whole = TrainingJob("run", blocks, even_ranges(len(blocks), 2), cfg, CpuStandIn(MIB))
    with TrainingExecutor(whole.device) as ex:
        ex.open(whole)
        first = [ex.submit("run", x, y) for x, y in data[:4]]
        saved = ex.save("run", tmp_path / "ckpt")
        rest = [ex.submit("run", x, y) for x, y in data[4:]]
        uninterrupted = [f.result(timeout=120).loss for f in first + rest]
        saved.result(timeout=60)

    meta = read_meta(tmp_path / "ckpt")
    assert meta["config"]["loss"] == SMOOTHED
    again_cfg = config_from(meta)  # what a resume without a configuration uses
    assert again_cfg.loss == SMOOTHED
    blocks2 = blocks_of("mlp", build("mlp"))
    resumed = TrainingJob("again", blocks2, even_ranges(len(blocks2), 3), again_cfg,
                          CpuStandIn(MIB))  # fmt: skip
    assert load_checkpoint(resumed, tmp_path / "ckpt") == 4
    close([r.loss for r in flow_run(resumed, data[4:])], uninterrupted[4:], "after resuming")

    other = TrainingJob("plain-ce", blocks_of("mlp", build("mlp")), [(0, len(blocks2))],
                        TrainConfig({"name": "adam", "lr": 0.01}), CpuStandIn(MIB))  # fmt: skip
    with pytest.raises(FlowmeshError) as info:
        load_checkpoint(other, tmp_path / "ckpt")
    assert "trained with loss" in info.value.reason
