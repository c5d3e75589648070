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
from flowmesh.errors import Code, FlowmeshError
from flowmesh.lifecycle import run_until_stopped
from flowmesh.sdnotify import notify
from flowmesh.transport import bind_router, pump, send

log = logging.getLogger("broker")

# Consecutive failed ticks after which the broker stops (non-zero) rather than limp on.
MAX_TICK_FAILURES = 3


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
        """Send what the core queued. Called after every message and tick, so an answer never
        waits for the next one; one message that cannot go out never holds back the others."""
        now = time.monotonic()
        for _ in range(1000):  # send failures may queue answers of their own
            out = self.core.drain()
            if not out:
                return
            for dest, addr, msg in out:
                try:
                    send(self.socks[dest], msg, [addr])
                except FlowmeshError as exc:
                    self._send_failed(dest, addr, msg, exc, now)
                except Exception as exc:  # e.g. a value msgpack cannot pack: a bug, not fatal
                    log.exception("could not encode %s for %r", msg.TYPE, addr)
                    failure = FlowmeshError(Code.INTERNAL, f"{type(exc).__name__}: {exc}")
                    self._send_failed(dest, addr, msg, failure, now)
        log.error("send failures kept queueing answers; the rest go out on the next flush")

    def _send_failed(
        self, dest: str, addr: bytes, msg: p.Message, exc: FlowmeshError, now: float
    ) -> None:
        ref = getattr(msg, "id", None)
        if dest == CLIENT and exc.code == Code.INTERNAL and isinstance(ref, int):
            # The client still waits for this call: tell it, rather than let it time out.
            with contextlib.suppress(Exception):
                send(self.socks[dest], p.error_for(exc, ref), [addr])
        try:
            self.core.send_failed(dest, addr, msg, exc, now)
        except Exception:
            log.exception("handling a failed send of %s to %r", msg.TYPE, addr)

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
        """Heartbeats out, dead peers and expired deadlines out, every `heartbeat_s`.

        Runs on its own task, on a fixed cadence, whatever the readers are doing. A tick that
        raises is logged and the next one tried; only a tick that keeps failing stops the
        broker (exit status 1, so that systemd restarts it): a broker that can no longer tell
        live peers from dead ones must not pretend to serve."""
        failures = 0
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                self.core.tick(time.monotonic())
                failures = 0
            except Exception:
                failures += 1
                log.exception("tick failed (%d in a row)", failures)
                if failures >= MAX_TICK_FAILURES:
                    raise
            finally:
                self._flush()
            next_at += self.cfg.heartbeat_s
            if next_at <= time.monotonic():  # late (a long tick, a busy loop): skip, not catch up
                next_at = time.monotonic() + self.cfg.heartbeat_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), next_at - time.monotonic())

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
