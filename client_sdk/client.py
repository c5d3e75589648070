"""The Python SDK: `AsyncClient` (asyncio) and `Client` (blocking), both over one DEALER socket.

One reader task owns the socket and resolves a `call id -> Future` map; a call that times out is
forgotten (a late answer is dropped), never cancelled on the socket. Tensors go out as zero-copy
frames and come back as tensors over the received frames (treat them as read-only; `.clone()` to
own them).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

import torch
import uvloop
import zmq
import zmq.asyncio

from client_sdk.errors import ClientError, Overloaded, Timeout, error_from
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.transport import connect_dealer, send

log = logging.getLogger("client_sdk")
T = TypeVar("T")

DEFAULT_ADDRESS = os.environ.get("FLOWMESH_BROKER", "tcp://127.0.0.1:5555")
# The broker answers TIMEOUT itself at the deadline; the client waits this much longer before
# concluding that the broker is not answering at all.
GRACE_S = 1.0


class AsyncClient:
    """Asynchronous client. Create and use it inside one running event loop."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: float = 60.0,
        limits: p.Limits = p.DEFAULT_LIMITS,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.limits = limits
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[p.Message]] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _connect(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            self._ctx = zmq.asyncio.Context()
            self._sock = connect_dealer(self._ctx, self.address, limits=self.limits)
            self._reader = asyncio.get_running_loop().create_task(self._read())
        return self._sock

    async def _read(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                msg = p.decode(frames, self.limits)
            except p.DecodeError as exc:
                log.warning("dropped a malformed answer from the broker: %s", exc)
                continue
            fut = self._pending.pop(getattr(msg, "id", None) or -1, None)
            if fut is None or fut.done():
                continue  # answer to a call that already timed out
            if isinstance(msg, p.Error):
                fut.set_exception(error_from(msg.code, msg.reason))
            else:
                fut.set_result(msg)

    async def _call(self, msg: p.Message, timeout: float | None) -> p.Message:
        sock = self._connect()
        fut: asyncio.Future[p.Message] = asyncio.get_running_loop().create_future()
        self._pending[msg.id] = fut  # type: ignore[attr-defined]
        try:
            send(sock, msg)
        except FlowmeshError as exc:
            self._pending.pop(msg.id, None)  # type: ignore[attr-defined]
            raise Overloaded(
                Code.OVERLOADED, f"cannot send to {self.address}: {exc.reason}"
            ) from None
        limit = self.timeout if timeout is None else timeout
        try:
            return await asyncio.wait_for(fut, limit + GRACE_S)
        except TimeoutError:
            raise Timeout(
                Code.TIMEOUT, f"no answer from the broker at {self.address} within {limit:.1f} s"
            ) from None
        finally:
            self._pending.pop(msg.id, None)  # type: ignore[attr-defined]

    def _ms(self, timeout: float | None) -> int:
        return int(1000 * (self.timeout if timeout is None else timeout))

    # ------------------------------------------------------------------ API

    async def deploy(
        self,
        name: str,
        factory: str,
        *,
        kwargs: Mapping[str, Any] | None = None,
        weights: str | None = None,
        seed: int | None = None,
        dtype: str = "float32",
        stages: int | None = None,
        max_batch_size: int = 8,
        replicas: int | None = None,
        inputs: Mapping[str, Any] | None = None,
        slo_ms: float | None = None,
        timeout: float = 600.0,
    ) -> dict[str, Any]:
        """Deploy a model; returns its status (stages, sizes, replicas) once every stage is
        held by its workers. `factory` is 'module:callable' from the broker's allow-list."""
        spec = {
            "name": name,
            "factory": factory,
            "kwargs": dict(kwargs or {}),
            "weights": weights,
            "seed": seed,
            "dtype": dtype,
            "stages": stages,
            "max_batch_size": max_batch_size,
            "replicas": replicas,
            "inputs": dict(inputs) if inputs else None,
            "slo_ms": slo_ms,
        }
        reply = await self._call(
            p.Deploy(id=next(self._ids), spec=spec, timeout_ms=self._ms(timeout)), timeout
        )
        assert isinstance(reply, p.Deployed)
        return reply.model

    async def undeploy(self, name: str, timeout: float | None = None) -> None:
        await self._call(p.Undeploy(id=next(self._ids), model=name), timeout)

    async def infer(
        self,
        model: str,
        inputs: torch.Tensor | Mapping[str, torch.Tensor],
        timeout: float | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Run `inputs` (a tensor, or a dict of named tensors; dim 0 is the batch) through
        `model`; returns a tensor, or a dict of tensors if the model returns several."""
        out, _info = await self.infer_with_info(model, inputs, timeout)
        return out

    async def infer_with_info(
        self,
        model: str,
        inputs: torch.Tensor | Mapping[str, torch.Tensor],
        timeout: float | None = None,
    ) -> tuple[torch.Tensor | dict[str, torch.Tensor], dict[str, Any]]:
        """Like `infer`, plus the broker's account: latency, queueing, batch size, workers."""
        tensors = {"": inputs} if isinstance(inputs, torch.Tensor) else dict(inputs)
        msg = p.Infer(
            id=next(self._ids), model=model, tensors=tensors, timeout_ms=self._ms(timeout)
        )
        reply = await self._call(msg, timeout)
        assert isinstance(reply, p.Result)
        out = {k: ref.tensor() for k, ref in reply.tensors.items()}
        if list(out) == [""]:
            return out[""], reply.info
        return out, reply.info

    async def status(self, timeout: float | None = 10.0) -> dict[str, Any]:
        reply = await self._call(p.Status(id=next(self._ids)), timeout)
        assert isinstance(reply, p.StatusReply)
        return reply.status

    async def plan(
        self,
        factory: str,
        *,
        kwargs: Mapping[str, Any] | None = None,
        dtype: str = "float32",
        inputs: Mapping[str, Any] | None = None,
        stages: int | None = None,
        kind: str = "stages",
        mem_cap: int | None = None,
        target_bytes: int | None = None,
        optimizer: str = "adam",
        batch: int = 1,
        measure: bool = False,
        timeout: float = 120.0,
    ) -> dict[str, Any]:
        """Ask the partitioner for a plan: pipeline `stages` (serving) or training `chunks`."""
        spec = {
            "name": "plan",
            "factory": factory,
            "kwargs": dict(kwargs or {}),
            "dtype": dtype,
            "inputs": dict(inputs) if inputs else None,
        }
        msg = p.PlanRequest(
            id=next(self._ids),
            spec=spec,
            kind=kind,
            stages=stages,
            mem_cap=mem_cap,
            target_bytes=target_bytes,
            optimizer=optimizer,
            batch=batch,
            measure=measure,
            timeout_ms=self._ms(timeout),
        )
        reply = await self._call(msg, timeout)
        assert isinstance(reply, p.PlanReply)
        return reply.plan

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ClientError(Code.UNAVAILABLE, "client closed"))
        self._pending.clear()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None


class Client:
    """Blocking client: the same calls as `AsyncClient`, run on a private event loop thread.

    Safe to share between threads; each call blocks its caller only.
    """

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: float = 60.0,
        limits: p.Limits = p.DEFAULT_LIMITS,
    ) -> None:
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="flowmesh-client", daemon=True
        )
        self._thread.start()
        self._async = AsyncClient(address, timeout=timeout, limits=limits)
        self.address = address

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        limit = (self._async.timeout if timeout is None else timeout) + 2 * GRACE_S
        try:
            return fut.result(limit)
        except TimeoutError:
            fut.cancel()
            raise Timeout(Code.TIMEOUT, f"no answer within {limit:.1f} s") from None

    def deploy(self, name: str, factory: str, **kw: Any) -> dict[str, Any]:
        return self._run(self._async.deploy(name, factory, **kw), kw.get("timeout", 600.0))

    def undeploy(self, name: str, timeout: float | None = None) -> None:
        self._run(self._async.undeploy(name, timeout), timeout)

    def infer(
        self,
        model: str,
        inputs: torch.Tensor | Mapping[str, torch.Tensor],
        timeout: float | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        return self._run(self._async.infer(model, inputs, timeout), timeout)

    def infer_with_info(
        self,
        model: str,
        inputs: torch.Tensor | Mapping[str, torch.Tensor],
        timeout: float | None = None,
    ) -> tuple[torch.Tensor | dict[str, torch.Tensor], dict[str, Any]]:
        return self._run(self._async.infer_with_info(model, inputs, timeout), timeout)

    def status(self, timeout: float | None = 10.0) -> dict[str, Any]:
        return self._run(self._async.status(timeout), timeout)

    def plan(self, factory: str, **kw: Any) -> dict[str, Any]:
        return self._run(self._async.plan(factory, **kw), kw.get("timeout", 120.0))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self._run(self._async.close(), 5.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
