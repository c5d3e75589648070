"""The broker process: two ROUTER sockets around `BrokerCore`, on uvloop.

Clients (DEALER) talk to the frontend; workers and partitioners (DEALER) to the backend. Each
socket has exactly one reader; every handler is synchronous and quick (state changes, then sends),
so the loop never blocks. Tensor frames pass through untouched: the broker reads their headers,
never their bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from broker.core import BACKEND, CLIENT, BrokerConfig, BrokerCore
from flowmesh import protocol as p
from flowmesh.errors import FlowmeshError
from flowmesh.lifecycle import run_until_stopped
from flowmesh.sdnotify import notify
from flowmesh.transport import bind_router, pump, send

log = logging.getLogger("broker")


class BrokerService:
    def __init__(
        self,
        cfg: BrokerConfig,
        frontend: str,
        backend: str,
        *,
        limits: p.Limits = p.DEFAULT_LIMITS,
        ready_file: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.core = BrokerCore(cfg, now=time.monotonic())
        self.frontend_ep, self.backend_ep = frontend, backend
        self.limits = limits
        self.ready_file = ready_file
        self._stop = asyncio.Event()
        self.socks: dict[str, zmq.asyncio.Socket] = {}

    def _flush(self) -> None:
        now = time.monotonic()
        for _ in range(1000):  # send failures may queue answers of their own
            out = self.core.drain()
            if not out:
                return
            for dest, addr, msg in out:
                try:
                    send(self.socks[dest], msg, [addr])
                except FlowmeshError as exc:
                    self.core.send_failed(dest, addr, msg, exc, now)

    def _on_client(self, addr: bytes | None, msg: p.Message) -> None:
        assert addr is not None
        try:
            self.core.on_client(addr, msg, time.monotonic())
        finally:
            self._flush()

    def _on_backend(self, addr: bytes | None, msg: p.Message) -> None:
        assert addr is not None
        try:
            self.core.on_backend(addr, msg, time.monotonic())
        finally:
            self._flush()

    async def _ticks(self) -> None:
        while not self._stop.is_set():
            self.core.tick(time.monotonic())
            self._flush()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.cfg.heartbeat_s)

    def _write_ready(self, endpoints: dict[str, Any]) -> None:
        if not self.ready_file:
            return
        path = Path(self.ready_file)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(endpoints))
        tmp.replace(path)  # atomic: a reader never sees half a file

    async def serve(self) -> None:
        ctx = zmq.asyncio.Context()
        self.socks[CLIENT], front = bind_router(ctx, self.frontend_ep, self.limits)
        self.socks[BACKEND], back = bind_router(ctx, self.backend_ep, self.limits)
        tasks = [
            asyncio.create_task(
                pump(self.socks[CLIENT], self._on_client, routed=True, log=log, limits=self.limits)
            ),
            asyncio.create_task(
                pump(
                    self.socks[BACKEND], self._on_backend, routed=True, log=log, limits=self.limits
                )
            ),
            asyncio.create_task(self._ticks()),
        ]
        self._write_ready({"frontend": front, "backend": back, "pid": os.getpid()})
        log.info("serving frontend=%s backend=%s", front, back)
        notify("READY=1")
        await run_until_stopped(tasks, self._stop, log)
        for s in self.socks.values():
            s.close(linger=0)
        ctx.term()
        log.info("stopped")
