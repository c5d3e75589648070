"""Errors as HTTP answers: each flowmesh code mapped to an HTTP status, written in the body the
route's protocol expects (OpenAI's `{"error": {"message", "type", "param", "code"}}` under /v1,
KServe v2's `{"error": message}` elsewhere)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.responses import Response

from flowmesh.errors import Code, FlowmeshError

# The gateway's own code for a path no route has (the mesh's codes name what a request asks
# for; this one, what it asked of the gateway): `not_found`, as the unknown model's 404 is
# `model_not_found`.
NOT_FOUND = "not_found"

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
    NOT_FOUND: 404,
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


class ParamError(FlowmeshError):
    """A request refused (400) for one of its parameters, which OpenAI's error body names in
    `param` (a path in OpenAI's own form: `stop`, `messages.[2].role`)."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(Code.BAD_REQUEST, reason)
        self.param = param


def openai_body(
    code: str, message: str, status: int = 0, param: str | None = None
) -> dict[str, object]:
    status = status or http_status(code)
    kind = _OPENAI_TYPE.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": str(code)}}


def error_response(
    path: str, code: str, message: str, status: int = 0, param: str | None = None
) -> JSONResponse:
    """The answer to a failed request for `path`, in its protocol's error body; `status`: an
    HTTP status more precise than `code`'s (431 for headers over the limit, say); `param`: the
    request's parameter at fault (OpenAI's body names it; KServe's has no place for it)."""
    if path.startswith("/v1"):
        body: dict[str, object] = openai_body(code, message, status, param)
    else:
        body = {"error": message}
    return JSONResponse(body, status_code=status or http_status(code))


async def on_flowmesh_error(request: Request, exc: Exception) -> JSONResponse:
    """A refusal from the broker (the SDK's `ClientError`s) or from the gateway's own checks."""
    assert isinstance(exc, FlowmeshError)
    param = exc.param if isinstance(exc, ParamError) else None
    return error_response(request.url.path, exc.code, exc.reason, param=param)


def param_path(loc: Sequence[int | str]) -> str:
    """A location in a request body as OpenAI writes it in `param`: `messages.[0].role`."""
    return ".".join(f"[{p}]" if isinstance(p, int) else p for p in loc)


def _loc(error: Any) -> tuple[Any, ...]:
    """Where in the body a pydantic `error` is (() for the body as a whole)."""
    if error.get("type") == "json_invalid":  # its location is an offset in the text
        return ()
    return tuple(error.get("loc", ()))[1:]  # past FastAPI's leading "body"


def _faulty_param(errors: Sequence[Any]) -> str | None:
    """The parameter pydantic's `errors` are about (None: the body as a whole): the path the
    first one's errors share. A value that fits no member of a union is an error per member,
    each path ending in the member's type (`stop.str`, `stop.list[str]`): their shared path is
    the parameter's."""
    locs = [_loc(e) for e in errors]
    if not locs or not locs[0]:
        return None
    shared = locs[0]
    for loc in locs[1:]:
        if loc[:1] == shared[:1]:
            shared = _common(shared, loc)
    return param_path(shared)


def _common(a: tuple[Any, ...], b: tuple[Any, ...]) -> tuple[Any, ...]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


async def on_invalid_body(request: Request, exc: Exception) -> JSONResponse:
    """A body that does not fit the route's schema: 400, as both protocols say (FastAPI's own
    answer is a 422 in a body neither protocol's clients read)."""
    assert isinstance(exc, RequestValidationError)
    problems = "; ".join(f"{param_path(_loc(e)) or 'body'}: {e.get('msg')}" for e in exc.errors())
    return error_response(
        request.url.path,
        Code.BAD_REQUEST,
        problems or "invalid body",
        param=_faulty_param(exc.errors()),
    )


async def on_http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (a path no route has: 404; a method its route does not take:
    405), under /v1 and /v2 in the protocol's error body: FastAPI's `{"detail": ...}` is a body
    neither protocol's clients read. Elsewhere, FastAPI's own answer."""
    assert isinstance(exc, HTTPException)
    path = request.url.path
    if not any(path == root or path.startswith(root + "/") for root in ("/v1", "/v2")):
        return await http_exception_handler(request, exc)
    code = {404: NOT_FOUND, 405: Code.NOT_ALLOWED}.get(exc.status_code, Code.BAD_REQUEST)
    message = f"{exc.detail}: {request.method} {path}"
    answer = error_response(path, code, message, status=exc.status_code)
    answer.headers.update(exc.headers or {})  # a 405's Allow
    return answer
