"""Errors as HTTP answers: each flowmesh code mapped to an HTTP status, written in the body the
route's protocol expects (OpenAI's `{"error": {"message", "type", "code"}}` under /v1, KServe
v2's `{"error": message}` elsewhere)."""

from __future__ import annotations

from fastapi import Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.responses import Response

from flowmesh.errors import Code, FlowmeshError

STATUS_BY_CODE: dict[str, int] = {
    Code.BAD_REQUEST: 400,
    Code.BAD_MESSAGE: 400,
    Code.BAD_FRAMES: 400,
    Code.BAD_TENSOR: 400,
    Code.UNKNOWN_TYPE: 400,
    Code.VERSION: 400,
    Code.NOT_A_CHAIN: 400,
    Code.PLAN_ERROR: 400,
    Code.DEPLOY_FAILED: 400,
    Code.TOO_BIG: 400,  # a model that can never fit: asking again will not help
    Code.UNAUTHORIZED: 401,
    Code.NOT_ALLOWED: 403,
    Code.FORBIDDEN: 403,
    Code.MODEL_NOT_FOUND: 404,
    Code.MODEL_EXISTS: 409,
    Code.TOO_LARGE: 413,
    Code.OVERLOADED: 429,
    Code.MODEL_ERROR: 500,
    Code.IO_ERROR: 500,
    Code.INTERNAL: 500,
    Code.UNAVAILABLE: 503,
    Code.WORKER_LOST: 503,  # retried elsewhere by the broker when it can; a retry may succeed
    Code.NO_SPACE: 503,
    Code.NOT_RESIDENT: 503,
    Code.TOKENIZER_CHANGED: 503,  # (the SDK asks again itself; left only if it changed twice)
    Code.TIMEOUT: 504,
}

# OpenAI's error types, by status (what its clients and their users look for).
_OPENAI_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
}


def http_status(code: str) -> int:
    """The HTTP status of flowmesh error `code` (500 for a code this table does not know)."""
    return STATUS_BY_CODE.get(code, 500)


def openai_body(code: str, message: str, status: int = 0) -> dict[str, object]:
    status = status or http_status(code)
    kind = _OPENAI_TYPE.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": str(code)}}


def error_response(path: str, code: str, message: str, status: int = 0) -> JSONResponse:
    """The answer to a failed request for `path`, in its protocol's error body; `status`: an
    HTTP status more precise than `code`'s (431 for headers over the limit, say)."""
    body = openai_body(code, message, status) if path.startswith("/v1") else {"error": message}
    return JSONResponse(body, status_code=status or http_status(code))


async def on_flowmesh_error(request: Request, exc: Exception) -> JSONResponse:
    """A refusal from the broker (the SDK's `ClientError`s) or from the gateway's own checks."""
    assert isinstance(exc, FlowmeshError)
    return error_response(request.url.path, exc.code, exc.reason)


async def on_invalid_body(request: Request, exc: Exception) -> JSONResponse:
    """A body that does not fit the route's schema: 400, as both protocols say (FastAPI's own
    answer is a 422 in a body neither protocol's clients read)."""
    assert isinstance(exc, RequestValidationError)
    problems = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
        for e in exc.errors()
    )
    return error_response(request.url.path, Code.BAD_REQUEST, problems or "invalid body")


async def on_http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (a path no route has: 404; a method its route does not take:
    405), under /v1 and /v2 in the protocol's error body: FastAPI's `{"detail": ...}` is a body
    neither protocol's clients read. Elsewhere, FastAPI's own answer."""
    assert isinstance(exc, HTTPException)
    path = request.url.path
    if not any(path == root or path.startswith(root + "/") for root in ("/v1", "/v2")):
        return await http_exception_handler(request, exc)
    code = Code.NOT_ALLOWED if exc.status_code == 405 else Code.BAD_REQUEST
    message = f"{exc.detail}: {request.method} {path}"
    answer = error_response(path, code, message, status=exc.status_code)
    answer.headers.update(exc.headers or {})  # a 405's Allow
    return answer
