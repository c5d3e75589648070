"""The SDK's connection to the broker: one DEALER socket, the ids of the calls, sending them and
waiting for their answers, and the broker's limits (stated in its Welcome). `AsyncClient` and the
training jobs (`client_sdk.jobs`) make their calls through it: `next_id`, `timeout_ms`, `call`.

One reader task owns the socket and resolves a `call id -> Future` map; a call that times out is
forgotten (a late answer is dropped), never cancelled on the socket. Tensors go out as zero-copy
frames and come back as tensors over the received frames (treat them as read-only; `.clone()` to
own them).

Nothing waits for the timeout when the answer cannot come: a request over the client's own
`limits`, or over the broker's, raises `TooLarge` before it is sent, and if the reader stops,
every call in flight fails at once with the cause (the next call connects again on a fresh
socket). The broker's limits are learned on each connection (`Hello`, answered by `Welcome`)
before any call goes out on it: beyond twice its limit, the broker's socket drops the connection
that carries a message, and every answer in flight on it with the connection.

With `keys` (or FLOWMESH_KEYS), the socket is a CURVE client: a broker that refuses the key fails
the calls in flight at once with an UNAUTHORIZED error, rather than leaving them to their timeout.

A broker that goes away (it crashed, or restarts) takes the answers of the calls in flight with
it; ZeroMQ connects again by itself, and calls made meanwhile wait, and go out once it is back.
The calls in flight when the connection was lost are settled by what they are: one that is safe
to send twice (inference, status, jobs, plans; a training step, which the broker never applies
twice as it carries its `seq`, and an evaluation) is sent once more as soon as the connection is
back and the broker has stated its limits on it, with what is left of its timeout; any other
(deploy, undeploy, training open, save and close) fails at once with UNAVAILABLE, saying that it
may or may not have run. A call over the broker's limits is never sent again but fails with
`TooLarge`: such a call is what a broker drops a connection for, and sent again it would drop
the new one too, with the answers of every call in flight on it.

No broker: the first contact (the Hello, answered by Welcome) waits at most `connect_timeout`
seconds (`CONNECT_TIMEOUT_S` unless given; never longer than the call's own timeout), then the
calls waiting for it fail with UNAVAILABLE naming the address ("is 'flowmesh up' running?"). The
wait counts from each call, not from the client's creation, and a failed first contact does not
end the client: ZeroMQ keeps connecting, and the next call reaches a broker that came up since,
such as one that `flowmesh up` was still starting. A script that starts the mesh itself and
calls at once can wait for it with a larger `connect_timeout` (None: each call's own timeout).
Once a broker has answered, a lost connection is a restart, not a missing broker: calls wait for
it to come back, each up to its own timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import os
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from client_sdk.errors import BadRequest, ClientError, Timeout, TooLarge, Unavailable, error_from
from flowmesh import protocol as p
from flowmesh.auth import (
    CurveKeys,
    handshake_events,
    load_keys,
    stop_watching,
    watch_handshakes,
)
from flowmesh.errors import Code, FlowmeshError
from flowmesh.transport import (
    connect_dealer,
    read_frames,
    send,
    send_encoded_bundled,
    send_frames,
)

log = logging.getLogger("client_sdk")

# The client's CURVE keys when `keys` is not given: a .key_secret file (broker.key next to it).
KEYS_ENV = "FLOWMESH_KEYS"
# The broker answers TIMEOUT itself at the deadline; the client waits this much longer before
# concluding that the broker is not answering at all.
GRACE_S = 1.0
# How long the first contact with a broker may take before the calls waiting for it fail (see
# above): a broker that is up answers a Hello at once, even a busy one.
CONNECT_TIMEOUT_S = 5.0


# Calls that may be sent again after the connection was lost with them in flight (see above).
RETRYABLE = (p.Infer, p.Status, p.Jobs, p.PlanRequest, p.TrainStep, p.TrainEval)
# Messages that are part of a call's answer, not its end: a streamed Generate's chunks come
# under its id before the one Generated that ends it (`call`'s `on_part`).
PARTS = (p.GenChunk,)


@dataclass
class PendingCall:
    fut: asyncio.Future[p.Message]
    nbytes: int  # the request's encoded size: what an answer without an id is matched by
    kind: str  # the request's TYPE
    # For a call that may be sent again (RETRYABLE): the message and its deadline (loop time).
    msg: p.Message | None = None
    deadline: float = 0.0
    link: int = 0  # the connection it went out on (`Connection._link` then)
    lost: bool = False  # that connection was lost: sent again once a new one is up
    retried: bool = False
    # Not sent yet: its frames wait for the broker's limits on this connection (`_welcomed`).
    held: list[Any] | None = None
    # Takes the answer's parts (PARTS) as they come, on the loop, while the call waits on.
    on_part: Callable[[p.Message], None] | None = None


def client_keys(keys: Any) -> CurveKeys | None:
    """`keys` as an AsyncClient takes it: None (FLOWMESH_KEYS, or no CURVE when unset), False
    (no CURVE), a .key_secret file, or a (public, secret, server_public) triple of z85 keys."""
    if keys is None:
        keys = os.environ.get(KEYS_ENV) or None
    if keys is None or keys is False:
        return None
    try:
        return load_keys(keys)
    except FlowmeshError as exc:
        raise ClientError(exc.code, f"client keys: {exc.reason}") from None


class Connection:
    """A client's connection to the broker at `address`. Use it inside one running event loop;
    the socket is made by the first call (`connect`) and ends with `close`.

    `timeout`: the seconds a call waits when it gives none of its own; `limits`: the client's
    own size limits; `curve`: CURVE keys (`client_keys`); `connect_timeout`: see the module's
    docstring."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float,
        limits: p.Limits = p.DEFAULT_LIMITS,
        curve: CurveKeys | None = None,
        connect_timeout: float | None = CONNECT_TIMEOUT_S,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.limits = limits
        self.curve = curve
        # Whether a broker ever answered a Hello of this connection's (the first contact).
        self.contacted = False
        # The current socket's handshake watcher, and every task that still holds a monitor
        # or socket of this client's context (awaited before the context ends).
        self._watcher: asyncio.Task[None] | None = None
        self._bg: set[asyncio.Task[None]] = set()
        self._ids = itertools.count(1)
        self._pending: dict[int, PendingCall] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        # Connections of the current socket lost so far: a call records the one it went on.
        self._link = 0
        # The broker's limits as it stated them on the current connection (None: not known,
        # or it states none); `_known` once it answered the Hello of the current connection
        # (`_hello`: its id, and the connection it was sent on).
        self.broker_limits: p.Limits | None = None
        self._known = False
        self._hello = (0, -1)
        self.resent = 0  # calls sent again after the connection was lost with them in flight
        # Calls sent in bundles, and answers that came in bundles (see `_send_outbox`).
        self.bundled_calls = 0
        self.bundled_answers = 0
        # Calls made in this loop turn after its first send, to go together (`_send_outbox`).
        self._outbox: list[tuple[int, list[Any]]] | None = None
        self._outbox_sock: zmq.asyncio.Socket | None = None

    def next_id(self) -> int:
        """A fresh call id, for the message of the next call."""
        return next(self._ids)

    def seconds(self, timeout: float | None) -> float:
        """How long a call waits: its own `timeout`, or the client's when None."""
        return self.timeout if timeout is None else timeout

    def timeout_ms(self, timeout: float | None) -> int:
        """A message's `timeout_ms` for a call with `timeout` (see `seconds`)."""
        return int(1000 * self.seconds(timeout))

    def connect(self) -> zmq.asyncio.Socket:
        """The socket, made (and its Hello sent) if there is none."""
        if self._sock is None:
            if self._ctx is None:
                self._ctx = zmq.asyncio.Context()
            try:
                sock = connect_dealer(
                    self._ctx,
                    self.address,
                    limits=self.limits,
                    curve=self.curve,
                    monitor=handshake_events(link=True),
                )
            except zmq.ZMQError as exc:
                raise BadRequest(
                    Code.BAD_REQUEST,
                    f"cannot connect to {self.address!r}: {exc.strerror} (a broker's address is "
                    "tcp://HOST:PORT)",
                ) from None
            loop = asyncio.get_running_loop()
            reader = loop.create_task(self._read(sock), name="flowmesh-client-reader")
            reader.add_done_callback(functools.partial(self._reader_done, sock))
            self._sock, self._reader = sock, reader
            self._send_hello(sock)
            # Also without keys: a broker that wants keys then fails our calls at once too.
            self._watcher = self._background(
                watch_handshakes(
                    sock,
                    functools.partial(self._refused, sock),
                    f"client of the broker at {self.address}",
                    keyed=self.curve is not None,
                    on_link=functools.partial(self._on_link, sock),
                ),
                "flowmesh-client-handshakes",
            )
        return self._sock

    def _background(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)
        return task

    def _stop_watcher(self, sock: zmq.asyncio.Socket) -> None:
        watcher, self._watcher = self._watcher, None
        stop_watching(sock)
        if watcher is not None and watcher is not asyncio.current_task():
            watcher.cancel()

    def _refused(self, sock: zmq.asyncio.Socket, reason: str) -> None:
        """The broker refused our key: fail the calls in flight now; the next call tries again
        on a fresh socket (a refused connection is not retried by ZeroMQ itself)."""
        if self._sock is not sock:
            return
        log.info("%s", reason)  # the calls' error says it
        reader = self._reader
        self._sock, self._reader = None, None  # tells _reader_done that this is no failure
        self._stop_watcher(sock)
        self._fail_pending(ClientError(Code.UNAUTHORIZED, reason))
        self._background(self._drop(sock, reader), "flowmesh-client-drop")

    def _on_link(self, sock: zmq.asyncio.Socket, up: bool) -> None:
        """The connection to the broker was lost (`up` False) or is up again: the answers of
        the calls in flight on a lost one cannot come. Each is failed now, or marked to be sent
        once more when the broker has stated its limits on the next connection (see the module's
        docstring). Calls made meanwhile wait for those limits too."""
        if self._sock is not sock:
            return
        if up:
            if self._hello[1] != self._link:  # the first connection's went out with the socket
                self._send_hello(sock)
            return
        lost, self._link = self._link, self._link + 1
        # Limits stated on the lost connection, even in an answer read only now, are not taken:
        # the next one's Hello asks again.
        self._known, self.broker_limits, self._hello = False, None, (0, -1)
        for cid, call in list(self._pending.items()):
            if call.fut.done() or call.link != lost or call.lost or call.held is not None:
                continue
            if call.msg is not None and not call.retried:
                call.lost = True
                continue
            del self._pending[cid]
            again = " again (it was already sent twice)" if call.retried else ""
            call.fut.set_exception(
                Unavailable(
                    Code.UNAVAILABLE,
                    f"the connection to the broker at {self.address} was lost{again} with "
                    f"this call in flight; it may or may not have run",
                )
            )

    def _send_hello(self, sock: zmq.asyncio.Socket) -> None:
        """Ask the broker for its limits on this connection (see `_welcomed`)."""
        ref = next(self._ids)
        self._known, self.broker_limits, self._hello = False, None, (ref, self._link)
        try:
            send(sock, p.Hello(id=ref))
        except (FlowmeshError, zmq.ZMQError) as exc:  # the socket failed: its reader is ending
            log.info("could not ask the broker at %s for its limits: %s", self.address, exc)

    def _welcomed(self, limits: p.Limits | None) -> None:
        """The broker answered the Hello of the current connection with its `limits` (None: it
        knows no Hello, so only the client's own limits apply): the calls made meanwhile go
        out, and those the last connection was lost with go once more, each unless it is over
        the broker's limits (`_check`)."""
        self.broker_limits, self._known, self.contacted = limits, True, True
        sock = self._sock
        if sock is None:
            return
        now = asyncio.get_running_loop().time()
        box: list[tuple[int, list[Any]]] = []
        for cid, call in list(self._pending.items()):
            if call.fut.done():
                continue
            again = call.held is None
            if call.held is not None:
                frames, call.held = call.held, None
            elif call.lost and call.msg is not None:
                call.lost, call.retried = False, True
                left = call.deadline - now
                if left <= 0:
                    continue  # its timeout ends it
                msg = call.msg
                if getattr(msg, "timeout_ms", None) is not None:
                    msg = msgspec.structs.replace(msg, timeout_ms=max(1, int(left * 1000)))
                frames = p.encode(msg)
            else:
                continue
            try:
                self._check(call.kind, frames, again)
            except TooLarge as exc:
                del self._pending[cid]
                call.fut.set_exception(exc)
                continue
            call.link = self._link
            box.append((cid, frames))
            if again:
                self.resent += 1
                log.info(
                    "sending call %d again: the connection to %s was lost with it in flight",
                    cid,
                    self.address,
                )
        self._send_box(sock, box)

    @staticmethod
    async def _drop(sock: zmq.asyncio.Socket, reader: asyncio.Task[None] | None) -> None:
        """Stop a socket's reader, then close it."""
        if reader is not None:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        sock.close(linger=0)

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        """The socket's only reader (batched, off pyzmq's asyncio layer: `read_frames`). Only a
        failing socket ends it: one answer it cannot handle is logged and skipped, as every
        other call on the socket still waits on it."""
        try:
            await read_frames(sock, self._on_frames)
        except zmq.ZMQError:
            # What closing the socket under the reader does: say so, instead of looking like
            # an orderly close().
            raise Unavailable(
                Code.UNAVAILABLE,
                f"its socket stopped receiving (socket closed: {sock.closed})",
            ) from None

    def _on_frames(self, frames: list[Any], member: bool = False) -> None:
        try:
            self._dispatch(frames, member)
        except Exception:
            log.exception("could not handle an answer from the broker at %s", self.address)

    def _dispatch(self, frames: list[Any], member: bool = False) -> None:
        try:
            msg = p.decode_member(frames, self.limits) if member else p.decode(frames, self.limits)
        except p.DecodeError as exc:
            # An answer this client refuses (over its own limits, say) still ends its call now.
            call = self._pending.pop(exc.ref, None) if exc.ref is not None else None
            log.warning("refused an answer from the broker: %s", exc)
            if call is not None and not call.fut.done():
                call.fut.set_exception(
                    error_from(exc.code, f"the broker's answer was refused: {exc.reason}")
                )
            return
        if type(msg) is p.Bundle:  # answers sent together: each as if it had come alone
            self.bundled_answers += len(msg.members)
            for frames in msg.members:
                self._on_frames(frames, member=True)
            return
        ref = getattr(msg, "id", None)
        if ref is not None and ref == self._hello[0]:
            self._hello_answered(msg)
            return
        if ref is None:
            if isinstance(msg, p.Error):
                self._unmatched_error(msg)
            else:
                log.debug("ignored %s from the broker: it answers no call", msg.TYPE)
            return
        if isinstance(msg, PARTS):
            part_of = self._pending.get(ref)
            if part_of is not None and part_of.on_part is not None and not part_of.fut.done():
                part_of.on_part(msg)
            return  # a part of an answer no call waits for any more
        call = self._pending.pop(ref, None)
        if call is None or call.fut.done():
            return  # answer to a call that already timed out
        if isinstance(msg, p.Error):
            call.fut.set_exception(error_from(msg.code, msg.reason))
        else:
            call.fut.set_result(msg)

    def _hello_answered(self, msg: p.Message) -> None:
        if isinstance(msg, p.Welcome):
            limits = p.Limits(
                max_message_bytes=msg.max_message_bytes, max_header_bytes=msg.max_header_bytes
            )
            self._welcomed(limits)
            return
        # An error: a broker that knows no Hello; it still refuses what is over its limits, but
        # a message over twice its limit drops the connection.
        reason = f"{msg.code}: {msg.reason}" if isinstance(msg, p.Error) else msg.TYPE
        log.warning(
            "the broker at %s did not state its limits (%s); only the client's own apply",
            self.address,
            reason,
        )
        self._welcomed(None)

    def _unmatched_error(self, msg: p.Error) -> None:
        """An error the broker could not give an id: it could not read the header of one of our
        messages. Our headers are well formed, so in practice the message was over a size limit
        of the broker's that the client's own `limits` did not catch.

        The broker answers each unreadable message once, so this fails exactly one call: the one
        with the largest message in flight (the oldest of equals), as size is what gets a
        well-formed message refused unread. Failing every call in flight would take innocent
        ones down with it, and failing none leaves the culprit to its timeout. Should the guess
        be wrong, one call fails early and the culprit still ends at its timeout.
        """
        live = [(cid, c) for cid, c in self._pending.items() if not c.fut.done() and c.held is None]
        if not live:
            log.warning(
                "the broker answered %s with no id and no call is in flight: %s",
                msg.code,
                msg.reason,
            )
            return
        cid, call = max(live, key=lambda item: (item[1].nbytes, -item[0]))
        del self._pending[cid]
        log.warning(
            "the broker answered %s with no id (%s); failing call %d, the largest in flight "
            "(%d bytes)",
            msg.code,
            msg.reason,
            cid,
            call.nbytes,
        )
        call.fut.set_exception(
            error_from(
                msg.code,
                f"{msg.reason} (the broker could not read the request's id; this call, the "
                f"largest in flight at {call.nbytes} bytes, is taken to be the one)",
            )
        )

    def _reader_done(self, sock: zmq.asyncio.Socket, task: asyncio.Task[None]) -> None:
        if self._reader is not task:
            return  # close() stopped it, and answers the calls in flight itself
        if task.cancelled():
            cause = "it was cancelled"
        else:
            exc = task.exception()
            cause = exc.reason if isinstance(exc, ClientError) else repr(exc)
        log.error(
            "the reader of the connection to %s stopped: %s; failing %d call(s) in flight",
            self.address,
            cause,
            len(self._pending),
        )
        # A fresh socket on the next call, rather than failing every later call for good: a
        # long-lived client (a web server's, say) recovers by itself, and if the cause persists,
        # the next reader stops at once too, so the next call still fails fast, not at its
        # timeout. The calls in flight cannot be saved: their answers went to this socket.
        self._reader = None
        self._sock = None
        self._stop_watcher(sock)
        sock.close(linger=0)
        self._fail_pending(
            Unavailable(
                Code.UNAVAILABLE,
                f"the connection to the broker at {self.address} broke: its reader stopped "
                f"({cause}); the call may or may not have run",
            )
        )

    def _fail_pending(self, exc: ClientError) -> None:
        pending, self._pending = self._pending, {}
        for call in pending.values():
            if not call.fut.done():  # one instance each: a raised exception collects a traceback
                call.fut.set_exception(type(exc)(exc.code, exc.reason))

    def _encode(self, msg: p.Message) -> tuple[list[Any], int]:
        """`msg`'s frames and the bytes they take on the wire (`_check`)."""
        try:
            frames = p.encode(msg)
        except FlowmeshError as exc:  # a tensor of a dtype that cannot travel, say
            raise error_from(exc.code, exc.reason) from None
        return frames, self._check(msg.TYPE, frames)

    def _check(self, kind: str, frames: list[Any], again: bool = False) -> int:
        """The bytes `frames` take on the wire; TooLarge if over the client's own limits or the
        broker's (when known; `again`: a call the connection was lost with, to be sent again).

        Checked before sending because the broker's socket drops a connection that carries a
        message over twice its limit, answer-less: the call would wait for its full timeout,
        and every other call in flight on the connection would lose its answer."""
        header = memoryview(frames[0]).nbytes
        total = sum(memoryview(f).nbytes for f in frames)
        own, broker = self.limits, self.broker_limits
        if header > own.max_header_bytes:
            why = (
                f"its header is {header} bytes, over the client's limit of "
                f"{own.max_header_bytes} (Limits.max_header_bytes)"
            )
        elif total > own.max_message_bytes:
            why = (
                f"it is {total} bytes, over the client's limit of {own.max_message_bytes} "
                f"(Limits.max_message_bytes); send fewer rows per call, or raise the limit on "
                f"the client and the broker (--max-message)"
            )
        elif broker is not None and header > broker.max_header_bytes:
            why = (
                f"its header is {header} bytes, over the limit of {broker.max_header_bytes} "
                f"of the broker at {self.address}"
            )
        elif broker is not None and total > broker.max_message_bytes:
            why = (
                f"it is {total} bytes, over the limit of {broker.max_message_bytes} of the "
                f"broker at {self.address} (its --max-message); send fewer rows per call, or "
                f"raise the broker's limit"
            )
        else:
            return total
        verb = "not sent again (the connection was lost with it in flight)" if again else "not sent"
        raise TooLarge(Code.TOO_LARGE, f"{kind} {verb}: {why}")

    async def call(
        self,
        msg: p.Message,
        timeout: float | None,
        *,
        on_part: Callable[[p.Message], None] | None = None,
    ) -> p.Message:
        """Send `msg` (its `id` from `next_id`) and return the broker's answer; an error answer
        raises its `ClientError`, and no answer within `timeout` (see `seconds`) and a grace
        raises `Timeout`. `on_part` takes the parts of the answer that come before it (PARTS:
        a streamed Generate's chunks), in order, on the loop; the timeout covers the whole."""
        sock = self.connect()  # first: a fresh socket knows no broker's limits yet
        frames, nbytes = self._encode(msg)
        ref: int = msg.id  # type: ignore[attr-defined]
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[p.Message] = loop.create_future()
        limit = self.seconds(timeout)
        pending = PendingCall(fut, nbytes, msg.TYPE, link=self._link, on_part=on_part)
        if isinstance(msg, RETRYABLE):
            pending.msg, pending.deadline = msg, loop.time() + limit
        self._pending[ref] = pending
        first: asyncio.TimerHandle | None = None
        if not self._known:
            pending.held = frames  # until the broker states its limits (`_welcomed`)
            if not self.contacted and self.connect_timeout is not None:
                wait = min(self.connect_timeout, limit)
                first = loop.call_later(wait, self._no_contact, ref, wait)
        elif self._outbox is not None and self._outbox_sock is sock:
            self._outbox.append((ref, frames))  # goes with the other calls of this loop turn
        else:
            # The calls made in one loop turn (many tasks calling at once, the tasks that
            # answers just woke, a gateway's requests read in one turn) go together at the
            # start of the next, in one bundle: one send, one wake-up of the broker and one
            # read there for all of them. (The first call of a turn once went at once, alone:
            # a ZeroMQ send more per turn, 10-20 us of CPU on each side of
            # `scripts/bench_gateway.py`, for no measurable latency.)
            self._outbox, self._outbox_sock = [(ref, frames)], sock
            loop.call_soon(self._send_outbox)
        return await self._answer(pending, ref, limit, first)

    async def _answer(
        self,
        pending: PendingCall,
        ref: int,
        limit: float,
        first: asyncio.TimerHandle | None = None,
    ) -> p.Message:
        """Wait for the answer of call `ref` (sent, or held, as `pending`) for `limit` seconds
        and a grace; `first`: its connect timeout, ended with it."""
        # A timer on the call's own future, not wait_for (a task and two futures per call).
        fut = pending.fut
        timer = asyncio.get_running_loop().call_later(limit + GRACE_S, expire_call, fut)
        try:
            return await fut
        except TimeoutError:
            again = ""
            if pending.held is not None:
                again = " (not sent: the broker has not answered this client since it connected)"
            elif pending.retried:
                again = " (sent again after the connection to the broker was lost)"
            elif pending.lost:
                again = (
                    " (the connection to the broker was lost with it in flight, and is not back)"
                )
            raise Timeout(
                Code.TIMEOUT,
                f"no answer from the broker at {self.address} within {limit:.1f} s{again}",
            ) from None
        finally:
            timer.cancel()
            if first is not None:
                first.cancel()
            self._pending.pop(ref, None)

    def notify(self, msg: p.Message) -> bool:
        """Send `msg`, a message the broker does not answer (StopGenerate), after the calls
        already on their way; False when it cannot go now (no connection, or one whose broker
        has not stated its limits yet): then what it refers to went out on a connection lost
        since, or has not gone out at all, and the message would mean nothing."""
        sock = self._sock
        if sock is None or not self._known:
            return False
        frames = self._encode_notice(msg)
        if frames is None:
            return False
        if self._outbox is not None and self._outbox_sock is sock:
            self._outbox.append((0, frames))  # behind this loop turn's calls (no call id is 0)
            return True
        try:
            send_frames(sock, frames)
        except (FlowmeshError, zmq.ZMQError) as exc:
            log.info("could not send %s to %s: %s", msg.TYPE, self.address, exc)
            return False
        return True

    def _encode_notice(self, msg: p.Message) -> list[Any] | None:
        """`notify`'s frames for `msg`, checked against the limits; None (logged) if over."""
        try:
            frames, _ = self._encode(msg)
        except ClientError as exc:
            log.warning("could not send %s: %s", msg.TYPE, exc.reason)
            return None
        return frames

    def _no_contact(self, ref: int, wait: float) -> None:
        """Call `ref`'s connect timeout: if it still waits for the first contact with a broker
        (see the module's docstring), no broker is there to answer it."""
        call = self._pending.get(ref)
        if self.contacted or call is None or call.fut.done() or call.held is None:
            return
        del self._pending[ref]
        call.fut.set_exception(
            Unavailable(
                Code.UNAVAILABLE,
                f"no broker answers at {self.address} within {wait:.1f} s, the client's "
                f"connect timeout (is 'flowmesh up' running?)",
            )
        )

    def _send_error(self, exc: BaseException) -> ClientError:
        if isinstance(exc, FlowmeshError):
            return error_from(exc.code, f"cannot send to {self.address}: {exc.reason}")
        # A ZMQError: the socket failed under the reader, which is ending.
        return Unavailable(Code.UNAVAILABLE, f"cannot send to {self.address}: {exc}")

    def _send_outbox(self) -> None:
        """Send the calls collected since the last send of a loop turn, bundled; a send that
        fails fails its calls."""
        box, sock = self._outbox or [], self._outbox_sock
        self._outbox = self._outbox_sock = None
        if sock is not None:
            self._send_box(sock, box)

    def _send_box(self, sock: zmq.asyncio.Socket, box: list[tuple[int, list[Any]]]) -> None:
        """Send calls (id, frames) bundled, within the broker's limits; a send that fails fails
        its calls."""
        if not box:
            return
        limits, broker = self.limits, self.broker_limits
        if broker is not None:  # a bundle stays within half the smaller limit
            smaller = min(limits.max_message_bytes, broker.max_message_bytes)
            limits = dataclasses.replace(limits, max_message_bytes=smaller)
        sends = send_encoded_bundled(sock, [frames for _, frames in box], limits=limits)
        for taken, exc in sends:
            if exc is None:
                if len(taken) > 1:
                    self.bundled_calls += len(taken)
                continue
            for i in taken:
                call = self._pending.pop(box[i][0], None)
                if call is not None and not call.fut.done():
                    call.fut.set_exception(self._send_error(exc))

    async def close(self) -> None:
        """Close the connection; calls still in flight fail with UNAVAILABLE."""
        reader, self._reader = self._reader, None  # tells _reader_done that this is no failure
        sock, self._sock = self._sock, None
        if reader is not None:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        if sock is not None:
            self._stop_watcher(sock)
        # Every monitor and dropped socket closed before the context ends (or term() waits).
        if self._bg:
            _, late = await asyncio.wait(set(self._bg), timeout=1.0)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        self._fail_pending(ClientError(Code.UNAVAILABLE, "client closed"))
        if sock is not None:
            sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None


def expire_call(fut: asyncio.Future[p.Message]) -> None:
    """A call's timer: no answer in time (`call` turns it into Timeout)."""
    if not fut.done():
        fut.set_exception(TimeoutError())


def is_tensor(t: Any) -> bool:
    """Whether `t` is a torch tensor, without importing torch: nothing is one before torch is
    imported, and the SDK's calls that carry no tensors (status, deploy, generate) leave torch
    unimported, so that the CLI starts in a fraction of torch's import time."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(t, torch.Tensor)


def sendable(t: Any) -> Any:
    """A tensor as it can travel (contiguous, on the CPU); anything else as it is."""
    if is_tensor(t) and (t.device.type != "cpu" or not t.is_contiguous()):
        return t.detach().to("cpu").contiguous()
    return t
