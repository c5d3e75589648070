"""Training jobs in the SDK: `AsyncJob` (from `AsyncClient.train_open`) and `Job` (from
`Client.train_open`).

A job numbers its steps (`seq` 1, 2, ...) as it sends them; the broker and the worker run them in
that order and never apply one `seq` twice. Several steps may be in flight: each is numbered and
sent before its call first waits, so the order of the calls is the order of the steps.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from flowmesh import protocol as p

if TYPE_CHECKING:
    from client_sdk.client import AsyncClient, Client

Inputs = torch.Tensor | Mapping[str, torch.Tensor]


@dataclass
class StepResult:
    """One training step's outcome: its loss (summed over micro-batches), the job's step count
    with it, and the worker's metrics (tasks, bytes moved, seconds, grad_norm when clipping)."""

    loss: float
    step: int
    metrics: dict[str, float] = field(default_factory=dict)


def batch_tensors(inputs: Inputs, targets: torch.Tensor) -> dict[str, Any]:
    """A step's tensors as they travel: 'inputs' (or 'inputs/<name>') and 'targets'."""
    from client_sdk.client import _sendable

    if isinstance(inputs, torch.Tensor):
        tensors = {"inputs": _sendable(inputs)}
    else:
        tensors = {f"inputs/{k}": _sendable(v) for k, v in inputs.items()}
    tensors["targets"] = _sendable(targets)
    return tensors


class AsyncJob:
    """A training job open on the mesh; use it on the event loop of its `AsyncClient`."""

    def __init__(self, client: AsyncClient, name: str, info: dict[str, Any]) -> None:
        self.client = client
        self.name = name
        self.info = info  # the broker's status of the job when it opened
        self._seq = itertools.count(1)

    async def step_async(
        self, inputs: Inputs, targets: torch.Tensor, timeout: float | None = None
    ) -> StepResult:
        """One training step on a batch (`inputs`: a tensor, or a dict of named tensors; dim 0
        is the batch). Steps run in the order of the calls, even with several in flight
        (`asyncio.gather(job.step_async(a, y), job.step_async(b, z))`)."""
        msg = p.TrainStep(
            id=next(self.client._ids),
            job=self.name,
            seq=next(self._seq),
            tensors=batch_tensors(inputs, targets),
            timeout_ms=self.client._ms(timeout),
        )
        reply = await self.client._call(msg, timeout)
        assert isinstance(reply, p.TrainStepResult)
        return StepResult(reply.loss, reply.step, dict(reply.metrics))

    step = step_async

    async def eval_async(
        self, inputs: Inputs, targets: torch.Tensor, timeout: float | None = None
    ) -> StepResult:
        """Loss and metrics ('accuracy' for class targets) of the model on a batch, updating
        nothing: eval mode (dropout off, BatchNorm on its running statistics), no gradients,
        the job's random stream untouched. It runs after the steps sent before this call;
        `step` is how many of them were applied."""
        msg = p.TrainEval(
            id=next(self.client._ids),
            job=self.name,
            tensors=batch_tensors(inputs, targets),
            timeout_ms=self.client._ms(timeout),
        )
        reply = await self.client._call(msg, timeout)
        assert isinstance(reply, p.TrainEvalResult)
        return StepResult(reply.loss, reply.step, dict(reply.metrics))

    eval = eval_async

    async def save(self, path: str, timeout: float | None = None) -> dict[str, Any]:
        """Checkpoint the job after the steps sent before this call, into directory `path` on
        its worker (safetensors + job.json); returns {'path', 'step'}."""
        msg = p.TrainSave(
            id=next(self.client._ids),
            job=self.name,
            path=str(path),
            timeout_ms=self.client._ms(timeout),
        )
        reply = await self.client._call(msg, timeout)
        assert isinstance(reply, p.TrainSaved)
        return {"path": reply.path, "step": reply.step}

    async def close(self, timeout: float | None = None) -> None:
        """Close the job: steps still queued fail, its memory goes to the other jobs."""
        msg = p.TrainClose(
            id=next(self.client._ids), job=self.name, timeout_ms=self.client._ms(timeout)
        )
        await self.client._call(msg, timeout)


class Job:
    """The blocking twin of `AsyncJob` (from `Client.train_open`)."""

    def __init__(self, client: Client, job: AsyncJob) -> None:
        self.client = client
        self._job = job
        self.name = job.name
        self.info = job.info

    def step(
        self, inputs: Inputs, targets: torch.Tensor, timeout: float | None = None
    ) -> StepResult:
        """One training step; blocks until it is done (see `AsyncJob.step_async`)."""
        return self.client._run(self._job.step_async(inputs, targets, timeout), timeout)

    def step_async(
        self, inputs: Inputs, targets: torch.Tensor, timeout: float | None = None
    ) -> Future[StepResult]:
        """Send one step now and return a future of its result: steps run in call order."""
        return asyncio.run_coroutine_threadsafe(
            self._job.step_async(inputs, targets, timeout), self.client._loop
        )

    def eval(
        self, inputs: Inputs, targets: torch.Tensor, timeout: float | None = None
    ) -> StepResult:
        """Evaluate on a batch without updating anything; blocks (see `AsyncJob.eval_async`)."""
        return self.client._run(self._job.eval_async(inputs, targets, timeout), timeout)

    def eval_async(
        self, inputs: Inputs, targets: torch.Tensor, timeout: float | None = None
    ) -> Future[StepResult]:
        """Send an evaluation now and return a future of its result (after earlier steps)."""
        return asyncio.run_coroutine_threadsafe(
            self._job.eval_async(inputs, targets, timeout), self.client._loop
        )

    def save(self, path: str, timeout: float | None = None) -> dict[str, Any]:
        """Checkpoint the job (see `AsyncJob.save`)."""
        return self.client._run(self._job.save(path, timeout), timeout)

    def close(self, timeout: float | None = None) -> None:
        """Close the job (see `AsyncJob.close`)."""
        self.client._run(self._job.close(timeout), timeout)
