"""The flowmesh Python SDK: `Client` (blocking) and `AsyncClient` (asyncio)."""

from client_sdk.client import AsyncClient, Client
from client_sdk.errors import ClientError
from client_sdk.jobs import AsyncJob, Job, StepResult

__all__ = ["AsyncClient", "AsyncJob", "Client", "ClientError", "Job", "StepResult"]
