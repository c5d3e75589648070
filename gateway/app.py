"""The gateway's ASGI application: one `AsyncClient` to the broker for the app's lifetime, the
OpenAI and KServe v2 routes, and errors answered in each protocol's body."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError

from client_sdk.client import AsyncClient
from flowmesh.errors import FlowmeshError
from gateway import kserve, openai_api
from gateway.errors import on_flowmesh_error, on_invalid_body


def create_app(broker: str, *, keys: Any = None, timeout: float = 60.0) -> FastAPI:
    """The gateway for the broker at `broker` (its frontend address). `keys`: the SDK's CURVE
    keys (`client_sdk.connection.client_keys`: None reads FLOWMESH_KEYS); `timeout`: seconds
    each call to the broker may take."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Made inside the server's running loop, as an AsyncClient must be; closed with it.
        async with AsyncClient(broker, keys=keys, timeout=timeout) as client:
            app.state.client = client
            yield

    app = FastAPI(title="flowmesh gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.include_router(openai_api.router)
    app.include_router(kserve.router)
    app.add_exception_handler(FlowmeshError, on_flowmesh_error)
    app.add_exception_handler(RequestValidationError, on_invalid_body)
    return app
