"""The broker process: two ROUTER sockets around `BrokerCore`, on uvloop.

Clients (DEALER) talk to the frontend; workers and partitioners (DEALER) to the backend. Each
socket has exactly one reader; every handler is synchronous and quick (state changes, then sends),
so the loop never blocks. Tensor frames pass through untouched: the broker reads their headers,
never their bytes.

With `keys` (a key directory, `flowmesh.auth`), both sockets are CURVE servers behind a ZAP
handler on this loop, started before either binds: a key not in the directory never gets a
message through. Each message then reaches the core with the Identity of its connection's key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from broker.core import BACKEND, CLIENT, BrokerConfig, BrokerCore
from broker.lm_files import start_reads
from flowmesh import protocol as p
from flowmesh.auth import BACKEND_DOMAIN, FRONTEND_DOMAIN, KeyRing, MeshAuthenticator
from flowmesh.errors import Code, FlowmeshError
from flowmesh.lifecycle import run_until_stopped
from flowmesh.sdnotify import notify
from flowmesh.transport import bind_router, pump, send, send_bundled

log = logging.getLogger("broker")

# Consecutive failed ticks after which the broker stops (non-zero) rather than limp on.
MAX_TICK_FAILURES = 3
# Clients remembered as taking bundles (the latest to send one).
MAX_BUNDLING = 1 << 16


class BrokerService:
    def __init__(
        self,
        cfg: BrokerConfig,
        frontend: str,
        backend: str,
        *,
        limits: p.Limits = p.DEFAULT_LIMITS,
        ready_file: str | None = None,
        keys: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.core = BrokerCore(cfg, now=time.monotonic())
        # Read now, so that a missing or broken key directory stops the broker at start.
        self.keyring = KeyRing(keys) if keys else None
        self.core.auth = self.keyring is not None
        self.core.limits = limits
        self.auth: MeshAuthenticator | None = None
        self.frontend_ep, self.backend_ep = frontend, backend
        self.limits = limits
        self.ready_file = ready_file
        self._stop = asyncio.Event()
        self.socks: dict[str, zmq.asyncio.Socket] = {}
        # Clients that sent a bundle, so take them (see `protocol.Bundle`): the latest
        # MAX_BUNDLING of them, a bound whatever the number of connections over time.
        self.bundling: OrderedDict[bytes, None] = OrderedDict()

    def _flush(self) -> None:
        """Send what the core queued. Called after every message and tick, so an answer never
        waits for the next one; one message that cannot go out never holds back the others.

        What goes to one client that takes bundles goes in bundles (the answers of a grouped
        run, say: one send and one read for all of them). Nothing to a worker is bundled: its
        reader thread computes a quick run the moment it reads it, alone.

        Reads of model directories the core asked for start here too, on threads: their
        results come back on the loop (`broker.lm_files.start_reads`), flushed in turn."""
        if self.core.generation.reads:
            start_reads(self.core, asyncio.get_running_loop(), time.monotonic, self._flush)
        now = time.monotonic()
        for _ in range(1000):  # send failures may queue answers of their own
            out = self.core.drain()
            if not out:
                return
            to_clients: dict[bytes, list[p.Message]] = {}
            for dest, addr, msg in out:
                if dest == CLIENT and addr in self.bundling:
                    to_clients.setdefault(addr, []).append(msg)  # in order, per client
                    continue
                try:
                    send(self.socks[dest], msg, [addr])
                except Exception as exc:
                    self._not_sent(dest, addr, msg, exc, now)
            for addr, msgs in to_clients.items():
                for failed, exc in send_bundled(self.socks[CLIENT], msgs, [addr], self.limits):
                    for msg in failed:
                        self._not_sent(CLIENT, addr, msg, exc, now)
        log.error("send failures kept queueing answers; the rest go out on the next flush")

    def _client_bundles(self, addr: bytes | None) -> None:
        if addr is None:
            return
        self.bundling[addr] = None
        self.bundling.move_to_end(addr)
        if len(self.bundling) > MAX_BUNDLING:
            self.bundling.popitem(last=False)

    def _not_sent(
        self, dest: str, addr: bytes, msg: p.Message, exc: BaseException, now: float
    ) -> None:
        if not isinstance(exc, FlowmeshError):  # e.g. a value msgpack cannot pack: a bug
            log.error("could not encode %s for %r", msg.TYPE, addr, exc_info=exc)
            exc = FlowmeshError(Code.INTERNAL, f"{type(exc).__name__}: {exc}")
        self._send_failed(dest, addr, msg, exc, now)

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

    def _on_client(self, addr: bytes | None, msg: p.Message, user: str | None = None) -> None:
        assert addr is not None
        try:
            if self.keyring is None:
                self.core.on_client(addr, msg, time.monotonic())
            else:
                ident = self.keyring.identity(user)
                self.core.on_client(addr, msg, time.monotonic(), ident)
        finally:
            self._flush()

    def _on_backend(self, addr: bytes | None, msg: p.Message, user: str | None = None) -> None:
        assert addr is not None
        try:
            if self.keyring is None:
                self.core.on_backend(addr, msg, time.monotonic())
            else:
                ident = self.keyring.identity(user)
                self.core.on_backend(addr, msg, time.monotonic(), ident)
        finally:
            self._flush()

    def _refused_backend(
        self, addr: bytes | None, ref: int, kind: str, exc: p.DecodeError
    ) -> None:
        # A peer's answer the codec refused (its reason names the type, `kind`, when a field
        # was wrong) fails the call it answers now, not at that call's deadline.
        assert addr is not None
        try:
            self.core.answer_refused(addr, ref, str(exc.code), exc.reason, time.monotonic())
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
            if self.auth is not None:  # connections ZAP refused, shown by status
                self.core.totals["zap_refused"] = self.auth.refused
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
        auth: MeshAuthenticator | None = None
        front_curve = back_curve = None
        if self.keyring is not None:
            # Before the sockets bind: a CURVE socket with no ZAP handler lets every key in.
            auth = self.auth = MeshAuthenticator(ctx, self.keyring)
            auth.start()
            front_curve = (self.keyring.secret, FRONTEND_DOMAIN)
            back_curve = (self.keyring.secret, BACKEND_DOMAIN)
        self.socks[CLIENT], front = bind_router(
            ctx, self.frontend_ep, self.limits, curve=front_curve
        )
        self.socks[BACKEND], back = bind_router(ctx, self.backend_ep, self.limits, curve=back_curve)
        keyed = auth is not None
        tasks = [
            asyncio.create_task(
                pump(
                    self.socks[CLIENT],
                    self._on_client,
                    routed=True,
                    log=log,
                    limits=self.limits,
                    with_user=keyed,
                    on_bundle=self._client_bundles,
                )
            ),
            asyncio.create_task(
                pump(
                    self.socks[BACKEND],
                    self._on_backend,
                    routed=True,
                    log=log,
                    limits=self.limits,
                    with_user=keyed,
                    on_refused=self._refused_backend,
                )
            ),
            asyncio.create_task(self._ticks()),
        ]
        self._write_ready({"frontend": front, "backend": back, "pid": os.getpid()})
        log.info(
            "serving frontend=%s backend=%s%s",
            front,
            back,
            f" (CURVE, keys from {self.keyring.dir})" if self.keyring else "",
        )
        notify("READY=1")
        await run_until_stopped(tasks, self._stop, log)
        for s in self.socks.values():
            s.close(linger=0)
        if auth is not None:
            auth.stop()
        ctx.term()
        log.info("stopped")
