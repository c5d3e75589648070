"""ZeroMQ plumbing shared by every process: sockets with deliberate options, sends that make
back-pressure visible, and the one reader loop per socket that validates and answers.

Pitfalls handled here once (docs/ARCHITECTURE.md): ROUTER_MANDATORY so mail to a vanished peer
raises instead of being dropped; routing ids the ROUTER chooses, never the peer
(ROUTER_HANDOVER off, so no connection can take another's, and seeded, see `_seed_routing_ids`);
a short LINGER so closing never hangs; every send is non-blocking, so a full high-water mark
becomes an OVERLOADED error for the sender of the request rather than a stalled event loop.

With CURVE keys (`flowmesh.auth`), the ROUTERs are CURVE servers checked by ZAP, and a reader
passes each message's ZAP User-Id (its key's certificate name) on to the handler (`with_user`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import select
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

from flowmesh.auth import CurveKeys, curve_client, curve_server, user_id
from flowmesh.errors import Code, FlowmeshError
from flowmesh.logs import LogThrottle
from flowmesh.protocol import (
    DEFAULT_LIMITS,
    Bundle,
    DecodeError,
    Error,
    Limits,
    Message,
    bundled,
    decode,
    decode_member,
    encode,
    error_for,
)

LINGER_MS = 200

# pyzmq's constants are enum members, and flag arithmetic on them costs microseconds; the
# readers and senders below use them several times per message, so as plain ints.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


class PeerGone(FlowmeshError):
    """The peer an address names is not connected (ROUTER_MANDATORY)."""

    def __init__(self, reason: str) -> None:
        super().__init__(Code.UNAVAILABLE, reason)


def _common(sock: zmq.Socket, limits: Limits, hwm: int) -> None:
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    # Hard cap: a frame beyond twice the soft limit drops the peer before it fills memory;
    # below that, decode() answers TOO_LARGE with an error reply.
    sock.setsockopt(zmq.MAXMSGSIZE, 2 * limits.max_message_bytes)


@functools.cache
def _seed_routing_ids() -> None:
    """Seed C's rand(), from which libzmq 4.3 draws the first routing id a ROUTER gives a peer
    (then counts up). Nothing else seeds it, so every process's first ROUTER gives out
    0x006b8b4567 first: a stranger could connect under the id the next peer will get, and
    libzmq aborts the whole process when the two meet (socket_base.cpp, add_out_pipe). Seeded
    from the OS, the next id is one of 2**32."""
    with contextlib.suppress(OSError, AttributeError):  # no C library to seed: nothing to do
        ctypes.CDLL(None).srand(ctypes.c_uint(int.from_bytes(os.urandom(4), "little")))


def bind_router(
    ctx: zmq.asyncio.Context,
    endpoint: str,
    limits: Limits = DEFAULT_LIMITS,
    hwm: int = 10_000,
    *,
    curve: tuple[bytes, str] | None = None,
) -> tuple[zmq.asyncio.Socket, str]:
    """A bound ROUTER and the endpoint it really got (port 0 / '*' picks a free port).

    `curve`: (the broker's secret key, ZAP domain) to make it a CURVE server.

    ROUTER_HANDOVER is off, with keys or without: a connection claiming a routing id another
    one holds is ignored by libzmq (nothing it sends is read, nothing is sent to it), so none
    can take over a live peer's mail. Our peers set no routing id; the ROUTER numbers them."""
    _seed_routing_ids()
    sock = ctx.socket(zmq.ROUTER)
    _common(sock, limits, hwm)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
    if curve:
        curve_server(sock, *curve)
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        endpoint = endpoint[:-2] + ":*"
    sock.bind(endpoint)
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


def connect_dealer(
    ctx: zmq.asyncio.Context,
    endpoint: str,
    identity: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
    hwm: int = 10_000,
    *,
    curve: CurveKeys | None = None,
    monitor: int = 0,
) -> zmq.asyncio.Socket:
    """A DEALER connected to `endpoint`; a CURVE client of it with `curve` keys. `monitor`:
    the events of a monitor started before the connection is (`flowmesh.auth.watch_handshakes`
    reads it), so that none of them comes and goes before anyone watches."""
    sock = ctx.socket(zmq.DEALER)
    _common(sock, limits, hwm)
    if curve:
        curve_client(sock, curve)
    if identity:
        sock.setsockopt(zmq.ROUTING_ID, identity.encode())
    if monitor:
        sock.get_monitor_socket(monitor)
    try:
        sock.connect(endpoint)
    except zmq.ZMQError:
        # (An address libzmq does not take.) Closed at once: a socket left open would hold its
        # context's term, and the program's exit, for good. Its monitor is stopped before the
        # monitor's PAIR is closed: stopping sends a last event to that PAIR, and a send to a PAIR
        # whose peer is gone blocks for ever, holding the GIL (`flowmesh.auth.watch_handshakes`).
        if monitor:
            events = sock.get_monitor_socket()
            sock.disable_monitor()
            events.close(linger=0)
        sock.close(linger=0)
        raise
    return sock


class _Channel:
    """A pumped socket's fast path: a plain (sync) shadow of the same libzmq socket, read and
    written with NOBLOCK, bypassing pyzmq's asyncio layer (a future and poller round per
    message), and how to wake its reader while the socket is empty.

    A libzmq socket may be used by one thread at a time. Its loop uses it, and `send_from_thread`
    lets other threads of the process send on it too (a worker's compute lane answering its own
    run): every use of the socket holds `lock` (uncontended, a fraction of a microsecond), and
    `open` turns False, under the lock, when the reader ends, before anyone closes the socket.

    The reader is the loop's callback for the socket's FD (`read_frames`: `kick` has it read
    soon, `idle` says it waits) or a thread of its own (`read_frames_on_thread`: it waits on the
    socket's FD and `wake_w`, a pipe)."""

    __slots__ = (
        "handled",
        "idle",
        "kick",
        "lock",
        "loop",
        "open",
        "posted",
        "reader_ident",
        "sync",
        "wake_w",
    )

    def __init__(self, sock: zmq.Socket, loop: asyncio.AbstractEventLoop) -> None:
        self.sync = zmq.Socket.shadow(sock.underlying)
        # A loop reader's (`read_frames`): it waits for the FD (nothing to read, nothing being
        # handled), and how to have it read soon (from the loop's thread).
        self.idle = False
        self.kick: Callable[[], None] | None = None
        self.lock = threading.Lock()
        self.loop = loop
        self.open = True
        # A reader thread's: its pipe's write end (-1: the reader is a task of the loop), its
        # thread, and the messages it passed to the loop and those the loop has handled.
        self.wake_w = -1
        self.reader_ident: int | None = None
        self.posted = self.handled = 0

    def readable(self) -> bool:
        """A whole message is queued (reading the events also re-arms the FD's edge)."""
        with self.lock:
            return self._readable_locked()

    def _readable_locked(self) -> bool:
        return bool(self.sync.getsockopt(_EVENTS) & _POLLIN)

    def recv(self) -> list[zmq.Frame]:
        """One queued message's frames (pyzmq's recv_multipart asks RCVMORE of the socket
        after each frame; the frame knows it)."""
        with self.lock:
            return self._recv_locked()

    def _recv_locked(self) -> list[zmq.Frame]:
        recv = self.sync.recv
        frame = recv(_NOBLOCK, copy=False)
        frames = [frame]
        while frame.more:
            frame = recv(_NOBLOCK, copy=False)
            frames.append(frame)
        return frames

    def recv_queued(self, sock: zmq.Socket) -> list[zmq.Frame] | None:
        """A reader thread's read of `sock` (this channel's): the next queued message's frames,
        None when there is none. Raises ENOTSOCK once the reader has ended or the socket is
        closed (the shadow's handle is freed with the socket: never touch it then)."""
        with self.lock:
            if not self.open or sock.closed:
                raise zmq.ZMQError(zmq.ENOTSOCK)
            if not self._readable_locked():
                return None
            return self._recv_locked()

    def send(self, frames: list[Any]) -> None:
        with self.lock:
            self._send_locked(frames)

    def _send_locked(self, frames: list[Any]) -> None:
        send = self.sync.send
        last = len(frames) - 1
        for i, frame in enumerate(frames):
            send(frame, _NOBLOCK | _SNDMORE if i < last else _NOBLOCK, copy=False)

    def wake(self) -> None:
        if self.kick is not None:
            self.kick()

    def ping(self) -> None:
        """Wake a reader thread (a byte down its pipe; a full pipe already wakes it)."""
        with self.lock:  # the thread closes the pipe under it as it ends
            if self.wake_w >= 0:
                with contextlib.suppress(BlockingIOError):
                    os.write(self.wake_w, b"\0")

    def poke(self) -> None:
        """After a send from the loop: libzmq's FD is edge-triggered and a send may consume
        the edge of messages that arrived meanwhile, so look at the socket's events and wake a
        waiting reader if it has input (pyzmq's asyncio layer does the same after its sends)."""
        if self.wake_w >= 0:
            if self.readable():
                self.ping()
        elif self.idle and self.readable():
            self.wake()

    def input_seen(self) -> None:
        """A send from a thread other than the loop's found input queued: wake its reader,
        unless the sender is the reader thread itself (it looks again before it waits)."""
        if self.wake_w >= 0:
            if threading.get_ident() != self.reader_ident:
                self.ping()
        else:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody reads any more
                self.loop.call_soon_threadsafe(self.wake)


# Sockets read by `pump`: `send` to them takes the same fast path and keeps their reader awake.
_CHANNELS: weakref.WeakKeyDictionary[zmq.Socket, _Channel] = weakref.WeakKeyDictionary()


def _send_failed(exc: BaseException) -> None:
    if isinstance(exc, zmq.Again):
        raise FlowmeshError(Code.OVERLOADED, "peer queue full (high-water mark reached)")
    if isinstance(exc, zmq.ZMQError) and exc.errno == zmq.EHOSTUNREACH:
        raise PeerGone("peer is not connected")
    raise exc


def send_from_thread(sock: zmq.asyncio.Socket, frames: list[Any]) -> bool:
    """`send_frames` from a thread other than the socket's event loop, where the socket has a
    reader (`read_frames`). False, with nothing sent, when it cannot go now: no reader (the
    socket is closing), a full queue, a peer gone; the caller then hands the message to the
    loop, whose own send says what happened.

    The socket's owner must end its reader before it touches the socket otherwise (a
    monitor, close): from then on no thread sends on it."""
    chan = _CHANNELS.get(sock)
    if chan is None:
        return False
    with chan.lock:  # the loop neither reads nor sends on the socket meanwhile
        if not chan.open or sock.closed:
            return False
        try:
            chan._send_locked(frames)
        except zmq.ZMQError:  # the first frame was refused: nothing went out
            return False
        # The send may have taken the FD edge of a message that arrived meanwhile.
        waiting = chan._readable_locked()
    if waiting:
        chan.input_seen()
    return True


def send(sock: zmq.asyncio.Socket, msg: Message, envelope: list[Any] | None = None) -> None:
    """Send now or raise: OVERLOADED when the peer's queue is full, PeerGone when it is gone."""
    send_frames(sock, [*(envelope or []), *encode(msg)])


def send_frames(sock: zmq.asyncio.Socket, frames: list[Any]) -> None:
    """`send` of frames already encoded (the envelope first, if any)."""
    chan = _CHANNELS.get(sock)
    if chan is not None:
        if sock.closed:  # the shadow's handle is freed with the socket: never touch it
            _send_failed(zmq.ZMQError(zmq.ENOTSOCK))
        try:
            chan.send(frames)
        except zmq.ZMQError as exc:
            _send_failed(exc)
        finally:
            chan.poke()
        return
    fut = sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
    exc = fut.exception() if fut.done() else None
    if exc is not None:
        _send_failed(exc)


# (sender's address, message), and with `with_user` the connection's ZAP User-Id third.
Handler = Callable[..., Awaitable[None] | None]
# Told of a message the codec refused that named its type and id: (sender, id, type, error).
Refused = Callable[[bytes | None, int, str, DecodeError], None]

# A recv on a socket with queued messages completes without yielding to the event loop, so a
# reader fed faster than it handles would starve every other task (timers, heartbeats, the
# other socket's reader). It lets the loop turn after this many messages.
YIELD_EVERY = 32

# How often a reader waiting on an empty socket looks whether it was closed under it.
CLOSED_CHECK_S = 1.0


async def pump(
    sock: zmq.asyncio.Socket,
    handle: Handler,
    *,
    routed: bool,
    log: logging.Logger,
    limits: Limits = DEFAULT_LIMITS,
    with_user: bool = False,
    here: Callable[[list[Any]], bool] | None = None,
    init: Callable[[], None] | None = None,
    on_bundle: Callable[[bytes | None], None] | None = None,
    on_refused: Refused | None = None,
) -> None:
    """The socket's only reader: decode, validate, dispatch; answer every failure, never die.

    `routed` sockets (ROUTER) carry the sender's identity as the first frame; replies go back to
    it. A handler may be sync (preferred: the broker's state changes are) or a coroutine. Only a
    failing socket ends the reader; whatever one message does is answered and logged.

    It reads through `read_frames`, and must stay the socket's only reader for its life; with
    `here`, through `read_frames_on_thread` (`here` and `init` as there), and the loop handles
    what `here` leaves to it.

    `on_bundle(sender)` is called for each bundle received, before its members are handled:
    a sender that sends bundles can take them (see `protocol.Bundle`). `on_refused`: as in
    `handle_one`.
    """
    throttle = LogThrottle(log)

    def one(frames: list[Any]) -> Awaitable[None] | None:
        return handle_one(
            sock,
            frames,
            handle,
            routed=routed,
            log=log,
            limits=limits,
            throttle=throttle,
            with_user=with_user,
            on_bundle=on_bundle,
            on_refused=on_refused,
        )

    if here is None:
        await read_frames(sock, one)
    else:
        await read_frames_on_thread(sock, one, here, init=init, log=log)


async def read_frames(
    sock: zmq.asyncio.Socket, on_frames: Callable[[list[Any]], Awaitable[None] | None]
) -> None:
    """Be the socket's only reader: call `on_frames` with each message's frames, in order.

    It reads in batches through a sync shadow of the socket (NOBLOCK until empty, at most
    YIELD_EVERY before the loop turns), right in the loop's callback for the socket's FD: no
    pyzmq future per message, and no task to wake up either, which would cost a turn of the
    loop on every message's way in. `send` to the socket takes the same path. A coroutine that
    `on_frames` returns is awaited (on a task) before the next message is read. Ends only by
    cancellation or when the socket fails (a ZMQError: closed under the reader, say), or when
    `on_frames` raises, which it must not."""
    loop = asyncio.get_running_loop()
    chan = _CHANNELS[sock] = _Channel(sock, loop)
    fd = chan.sync.getsockopt(zmq.FD)
    # pyzmq registers its own reader on this FD the first time it needs the loop; have that
    # happen now, so that it cannot later replace ours (the loop keeps one reader per FD).
    if hasattr(sock, "_get_loop"):
        sock._get_loop()
    ended: asyncio.Future[None] = loop.create_future()
    busy: list[asyncio.Task[None]] = []  # the task awaiting a coroutine of `on_frames`
    scheduled = False

    def stop(exc: BaseException) -> None:
        chan.idle = False
        if not ended.done():
            ended.set_exception(exc)

    def drain() -> None:
        nonlocal scheduled
        scheduled = False
        if ended.done():
            return
        if busy:  # a message is still being handled: it reads on once that is done
            with contextlib.suppress(zmq.ZMQError):
                chan.readable()  # takes the FD's signal, which would fire again and again
            return
        chan.idle = False
        n = 0
        try:
            while n < YIELD_EVERY:
                if sock.closed:  # the shadow's handle is freed with the socket: never touch it
                    raise zmq.ZMQError(zmq.ENOTSOCK)
                if not chan.readable():
                    chan.idle = True  # empty (just seen): until the FD fires or a `kick`
                    return
                try:
                    frames = chan.recv()
                except zmq.Again:  # readable() said a message was queued; never mind it
                    chan.idle = True
                    return
                n += 1
                result = on_frames(frames)
                if result is not None:
                    busy.append(loop.create_task(finish(result)))
                    return
        except BaseException as exc:  # the socket failed, or `on_frames` raised: it ends
            stop(exc)
            return
        kick()  # YIELD_EVERY read: more may be queued, but the loop turns first (fairness)

    async def finish(result: Awaitable[None]) -> None:
        try:
            await result
        except asyncio.CancelledError:  # the reader is ending (its own cancellation)
            raise
        except BaseException as exc:
            stop(exc)
            return
        finally:
            busy.clear()
        kick()

    def kick() -> None:
        nonlocal scheduled
        if not scheduled and not ended.done():
            scheduled = True
            loop.call_soon(drain)

    def look() -> None:
        # Closing the socket under its reader takes the FD's loop reader with it (pyzmq clears
        # its own): look again every CLOSED_CHECK_S, so that the reader ends rather than waits
        # for ever.
        nonlocal check
        kick()
        check = loop.call_later(CLOSED_CHECK_S, look)

    chan.kick = kick
    loop.add_reader(fd, drain)
    check = loop.call_later(CLOSED_CHECK_S, look)
    kick()  # what was queued before the reader started
    try:
        await ended
    finally:
        check.cancel()
        chan.kick, chan.idle = None, False
        for task in busy:
            task.cancel()
        with chan.lock:  # no other thread sends on it from now on (`send_from_thread`)
            chan.open = False
        if _CHANNELS.get(sock) is chan:
            del _CHANNELS[sock]
        with contextlib.suppress(Exception):
            loop.remove_reader(fd)


async def read_frames_on_thread(
    sock: zmq.asyncio.Socket,
    on_frames: Callable[[list[Any]], Awaitable[None] | None],
    here: Callable[[list[Any]], bool],
    *,
    init: Callable[[], None] | None = None,
    log: logging.Logger | None = None,
    name: str = "reader",
) -> None:
    """`read_frames` with the reading done by a thread of its own, which offers each message to
    `here(frames)` first: True when `here` handled it there, on the reader thread; the rest go
    to `on_frames` on the loop, in order, in batches (one loop wake-up each).

    What it is for: a worker computes a small model's run on the thread that read it. Handed
    to another thread instead, the run waits for that thread to wake up, and trades the GIL
    with the loop, which cost more than the run itself (scripts/bench_broker.py). The thread
    waits on the socket's FD with the GIL released, as the loop would.

    Order is kept: a message is offered to `here` only when the loop has handled every message
    passed to it before (a run never overtakes the Load before it). `here` must not raise (what
    it raises is logged, and the message counts as handled); `init` runs first on the thread.
    Like `read_frames`, it ends by cancellation, when the socket fails, or when `on_frames`
    raises; once it has ended, the thread no longer touches the socket (it may still be inside
    `here`, whose sends then find no reader)."""
    log = log or logging.getLogger("transport")
    loop = asyncio.get_running_loop()
    chan = _CHANNELS[sock] = _Channel(sock, loop)
    fd = chan.sync.getsockopt(zmq.FD)
    # pyzmq's own reader on the FD, registered the first time it needs the loop, would read the
    # socket's events on the loop thread, under the reader thread: register it now, and remove
    # it, so that the thread is the FD's only watcher.
    if hasattr(sock, "_get_loop"):
        sock._get_loop()
    with contextlib.suppress(Exception):
        loop.remove_reader(fd)
    wake_r, chan.wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(chan.wake_w, False)
    stop = threading.Event()
    # What the thread hands the loop: batches of messages, then how it ended (None: stopped).
    inbox: asyncio.Queue[list[list[Any]] | BaseException | None] = asyncio.Queue()

    def post(item: list[list[Any]] | BaseException | None) -> None:
        if isinstance(item, list):
            chan.posted += len(item)
        loop.call_soon_threadsafe(inbox.put_nowait, item)

    def read() -> None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.register(wake_r, select.POLLIN)
        batch: list[list[Any]] = []
        while not stop.is_set():
            frames = chan.recv_queued(sock)
            if frames is None:  # empty (just seen): hand over what is the loop's, then wait
                if batch:
                    post(batch)
                    batch = []
                _wait_for_input(poller, wake_r)
                continue
            if not batch and chan.handled == chan.posted:
                try:
                    if here(frames):
                        continue
                except Exception:
                    log.exception("handling a message on the reader thread")
                    continue
            batch.append(frames)
            if len(batch) >= YIELD_EVERY:
                post(batch)
                batch = []

    def body() -> None:
        chan.reader_ident = threading.get_ident()
        end: BaseException | None = None
        try:
            if init is not None:
                init()
            read()
        except BaseException as exc:  # it ends the reader (if the reader has not ended first)
            end = exc
        finally:
            with chan.lock:  # no more pings into a pipe that is closing
                wake_w, chan.wake_w = chan.wake_w, -1
            os.close(wake_r)
            os.close(wake_w)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            post(end)

    threading.Thread(target=body, name=name, daemon=True).start()
    try:
        # As `read_frames` does: each message handled (a coroutine handler's awaited) before
        # the next, a failure ends the reader, and the loop turns after each batch.
        while True:
            item = await inbox.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            for frames in item:
                result = on_frames(frames)
                if result is not None:
                    await result
                chan.handled += 1
            await asyncio.sleep(0)
    finally:
        stop.set()
        chan.ping()
        with chan.lock:  # from here the thread neither reads nor sends on the socket
            chan.open = False
        if _CHANNELS.get(sock) is chan:
            del _CHANNELS[sock]


def _wait_for_input(poller: select.poll, wake_r: int) -> None:
    """A reader thread's sleep, GIL released: until the socket's FD fires, a ping comes down
    its pipe (`_Channel.ping`), or CLOSED_CHECK_S pass."""
    for fd, _ in poller.poll(CLOSED_CHECK_S * 1000):
        if fd == wake_r:  # emptied only when pinged: a read of an empty pipe costs a raise
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)


def handle_one(
    sock: zmq.asyncio.Socket,
    frames: list[Any],
    handle: Handler,
    *,
    routed: bool,
    log: logging.Logger,
    limits: Limits = DEFAULT_LIMITS,
    throttle: LogThrottle | None = None,
    with_user: bool = False,
    member: bool = False,
    on_bundle: Callable[[bytes | None], None] | None = None,
    on_refused: Refused | None = None,
) -> Awaitable[None] | None:
    """Decode and dispatch one received message; answer any failure with an Error. Never
    raises (except cancellation): one message must not end its socket's reader.

    Synchronous when the handler is (no coroutine per message); for a coroutine handler it
    returns what to await, which answers that handler's failure the same way.

    A bundle's members are handled one by one, in order, as if each had come alone (`member`:
    this is one of them, and may not be a bundle itself), after `on_bundle(sender)`.

    `with_user`: the handler takes the ZAP User-Id of the connection as a third argument
    (None when the connection has none).

    `on_refused(sender, id, type, error)`: a message the codec refused whose header carried
    its type and id, besides the Error answered to its sender (a refused answer must fail the
    call it answers now, not at that call's deadline). A failure in it is logged, not raised."""
    throttle = throttle or LogThrottle(log)
    if routed:
        if not frames:
            return None
        envelope, body = frames[:1], frames[1:]
        peer: bytes | None = envelope[0].bytes if hasattr(envelope[0], "bytes") else envelope[0]
    else:
        envelope, body, peer = [], frames, None
    try:
        msg = decode_member(body, limits) if member else decode(body, limits)
    except DecodeError as exc:
        if throttle.allow():
            log.warning("rejected message from %r: %s", peer, exc)
        _answer(sock, envelope, error_for(exc), throttle)
        if on_refused is not None and exc.ref is not None and exc.type is not None:
            try:
                on_refused(peer, exc.ref, exc.type, exc)
            except Exception:
                log.exception("handling a refused %s from %r", exc.type, peer)
        return None
    except Exception as exc:  # a decoder bug: the message is still the sender's fault
        if throttle.allow():
            log.exception("could not decode a message from %r", peer)
        reason = f"undecodable message: {type(exc).__name__}"
        _answer(sock, envelope, Error(id=None, code=str(Code.BAD_MESSAGE), reason=reason), throttle)
        return None

    if type(msg) is Bundle:
        if on_bundle is not None:
            on_bundle(peer)
        members = [[*envelope, *m] for m in msg.members]
        return _handle_members(
            sock,
            members,
            handle,
            routed=routed,
            log=log,
            limits=limits,
            throttle=throttle,
            with_user=with_user,
            on_refused=on_refused,
        )

    def refused(exc: Exception) -> None:
        # Throttled: a refusal (OVERLOADED under a flood) or a handler bug a peer can trigger
        # at will must not turn into a log line per message.
        if not throttle.allow():
            pass
        elif isinstance(exc, FlowmeshError):
            log.info("refused %s from %r: %s", msg.TYPE, peer, exc)
        else:
            log.exception("handler failed on %s from %r", msg.TYPE, peer)
        if isinstance(msg, Error):
            return  # never answer an error with an error: two peers would bounce it forever
        _answer(sock, envelope, error_for(exc, getattr(msg, "id", None)), throttle)

    try:
        result = handle(peer, msg, user_id(frames[-1])) if with_user else handle(peer, msg)
    except Exception as exc:
        refused(exc)
        return None
    if result is None:
        return None

    async def finish(pending: Awaitable[None]) -> None:
        try:
            await pending
        except Exception as exc:
            refused(exc)

    return finish(result)


def _handle_members(
    sock: zmq.asyncio.Socket, members: list[list[Any]], handle: Handler, **kw: Any
) -> Awaitable[None] | None:
    """A bundle's members (each with the envelope), in order. A coroutine handler's member is
    awaited before the next one is handled, as `read_frames` does for whole messages."""
    for i, frames in enumerate(members):
        pending = handle_one(sock, frames, handle, member=True, **kw)
        if pending is not None:
            return _handle_rest(pending, sock, members[i + 1 :], handle, kw)
    return None


async def _handle_rest(
    pending: Awaitable[None],
    sock: zmq.asyncio.Socket,
    members: list[list[Any]],
    handle: Handler,
    kw: dict[str, Any],
) -> None:
    await pending
    for frames in members:
        more = handle_one(sock, frames, handle, member=True, **kw)
        if more is not None:
            await more


def send_bundled(
    sock: zmq.asyncio.Socket,
    messages: list[Message],
    envelope: list[Any] | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> list[tuple[list[Message], BaseException]]:
    """Send `messages` to one peer, in order, bundled (`protocol.bundled`). Never raises: what
    could not go out is returned, each failure with the messages it took (one that cannot be
    encoded alone; all the messages of a send that failed)."""
    if len(messages) == 1:  # the common case at low load: nothing to bundle
        try:
            send(sock, messages[0], envelope)
        except Exception as exc:
            return [(messages, exc)]
        return []
    failed: list[tuple[list[Message], BaseException]] = []
    encoded: list[list[Any]] = []
    kept: list[Message] = []
    for msg in messages:
        try:
            encoded.append(encode(msg))
            kept.append(msg)
        except Exception as exc:
            failed.append(([msg], exc))
    for taken, exc in send_encoded_bundled(sock, encoded, envelope, limits):
        if exc is not None:
            failed.append(([kept[i] for i in taken], exc))
    return failed


def send_encoded_bundled(
    sock: zmq.asyncio.Socket,
    encoded: list[list[Any]],
    envelope: list[Any] | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> list[tuple[range, BaseException | None]]:
    """Send encoded messages (each its frames) to one peer, in order, bundled
    (`protocol.bundled`). Never raises: returns each send, as the indices of the messages it
    took and what it raised (None: it went)."""
    sends: list[tuple[range, BaseException | None]] = []
    at = 0
    for count, frames in bundled(encoded, limits):
        try:
            send_frames(sock, [*(envelope or []), *frames])
            sends.append((range(at, at + count), None))
        except Exception as exc:
            sends.append((range(at, at + count), exc))
        at += count
    return sends


def _answer(
    sock: zmq.asyncio.Socket, envelope: list[Any], reply: Message, throttle: LogThrottle
) -> None:
    # Throttled: a peer that floods garbage and leaves makes every one of its answers fail.
    try:
        send(sock, reply, envelope)
    except FlowmeshError as exc:
        throttle.warning("could not answer %r: %s", envelope, exc.reason)
    except Exception:  # an answer that cannot go out must not take the reader down with it
        throttle.exception("could not answer %r", envelope)
