"""Isolation through an in-process mesh (tests/support/inproc.py): one worker runs three jobs
whose steps fail in three ways at once (model code raising, a wrong input shape, a NaN loss).
Each failure reaches that job's caller only, as a typed error naming the job; its memory goes
back; the job trains on; every other step equals the plain PyTorch run of the same job without
the failed batch (its solo run), compared with `assert_close` (rtol 1e-5, atol 1e-6). A fourth
job, opened with `stop_on_nonfinite=False`, gets its NaN loss reported in that step's metrics
instead."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch

from client_sdk import errors
from client_sdk.client import AsyncClient
from flowmesh.reports import JobRow
from flowmesh.spec import ModelSpec
from tests.support.inproc import InProcMesh
from tests.support.mesh import fresh_stats
from tests.support.train_models import MARK
from tests.support.training import ALLOW_MODULES, BATCH, CHUNK, TRAIN_BYTES, data, plain

STEPS, BAD = 6, 2  # the failing step of every job (0-based)
ADAM = {"name": "adam", "lr": 0.01}
MLP = {"width": 32, "depth": 4, "in_features": 8, "out_features": 5}


def solo(s: ModelSpec, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    return plain(s, ADAM, batches)[0]


def poisoned(seed: int, how: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = data(seed, STEPS)
    x, y = batches[BAD]
    if how == "raise":
        x = x.clone()
        x[0, 0] = MARK
    elif how == "shape":
        x = x[:, :6]
    else:
        x = x.clone()
        x[1, 2] = float("nan")
    batches[BAD] = (x, y)
    return batches


def test_three_failing_jobs_on_one_worker_fail_alone() -> None:
    jobs = {
        "raise": ModelSpec(name="raise", factory="tests.support.train_models:boom_mlp", seed=1),
        "shape": ModelSpec(name="shape", factory="flowmesh.examples:mlp", kwargs=MLP, seed=2),
        "nan": ModelSpec(name="nan", factory="flowmesh.examples:mlp", kwargs=MLP, seed=3),
    }
    batches = {n: poisoned(i + 10, n) for i, n in enumerate(jobs)}
    kept = poisoned(12, "nan")  # the "nan" job's data, for a job that does not stop on it
    expected = {n: solo(s, batches[n][:BAD] + batches[n][BAD + 1 :]) for n, s in jobs.items()}

    async def run(c: AsyncClient) -> tuple[dict[str, list[Any]], list[JobRow]]:
        opened = {
            n: await c.train_open(
                f"iso-{n}",
                s.factory,
                kwargs=s.kwargs,
                seed=s.seed,
                optimizer=ADAM,
                batch_size=BATCH,
                chunk_bytes=CHUNK,
                timeout=60,
            )
            for n, s in jobs.items()
        }
        s = jobs["nan"]
        opened["kept"] = await c.train_open(
            "iso-kept",
            s.factory,
            kwargs=s.kwargs,
            seed=s.seed,
            optimizer=ADAM,
            batch_size=BATCH,
            chunk_bytes=CHUNK,
            stop_on_nonfinite=False,
            timeout=60,
        )
        batches["kept"] = kept
        assert {j.info.worker for j in opened.values()} == {"worker-0"}
        # Every step of every job in flight at once: the failures happen among healthy steps.
        futures = {
            n: [asyncio.ensure_future(opened[n].step_async(x, y)) for x, y in batches[n]]
            for n in opened
        }
        results = {
            n: await asyncio.gather(*fs, return_exceptions=True) for n, fs in futures.items()
        }
        # An evaluation failing in model code fails alone too, and changes nothing.
        x, y = batches["raise"][BAD]
        with pytest.raises(errors.ModelError) as info:
            await opened["raise"].eval(x, y)
        assert "eval after step 5" in info.value.reason, info.value.reason
        x, y = batches["raise"][0]
        assert (await opened["raise"].eval(x, y)).step == STEPS - 1
        listed = await c.jobs()
        return results, listed

    with InProcMesh(
        cpu_workers=1, memory_budget="8MiB", train_bytes=TRAIN_BYTES, allow=ALLOW_MODULES
    ) as mesh:

        async def main() -> tuple[dict[str, list[Any]], list[JobRow]]:
            async with mesh.async_client(timeout=60) as c:
                return await run(c)

        results, listed = asyncio.run(main())
        with mesh.client(timeout=60) as c:
            stats = fresh_stats(c, "worker-0")

    failures = {
        "raise": (errors.ModelError, ["job 'iso-raise'", "boom: the model's own code failed"]),
        "shape": (errors.BadRequest, ["input 'x'"]),
        "nan": (errors.ModelError, ["job 'iso-nan'", "the loss is nan", "not applied"]),
    }
    for n, (kind, words) in failures.items():
        got = results[n]
        err = got[BAD]
        assert isinstance(err, kind), f"{n}: step {BAD} gave {err!r}"
        assert all(w in err.reason for w in words), (n, err.reason)
        ok = [r for i, r in enumerate(got) if i != BAD]
        assert not [r for r in ok if isinstance(r, BaseException)], (n, ok)
        torch.testing.assert_close(
            [r.loss for r in ok], expected[n], rtol=1e-5, atol=1e-6, msg=f"{n} vs its solo run"
        )
        assert [r.step for r in ok] == list(range(1, STEPS)), n
    reported = results["kept"]
    assert not [r for r in reported if isinstance(r, BaseException)], reported
    assert math.isnan(reported[BAD].loss) and reported[BAD].metrics["nonfinite"] == 1.0
    assert [r.metrics["nonfinite"] for r in reported[:BAD]] == [0.0] * BAD
    torch.testing.assert_close(
        [r.loss for r in reported[:BAD]], expected["nan"][:BAD], rtol=1e-5, atol=1e-6
    )
    rows = {j.name: j for j in listed}
    assert {n: rows[f"iso-{n}"].errors for n in jobs} == {n: 1 for n in jobs}
    assert {n: rows[f"iso-{n}"].state for n in jobs} == {n: "ready" for n in jobs}
    # The jobs are still open and idle: a failed step holds no device bytes.
    assert stats.train_jobs == 4 and stats.train_step_errors == 2, stats
    assert stats.train_reserved_bytes == 0 and stats.train_resident_bytes == 0, stats
    # Training borrowed what serving left free, within the one arena.
    assert 0 < stats.train_resident_peak <= stats.arena_bytes
