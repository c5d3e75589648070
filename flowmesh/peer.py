"""What every process behind the broker does the same way: register, heartbeat both ways,
notice a silent broker and register again.

A worker or partitioner subclasses `MeshPeer`, says who it is (`registration`), what it reports
(`stats`), and handles its commands (`handle`). Registration is confirmed by the broker's ack; the
broker counts the peer as ready once its first heartbeat follows. A registration left unanswered,
or a broker silent past its liveness, gets a fresh socket.

The broker, not the peer, names each connection (no routing id is set here): no socket can take
over another's. Each registration carries the process's own secret (`session`, in its `info`),
so that the broker knows this very process again on a fresh socket and keeps its state, which a
pid, visible to any client in status, would not prove. A name a live peer of another process
holds is refused (`name_taken`): tried again for `register_timeout_s` (the holder may be this
process's predecessor, not yet declared lost), then the process stops with that error (exit
status 1) rather than flap with the other one.

With CURVE keys (`curve`, set before `serve`), the socket is a CURVE client: the name registered
is the one the key's certificate grants, and a refused key or registration is logged as such
(and counted in `auth_refusals`), then tried again like any other unanswered registration.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from flowmesh import protocol as p
from flowmesh.auth import CurveKeys, handshake_events, stop_watching, watch_handshakes
from flowmesh.errors import Code, FlowmeshError
from flowmesh.lifecycle import run_until_stopped
from flowmesh.sdnotify import notify
from flowmesh.transport import connect_dealer, pump, send, send_from_thread


class MeshPeer:
    role = "peer"
    # What its heartbeats carry: `stats()` and `peer_stats()` as this role's declared figures.
    stats_type: type[p.WorkerStats] | type[p.PartitionerStats]
    send_hwm = 10_000  # messages queued to the broker before sends are dropped

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
        self.dropped_sends = 0
        self.reconnects = 0
        self._drop_run = 0  # drops since the last send that went out
        self._acked = asyncio.Event()
        # Set by the broker's answer to a registration: an ack, or a refusal of our name.
        self._answered = asyncio.Event()
        self._name_refusal: str | None = None  # the refusal's reason, for `_register`
        self._name_refused_since: float | None = None
        # Proves to the broker that a registration on a fresh socket comes from this process.
        self.session = secrets.token_hex(16)
        self._stop = asyncio.Event()
        self.sock: zmq.asyncio.Socket | None = None
        # CURVE keys (flowmesh.auth.load_keys), or None for a plain socket.
        self.curve: CurveKeys | None = None
        self.auth_refusals = 0

    # -- to override

    def registration(self) -> p.Register:
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        return {}

    def handle(self, msg: p.Message) -> None:
        raise NotImplementedError

    def on_allow(self, allow: tuple[str, ...]) -> None:
        """The broker's allow-list, received at registration (see `spec.narrow_allow`)."""

    def on_registered(self, again: bool) -> None:
        """Called after each ack; `again` when the broker may have forgotten this peer."""

    def side_tasks(self, ctx: zmq.asyncio.Context) -> list[Any]:
        """Coroutines to run beside the broker connection (sockets of the peer's own, bound
        here before the first registration, so the registration can name them)."""
        return []

    def close(self) -> None:
        """Release resources when the process stops."""

    def reader_thread(
        self,
    ) -> tuple[Callable[[list[Any]], bool], Callable[[], None] | None] | None:
        """To read the broker's socket on a thread of its own: what that thread does with each
        message first, and its set-up (`transport.read_frames_on_thread`'s `here` and `init`).
        None (the default): the event loop reads the socket."""
        return None

    # -- plumbing

    def peer_stats(self) -> dict[str, Any]:
        """What every peer reports with its heartbeats, next to its own `stats()`."""
        out = {"dropped_sends": self.dropped_sends, "reconnects": self.reconnects}
        if self.curve is not None:  # keyless stats stay as they were
            out["auth_refusals"] = self.auth_refusals
        return out

    def heartbeat_stats(self) -> p.PeerStats:
        """This peer's figures, typed (`flowmesh.reports.WorkerStats`, `PartitionerStats`): a
        figure the type does not declare is a TypeError here, in the peer's own tests."""
        return self.stats_type(**self.stats(), **self.peer_stats())

    def _heartbeat(self) -> p.Heartbeat:
        return p.Heartbeat(stats=self.heartbeat_stats())

    def send(self, msg: p.Message) -> bool:
        """Send `msg` now; False when it was dropped: the queue to the broker is full, or there
        is no connection (between sockets, or stopping). A drop is counted (`dropped_sends`)
        and logged once per run of drops.

        Never raises, as callers are often a future's done-callback, which must run to its end
        for their own state to stay right. Nothing is retried: a dropped reply ends, on the
        broker's side, at the deadline it puts on every call. A reply that cannot be encoded
        (a result of a dtype that cannot travel, say) is answered with an Error for its id
        instead, so that the broker fails the call now.
        """
        sock = self.sock
        if sock is None:
            reason = "not connected"
        else:
            try:
                send(sock, msg)
            except FlowmeshError as exc:
                reason = exc.reason
                ref = getattr(msg, "id", None)
                unencodable = exc.code not in (Code.OVERLOADED, Code.UNAVAILABLE)
                if unencodable and ref is not None and not isinstance(msg, p.Error):
                    self.log.warning("cannot send %s %s: %s", msg.TYPE, ref, exc.reason)
                    return self.send(p.error_for(exc, ref))
            except zmq.ZMQError as exc:  # a socket closed under us
                reason = str(exc)
            else:
                if self._drop_run:
                    self.log.info("sending again after %d dropped message(s)", self._drop_run)
                    self._drop_run = 0
                return True
        self.dropped_sends += 1
        self._drop_run += 1
        if self._drop_run == 1:  # a full queue stays full: one line per run, not per message
            self.log.warning(
                "dropped %s to the broker: %s (further drops counted, not logged)",
                msg.TYPE,
                reason,
            )
        return False

    def send_from_thread(self, msg: p.Message) -> bool:
        """Send `msg` from a thread other than the event loop's (a compute lane answering its
        own run), encoded on that thread. False, with nothing sent, when it cannot go out from
        there; the caller then hands it to `send` on the loop, which drops or answers it as
        it always does."""
        sock = self.sock
        if sock is None:
            return False
        try:
            frames = p.encode(msg)
        except Exception:  # e.g. a dtype that cannot travel: `send` answers with an Error
            return False
        return send_from_thread(sock, frames)

    def _on_message(self, _peer: bytes | None, msg: p.Message) -> None:
        self.last_heard = time.monotonic()
        if isinstance(msg, p.RegisterAck):
            self.heartbeat_s, self.liveness = msg.heartbeat_s, msg.liveness
            if msg.allow is not None:
                self.on_allow(tuple(msg.allow))
            # A fresh socket of the same process finds its state kept by the broker; dropping
            # what we hold then would leave the broker counting on stages that are gone.
            again = self.registrations > 0 and not msg.kept
            self.registrations += 1
            self._name_refused_since = None
            self._acked.set()
            self._answered.set()
            self.on_registered(again)
            notify("READY=1")
            self.send(self._heartbeat())  # the broker marks us ready on it
        elif isinstance(msg, p.Heartbeat):
            pass
        elif isinstance(msg, p.Disconnect):
            # The broker is there and reading this socket, it just does not know us: register
            # again on the same socket.
            self.log.warning("broker asked to register again: %s", msg.reason)
            self._acked.clear()
        elif isinstance(msg, p.Error) and msg.id is None:
            self.log.warning("broker error: %s %s", msg.code, msg.reason)
        elif isinstance(msg, p.Error) and msg.code == Code.NAME_TAKEN:
            self._name_refusal = msg.reason
            self._answered.set()
        elif isinstance(msg, p.Error) and msg.code in (Code.FORBIDDEN, Code.UNAUTHORIZED):
            # Our key does not grant what we asked (registering under this name, say): the
            # next try is at the registration timeout, on a fresh socket.
            self.auth_refusals += 1
            self.log.error("the broker refused us: %s %s", msg.code, msg.reason)
        else:
            self.handle(msg)

    async def _register(self) -> bool:
        """Send our registration once; True when the broker answered it in time: acked, or our
        name refused (then after a pause, to be tried again; raises once it has been refused
        for `register_timeout_s`)."""
        self._acked.clear()
        self._answered.clear()
        self._name_refusal = None
        reg = self.registration()
        info = msgspec.structs.replace(reg.info, session=self.session)
        self.send(msgspec.structs.replace(reg, info=info))
        try:
            await asyncio.wait_for(self._answered.wait(), self.register_timeout_s)
        except TimeoutError:
            return False
        if self._name_refusal is not None:
            await self._name_taken(self._name_refusal)
        return True

    async def _name_taken(self, reason: str) -> None:
        now = time.monotonic()
        if self._name_refused_since is None:
            self._name_refused_since = now
            self.log.warning("the broker refused our name: %s; trying again a while", reason)
        if now - self._name_refused_since >= self.register_timeout_s:
            self.log.error("the broker refused our name: %s; stopping", reason)
            raise FlowmeshError(Code.NAME_TAKEN, reason)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), min(self.heartbeat_s, 0.5))

    async def _session(self) -> str:
        """Register, then heartbeat, on the current socket, until the broker stops answering
        on it. Returns why the socket is given up."""
        while not self._stop.is_set():
            if not self._acked.is_set():
                if not await self._register():
                    return f"no answer to registration within {self.register_timeout_s:.1f} s"
                continue
            self.send(self._heartbeat())
            silent = time.monotonic() - self.last_heard
            if silent > self.heartbeat_s * self.liveness:
                return f"broker silent for {silent:.1f} s"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.heartbeat_s)
        return "stopping"

    async def _connection(self, ctx: zmq.asyncio.Context) -> None:
        """Owns the socket to the broker: one socket and its one reader at a time.

        A broker that stops answering gets a fresh socket, not more messages on the old one:
        the old connection may be dead in a way ZeroMQ never reports.
        """
        while not self._stop.is_set():
            self._acked.clear()
            sock = connect_dealer(
                ctx,
                self.broker,
                limits=self.limits,
                hwm=self.send_hwm,
                curve=self.curve,
                monitor=handshake_events(),
            )
            # A refused handshake is said so, not left to look like a silent broker.
            watcher = asyncio.create_task(
                watch_handshakes(
                    sock, self._refused, f"{self.role} {self.name}", keyed=self.curve is not None
                ),
                name=f"{self.role}-handshakes",
            )
            here, init = self.reader_thread() or (None, None)
            reader = asyncio.create_task(
                pump(
                    sock,
                    self._on_message,
                    routed=False,
                    log=self.log,
                    limits=self.limits,
                    here=here,
                    init=init,
                ),
                name=f"{self.role}-reader",
            )
            session = asyncio.create_task(self._session(), name=f"{self.role}-session")
            self.sock = sock
            try:
                await asyncio.wait({reader, session}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                # The old reader is gone before its socket closes and before the next one
                # starts: never two readers, never a reader on a closed socket.
                self.sock = None
                session.cancel()
                reader.cancel()
                await asyncio.gather(session, reader, return_exceptions=True)
                # The reader has ended: no compute lane sends on the socket any more
                # (`send_from_thread`), so the loop may touch it alone.
                stop_watching(sock)
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
                sock.close(linger=0)
            if not reader.cancelled():
                # Only a failing socket ends the reader: stop the process (exit status 1)
                # rather than paper over it.
                exc = reader.exception()
                raise exc or FlowmeshError(Code.INTERNAL, "the reader ended")
            why = session.result() if not session.cancelled() else "stopping"
            if self._stop.is_set():
                return
            self.reconnects += 1
            self.log.warning(
                "%s; connecting again to %s on a fresh socket (reconnect %d)",
                why,
                self.broker,
                self.reconnects,
            )

    def _refused(self, reason: str) -> None:
        self.auth_refusals += 1
        if self.auth_refusals <= 5 or self.auth_refusals % 100 == 0:
            self.log.error("%s at %s (%d refusals)", reason, self.broker, self.auth_refusals)

    async def serve(self) -> None:
        ctx = zmq.asyncio.Context()
        tasks = [
            asyncio.create_task(coro, name=f"{self.role}-side-{i}")
            for i, coro in enumerate(self.side_tasks(ctx))
        ]
        tasks.append(asyncio.create_task(self._connection(ctx), name=f"{self.role}-connection"))
        self.log.info("started name=%s broker=%s pid=%d", self.name, self.broker, os.getpid())
        await run_until_stopped(tasks, self._stop, self.log)
        # The connection closes its socket as it ends; ctx.term() would wait for it forever.
        await asyncio.gather(*tasks, return_exceptions=True)
        self.close()
        ctx.term()
        self.log.info("stopped name=%s", self.name)

    def stop(self) -> None:
        self._stop.set()
