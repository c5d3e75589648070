"""The gateway's ASGI application: one `AsyncClient` to the broker for the app's lifetime, the
OpenAI and KServe v2 routes, errors answered in each protocol's body, `/metrics`, and the door
in front of it all (`gateway.guard`: API keys, loopback only without them, body and stream
limits, the requests' counts)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Response
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from client_sdk.client import AsyncClient
from flowmesh.errors import FlowmeshError
from gateway import BODY_TIMEOUT_S, MAX_BODY, MAX_HEADER, MAX_STREAMS_PER_KEY, kserve, openai_api
from gateway.disconnect import ClientGone, on_client_gone
from gateway.errors import on_flowmesh_error, on_http_error, on_invalid_body
from gateway.guard import ApiKeys, Guard, Streams
from gateway.metrics import GatewayMetrics


class GatewayApp(FastAPI):
    """The gateway's FastAPI app with its door (`Guard`) in front of FastAPI's own layers, not
    among them: a request the door serves itself (a refusal, the hot infer route) skips them
    all (the app, its error, telemetry and body-limit middlewares: a few percent of the
    gateway's CPU per small infer); the others go through them as before."""

    door: Guard | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.door is None:
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self  # as FastAPI would set it: the fast routes read the app's state
        await self.door(scope, receive, send)

    async def behind_door(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().__call__(scope, receive, send)


def create_app(
    broker: str,
    *,
    keys: Any = None,
    timeout: float = 60.0,
    api_keys: Path | None = None,
    insecure_open: bool = False,
    max_body: int = MAX_BODY,
    max_header: int = MAX_HEADER,
    body_timeout: float = BODY_TIMEOUT_S,
    max_streams_per_key: int = MAX_STREAMS_PER_KEY,
) -> GatewayApp:
    """The gateway for the broker at `broker` (its frontend address). `keys`: the SDK's CURVE
    keys (`client_sdk.connection.client_keys`: None reads FLOWMESH_KEYS); `timeout`: seconds
    each call to the broker may take (504 past it); `api_keys`: the API key file callers'
    bearer tokens must be in (None: loopback callers only, or anyone with `insecure_open`);
    `max_body`: bytes a request body may have (413 beyond); `max_header`: bytes its headers
    may have in all (431 beyond); `body_timeout`: seconds a body may take to arrive (408
    past it), and an event stream's client to take each event (cut off past it);
    `max_streams_per_key`: event streams each key may hold open at once (429
    beyond)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Made inside the server's running loop, as an AsyncClient must be; closed with it.
        async with AsyncClient(broker, keys=keys, timeout=timeout) as client:
            app.state.client = client
            yield

    app = GatewayApp(title="flowmesh gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.include_router(openai_api.router)
    app.include_router(kserve.router)
    app.add_exception_handler(FlowmeshError, on_flowmesh_error)
    app.add_exception_handler(RequestValidationError, on_invalid_body)
    app.add_exception_handler(ClientGone, on_client_gone)
    app.add_exception_handler(HTTPException, on_http_error)
    metrics = GatewayMetrics()
    app.state.streams = Streams(max_streams_per_key, metrics)
    app.state.write_timeout = body_timeout  # an event stream's, for each event (`EventStream`)

    @app.get("/metrics", include_in_schema=False)
    async def scrape() -> Response:
        """Open, like the probes: scrapers carry no key, and it tells counts and model names,
        no data (the mesh's processes serve theirs unauthenticated on --metrics-port too)."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.door = Guard(
        app.behind_door,
        keys=ApiKeys(api_keys) if api_keys is not None else None,
        insecure_open=insecure_open,
        max_body=max_body,
        max_header=max_header,
        body_timeout=body_timeout,
        metrics=metrics,
        # The routers' own routes: the app's wraps them in FastAPI's included-router objects.
        routes=[*openai_api.router.routes, *kserve.router.routes],
        fast=kserve.fast_routes(),
    )
    return app
