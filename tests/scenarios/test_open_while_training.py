"""Jobs opened while another trains, in process (tests/support/inproc.py): building, seeding and
tracing a model touch process-wide state a computing task uses, so `open_job` and stage loads
hold `gpu_worker.model_code.MODEL_CODE_LOCK`, as task computes do (without it this test fails).

The job's losses and the opened jobs' initial weights are compared with plain PyTorch on the
same seeds and data, with `torch.testing.assert_close` at rtol 1e-5 / atol 1e-6 (README "Tests":
training results are compared within tolerance, never bit for bit). The whole exactness grid
is tests/scenarios/test_training_exactness.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from safetensors.torch import load_file

from flowmesh.modelio.build import build_seeded
from tests.support.inproc import InProcMesh
from tests.support.mesh import roots_at
from tests.support.train_grid import (
    ALLOW,
    ATOL,
    BATCH,
    KIB,
    MODELS,
    OPTIMIZERS,
    RNG_SEED,
    RTOL,
    TRAIN_BYTES,
    data_for,
    plain_run,
)


def test_opening_jobs_while_a_job_trains_changes_nothing(tmp_path: Path) -> None:
    """The dropout GPT trains 20 steps while ResNets (traced by torch.fx) and MLPs (seeded)
    open on the same worker: its losses must still equal plain PyTorch, and so must the
    initial weights of the jobs opened meanwhile."""
    torch.set_num_threads(1)
    data = data_for("gpt-dropout", seed=7)
    want = plain_run("gpt-dropout", OPTIMIZERS["adam"], None, data)
    spec = MODELS["gpt-dropout"]
    mlp = MODELS["mlp"]
    init = build_seeded(mlp, ALLOW).state_dict()

    async def run(mesh: InProcMesh) -> tuple[list[float], list[dict[str, torch.Tensor]], list[str]]:
        async with mesh.async_client(timeout=300.0) as client:
            job = await client.train_open(
                "trains", spec.factory, kwargs=spec.kwargs, seed=spec.seed,
                optimizer=OPTIMIZERS["adam"], batch_size=BATCH, rng_seed=RNG_SEED,
                chunk_bytes=70 * KIB, timeout=300.0,
            )  # fmt: skip
            steps = [asyncio.ensure_future(job.step_async(x, y)) for x, y in data]
            errors: list[str] = []
            opened: list[dict[str, torch.Tensor]] = []
            for i in range(6):
                s = MODELS["resnet-bn"] if i % 2 else mlp
                try:
                    other = await client.train_open(
                        f"opened-{i}", s.factory, kwargs=s.kwargs, seed=s.seed,
                        optimizer=OPTIMIZERS["sgd+momentum"], batch_size=BATCH, timeout=300.0,
                    )  # fmt: skip
                    if s is mlp:  # its weights as opened: a checkpoint before any step
                        saved = await other.save(str(tmp_path / f"opened-{i}"))
                        path = Path(saved["path"]) / "state.safetensors"
                        opened.append(
                            {k: v for k, v in load_file(str(path)).items() if "/" not in k}
                        )
                    await other.close()
                except Exception as exc:
                    errors.append(f"open {i}: {exc}")
            results = await asyncio.gather(*steps, return_exceptions=True)
            losses = [r.loss for r in results if not isinstance(r, BaseException)]
            errors += [str(r) for r in results if isinstance(r, BaseException)]
            return losses, opened, errors

    with InProcMesh(
        cpu_workers=1, memory_budget="8MiB", train_bytes=TRAIN_BYTES, allow=ALLOW,
        **roots_at(tmp_path),
    ) as mesh:  # fmt: skip
        losses, opened, errors = asyncio.run(run(mesh))
    assert not errors, errors
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(want.losses), rtol=RTOL, atol=ATOL
    )
    for state in opened:
        for n, t in init.items():
            torch.testing.assert_close(state[n], t, rtol=RTOL, atol=ATOL, msg=f"opened {n}")
