"""Pipeline-parallel training through the mesh (issue 23 §2), on an in-process mesh of three
workers (tests/support/inproc.py: the real broker core, worker cores and hands, every message
through the real codec, the real SDK): jobs opened with `pipeline=2` and `pipeline=3`, their
steps all in flight at once, each micro-batch's activations and gradients going worker to
worker. Per-step losses equal a plain PyTorch loop's on the same seeds and data, with
`torch.testing.assert_close` at rtol 1e-5 / atol 1e-6; the stages sit on distinct workers;
the refusals of what a pipelined job cannot do are clear errors."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from client_sdk import errors
from flowmesh.modelio.build import build_seeded
from flowmesh.reference import train
from tests.support.inproc import InProcMesh
from tests.support.mesh import roots_at
from tests.support.torch_threads import one_thread  # noqa: F401 (fixture)
from tests.support.train_grid import ALLOW, ATOL, BATCH, MODELS, OPTIMIZERS, RNG_SEED, RTOL
from tests.support.train_grid import data_for as grid_data

TRAIN_BYTES = 4 << 20  # each stage resident: no memory flow

# model, optimizer, stages, clip, accumulate (the pipeline's micro-batches)
CASES = [
    ("mlp", "adam", 2, 0.5, 2),
    ("mlp", "sgd+momentum", 3, None, 4),
    ("gpt-dropout", "adamw", 3, 0.5, 2),
    ("resnet-bn", "sgd+momentum", 2, None, 2),
    ("resnet-bn", "adam", 3, 0.5, 1),
    ("hf-gpt2-tied", "adam", 3, 0.5, 1),
    ("hf-gpt2-tied", "sgd+momentum", 2, None, 2),
]


def plain(model: str, opt: str, clip: float | None, accumulate: int, data: Any) -> list[float]:
    net = build_seeded(MODELS[model], ALLOW)
    return train(net, OPTIMIZERS[opt], data, clip=clip, accumulate=accumulate,
                 rng_seed=RNG_SEED)  # fmt: skip


async def run(mesh: InProcMesh, data: dict[str, Any]) -> list[Any]:
    async with mesh.async_client(timeout=300.0) as client:

        async def one(i: int, case: tuple[Any, ...]) -> Any:
            model, opt, stages, clip, acc = case
            s = MODELS[model]
            job = await client.train_open(
                f"p{i}-{model}", s.factory, kwargs=s.kwargs, seed=s.seed,
                optimizer=OPTIMIZERS[opt], batch_size=BATCH, clip_grad_norm=clip,
                accumulate=acc, rng_seed=RNG_SEED, pipeline=stages, timeout=300.0,
            )  # fmt: skip
            results = await asyncio.gather(*(job.step_async(x, y) for x, y in data[model]))
            info = job.info
            await job.close()
            return info, results

        return await asyncio.gather(*(one(i, c) for i, c in enumerate(CASES)))


def test_pipelined_jobs_through_the_mesh_equal_plain_pytorch(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    data = {m: grid_data(m, seed=60 + i)[:8] for i, m in enumerate(MODELS)}
    with InProcMesh(
        cpu_workers=3, memory_budget="8MiB", train_bytes=TRAIN_BYTES, allow=ALLOW,
        **roots_at(tmp_path),
    ) as mesh:  # fmt: skip
        got = asyncio.run(run(mesh, data))
    for (model, opt, stages, clip, acc), (info, results) in zip(CASES, got, strict=True):
        assert len(info.pipeline) == len(set(info.pipeline)) == stages, info.pipeline
        assert info.worker == info.pipeline[0] and len(info.sub_models) == stages
        blocks = [r.blocks for r in info.sub_models]
        assert blocks[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(blocks))
        assert [r.step for r in results] == list(range(1, len(data[model]) + 1))
        want = plain(model, opt, clip, acc, data[model])
        got_losses = [r.loss for r in results]
        torch.testing.assert_close(got_losses, want, rtol=RTOL, atol=ATOL,
                                   msg=f"{model}/{opt}/p{stages}")  # fmt: skip
        # Forwards one after the other only where the model draws random numbers.
        serial = [r.metrics["serial_forwards"] for r in results]
        draws = model in ("gpt-dropout", "hf-gpt2-tied")
        overlap = [1.0] * len(serial) if draws else [1.0] + [0.0] * (len(serial) - 1)
        assert serial == overlap, (model, serial)


def test_what_a_pipelined_job_cannot_do_is_refused_clearly(tmp_path: Path) -> None:
    s = MODELS["mlp"]
    with InProcMesh(
        cpu_workers=2, memory_budget="8MiB", train_bytes=TRAIN_BYTES, allow=ALLOW,
        **roots_at(tmp_path),
    ) as mesh, mesh.client(timeout=60) as c:  # fmt: skip
        kw: dict[str, Any] = {"kwargs": s.kwargs, "seed": s.seed, "optimizer": {"name": "sgd",
                              "lr": 0.1}, "batch_size": BATCH}  # fmt: skip
        with pytest.raises(errors.Unavailable, match="needs 3 ready workers"):
            c.train_open("three", s.factory, pipeline=3, **kw)
        with pytest.raises(errors.BadRequest, match="does not split into 3 micro-batches"):
            c.train_open("uneven", s.factory, pipeline=2, accumulate=3, **kw)
        job = c.train_open("two", s.factory, pipeline=2, **kw)
        x, y = grid_data("mlp", 0)[0]
        assert job.step(x, y).step == 1
        assert job.save(str(tmp_path / "ck"))["step"] == 1
        assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
            "stage-0.safetensors",
            "stage-1.safetensors",
        ]
        with pytest.raises(errors.BadRequest, match="pipelined: it does not evaluate"):
            job.eval(x, y)
        assert [j.pipeline for j in c.jobs()] == [job.info.pipeline]
        job.close()
        assert c.jobs() == []
        # Closed on both workers: the name opens again.
        again = c.train_open("two", s.factory, pipeline=2, **kw)
        assert again.step(x, y).step == 1
