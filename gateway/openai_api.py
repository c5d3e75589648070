"""The OpenAI API for language models: /v1/models (and /v1/models/{model}), /v1/completions and
/v1/chat/completions, blocking or streamed as server-sent events in OpenAI's chunk format, ending
`data: [DONE]`.

Defaults are OpenAI's (`temperature` 1, `top_p` 1; `max_tokens` 16 for a completion, none for
a chat, whose answer runs until it stops or fills the model's context), so that a client that
names none gets what it would elsewhere. Values are checked strictly, as OpenAI checks them
("5" is no number, "yes" no boolean). A request for what flowmesh does not do (n > 1, echo,
suffix, best_of, logprobs, top_logprobs, penalties, logit_bias, a response_format other than
text, tools and function calls, audio) is refused with 400 naming the parameter, rather than
answered as if done; fields that change nothing of the answer (`user`, `metadata`, `store`,
...) are ignored.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from client_sdk.client import AsyncClient
from client_sdk.generation import AsyncGenStream, Chunk, Generation
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from gateway.disconnect import unless_gone
from gateway.errors import ParamError, openai_body
from gateway.guard import MODEL
from gateway.sse import DONE, EventStream, event

router = APIRouter(prefix="/v1")

# New tokens of a completion that names no max_tokens: OpenAI's default (its chat has none).
COMPLETION_TOKENS = 16
# The most stop sequences a request may give: OpenAI's limit.
MAX_STOPS = 4
# A tool choice that asks for no call: the only ones flowmesh, which calls no tool, honours.
NO_CALL = (None, "none", "auto")
LOGPROBS = "log probabilities are not supported"
# Message roles of function calling's history: a call's result, which no chat template here
# writes as the model was trained to read it.
TOOL_ROLES = ("tool", "function")


class _Strict(BaseModel):
    # Strict, as OpenAI is: "5" is no max_tokens nor "yes" a stream (a float still takes an
    # integer: temperature 0). Fields this schema does not name are ignored: those OpenAI's
    # clients send that change nothing of the answer (user, metadata, store, service_tier).
    # Those that would change it are named, to be refused unless they ask for nothing.
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    # Not in OpenAI's API, taken as vLLM's server takes it (the `openai` client's extra_body):
    # -1, 0 or null for no cut.
    top_k: int | None = Field(default=None, ge=-1, lt=1 << 31)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Not done here (`_unsupported`): refused unless they ask for nothing.
    n: int = 1
    logprobs: bool | int | None = None  # chat's a bool, completions' a count (0 asks too)
    top_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None  # tools' forerunners, with function_call
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None

    def check(self) -> None:
        """Refuse (400, naming the parameter) what the schema alone does not: values past
        OpenAI's limits, and what flowmesh does not do (`_unsupported`)."""
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOPS:
            raise ParamError(
                "stop", f"stop: at most {MAX_STOPS} sequences are taken, {len(self.stop)} given"
            )
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options: only taken with stream: true")
        for param, asked, why in self._unsupported():
            if asked:
                raise ParamError(param, f"{param}: {why}")

    def _unsupported(self) -> list[tuple[str, bool, str]]:
        """(parameter, whether it asks for something flowmesh does not do, why refused)."""
        text = self.response_format is None or self.response_format.get("type") == "text"
        return [
            ("n", self.n != 1, "only 1 choice per prompt is supported"),
            # Any count, 0 too (the chosen tokens' own), asks for them; False (== 0) does not.
            ("logprobs", self.logprobs is not None and self.logprobs is not False, LOGPROBS),
            ("top_logprobs", self.top_logprobs not in (None, 0), LOGPROBS),
            ("presence_penalty", bool(self.presence_penalty), "penalties are not supported"),
            ("frequency_penalty", bool(self.frequency_penalty), "penalties are not supported"),
            ("logit_bias", bool(self.logit_bias), "biasing tokens is not supported"),
            ("response_format", not text, 'only {"type": "text"} is supported'),
            ("tools", bool(self.tools), "tools (function calling) are not supported"),
            ("tool_choice", self.tool_choice not in NO_CALL, "no tool is ever called"),
            ("functions", bool(self.functions), "function calling is not supported"),
            ("function_call", self.function_call not in NO_CALL, "no function is ever called"),
            ("modalities", self.modalities not in (None, ["text"]), "only text is generated"),
            ("audio", self.audio is not None, "only text is generated"),
        ]

    def sdk_args(self, max_tokens: int | None) -> dict[str, Any]:
        """The SDK's sampling arguments (`max_tokens` None: until the context is full)."""
        return {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": max(self.top_k or 0, 0),
            "seed": self.seed,
            "stop": self.stop,
        }

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    # Strict: a string of digits is text, never a token id ("1" is not 1).
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def _unsupported(self) -> list[tuple[str, bool, str]]:
        return [
            *super()._unsupported(),
            ("echo", self.echo, "echoing the prompt is not supported"),
            ("suffix", bool(self.suffix), "a suffix is not supported"),
            ("best_of", (self.best_of or 1) > 1, "only 1 choice per prompt is supported"),
        ]


class ChatMessage(_Strict):
    role: str
    content: str | list[dict[str, Any]] | None = None
    # Function calling's, in a chat's history: refused (`_chat`), not dropped, since the model
    # would otherwise answer another conversation than the one sent.
    tool_calls: list[Any] | None = None
    function_call: Any = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def client_of(request: Request) -> AsyncClient:
    return request.app.state.client


def _usage(outs: list[Generation]) -> dict[str, int]:
    prompt = sum(o.prompt_tokens for o in outs)
    completion = sum(o.completion_tokens for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _prompt_args(prompt: str | list[str] | list[int] | list[list[int]]) -> dict[str, Any]:
    """The SDK's prompt arguments, always a batch, so that the answer is always a list."""
    if isinstance(prompt, str):
        return {"prompt": [prompt]}
    if not prompt:
        raise ParamError("prompt", "prompt: an empty list")
    if all(isinstance(x, str) for x in prompt):
        return {"prompt": list(prompt)}
    if all(isinstance(x, int) for x in prompt):
        return {"ids": [list(prompt)]}
    return {"ids": [list(x) for x in prompt]}  # the schema let through only lists of ids


def _chat(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The chat for the model's template: each message's role and text. Function calling's
    history (a call, its result) is refused: dropped, the model would answer another chat."""
    chat = []
    for k, message in enumerate(messages):
        where = f"messages.[{k}]"
        if message.role in TOOL_ROLES:
            raise ParamError(
                f"{where}.role",
                f"{where}.role: {message.role!r} messages (a call's result) are not supported",
            )
        for field in ("tool_calls", "function_call"):
            if getattr(message, field):
                raise ParamError(
                    f"{where}.{field}", f"{where}.{field}: function calling is not supported"
                )
        chat.append({"role": message.role, "content": _text(message.content, where)})
    return chat


def _text(content: str | list[dict[str, Any]] | None, where: str) -> str:
    """A message's content: a string, or OpenAI's list of parts (text parts only)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ParamError(
                f"{where}.content",
                f"{where}.content: a part of type {part.get('type')!r}: only text is supported",
            )
        parts.append(part["text"])
    return "".join(parts)


def _head(kind: str, model: str) -> dict[str, Any]:
    return {"id": f"{kind}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}


def _generates(row: p.ModelRow) -> bool:
    """Whether a deployed model is a language model: one from a Hugging Face directory. A
    factory's takes tensors only (the broker refuses it generation: "not a language model")."""
    return row.factory is None


def _model_object(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "flowmesh"}


@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    """The deployed language models, in OpenAI's list: the others take no /v1 call."""
    status = await client_of(request).status()
    now = int(time.time())
    data = [_model_object(row.name, now) for row in status.models if _generates(row)]
    return {"object": "list", "data": data}


@router.get("/models/{model}")
async def model(request: Request, model: str) -> dict[str, Any]:
    """One of them (the `openai` client's `models.retrieve`): 404 for any other name."""
    row = next((r for r in (await client_of(request).status()).models if r.name == model), None)
    if row is None:
        raise FlowmeshError(Code.MODEL_NOT_FOUND, f"no model {model!r} is deployed")
    if not _generates(row):
        raise FlowmeshError(
            Code.MODEL_NOT_FOUND,
            f"{model!r} is not a language model: its tensors are served under /v2/models/{model}",
        )
    return _model_object(model, int(time.time()))


@router.post("/completions", response_model=None)
async def completions(request: Request, body: CompletionRequest) -> dict[str, Any] | EventStream:
    request.scope[MODEL] = body.model
    body.check()
    args = {**_prompt_args(body.prompt), **body.sdk_args(body.max_tokens or COMPLETION_TOKENS)}
    client = client_of(request)
    head = {**_head("cmpl", body.model), "object": "text_completion"}
    if body.stream:
        return await _stream(request, body, args, head, chat=False)
    outs = await unless_gone(request, client.generate(body.model, **args))
    assert isinstance(outs, list)
    choices = [
        {"index": k, "text": o.text or "", "logprobs": None, "finish_reason": o.finish_reason}
        for k, o in enumerate(outs)
    ]
    return {**head, "choices": choices, "usage": _usage(outs)}


@router.post("/chat/completions", response_model=None)
async def chat(request: Request, body: ChatRequest) -> dict[str, Any] | EventStream:
    request.scope[MODEL] = body.model
    body.check()
    args = {
        "messages": [_chat(body.messages)],
        # Neither given: no cap but the model's context, as OpenAI's chat has none.
        **body.sdk_args(body.max_completion_tokens or body.max_tokens),
    }
    client = client_of(request)
    head = {**_head("chatcmpl", body.model), "object": "chat.completion"}
    if body.stream:
        return await _stream(request, body, args, head, chat=True)
    outs = await unless_gone(request, client.generate(body.model, **args))
    assert isinstance(outs, list)
    (out,) = outs
    message = {"role": "assistant", "content": out.text or ""}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": out.finish_reason}
    return {**head, "choices": [choice], "usage": _usage(outs)}


async def _stream(
    request: Request, body: _Sampling, args: dict[str, Any], head: dict[str, Any], *, chat: bool
) -> EventStream:
    """The generation's chunks as events. The first read happens here, before the response
    starts, so that a refusal at the door (an unknown model, a prompt too long) is answered
    with its status and body, not as an event inside a 200. A slot of the caller's key's
    streams is held from before the stream starts until it is over (429 if none is free)."""
    release = request.app.state.streams.acquire(request)
    try:
        stream = client_of(request).generate_stream(body.model, **args)
    except BaseException:
        release()
        raise
    kind: Literal["chat.completion.chunk", "text_completion"] = (
        "chat.completion.chunk" if chat else "text_completion"
    )
    head = {**head, "object": kind}
    try:
        # Watched for the client leaving, as the blocking routes are: until the first token
        # nothing is written, so the server would not notice it gone, and its sequence (its KV
        # memory) and its stream slot would be held until then; cancelled, the stream stops
        # the sequence on the broker.
        first: Chunk | None = await unless_gone(request, anext(stream))
    except StopAsyncIteration:
        first = None
    except BaseException:
        release()
        await stream.aclose()
        raise

    def choice(index: int, text: str | None, finish: str | None) -> dict[str, Any]:
        if not chat:
            return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
        delta = {"content": text} if text else {}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}

    async def events() -> AsyncIterator[bytes]:
        # Closing the stream (the client gone: `EventStream` closes this generator) stops the
        # sequences on the broker.
        async with stream:
            try:
                if chat:  # OpenAI's first chat chunk names the role, with no content yet
                    role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
                    yield event(
                        {**head, "choices": [{**role, "logprobs": None, "finish_reason": None}]}
                    )
                async for chunk in _chain(first, stream):
                    if chunk.text or chunk.finish_reason:
                        yield event(
                            {
                                **head,
                                "choices": [choice(chunk.index, chunk.text, chunk.finish_reason)],
                            }
                        )
                if body.include_usage and stream.generations is not None:
                    yield event({**head, "choices": [], "usage": _usage(stream.generations)})
            except FlowmeshError as exc:
                # After the 200 is sent an error can only travel as an event of its own.
                yield event(openai_body(exc.code, exc.reason))
        yield DONE

    # A client that stops reading is cut off as one whose body stops coming is (`body_timeout`).
    write_timeout = getattr(request.app.state, "write_timeout", None)
    return EventStream(events(), on_close=release, write_timeout=write_timeout)


async def _chain(first: Chunk | None, rest: AsyncGenStream) -> AsyncIterator[Chunk]:
    """The stream's chunks, its first already read (None: it had none)."""
    if first is None:
        return
    yield first
    async for chunk in rest:
        yield chunk
