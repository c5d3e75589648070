"""The KServe v2 / Open Inference Protocol: server metadata, health, model metadata and readiness,
and infer with JSON tensors or the binary tensor data extension (`Inference-Header-Content-Length`),
and the model repository extension: its index, and `load` / `unload` as deploy / undeploy
(operator keys only). A model has one version, "1": each model route is served under
`/v2/models/{model}/versions/1` as well, as the protocol defines it."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec
import torch
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from starlette.datastructures import State
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from client_sdk import errors
from client_sdk.client import AsyncClient
from flowmesh import __version__
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from gateway.disconnect import GONE, ClientGone, unless_gone_on
from gateway.errors import error_response
from gateway.guard import IDENTITY
from gateway.tensors import V2_BY_NAME, bad, binary_size, from_bytes, from_json, to_bytes, to_json

router = APIRouter(prefix="/v2")

HEADER_LENGTH = "inference-header-content-length"
PLATFORM = "flowmesh"
# What a model's single unnamed output (the SDK's plain tensor) is called on the wire.
OUTPUT = "output0"
# A model's one version: flowmesh keeps one model per name (deployed again, it replaces it).
VERSION = "1"
# The protocol's extensions served here, by the names Triton gives them in its server metadata
# (those its clients look for): the binary tensor data extension, and the model repository's
# index, load and unload.
EXTENSIONS = ["binary_tensor_data", "model_repository"]
# Seconds a readiness probe waits for the broker: probes come often and want a quick "no".
READY_TIMEOUT_S = 2.0


def client_of(request: Request) -> AsyncClient:
    return request.app.state.client


async def _row(client: AsyncClient, model: str) -> p.ModelRow:
    for row in (await client.status()).models:
        if row.name == model:
            return row
    raise errors.ModelNotFound(Code.MODEL_NOT_FOUND, f"no model {model!r} is deployed")


@router.get("")
async def server_metadata() -> dict[str, Any]:
    """The server's name, version and the extensions it serves."""
    return {"name": PLATFORM, "version": __version__, "extensions": EXTENSIONS}


def _check_version(model: str, version: str | None) -> None:
    """Refuse (404) a version of `model` other than its one (None: the route named none)."""
    if version not in (None, VERSION):
        raise FlowmeshError(
            Code.MODEL_NOT_FOUND,
            f"no version {version!r} of model {model!r}: flowmesh serves one, {VERSION!r}",
        )


@router.get("/health/live")
async def live() -> dict[str, bool]:
    """The process answers: nothing else is asked of it."""
    return {"live": True}


@router.get("/health/ready")
async def ready(request: Request) -> JSONResponse:
    """A broker answers and at least one worker is registered with it."""
    try:
        status = await client_of(request).status(timeout=READY_TIMEOUT_S)
    except errors.ClientError as exc:
        return JSONResponse({"ready": False, "error": exc.reason}, status_code=503)
    up = any(w.ready for w in status.workers)
    return JSONResponse({"ready": up}, status_code=200 if up else 503)


@router.get("/models/{model}")
async def metadata(request: Request, model: str) -> dict[str, Any]:
    return await _metadata(client_of(request), model)


@router.get("/models/{model}/versions/{version}")
async def version_metadata(request: Request, model: str, version: str) -> dict[str, Any]:
    _check_version(model, version)
    return await _metadata(client_of(request), model)


async def _metadata(client: AsyncClient, model: str) -> dict[str, Any]:
    """Its inputs from the model's declared inputs (-1: a free dimension, as in v2)."""
    row = await _row(client, model)
    inputs = [
        {
            "name": name,
            "datatype": V2_BY_NAME.get(spec.dtype, spec.dtype),
            "shape": list(spec.shape),
        }
        for name, spec in row.inputs.items()
    ]
    # Outputs are not declared to flowmesh: v2 lets a server leave them out.
    return {
        "name": model,
        "versions": [VERSION],
        "platform": PLATFORM,
        "inputs": inputs,
        "outputs": [],
    }


@router.get("/models/{model}/ready")
async def model_ready(request: Request, model: str) -> JSONResponse:
    return await _ready(client_of(request), model)


@router.get("/models/{model}/versions/{version}/ready")
async def version_ready(request: Request, model: str, version: str) -> JSONResponse:
    _check_version(model, version)
    return await _ready(client_of(request), model)


async def _ready(client: AsyncClient, model: str) -> JSONResponse:
    row = await _row(client, model)
    up = row.state == "ready"
    return JSONResponse({"name": model, "ready": up}, status_code=200 if up else 503)


def _parse(body: bytes, header_length: str | None) -> tuple[dict[str, Any], memoryview]:
    """The request's JSON header and the bytes after it (the binary extension's tensors)."""
    split = len(body)
    if header_length is not None:
        length = _byte_count(header_length)
        if length is None or length > len(body):
            raise bad(f"{HEADER_LENGTH} {header_length!r} is not a length within the body")
        split = length
    # msgspec's decoder: several times json's on the numbers of a tensor's data.
    head = _json(memoryview(body)[:split], msgspec.json.decode, "the request")
    if not isinstance(head, dict) or not isinstance(head.get("inputs"), list) or not head["inputs"]:
        raise bad("the request needs a non-empty list of inputs")
    return head, memoryview(body)[split:]


def _json(text: Any, decode: Callable[[Any], Any], what: str) -> Any:
    """`text` read by `decode` (a JSON decoder); 400 naming `what` if it is not JSON, or nests
    deeper than the decoder's recursion goes (a few KB of `[`)."""
    try:
        return decode(text)
    except RecursionError:
        raise bad(f"{what} is JSON nested too deeply to be read") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"{what} is not JSON: {exc}") from None


def _byte_count(text: str) -> int | None:
    """`text` as a count of bytes, None if it is not one. ASCII digits only: '²' is a digit to
    `str.isdigit` but not to `int`; and few enough of them for `int` to read (it refuses
    thousands), more than any body has."""
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        return None
    return int(text)


def _inputs(head: dict[str, Any], rest: memoryview) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    at = 0
    for k, item in enumerate(head["inputs"]):
        where = f"inputs[{k}]"
        size = binary_size(item) if isinstance(item, dict) else None
        if size is None:
            name, tensor = from_json(item, where)
        else:
            if at + size > len(rest):
                raise bad(f"{where}: binary_data_size {size} runs past the body's end")
            name, tensor = from_bytes(item, rest[at : at + size], where)
            at += size
        if name in tensors:
            raise bad(f"input {name!r} given twice")
        tensors[name] = tensor
    if at != len(rest):
        raise bad(f"{len(rest) - at} bytes after the inputs' binary data")
    return tensors


def _parameters(item: dict[str, Any], where: str) -> dict[str, Any]:
    """`item`'s parameters ({} without any)."""
    params = item.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise bad(f"{where}parameters must be an object")
    return params


def _flag(params: dict[str, Any], key: str, where: str, default: bool) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise bad(f"{where}parameters.{key} must be true or false")
    return value


def _asked(head: dict[str, Any]) -> tuple[bool, list[tuple[str, bool]] | None]:
    """What the request asks of its answer, read before the model runs (a malformed request
    costs the mesh nothing): whether outputs are sent in binary unless they say otherwise, and
    (name, in binary) of each output asked for (None: all of them)."""
    default = _flag(_parameters(head, ""), "binary_data_output", "", False)
    asked = head.get("outputs")
    if asked is None:
        return default, None
    if not isinstance(asked, list):
        raise bad("outputs must be a list of objects, each with a name")
    out = []
    for k, item in enumerate(asked):
        where = f"outputs[{k}]."
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str):
            raise bad(f"{where}name must be a string (outputs: a list of objects with a name)")
        out.append((name, _flag(_parameters(item, where), "binary_data", where, default)))
    return default, out or None


def _wanted(
    default: bool, asked: list[tuple[str, bool]] | None, outputs: dict[str, torch.Tensor]
) -> list[tuple[str, bool]]:
    """(name, in binary) of each output to answer: those asked for, else all. Outputs are not
    declared to flowmesh, so a name is checked only here, against the model's answer."""
    if asked is None:
        return [(name, default) for name in outputs]
    for name, _ in asked:
        if name not in outputs:
            raise bad(f"output {name!r} is not one of the model's: {', '.join(outputs)}")
    return asked


async def _infer(
    state: State,
    params: dict[str, str],
    body: bytes,
    header_length: str | None,
    receive: Receive,
) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """The answer to an infer request (the body and raw headers of a 200), for both ways in
    (`infer`, `FastInfer`); errors raised as FlowmeshError (ClientGone: the client left).
    `state`: the app's (its client looked up only once the request reads well); `params`: the
    route's (the model, and the version if the path names one); `receive`: the request's, its
    body read already (for the disconnect)."""
    model = params["model"]
    _check_version(model, params.get("version"))
    head, rest = _parse(body, header_length)
    tensors = _inputs(head, rest)
    default, asked = _asked(head)
    client: AsyncClient = state.client
    answer = await unless_gone_on(receive, client.infer(model, tensors))
    outputs = {OUTPUT: answer} if isinstance(answer, torch.Tensor) else dict(answer)
    reply: dict[str, Any] = {"model_name": model, "model_version": VERSION, "outputs": []}
    if "id" in head:
        reply["id"] = head["id"]
    blobs = []
    for name, binary in _wanted(default, asked, outputs):
        if binary:
            meta, raw = to_bytes(name, outputs[name])
            reply["outputs"].append(meta)
            blobs.append(raw)
        else:
            reply["outputs"].append(to_json(name, outputs[name]))
    text = msgspec.json.encode(reply)
    # The headers Starlette's Response would write, in its order (the route's answers are the
    # same whichever way the request came in).
    if not blobs:
        return text, [(b"content-length", b"%d" % len(text)), _JSON]
    body = b"".join([text, *blobs])
    return body, [
        (HEADER_LENGTH.encode(), b"%d" % len(text)),
        (b"content-length", b"%d" % len(body)),
        _BINARY,
    ]


_JSON = (b"content-type", b"application/json")
_BINARY = (b"content-type", b"application/octet-stream")


async def infer(request: Request) -> Response:
    """A plain Starlette endpoint, not a FastAPI one: the hot path has no parameters for
    FastAPI's dependency solving to find (some 8% of the gateway's CPU per small infer).
    Requests the guard lets in take `FastInfer` instead; this one serves the rest (an app
    mounted under a root path)."""
    body, headers = await _infer(
        request.app.state,
        request.path_params,
        await request.body(),
        request.headers.get(HEADER_LENGTH),
        request.receive,
    )
    answer = Response(body)
    answer.raw_headers = headers
    return answer


def _infer_route(path: str) -> Route:
    router.add_route(f"{router.prefix}{path}", infer, methods=["POST"])
    route = router.routes[-1]
    assert isinstance(route, Route)
    return route


INFER_ROUTE = _infer_route("/models/{model}/infer")
VERSION_INFER_ROUTE = _infer_route("/models/{model}/versions/{version}/infer")


class FastInfer:
    """An infer route (`INFER_ROUTE`, `VERSION_INFER_ROUTE`) as a bare ASGI handler, called by
    the guard once it let the request in and read its body: no routing, no FastAPI or
    Starlette layers, Request or Response (on a small infer, they were about half the
    gateway's CPU). The same answers as `infer`, errors included (in the bodies and statuses
    of the app's exception handlers); any other exception is raised, as from `infer`, to the
    server's last-resort 500."""

    def __init__(self, route: Route) -> None:
        self.route = route

    def match(self, scope: Scope) -> dict[str, str] | None:
        """The path parameters of a request for this route (None: another route's). Only
        without a root path: the router strips one first, and `infer` serves those."""
        if scope["method"] != "POST" or scope.get("root_path"):
            return None
        found = self.route.path_regex.match(scope["path"])
        return found.groupdict() if found is not None else None

    async def __call__(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        header_length = None
        for name, value in scope["headers"]:
            if name == _HEADER_LENGTH:
                header_length = value.decode("latin-1")
                break
        try:
            content, headers = await _infer(
                scope["app"].state, scope["path_params"], body, header_length, receive
            )
        except FlowmeshError as exc:
            await error_response(scope["path"], exc.code, exc.reason)(scope, receive, send)
            return
        except ClientGone:
            await Response(status_code=GONE)(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": content})


_HEADER_LENGTH = HEADER_LENGTH.encode()


def fast_routes() -> list[FastInfer]:
    """The routes the guard serves itself: infer, the unversioned first (the one most
    clients ask: a request for it is matched at the first try)."""
    return [FastInfer(INFER_ROUTE), FastInfer(VERSION_INFER_ROUTE)]


# The repository extension's `load` parameters that make a deploy: AsyncClient.deploy's own
# keywords, each with the JSON types it takes (checked here, so that a wrong one is a 400 naming
# it, not a failure deep in the SDK).
_NUMBER = (int, float)
DEPLOY_PARAMETERS: dict[str, tuple[type, ...]] = {
    "factory": (str,),
    "hf": (str,),
    "kwargs": (dict,),
    "weights": (str,),
    "seed": (int,),
    "dtype": (str,),
    "stages": (int,),
    "max_batch_size": (int,),
    "replicas": (int,),
    "inputs": (dict,),
    "slo_ms": _NUMBER,
    "max_context": (int,),
    "max_seqs": (int,),
    "kv_share": _NUMBER,
    "timeout": _NUMBER,
}


def _operator_only(request: Request, what: str) -> None:
    """Deploy and undeploy are an operator key's, as over CURVE. Without API keys there is no
    identity: the door already let in only loopback callers (or anyone, told --insecure-open)."""
    identity = request.scope.get(IDENTITY)
    if identity is not None and identity.role != "operator":
        raise FlowmeshError(
            Code.FORBIDDEN,
            f"{what} needs an operator API key; {identity.name!r} is a {identity.role} key",
        )


def _deploy_spec(body: bytes) -> dict[str, Any]:
    """The deploy keywords in a load request's `parameters` ({} without any). Triton's clients
    send the model's configuration as a JSON string in `parameters.config`: read as more of
    them."""
    if not body.strip():
        return {}
    head = _json(body, json.loads, "the request")
    params = head.get("parameters") if isinstance(head, dict) else None
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise bad("parameters must be an object")
    params = dict(params)
    config = params.pop("config", None)
    if isinstance(config, str):
        config = _json(config, json.loads, "parameters.config")
    if config is not None:
        if not isinstance(config, dict):
            raise bad("parameters.config must be an object (or a JSON string of one)")
        params = {**config, **params}
    for key, value in params.items():
        kinds = DEPLOY_PARAMETERS.get(key)
        if kinds is None:
            known = ", ".join(DEPLOY_PARAMETERS)
            raise bad(f"parameters.{key} is not a deploy parameter (known: {known})")
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise bad(f"parameters.{key} must be {' or '.join(k.__name__ for k in kinds)}")
    return params


# A model's state (its status row's) as the repository extension's index names it.
_INDEX_STATE = {
    "ready": "READY",
    "planning": "LOADING",
    "deploying": "LOADING",
    "draining": "UNLOADING",
    "unavailable": "UNAVAILABLE",
}


@router.post("/repository/index")
async def repository_index(request: Request) -> list[dict[str, str]]:
    """The deployed models, each at its one version, with its state (`{"ready": true}` in the
    body: the ready ones only)."""
    body = await request.body()
    head = _json(body, json.loads, "the request") if body.strip() else {}
    ready_only = head.get("ready", False) if isinstance(head, dict) else None
    if not isinstance(ready_only, bool):
        raise bad("the request must be an object whose ready, if given, is true or false")
    index = [
        {
            "name": row.name,
            "version": VERSION,
            "state": _INDEX_STATE.get(row.state, row.state.upper()),
            "reason": "",
        }
        for row in (await client_of(request).status()).models
    ]
    return [entry for entry in index if entry["state"] == "READY" or not ready_only]


@router.post("/repository/models/{model}/load")
async def load(request: Request, model: str) -> Response:
    """Deploy `model` from the flowmesh deploy spec in `parameters` (factory or hf, kwargs,
    stages, ...: AsyncClient.deploy's keywords); without one, a model already deployed is
    loaded (200), another is a 400. Operator keys only."""
    _operator_only(request, "loading a model")
    spec = _deploy_spec(await request.body())
    client = client_of(request)
    if "factory" not in spec and "hf" not in spec:
        try:
            await _row(client, model)
        except errors.ModelNotFound:
            raise bad(
                f"no model {model!r} is deployed: give its deploy spec in parameters "
                '(e.g. {"parameters": {"factory": "flowmesh.examples:mlp"}})'
            ) from None
        return Response(status_code=200)
    name = spec.pop("factory", None)
    await client.deploy(model, name, **spec)
    return Response(status_code=200)


@router.post("/repository/models/{model}/unload")
async def unload(request: Request, model: str) -> Response:
    """Undeploy `model`. Operator keys only."""
    _operator_only(request, "unloading a model")
    await client_of(request).undeploy(model)
    return Response(status_code=200)
