"""Training jobs in the SDK: `AsyncJob` (from `AsyncClient.train_open`) and `Job` (from
`Client.train_open`).

A job numbers its steps (`seq` 1, 2, ...) as it sends them; the broker and the worker run them in
that order and never apply one `seq` twice. Several steps may be in flight: each is numbered and
sent before its call first waits, so the order of the calls is the order of the steps.
"""

from __future__ import annotations

import itertools
from collections.abc import Coroutine, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from client_sdk.connection import Connection, is_tensor, sendable
from client_sdk.loop_thread import LoopThread
from flowmesh import protocol as p
from flowmesh.steps import StepResult

if TYPE_CHECKING:  # for annotations only: a caller with tensors has imported torch itself
    from typing import TypeAlias

    import torch

    Inputs: TypeAlias = torch.Tensor | Mapping[str, torch.Tensor]
T = TypeVar("T")


class Connected(Protocol):
    """What a job's calls go through: an `AsyncClient`'s connection."""

    connection: Connection


class Runs(Protocol):
    """What a blocking job runs on: a `Client`'s loop thread."""

    runner: LoopThread


def batch(inputs: Inputs, targets: torch.Tensor) -> tuple[list[str] | None, dict[str, Any]]:
    """A step's batch as it travels (`p.TrainStep`): the names of its keyword inputs (None: one
    input tensor) and its tensors."""
    if is_tensor(inputs):
        names, tensors = None, {"inputs": sendable(inputs)}
    else:
        if not inputs:
            raise ValueError("a batch needs at least one input tensor")
        if "targets" in inputs:
            raise ValueError("a keyword input may not be named 'targets' (the batch's targets)")
        names, tensors = list(inputs), {k: sendable(v) for k, v in inputs.items()}
    tensors["targets"] = sendable(targets)
    return names, tensors


class AsyncJob:
    """A training job open on the mesh; use it on the event loop of its `AsyncClient`."""

    def __init__(self, client: Connected, name: str, info: p.JobRow) -> None:
        self.client = client
        self.connection = client.connection
        self.name = name
        self.info = info  # the broker's row of the job when it opened (`flowmesh jobs`)
        self._seq = itertools.count(1)

    async def step_async(
        self, inputs: Inputs, targets: torch.Tensor, timeout: float | None = None
    ) -> StepResult:
        """One training step on a batch (`inputs`: a tensor, or a dict of named tensors; dim 0
        is the batch). Steps run in the order of the calls, even with several in flight
        (`asyncio.gather(job.step_async(a, y), job.step_async(b, z))`)."""
        names, tensors = batch(inputs, targets)
        msg = p.TrainStep(
            id=self.connection.next_id(),
            job=self.name,
            seq=next(self._seq),
            inputs=names,
            tensors=tensors,
            timeout_ms=self.connection.timeout_ms(timeout),
        )
        reply = await self.connection.call(msg, timeout)
        assert isinstance(reply, p.TrainStepResult)
        return StepResult(reply.loss, reply.step, dict(reply.metrics), list(reply.activations))

    step = step_async

    async def eval_async(
        self, inputs: Inputs, targets: torch.Tensor, timeout: float | None = None
    ) -> StepResult:
        """Loss and metrics ('accuracy' for class targets) of the model on a batch, updating
        nothing: eval mode (dropout off, BatchNorm on its running statistics), no gradients,
        the job's random stream untouched. It runs after the steps sent before this call;
        `step` is how many of them were applied."""
        names, tensors = batch(inputs, targets)
        msg = p.TrainEval(
            id=self.connection.next_id(),
            job=self.name,
            inputs=names,
            tensors=tensors,
            timeout_ms=self.connection.timeout_ms(timeout),
        )
        reply = await self.connection.call(msg, timeout)
        assert isinstance(reply, p.TrainEvalResult)
        return StepResult(reply.loss, reply.step, dict(reply.metrics))

    eval = eval_async

    async def save(self, path: str, timeout: float | None = None) -> dict[str, Any]:
        """Checkpoint the job after the steps sent before this call, into directory `path` on
        its worker (safetensors + job.json); returns {'path', 'step'}."""
        msg = p.TrainSave(
            id=self.connection.next_id(),
            job=self.name,
            path=str(path),
            timeout_ms=self.connection.timeout_ms(timeout),
        )
        reply = await self.connection.call(msg, timeout)
        assert isinstance(reply, p.TrainSaved)
        return {"path": reply.path, "step": reply.step}

    async def close(self, timeout: float | None = None) -> None:
        """Close the job: steps still queued fail, its memory goes to the other jobs."""
        msg = p.TrainClose(
            id=self.connection.next_id(),
            job=self.name,
            timeout_ms=self.connection.timeout_ms(timeout),
        )
        await self.connection.call(msg, timeout)


class Job:
    """The blocking twin of `AsyncJob` (from `Client.train_open`)."""

    def __init__(self, client: Runs, job: AsyncJob) -> None:
        self.client = client
        self._runner = client.runner
        self._job = job
        self.name = job.name
        self.info = job.info

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """`coro`'s result, waited for at most the call's timeout (the client's when None)."""
        return self._runner.run(coro, self._job.connection.seconds(timeout))

    def step(
        self, inputs: Inputs, targets: torch.Tensor, timeout: float | None = None
    ) -> StepResult:
        """One training step; blocks until it is done (see `AsyncJob.step_async`)."""
        return self._run(self._job.step_async(inputs, targets, timeout), timeout)

    def step_async(
        self, inputs: Inputs, targets: torch.Tensor, timeout: float | None = None
    ) -> Future[StepResult]:
        """Send one step now and return a future of its result: steps run in call order."""
        return self._runner.submit(self._job.step_async(inputs, targets, timeout))

    def eval(
        self, inputs: Inputs, targets: torch.Tensor, timeout: float | None = None
    ) -> StepResult:
        """Evaluate on a batch without updating anything; blocks (see `AsyncJob.eval_async`)."""
        return self._run(self._job.eval_async(inputs, targets, timeout), timeout)

    def eval_async(
        self, inputs: Inputs, targets: torch.Tensor, timeout: float | None = None
    ) -> Future[StepResult]:
        """Send an evaluation now and return a future of its result (after earlier steps)."""
        return self._runner.submit(self._job.eval_async(inputs, targets, timeout))

    def save(self, path: str, timeout: float | None = None) -> dict[str, Any]:
        """Checkpoint the job (see `AsyncJob.save`)."""
        return self._run(self._job.save(path, timeout), timeout)

    def close(self, timeout: float | None = None) -> None:
        """Close the job (see `AsyncJob.close`)."""
        self._run(self._job.close(timeout), timeout)
