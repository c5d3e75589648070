"""What every process behind the broker does the same way: register, heartbeat both ways,
notice a silent broker and register again.

A worker or partitioner subclasses `MeshPeer`, says who it is (`registration`), what it reports
(`stats`), and handles its commands (`handle`). Registration is confirmed by the broker's ack; the
broker counts the peer as ready once its first heartbeat follows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

import zmq
import zmq.asyncio

from flowmesh import protocol as p
from flowmesh.errors import FlowmeshError
from flowmesh.lifecycle import run_until_stopped
from flowmesh.sdnotify import notify
from flowmesh.transport import connect_dealer, pump, send


class MeshPeer:
    role = "peer"

    def __init__(
        self,
        name: str,
        broker: str,
        *,
        limits: p.Limits = p.DEFAULT_LIMITS,
        register_timeout_s: float = 5.0,
    ) -> None:
        self.name = name
        self.broker = broker
        self.limits = limits
        self.register_timeout_s = register_timeout_s
        self.log = logging.getLogger(self.role)
        self.heartbeat_s = 1.0
        self.liveness = 3
        self.last_heard = 0.0
        self.registrations = 0
        self._acked = asyncio.Event()
        self._stop = asyncio.Event()
        self.sock: zmq.asyncio.Socket | None = None

    # -- to override

    def registration(self) -> p.Register:
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        return {}

    def handle(self, msg: p.Message) -> None:
        raise NotImplementedError

    def on_registered(self, again: bool) -> None:
        """Called after each ack; `again` when the broker may have forgotten this peer."""

    def close(self) -> None:
        """Release resources when the process stops."""

    # -- plumbing

    def send(self, msg: p.Message) -> None:
        assert self.sock is not None
        try:
            send(self.sock, msg)
        except FlowmeshError as exc:
            self.log.warning("could not send %s to the broker: %s", msg.TYPE, exc.reason)

    def _on_message(self, _peer: bytes | None, msg: p.Message) -> None:
        self.last_heard = time.monotonic()
        if isinstance(msg, p.RegisterAck):
            self.heartbeat_s, self.liveness = msg.heartbeat_s, msg.liveness
            again = self.registrations > 0
            self.registrations += 1
            self._acked.set()
            self.on_registered(again)
            notify("READY=1")
            self.send(p.Heartbeat(stats=self.stats()))  # the broker marks us ready on it
        elif isinstance(msg, p.Heartbeat):
            pass
        elif isinstance(msg, p.Disconnect):
            self.log.warning("broker asked to register again: %s", msg.reason)
            self._acked.clear()
        elif isinstance(msg, p.Error) and msg.id is None:
            self.log.warning("broker error: %s %s", msg.code, msg.reason)
        else:
            self.handle(msg)

    async def _register(self) -> None:
        while not self._stop.is_set():
            self._acked.clear()
            self.send(self.registration())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._acked.wait(), self.register_timeout_s)
                return
            self.log.warning("no answer from broker %s; registering again", self.broker)

    async def _heartbeats(self) -> None:
        while not self._stop.is_set():
            if not self._acked.is_set():
                await self._register()
                continue
            self.send(p.Heartbeat(stats=self.stats()))
            if time.monotonic() - self.last_heard > self.heartbeat_s * self.liveness:
                self.log.warning(
                    "broker silent for %.1f s; registering again",
                    time.monotonic() - self.last_heard,
                )
                self._acked.clear()
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.heartbeat_s)

    async def serve(self) -> None:
        ctx = zmq.asyncio.Context()
        self.sock = connect_dealer(ctx, self.broker, identity=self.name, limits=self.limits)
        tasks = [
            asyncio.create_task(
                pump(self.sock, self._on_message, routed=False, log=self.log, limits=self.limits)
            ),
            asyncio.create_task(self._heartbeats()),
        ]
        self.log.info("started name=%s broker=%s pid=%d", self.name, self.broker, os.getpid())
        await run_until_stopped(tasks, self._stop, self.log)
        self.close()
        self.sock.close(linger=0)
        ctx.term()
        self.log.info("stopped name=%s", self.name)

    def stop(self) -> None:
        self._stop.set()
