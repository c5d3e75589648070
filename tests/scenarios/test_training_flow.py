"""Memory flow and exactness through an in-process mesh (tests/support/inproc.py).

- Memory flow: four jobs, each larger than the worker's training bytes and together more than
  three times them, train at once on one worker; status sampled while they train shows their
  sub-model tasks interleaving and the worker's resident training bytes within its training
  bytes; every job's losses equal its solo run in plain PyTorch.
- Exactness: a tiny GPT with dropout (AdamW), a small ResNet with BatchNorm (SGD + momentum,
  gradient clipping) and Hugging Face GPT-2 with tied weights (Adam, accumulate=2), several
  sub-models each: per-step losses and the checkpointed parameters equal a plain PyTorch loop.

Tolerance: `torch.testing.assert_close` at rtol 1e-5 / atol 1e-6 (the README's exactness rule).
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from flowmesh.modelio.build import build_seeded
from flowmesh.reference import train
from flowmesh.reports import JobRow, WorkerStats
from flowmesh.spec import ModelSpec
from tests.support.inproc import InProcMesh
from tests.support.mesh import fresh_stats, mesh_options
from tests.support.torch_threads import one_thread  # noqa: F401  (autouse)
from tests.support.training import saved_state

# one_thread: the workers run one intra-op thread (`threads_per_worker`); the plain loops here must
# reduce in the same order, or a gradient that is rounding noise (an attention key's bias: softmax
# ignores it) differs, and Adam scales such noise up to a full step.

KIB = 1 << 10
RTOL, ATOL = 1e-5, 1e-6
BATCH = 8
Data = list[tuple[torch.Tensor, torch.Tensor]]
ALLOW = ("flowmesh.examples", "tests.support.train_models")


def close(actual: Any, expected: Any, msg: str) -> None:
    torch.testing.assert_close(
        actual, expected, rtol=RTOL, atol=ATOL, msg=lambda detail: f"{msg}: {detail}"
    )


def plain(
    s: ModelSpec,
    optimizer: dict[str, Any],
    batches: Data,
    *,
    rng_seed: int = 0,
    clip: float | None = None,
    accumulate: int = 1,
) -> tuple[list[float], torch.nn.Module]:
    """What a PyTorch user writes: zero_grad, N micro-batches of loss/N, clip, step
    (`flowmesh.reference.train`)."""
    model = build_seeded(s, ALLOW)
    losses = train(model, optimizer, batches, clip=clip, accumulate=accumulate, rng_seed=rng_seed)
    return losses, model


def features(seed: int, steps: int, shape: tuple[int, ...], classes: int) -> Data:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(BATCH, *shape, generator=g), torch.randint(0, classes, (BATCH,), generator=g))
        for _ in range(steps)
    ]


def tokens(seed: int, steps: int, vocab: int, t: int = 6) -> Data:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, vocab, (BATCH, t), generator=g),
            torch.randint(0, vocab, (BATCH, t), generator=g),
        )
        for _ in range(steps)
    ]


# ================================================================== memory flow

FLOW_BYTES = 48 * KIB  # one worker's training bytes; each job's footprint is about 62 KiB
# Its serving budget: training borrows it too (one arena of both, FLOW_ARENA), and no job fits it.
FLOW_SERVING = 8 * KIB
FLOW_ARENA = FLOW_BYTES + FLOW_SERVING
FLOW_CHUNK = 24 * KIB
FLOW_STEPS = 10
FLOW_OPT = {"name": "adam", "lr": 0.01}


def flow_spec(seed: int) -> ModelSpec:
    return ModelSpec(
        name=f"flow-{seed}",
        factory="flowmesh.examples:mlp",
        kwargs={"width": 32, "depth": 4, "in_features": 8, "out_features": 5},
        seed=seed,
    )


def test_four_jobs_over_three_times_the_budget_flow_through_one_worker() -> None:
    jobs = {
        f"flow-{i}": (flow_spec(10 + i), features(10 + i, FLOW_STEPS, (8,), 5)) for i in range(4)
    }
    solo = {n: plain(s, FLOW_OPT, d)[0] for n, (s, d) in jobs.items()}
    samples: list[tuple[WorkerStats, list[JobRow]]] = []  # (worker's stats, job rows)
    midway: list[list[JobRow]] = []
    finished: list[list[JobRow]] = []
    with InProcMesh(
        cpu_workers=1,
        memory_budget=f"{FLOW_SERVING}B",
        train_bytes=FLOW_BYTES,
        allow=ALLOW,
    ) as mesh:
        stop = threading.Event()

        def sample() -> None:
            with mesh.client(timeout=30) as c:
                while not stop.is_set():
                    st = c.status()
                    (w,) = [w for w in st.workers if w.name == "worker-0"]
                    samples.append((w.stats, st.jobs))
                    time.sleep(0.05)  # the sampler's period, not a wait for anything

        async def run() -> tuple[dict[str, JobRow], dict[str, list[Any]]]:
            async with mesh.async_client(timeout=60) as ac:
                opened = {
                    n: await ac.train_open(
                        n,
                        s.factory,
                        kwargs=s.kwargs,
                        seed=s.seed,
                        optimizer=FLOW_OPT,
                        batch_size=BATCH,
                        chunk_bytes=FLOW_CHUNK,
                        timeout=60,
                    )
                    for n, (s, _) in jobs.items()
                }
                # Every step of every job in flight at once.
                steps = {
                    n: [asyncio.ensure_future(opened[n].step_async(x, y)) for x, y in d]
                    for n, (_, d) in jobs.items()
                }
                # Once every job has its first step back, the others are still to come: a status
                # now shows jobs part-way (the sampler thread may miss that moment on a busy box).
                for fs in steps.values():
                    await fs[0]
                midway.append((await ac.status()).jobs)
                results = {n: await asyncio.gather(*fs) for n, fs in steps.items()}
                infos = {n: j.info for n, j in opened.items()}
                finished.append((await ac.status()).jobs)  # every job at its last step, still open
                for j in opened.values():
                    await j.close()
                return infos, results

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            infos, results = asyncio.run(run())
        finally:
            stop.set()
            sampler.join(30)
        with mesh.client() as c:  # the worker's counters from a heartbeat after the last step
            last = fresh_stats(c, "worker-0")

    footprints = [i.footprint for i in infos.values()]
    assert min(footprints) > FLOW_ARENA, f"each job must be larger than the arena: {footprints}"
    assert sum(footprints) >= 3 * FLOW_ARENA, f"together at least 3x the arena: {footprints}"
    for n, rs in results.items():
        close([r.loss for r in rs], solo[n], f"job {n} vs its solo run")
        assert [r.step for r in rs] == list(range(1, FLOW_STEPS + 1)), f"{n}: steps out of order"

    assert samples, "status was never sampled"
    for st, _ in samples:
        if not st.train_budget_bytes:
            continue  # before the first heartbeat
        assert st.train_budget_bytes == FLOW_BYTES and st.arena_bytes == FLOW_ARENA
        # What the worker reports resident never exceeds its one arena.
        assert 0 <= st.train_resident_bytes + st.resident_bytes <= FLOW_ARENA, st
        assert st.train_resident_peak <= FLOW_ARENA and st.arena_peak <= FLOW_ARENA, st
    assert last.train_resident_peak > 0
    # Nothing served: training borrowed the idle serving budget besides its own bytes.
    assert last.train_borrowed_peak > 0, last
    # Interleaving: one job after the other would switch jobs 3 times; a flow switches often.
    assert last.train_job_switches > 4 * FLOW_STEPS, last
    assert last.train_tasks_admitted >= last.train_tasks_started >= last.train_tasks > 0
    # ... and status showed it while they trained: several jobs part-way at the same moment.
    sampled = [rows for _, rows in samples]
    during = [
        [j.name for j in rows if 0 < j.step < FLOW_STEPS]
        for rows in [*sampled, *midway]
        if len(rows) == 4
    ]
    assert any(len(names) >= 2 for names in during), during
    # Every job's row: worker, sub-models with block ranges and bytes, step, loss, steps/s.
    last_rows = [j for rows in [*sampled, *finished] for j in rows if j.step == FLOW_STEPS]
    assert {j.name for j in last_rows} == set(jobs)
    for j in last_rows:
        assert j.worker == "worker-0"
        assert len(j.sub_models) >= 2
        assert j.sub_models[0].blocks[0] == 0
        for a, b in zip(j.sub_models, j.sub_models[1:], strict=False):
            assert a.blocks[1] == b.blocks[0], j.sub_models
        assert all(0 < m.host_bytes < m.task_bytes <= FLOW_BYTES for m in j.sub_models)
        assert j.last_loss == results[j.name][-1].loss
        assert j.steps_per_s > 0


# ================================================================== exactness matrix

CASES: dict[str, dict[str, Any]] = {
    "gpt-dropout-adamw": {
        "spec": ModelSpec(
            name="gpt",
            factory="tests.support.train_models:dropout_gpt",
            kwargs={"vocab": 40, "d_model": 16, "n_layers": 2, "n_heads": 2},
            seed=31,
        ),
        "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.05},
        "data": lambda: tokens(31, 6, 40),
        "chunk": 64 * KIB,
    },
    "resnet-bn-sgd-clip": {
        "spec": ModelSpec(
            name="resnet",
            factory="flowmesh.examples:small_resnet",
            kwargs={"num_classes": 5, "width": 4, "blocks": [1, 1], "image": 8},
            seed=32,
        ),
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "clip": 0.3,
        "data": lambda: features(32, 6, (3, 8, 8), 5),
        "chunk": 64 * KIB,
    },
    "gpt2-tied-adam-acc2": {
        "spec": ModelSpec(
            name="gpt2",
            factory="flowmesh.examples:hf_gpt2",
            kwargs={"n_layer": 2, "n_embd": 16, "n_head": 2, "vocab_size": 40, "n_positions": 16},
            seed=33,
        ),
        # An attention key's bias has a zero gradient in exact arithmetic (softmax ignores it):
        # what it gets is rounding noise, whose bits depend on how the micro-batches' gradients
        # are summed, and Adam's default eps scales that noise up to full steps of random sign.
        # A larger eps keeps such noise far below the tolerance and real gradients training.
        "optimizer": {"name": "adam", "lr": 0.01, "eps": 1e-3},
        "accumulate": 2,
        "data": lambda: tokens(33, 6, 40),
        "chunk": 64 * KIB,
    },
}


pytestmark = mesh_options(cpu_workers=1, train_bytes=2 << 20, allow=ALLOW)


@pytest.mark.parametrize("case", list(CASES))
def test_exactness_through_the_mesh(mesh: InProcMesh, case: str, tmp_path: Path) -> None:
    c_ = CASES[case]
    s: ModelSpec = c_["spec"]
    if s.factory.endswith("hf_gpt2"):
        pytest.importorskip("transformers")
    batches: Data = c_["data"]()
    clip, acc = c_.get("clip"), c_.get("accumulate", 1)
    expected, reference = plain(s, c_["optimizer"], batches, rng_seed=21, clip=clip, accumulate=acc)
    with mesh.client(timeout=60) as c:
        job = c.train_open(
            case,
            s.factory,
            kwargs=s.kwargs,
            seed=s.seed,
            rng_seed=21,
            optimizer=c_["optimizer"],
            batch_size=BATCH,
            clip_grad_norm=clip,
            accumulate=acc,
            chunk_bytes=c_["chunk"],
            timeout=60,
        )
        assert len(job.info.sub_models) >= 2, job.info.sub_models
        futures = [job.step_async(x, y) for x, y in batches]  # all in flight
        results = [f.result(60) for f in futures]
        saved = job.save(str(tmp_path / "ckpt"))
        job.close()
    close([r.loss for r in results], expected, f"{case}: per-step losses")
    assert [r.step for r in results] == list(range(1, len(batches) + 1))
    if clip is not None:  # the clip was really exercised
        assert any(r.metrics["grad_norm"] > clip for r in results)
    got = saved_state(saved["path"])
    params = {n for n, _ in reference.named_parameters()}  # a tied weight once
    assert params <= set(got), f"parameters missing from the checkpoint: {params - set(got)}"
    state = reference.state_dict()
    for name in sorted(set(got) & set(state)):  # parameters and buffers (BatchNorm statistics)
        close(got[name], state[name], f"{case}: {name} after training")
    if "resnet" in case:
        assert any("running_mean" in n for n in got), "BatchNorm statistics were not saved"
