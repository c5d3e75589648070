"""Typed exceptions for the broker's error codes. Each carries the code and the broker's reason."""

from __future__ import annotations

from flowmesh.errors import Code, FlowmeshError


class ClientError(FlowmeshError):
    """Base of every error the SDK raises for a failed call."""


class BadRequest(ClientError):
    pass


class NotAllowed(ClientError):
    pass


class ModelNotFound(ClientError):
    pass


class ModelExists(ClientError):
    pass


class TooBig(ClientError):
    pass


class Unavailable(ClientError):
    pass


class Overloaded(ClientError):
    """Full for now, retry later: a queue or socket high-water mark reached, or (`no_space`)
    memory that others hold now."""


class Timeout(ClientError):
    pass


class WorkerLost(ClientError):
    pass


class ModelError(ClientError):
    """The model's own code raised while running the request."""


class ProtocolError(ClientError):
    """A message was malformed or spoke another protocol version."""


class TooLarge(ProtocolError):
    """A message over a size limit (`flowmesh.protocol.Limits`): raised before sending when a
    request is over the client's own limits, or answered by the broker when it is over the
    broker's. Not to be confused with `TooBig` (a model that cannot fit the devices). A
    `ProtocolError`, so code that caught oversized messages as protocol errors still does."""


class Unauthorized(ClientError):
    """The broker does not know this client's key (CURVE on), or this client has none."""


class Forbidden(ClientError):
    """The key is known, but its role (or name) does not grant this call: e.g. a deploy with a
    client key instead of an operator key."""


class IOFailure(ClientError):
    """A worker could not read or write a file (a full disk, a permission): the reason names the
    path and the operating system's words for what went wrong."""


class InternalError(ClientError):
    pass


_BY_CODE: dict[str, type[ClientError]] = {
    Code.BAD_REQUEST: BadRequest,
    Code.NOT_ALLOWED: NotAllowed,
    Code.MODEL_NOT_FOUND: ModelNotFound,
    Code.MODEL_EXISTS: ModelExists,
    Code.TOO_BIG: TooBig,
    Code.UNAVAILABLE: Unavailable,
    Code.TOKENIZER_CHANGED: Unavailable,
    Code.OVERLOADED: Overloaded,
    Code.NO_SPACE: Overloaded,
    Code.TIMEOUT: Timeout,
    Code.WORKER_LOST: WorkerLost,
    Code.MODEL_ERROR: ModelError,
    Code.NOT_A_CHAIN: BadRequest,
    Code.PLAN_ERROR: BadRequest,
    Code.DEPLOY_FAILED: BadRequest,
    Code.BAD_MESSAGE: ProtocolError,
    Code.BAD_FRAMES: ProtocolError,
    Code.BAD_TENSOR: ProtocolError,
    Code.UNKNOWN_TYPE: ProtocolError,
    Code.TOO_LARGE: TooLarge,
    Code.VERSION: ProtocolError,
    Code.UNAUTHORIZED: Unauthorized,
    Code.FORBIDDEN: Forbidden,
    Code.IO_ERROR: IOFailure,
}


def error_from(code: str, reason: str) -> ClientError:
    return _BY_CODE.get(code, InternalError)(code, reason)
