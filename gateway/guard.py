"""Who may call the gateway, how much they may send, and the count of what was answered.

`Guard` is the app's door (`gateway.app.GatewayApp`: in front of FastAPI's own layers; an
exception that passes it is the server's last-resort 500):
- With an API key file (`flowmesh keys add NAME --role client|operator --api`): every route but
  the open ones (`OPEN_PATHS`: probes and scrapers carry no key) needs `Authorization: Bearer
  KEY` of a key in the file, else 401 in the route's protocol's error body. The file is read
  again when it changes, so a key added or removed counts from the next request on.
- Without one: loopback callers only (403 for any other), unless `insecure_open`.
- Headers over `max_header` bytes in all are refused with 431, before anything else is read
  of them (a head far over it, or slow to come, is refused before it reaches the app:
  `gateway.http_protocol`).
- A body over `max_body` bytes is refused with 413: from its Content-Length before any of it is
  read, else as soon as the bytes read pass it (the routes read whole bodies anyway, so the
  guard reads it for them and hands it on in one piece). A body not all there `body_timeout`
  seconds after the headers is answered 408: a client that sends slowly, or stops, does not
  hold its request (and the connection's task) for ever.
- Every answer is counted in the app's `GatewayMetrics`: by route template, status and model,
  its time to first byte by route.
- The hot routes (`fast`: KServe v2 infer) it serves itself once it let the request in and read
  its body, past the app's routing and layers, with the same answers.

`Streams` bounds the server-sent event streams each key holds open at once (429 beyond).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from fastapi import Request
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flowmesh.auth import API_KEYS, Identity, api_key_hash, read_api_keys
from flowmesh.errors import Code, FlowmeshError
from gateway import BODY_TIMEOUT_S
from gateway.errors import error_response
from gateway.metrics import GatewayMetrics

log = logging.getLogger("flowmesh.gateway")

OPEN_PATHS = frozenset({"/v2/health/live", "/v2/health/ready", "/metrics"})
LOOPBACK = frozenset({"127.0.0.1", "::1"})
IDENTITY = "flowmesh.identity"  # the scope's key for the caller's `Identity`
MODEL = "flowmesh.model"  # the scope's key for a model named in a body (the /v1 routes)
# A model label only on an answer the mesh gave for that model (a status under 400): the name
# in a refused, unknown, malformed or unanswered request could be anything a caller chose, and
# each new label value is a new series, kept and exported for the gateway's life.
LABELLED_BELOW = 400


def find_api_keys(api_keys: str | None, keys: Any) -> Path | None:
    """The API key file: `api_keys` if given (it must exist), else api_keys.json in the CURVE
    key directory `keys` names (the directory, or a secret file in it) if there is one there."""
    if api_keys:
        path = Path(os.path.expanduser(api_keys))
        if path.is_dir():
            path = path / API_KEYS
        if not path.is_file():
            raise FlowmeshError(Code.BAD_REQUEST, f"--api-keys {api_keys}: no such file")
        return path
    if isinstance(keys, str | os.PathLike) and str(keys):
        d = Path(os.path.expanduser(str(keys)))
        candidate = (d if d.is_dir() else d.parent) / API_KEYS
        if candidate.is_file():
            return candidate
    return None


class ApiKeys:
    """The keys of an API key file, read again whenever the file changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._by_hash: dict[str, Identity] = {}
        self.refresh(strict=True)

    def refresh(self, strict: bool = False) -> None:
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp != self._stamp:
                self._by_hash = read_api_keys(self.path)
                self._stamp = stamp
        except (OSError, FlowmeshError) as exc:
            if strict:
                raise FlowmeshError(Code.BAD_REQUEST, f"API keys {self.path}: {exc}") from None
            # A file being replaced, or gone: nobody is let in until it reads again.
            log.warning("API keys %s unreadable (%s): refusing every key", self.path, exc)
            self._by_hash, self._stamp = {}, None

    def identity(self, token: str) -> Identity | None:
        self.refresh()
        return self._by_hash.get(api_key_hash(token))


class FastRoute(Protocol):
    """A route the guard serves itself once it let the request in and read its body."""

    route: BaseRoute  # the app's, for the metrics' route label

    def match(self, scope: Scope) -> dict[str, str] | None:
        """The path parameters of a request for this route; None: not one."""
        ...

    async def __call__(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        """Answer it (`body`: the request's, whole; `receive`: for the disconnect)."""
        ...


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


class Guard:
    """The ASGI layer described above, around `app`; `routes`: the app's, to name the route of
    a request refused before routing; `fast`: routes served here, once let in, without the
    app's layers (the hot ones: `gateway.kserve.FastInfer`)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: ApiKeys | None,
        insecure_open: bool,
        max_body: int,
        max_header: int,
        metrics: GatewayMetrics,
        body_timeout: float = BODY_TIMEOUT_S,
        routes: Sequence[BaseRoute],
        fast: Sequence[FastRoute] = (),
    ) -> None:
        self.app = app
        self.fast = tuple(fast)
        self.keys = keys
        self.insecure_open = insecure_open
        self.max_body = max_body
        self.max_header = max_header
        self.body_timeout = body_timeout
        self.metrics = metrics
        self.routes = routes
        # The metrics' children by label values: `labels` checks and locks on every call, a
        # few microseconds of each request; the series are the same ones either way.
        self._first_byte = functools.cache(metrics.first_byte.labels)
        self._requests = functools.cache(metrics.requests.labels)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 0
        sent_body = False

        async def sending(message: Message) -> None:
            nonlocal status, sent_body
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not sent_body:
                sent_body = True
                self._first_byte(self._route(scope)[0]).observe(time.perf_counter() - start)
            await send(message)

        try:
            size = sum(len(name) + len(value) + 4 for name, value in scope["headers"])
            if size > self.max_header:
                why = f"the headers are over {self.max_header} bytes (the gateway's --max-header)"
                answer = error_response(scope["path"], Code.TOO_LARGE, why, status=431)
                await answer(scope, receive, sending)
                return
            refusal = self._refusal(scope)
            if refusal is not None:
                answer = error_response(scope["path"], *refusal)
                if refusal[0] == Code.UNAUTHORIZED:
                    answer.headers["WWW-Authenticate"] = "Bearer"
                await answer(scope, receive, sending)
                return
            try:
                async with asyncio.timeout(self.body_timeout):
                    pending = await self._read_body(scope, receive)
            except TimeoutError:
                why = (
                    f"the body did not arrive within {self.body_timeout:g} s (the gateway's "
                    "--body-timeout)"
                )
                answer = error_response(scope["path"], Code.TIMEOUT, why, status=408)
                answer.headers["Connection"] = "close"  # what is left of it is not read
                await answer(scope, receive, sending)
                return
            if pending is None:
                why = f"the body is over {self.max_body} bytes (the gateway's --max-body)"
                await error_response(scope["path"], Code.TOO_LARGE, why)(scope, receive, sending)
                return

            if pending[0]["type"] == "http.request":
                for fast in self.fast:
                    params = fast.match(scope)
                    if params is not None:
                        # As the router would have put them: `_route` then finds the route
                        # for the metrics' labels without a search of the app's routes.
                        scope["route"], scope["path_params"] = fast.route, params
                        await fast(scope, pending[0]["body"], receive, sending)
                        return

            async def replay() -> Message:
                return pending.pop(0) if pending else await receive()

            await self.app(scope, replay, sending)
        finally:
            route, model = self._route(scope)
            code = status or 500  # nothing sent: the server's last-resort handler answers 500
            if code >= LABELLED_BELOW:
                model = ""
            self._requests(route, str(code), model).inc()

    def _refusal(self, scope: Scope) -> tuple[str, str] | None:
        """(code, reason) of a caller refused at the door; None: let in."""
        if scope["path"] in OPEN_PATHS:
            return None
        if self.keys is None:
            host = (scope.get("client") or ("", 0))[0]
            if self.insecure_open or host in LOOPBACK:
                return None
            return Code.FORBIDDEN, (
                "this gateway has no API keys and serves loopback callers only "
                "(start it with --api-keys FILE, or --insecure-open)"
            )
        token = _bearer(scope)
        if token is None:
            return Code.UNAUTHORIZED, "an API key is needed: send 'Authorization: Bearer KEY'"
        identity = self.keys.identity(token)
        if identity is None:
            return Code.UNAUTHORIZED, "the API key is not known to this gateway"
        scope[IDENTITY] = identity
        return None

    async def _read_body(self, scope: Scope, receive: Receive) -> list[Message] | None:
        """The request's messages to hand on (its whole body in one), or None: over the limit."""
        length = _content_length(scope)
        if length is not None and length > self.max_body:
            return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # gone before the body ended
                return [message]
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

    def _route(self, scope: Scope) -> tuple[str, str]:
        """(route template, model) of a request: "" for a path no route has."""
        route = scope.get("route")
        params = scope.get("path_params") or {}
        if route is None:  # refused before routing: find the route it would have had
            for candidate in self.routes:
                match, child = candidate.matches(scope)
                if match == Match.FULL:
                    route, params = candidate, child.get("path_params") or {}
                    break
        template = getattr(route, "path", "") if route is not None else ""
        model = scope.get(MODEL) or params.get("model") or ""
        return template, str(model)


class Streams:
    """The open event streams per key (the caller's key name; "" without keys, where every
    caller counts as one), at most `limit` each."""

    def __init__(self, limit: int, metrics: GatewayMetrics) -> None:
        self.limit = limit
        self.metrics = metrics
        self.open: dict[str, int] = {}

    def acquire(self, request: Request) -> Callable[[], None]:
        """Take a slot for the caller of `request` (OVERLOADED: it holds `limit` already); the
        function that gives it back (once)."""
        identity = request.scope.get(IDENTITY)
        who = identity.name if isinstance(identity, Identity) else ""
        if self.open.get(who, 0) >= self.limit:
            raise FlowmeshError(
                Code.OVERLOADED,
                f"{self.limit} streams are open for this key already (--max-streams-per-key)",
            )
        self.open[who] = self.open.get(who, 0) + 1
        self.metrics.open_streams.inc()
        given_back = False

        def release() -> None:
            nonlocal given_back
            if given_back:
                return
            given_back = True
            self.open[who] -= 1
            if not self.open[who]:
                del self.open[who]
            self.metrics.open_streams.dec()

        return release
