"""The OpenAI API for language models: /v1/models, /v1/completions and /v1/chat/completions,
blocking or streamed as server-sent events in OpenAI's chunk format, ending `data: [DONE]`.

Defaults are OpenAI's (`temperature` 1, `top_p` 1, `max_tokens` 16), so that a client that
names none gets what it would elsewhere; a request for what flowmesh does not do (n > 1,
echo, logprobs, penalties) is refused with 400 rather than answered as if done.
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
from flowmesh.errors import FlowmeshError
from gateway.disconnect import unless_gone
from gateway.errors import openai_body
from gateway.guard import MODEL
from gateway.sse import DONE, EventStream, event
from gateway.tensors import bad

router = APIRouter(prefix="/v1")


class _Sampling(BaseModel):
    # Fields OpenAI's clients send that this API does not name are ignored, as OpenAI does.
    model_config = ConfigDict(extra="ignore")

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
    stream_options: dict[str, Any] | None = None
    n: int = 1
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def refuse_unsupported(self) -> None:
        if self.n != 1:
            raise bad("n: only 1 choice per prompt is supported")
        if self.logprobs not in (None, False):
            raise bad("logprobs are not supported")
        if self.presence_penalty or self.frequency_penalty:
            raise bad("presence_penalty and frequency_penalty are not supported")

    def sdk_args(self, max_tokens: int | None) -> dict[str, Any]:
        return {
            "max_tokens": max_tokens or 16,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": max(self.top_k or 0, 0),
            "seed": self.seed,
            "stop": self.stop,
        }

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Sampling):
    # Strict: a string of digits is text, never a token id ("1" is not 1).
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = None


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
        raise bad("prompt: an empty list")
    if all(isinstance(x, str) for x in prompt):
        return {"prompt": list(prompt)}
    if all(isinstance(x, int) for x in prompt):
        return {"ids": [list(prompt)]}
    return {"ids": [list(x) for x in prompt]}  # the schema let through only lists of ids


def _text(content: str | list[dict[str, Any]] | None) -> str:
    """A message's content: a string, or OpenAI's list of parts (text parts only)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad(f"message content part of type {part.get('type')!r}: only text is supported")
        parts.append(part["text"])
    return "".join(parts)


def _head(kind: str, model: str) -> dict[str, Any]:
    return {"id": f"{kind}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}


@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    """The deployed models, in OpenAI's list."""
    status = await client_of(request).status()
    now = int(time.time())
    data = [
        {"id": row.name, "object": "model", "created": now, "owned_by": "flowmesh"}
        for row in status.models
    ]
    return {"object": "list", "data": data}


@router.post("/completions", response_model=None)
async def completions(request: Request, body: CompletionRequest) -> dict[str, Any] | EventStream:
    request.scope[MODEL] = body.model
    body.refuse_unsupported()
    if body.echo or body.suffix or (body.best_of or 1) > 1:
        raise bad("echo, suffix and best_of are not supported")
    client = client_of(request)
    args = {**_prompt_args(body.prompt), **body.sdk_args(body.max_tokens)}
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
    body.refuse_unsupported()
    client = client_of(request)
    messages = [{"role": m.role, "content": _text(m.content)} for m in body.messages]
    args = {"messages": [messages], **body.sdk_args(body.max_completion_tokens or body.max_tokens)}
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
