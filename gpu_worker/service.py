"""The gpu_worker process: a thin shell that feeds broker commands to the executor.

Commands are applied in arrival order on the event loop (allocation bookkeeping is cheap and
ordered); stage preparation, copies and compute run on worker threads; results go back as soon as
their futures resolve, so one slow model never holds up the others.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.peer import MeshPeer
from flowmesh.spec import DEFAULT_ALLOW, ModelSpec
from gpu_worker.device import Device
from gpu_worker.executor import Executor, LoadInfo, RunOutput
from gpu_worker.stage_loader import prepare_stage

T = TypeVar("T")


class WorkerService(MeshPeer):
    role = "worker"

    def __init__(
        self,
        name: str,
        broker: str,
        device: Device,
        *,
        compute_lanes: int = 2,
        allow: tuple[str, ...] = DEFAULT_ALLOW,
        limits: p.Limits = p.DEFAULT_LIMITS,
        threads: int | None = None,
    ) -> None:
        super().__init__(name, broker, limits=limits)
        self.device = device
        self.executor = Executor(device, compute_lanes)
        self.allow = allow
        self.threads = threads
        self._deploys = ThreadPoolExecutor(1, thread_name_prefix="deploy")
        self._tasks: set[asyncio.Task[Any]] = set()

    def registration(self) -> p.Register:
        return p.Register(
            id=1,
            role="worker",
            name=self.name,
            pid=os.getpid(),
            device=getattr(self.device, "name", self.device.kind),
            kind=self.device.kind,
            budget_bytes=self.device.budget_bytes,
            info={
                "compute_lanes": self.executor.compute_lanes,
                "threads": self.threads or 0,
                **self.device.info(),
            },
        )

    def stats(self) -> dict[str, Any]:
        return {**self.executor.stats(), **self.device.info()}

    def on_registered(self, again: bool) -> None:
        if again:
            # The broker may have restarted and forgotten what we hold: start clean.
            for key in list(self.executor.stages):
                self.executor.drop_stage(key)

    def close(self) -> None:
        self.executor.close()
        self._deploys.shutdown(wait=False, cancel_futures=True)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _answer_when_done(
        self, fut: asyncio.Future[T], ref: int, reply: Callable[[T], p.Message]
    ) -> None:
        """Send `reply(result)` once `fut` settles, or an error naming command `ref`."""

        def done(f: asyncio.Future[T]) -> None:
            if f.cancelled() or f.exception() is not None:
                self._fail(ref, f.exception() or FlowmeshError(Code.INTERNAL, "cancelled"))
            else:
                self.send(reply(f.result()))

        fut.add_done_callback(done)

    def _fail(self, ref: int, exc: BaseException) -> None:
        if not isinstance(exc, FlowmeshError):
            self.log.error("command %d failed: %r", ref, exc)
        self.send(p.error_for(exc, ref))

    def handle(self, msg: p.Message) -> None:
        if isinstance(msg, p.Run):
            self._run(msg)
        elif isinstance(msg, p.Load):
            self._load(msg)
        elif isinstance(msg, p.Evict):
            self.executor.evict((msg.model, msg.stage))
        elif isinstance(msg, p.DeployStage):
            self._spawn(self._deploy_stage(msg))
        elif isinstance(msg, p.DropStage):
            self.executor.drop_stage((msg.model, msg.stage))
        elif isinstance(msg, p.Error):
            self.log.warning("broker answered %s: %s %s", msg.id, msg.code, msg.reason)
        else:
            raise FlowmeshError(Code.BAD_REQUEST, f"a worker does not take {msg.TYPE}")

    async def _deploy_stage(self, msg: p.DeployStage) -> None:
        t0 = time.perf_counter()
        try:
            spec = ModelSpec.from_dict(msg.spec)
            blocks, host = await asyncio.get_running_loop().run_in_executor(
                self._deploys, prepare_stage, spec, msg.plan, msg.stage, self.device, self.allow
            )
        except Exception as exc:
            self._fail(msg.id, exc)
            return
        self.executor.add_stage((msg.model, msg.stage), blocks, host)
        self.log.info("stage ready model=%s stage=%d bytes=%d", msg.model, msg.stage, host.nbytes)
        self.send(
            p.StageReady(
                id=msg.id,
                model=msg.model,
                stage=msg.stage,
                nbytes=host.nbytes,
                seconds=time.perf_counter() - t0,
            )
        )

    def _load(self, msg: p.Load) -> None:
        try:
            fut = self.executor.load((msg.model, msg.stage))
        except FlowmeshError as exc:
            self._fail(msg.id, exc)
            return

        def loaded(info: LoadInfo) -> p.Message:
            return p.Loaded(
                id=msg.id,
                model=msg.model,
                stage=msg.stage,
                nbytes=info.nbytes,
                seconds=info.seconds,
            )

        self._answer_when_done(fut, msg.id, loaded)

    def _run(self, msg: p.Run) -> None:
        parts: list[dict[str, Any]] = [{} for _ in msg.parts]
        for name, ref in msg.tensors.items():
            k, _, inner = name.partition("/")
            if not k.isdigit() or int(k) >= len(parts):
                raise FlowmeshError(Code.BAD_REQUEST, f"run tensor {name!r}: expected 'k/name'")
            parts[int(k)][inner] = ref
        if not msg.parts or any(not part for part in parts):
            raise FlowmeshError(Code.BAD_REQUEST, "every part of a run needs its tensors")
        fut = self.executor.run((msg.model, msg.stage), parts)

        def result(out: RunOutput) -> p.Message:
            tensors = {
                f"{k}/{name}": t for k, part in enumerate(out.parts) for name, t in part.items()
            }
            return p.RunResult(
                id=msg.id,
                model=msg.model,
                stage=msg.stage,
                tensors=tensors,
                info={"compute_s": out.compute_s, "wait_s": out.wait_s},
            )

        self._answer_when_done(fut, msg.id, result)
