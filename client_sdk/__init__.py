"""The flowmesh Python SDK: `Client` (blocking) and `AsyncClient` (asyncio)."""

from client_sdk.client import AsyncClient, Client
from client_sdk.errors import ClientError

__all__ = ["AsyncClient", "Client", "ClientError"]
