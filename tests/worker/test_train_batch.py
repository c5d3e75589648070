"""A training job's batch against the memory planned for it: a worker opens a job for a batch
(its activation reservations are profiled at that micro-batch), so a step of more rows is
refused with `bad_request` naming both sizes, and an evaluation of more rows is cut into more
micro-batches of at most a step's, with the same loss. The worker's process is measured, not
only the arena's accounting: on the CPU stand-in activations live outside the arena."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.build import build_seeded
from flowmesh.spec import ModelSpec
from flowmesh.train_spec import TrainConfig
from gpu_worker.device import CpuStandIn
from gpu_worker.service import WorkerService

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
SPEC = ModelSpec(
    name="mlp",
    factory="flowmesh.examples:mlp",
    kwargs={"width": 256, "depth": 4, "in_features": 256, "out_features": 10},
    seed=3,
)
CONFIG = {"optimizer": {"name": "adam", "lr": 0.01}, "accumulate": 2, "seed": 1}
ARENA, TRAIN_BYTES, BATCH = 28 * MIB, 12 * MIB, 8


def open_worker(batch: int = BATCH) -> WorkerService:
    """A worker with a job opened for `batch` rows, as a TrainOpen from the broker opens it."""
    svc = WorkerService("w", "tcp://127.0.0.1:1", CpuStandIn(ARENA), train_bytes=TRAIN_BYTES)
    msg = p.TrainOpen(id=1, job="j", spec=SPEC, config=TrainConfig(**CONFIG), batch=batch)
    svc.hands.open_job(msg)
    return svc


def rows(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g)


def outcome(fut: Any) -> Any:
    try:
        return round(fut.result(timeout=300).loss, 6)
    except FlowmeshError as exc:
        return [str(exc.code), exc.reason]


def test_a_step_over_the_job_s_batch_is_refused_and_an_eval_over_it_is_cut_smaller() -> None:
    svc = open_worker()
    trainer = svc.trainer
    assert trainer is not None
    try:
        for n in (BATCH, 4, 2):  # the batch opened for, and smaller ones
            assert isinstance(outcome(trainer.submit("j", *rows(n))), float)
        with pytest.raises(FlowmeshError) as err:
            trainer.submit("j", *rows(2048)).result(timeout=300)
        assert err.value.code is Code.BAD_REQUEST
        assert err.value.reason == (
            "a batch of 2048 is over the batch of 8 job 'j' was opened for (its memory was "
            "planned for that many rows): send at most 8, or open a job for 2048"
        )
        x, y = rows(83, seed=1)  # 21 micro-batches of 4 rows, the last of 3
        ev = trainer.evaluate("j", x, y).result(timeout=300)
        # Under the batch and not a multiple of accumulate's 2: refused for a step, taken (in
        # micro-batches of at most 4) for an evaluation, which used to be refused too.
        small_x, small_y = rows(3, seed=2)
        small = trainer.evaluate("j", small_x, small_y).result(timeout=300)
        with pytest.raises(FlowmeshError, match="a batch of 3 does not split into 2 equal"):
            trainer.submit("j", small_x, small_y).result(timeout=300)
        job = trainer.jobs["j"]
        assert job.step_count == 3  # the refused steps changed nothing
    finally:
        svc.close()
    model = build_seeded(SPEC).eval()
    with torch.no_grad():  # the job's weights after its three steps, on the whole batch
        model.load_state_dict(job.state_dict())
        logits, small_logits = model(x), model(small_x)
    torch.testing.assert_close(ev.loss, F.cross_entropy(logits, y).item(), rtol=1e-5, atol=1e-6)
    assert ev.metrics["accuracy"] == int((logits.argmax(-1) == y).sum()) / len(y)
    want = F.cross_entropy(small_logits, small_y).item()
    torch.testing.assert_close(small.loss, want, rtol=1e-5, atol=1e-6)


# -- the process's memory ------------------------------------------------------------------


def _status(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) * 1024  # type: ignore[union-attr]


MEASURED = 256  # the batch of the job measured: evaluations of 16,384 rows in 128 pieces


def measure() -> None:
    """In a process of its own: the peak of its resident memory over what it held before, while
    a job opened for MEASURED rows is sent steps and evaluations of every size."""
    torch.set_num_threads(1)
    svc = open_worker(MEASURED)
    trainer = svc.trainer
    assert trainer is not None
    sizes = [2, 8, 100, 256, 512, 16384]
    data = {n: rows(n) for n in sizes}  # made before the measure: they are the client's
    # Warm, on the fewest rows: threads, kernels and state made on first use (about 12 MiB
    # here) are the process's, not any batch's; every batch's activations are measured.
    outcome(trainer.submit("j", *data[2]))
    outcome(trainer.evaluate("j", *data[2]))
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from here
    before = _status("VmRSS")
    steps = {n: outcome(trainer.submit("j", *data[n])) for n in sizes}
    evals = {n: outcome(trainer.evaluate("j", *data[n])) for n in sizes}
    peak = _status("VmHWM") - before
    svc.close()
    print(json.dumps({"peak": peak, "steps": steps, "evals": evals}))


def test_a_worker_s_training_allocations_stay_within_its_training_bytes_for_any_batch() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as exc:
        pytest.skip(f"the peak resident memory cannot be reset here: {exc}")
    code = "import tests.worker.test_train_batch as t; t.measure()"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # Before: a step of 16,384 rows on a job opened for 256 ran, its activations far outside
    # the arena (and the training bytes) it was planned against.
    assert got["peak"] <= TRAIN_BYTES, got
    over = {n: r for n, r in got["steps"].items() if not isinstance(r, float)}
    assert set(over) == {"512", "16384"}, got["steps"]
    assert all(r[0] == "bad_request" for r in over.values())
    assert all(isinstance(r, float) for r in got["evals"].values()), got["evals"]
