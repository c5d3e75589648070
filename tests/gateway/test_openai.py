"""The OpenAI API through a real gateway in front of a real mesh, spoken by the official `openai`
client: the language models listed (not the tensor ones), completions and chat equal the SDK's
`generate` for the same request (a chat without max_tokens runs to its context's end), streams
join to the blocking answer, refusals come back with OpenAI's statuses and error body (what
flowmesh does not do, or a value of the wrong type, named in its `param`), and a client that goes
away mid-stream, before a blocking answer or before its stream's first token, stops its sequence
on the broker. A second gateway in front of the same mesh has API keys: only their bearers get
in, each key holds at most its streams, and /metrics counts what was answered. Last, a model's
tokenizer: fetched once for every request that waits on it, whichever of them leaves, and asked
for again when a model refused one may have been deployed anew."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import openai
import pytest
import tritonclient.http as triton
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from client_sdk.client import AsyncClient
from client_sdk.errors import ModelNotFound
from client_sdk.mesh import LocalMesh
from flowmesh.auth import add_api_key
from tests.support.lm import tiny_lm_dir
from tests.support.mesh import FAST, roots_at
from tests.support.waiting import until, until_blocking

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"
# Tokens a stream is asked for, and its model's context room for them: many more than are made
# while a disconnect reaches the broker, however loaded the machine.
ENOUGH = 240
CONTEXT = 256  # the model's context: prompt and new tokens
CHAT = [{"role": "user", "content": "Hello! How are you today?"}]
ONE = {"model": "lm", "prompt": PROMPT, "max_tokens": 2}  # a short completion


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory,
    start_gateway: Callable[..., AbstractContextManager[str]],
) -> Iterator[tuple[LocalMesh, str]]:
    root = tmp_path_factory.mktemp("gateway-lm")
    model_dir = tiny_lm_dir(root / "tiny-llama", "llama", seed=5, max_positions=CONTEXT)
    with LocalMesh(cpu_workers=2, memory_budget="8MiB", **roots_at(root), **FAST) as mesh:
        with mesh.client() as c:
            c.deploy("lm", hf=str(model_dir), stages=2, replicas=1, max_seqs=4)
            # A tensor model beside it, which /v1 does not serve.
            c.deploy("mlp", "flowmesh.examples:mlp", kwargs={"width": 8, "depth": 1}, seed=1)
        with start_gateway(mesh.frontend) as url:
            yield mesh, url


@pytest.fixture(scope="module")
def api(served: tuple[LocalMesh, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[1]}/v1", api_key="unused", max_retries=0)


def test_models_lists_and_retrieves_the_language_models(api: openai.OpenAI) -> None:
    assert [m.id for m in api.models.list()] == ["lm"]  # not "mlp": /v1 would refuse it
    got = api.models.retrieve("lm")
    assert (got.id, got.object, got.owned_by) == ("lm", "model", "flowmesh")
    for name in ("mlp", "nope"):
        with pytest.raises(openai.NotFoundError) as lost:
            api.models.retrieve(name)
        assert lost.value.code == "model_not_found" and repr(name) in lost.value.message


def test_completions_equal_the_sdk_and_stream_to_the_same(
    served: tuple[LocalMesh, str], api: openai.OpenAI
) -> None:
    mesh, _ = served
    sampled = {"temperature": 0.9, "top_p": 0.8, "seed": 11}
    with mesh.client() as c:
        sdk = c.generate("lm", PROMPT, max_tokens=10, temperature=0.0)
        sdk_stop = c.generate("lm", PROMPT, max_tokens=10, temperature=0.0, stop=[sdk.text[3:6]])
        sdk_sampled = c.generate("lm", PROMPT, max_tokens=10, **sampled)  # type: ignore[arg-type]
    got = api.completions.create(model="lm", prompt=PROMPT, max_tokens=10, temperature=0)
    (choice,) = got.choices
    assert (choice.text, choice.finish_reason) == (sdk.text, sdk.finish_reason)
    assert got.usage is not None
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
        sdk.prompt_tokens,
        sdk.completion_tokens,
    )
    # With a stop string: the text ends before it, as the SDK's does.
    stopped = api.completions.create(
        model="lm", prompt=PROMPT, max_tokens=10, temperature=0, stop=[sdk.text[3:6]]
    )
    assert stopped.choices[0].text == sdk_stop.text
    assert stopped.choices[0].finish_reason == sdk_stop.finish_reason == "stop"
    # Streamed: the events join to the same text, the last one says why it ended.
    events = list(
        api.completions.create(
            model="lm",
            prompt=PROMPT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [e.choices[0].text for e in events if e.choices]
    assert "".join(texts) == sdk.text and len(texts) > 1
    finishes = [e.choices[0].finish_reason for e in events if e.choices]
    assert finishes[-1] == sdk.finish_reason and not any(finishes[:-1])
    assert events[-1].usage is not None
    assert events[-1].usage.completion_tokens == sdk.completion_tokens
    # top_k, as vLLM's server takes it: 1 keeps only the most likely token, so a draw at
    # temperature 1 is the greedy text.
    top1 = api.completions.create(
        model="lm", prompt=PROMPT, max_tokens=10, temperature=1, seed=3, extra_body={"top_k": 1}
    )
    assert top1.choices[0].text == sdk.text
    off = api.completions.create(
        model="lm", prompt=PROMPT, max_tokens=10, temperature=0, extra_body={"top_k": -1}
    )  # vLLM's "no cut"
    assert off.choices[0].text == sdk.text
    # Sampled with a seed: the same draws as the SDK's, one way and the other.
    drawn = api.completions.create(model="lm", prompt=PROMPT, max_tokens=10, **sampled)
    assert drawn.choices[0].text == sdk_sampled.text != sdk.text
    streamed = api.completions.create(
        model="lm", prompt=PROMPT, max_tokens=10, stream=True, **sampled
    )
    assert "".join(e.choices[0].text for e in streamed if e.choices) == sdk_sampled.text
    # On the wire: one `data:` event per chunk, OpenAI's chunk object, `data: [DONE]` last.
    ask = {"model": "lm", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    wire = httpx.post(f"{served[1]}/v1/completions", json=ask, timeout=30)
    assert wire.headers["content-type"].startswith("text/event-stream")
    data = [line for line in wire.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]" and len(data) > 2
    assert all(json.loads(d[6:])["object"] == "text_completion" for d in data[:-1])


def test_chat_equals_the_sdk_through_the_chat_template(
    served: tuple[LocalMesh, str], api: openai.OpenAI
) -> None:
    mesh, _ = served
    with mesh.client() as c:
        sdk = c.generate("lm", messages=CHAT, max_tokens=8, temperature=0.0)
    got = api.chat.completions.create(
        model="lm",
        messages=CHAT,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    (choice,) = got.choices
    assert choice.message.role == "assistant"
    assert (choice.message.content, choice.finish_reason) == (sdk.text, sdk.finish_reason)
    assert got.usage is not None and got.usage.prompt_tokens == sdk.prompt_tokens
    chunks = list(
        api.chat.completions.create(
            model="lm",
            messages=CHAT,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
            stream=True,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == sdk.text
    assert chunks[-1].choices[0].finish_reason == sdk.finish_reason


def test_a_chat_without_max_tokens_runs_until_it_stops_or_fills_the_context(
    served: tuple[LocalMesh, str], api: openai.OpenAI
) -> None:
    """OpenAI's chat has no default cap: without max_tokens the answer is the SDK's with
    max_tokens=None, which ends at an end-of-sequence token or once the context (256) is full;
    a completion keeps OpenAI's default of 16."""
    mesh, _ = served
    with mesh.client() as c:
        sdk = c.generate("lm", messages=CHAT, max_tokens=None, temperature=0.0)
        sdk16 = c.generate("lm", PROMPT, max_tokens=16, temperature=0.0)
    assert sdk.finish_reason == "stop" or sdk.prompt_tokens + sdk.completion_tokens == CONTEXT
    got = api.chat.completions.create(model="lm", messages=CHAT, temperature=0)  # type: ignore[arg-type]
    assert got.usage is not None
    assert (got.choices[0].message.content, got.choices[0].finish_reason) == (
        sdk.text,
        sdk.finish_reason,
    )
    assert got.usage.completion_tokens == sdk.completion_tokens > 16
    completion = api.completions.create(model="lm", prompt=PROMPT, temperature=0)
    assert completion.choices[0].text == sdk16.text
    assert completion.usage is not None
    assert completion.usage.completion_tokens == sdk16.completion_tokens


def test_refusals_answer_openai_statuses_and_bodies(
    served: tuple[LocalMesh, str], api: openai.OpenAI
) -> None:
    with pytest.raises(openai.NotFoundError) as lost:
        api.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert lost.value.status_code == 404
    assert lost.value.code == "model_not_found" and "nope" in lost.value.message
    # Streamed, the refusal still comes as the status, before any event.
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(
            model="nope",
            messages=CHAT,
            max_tokens=2,
            stream=True,  # type: ignore[arg-type]
        )
    # The broker's refusal (a prompt past the model's context) and the gateway's own checks.
    with pytest.raises(openai.BadRequestError, match="max_context") as long:
        api.completions.create(model="lm", prompt=[3] * 250, max_tokens=20)
    assert long.value.code == "bad_request"
    with pytest.raises(openai.BadRequestError, match="temperature"):
        api.completions.create(model="lm", prompt="hi", temperature=5)
    with pytest.raises(openai.BadRequestError, match="n: only 1"):
        api.completions.create(model="lm", prompt="hi", n=2)
    # A prompt mixing text and ids is neither: "1" is not token 1.
    mixed = httpx.post(
        f"{served[1]}/v1/completions", json={"model": "lm", "prompt": ["1", 2]}, timeout=10
    )
    assert mixed.status_code == 400 and "prompt" in mixed.json()["error"]["message"]
    # A body that is not JSON at all: OpenAI's error body too.
    answer = httpx.post(f"{served[1]}/v1/completions", content=b"{", timeout=10)
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"


def test_what_flowmesh_does_not_do_is_refused_naming_the_parameter(api: openai.OpenAI) -> None:
    """Answered as if done, each of these would be a wrong answer: refused with 400 instead,
    OpenAI's body naming the parameter; the same parameters asking for nothing are taken."""
    chat = {"model": "lm", "messages": CHAT, "max_tokens": 2}
    call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": call}]
    told = [*CHAT, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # a call's result
    refused: list[tuple[str, Callable[[], object]]] = [
        ("logit_bias", lambda: api.completions.create(**ONE, logit_bias={"65": -100})),
        ("logprobs", lambda: api.completions.create(**ONE, logprobs=0)),  # 0 asks too
        ("top_logprobs", lambda: api.chat.completions.create(**chat, top_logprobs=3)),
        ("tools", lambda: api.chat.completions.create(**chat, tools=[tool])),
        ("tool_choice", lambda: api.chat.completions.create(**chat, tool_choice="required")),
        (
            "response_format",
            lambda: api.chat.completions.create(**chat, response_format={"type": "json_object"}),
        ),
        (
            "messages.[1].tool_calls",
            lambda: api.chat.completions.create(**{**chat, "messages": history}),
        ),
        ("messages.[1].role", lambda: api.chat.completions.create(**{**chat, "messages": told})),
    ]
    for param, ask in refused:
        with pytest.raises(openai.BadRequestError) as bad:
            ask()
        assert bad.value.param == param and bad.value.code == "bad_request", param
    # Asking for nothing (and what changes nothing of the answer): taken.
    nothing = {
        "logit_bias": {},
        "logprobs": False,
        "top_logprobs": 0,
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "user": "u",
        "metadata": {"k": "v"},
        "store": False,
    }
    assert api.chat.completions.create(**chat, **nothing).choices[0].finish_reason


def test_values_of_the_wrong_type_or_past_openais_limits_are_refused_naming_them(
    served: tuple[LocalMesh, str],
) -> None:
    url = f"{served[1]}/v1"
    cases = [
        ("completions", {"max_tokens": "5"}, "max_tokens"),  # no number, as "1" is no token
        ("completions", {"stream": "yes"}, "stream"),
        ("completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),  # OpenAI takes 4
        ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("chat/completions", {"messages": [{"role": 1, "content": "hi"}]}, "messages.[0].role"),
    ]
    for route, fields, param in cases:
        body = {**ONE, "messages": CHAT, **fields}
        answer = httpx.post(f"{url}/{route}", json=body, timeout=30)
        assert answer.status_code == 400, (fields, answer.text)
        error = answer.json()["error"]
        assert error["param"] == param and param in error["message"], error
    # A float parameter still takes an integer.
    answer = httpx.post(f"{url}/completions", json={**ONE, "temperature": 0}, timeout=30)
    assert answer.status_code == 200, answer.text


async def settled(row: Callable[[], Awaitable[tuple[int, int]]]) -> tuple[int, int]:
    """`row()` (the model's live sequences, tokens made) once it has no live sequence."""
    last = (-1, -1)

    async def idle() -> bool:
        nonlocal last
        last = await row()
        return last[0] == 0

    await until(idle, "the model's sequences to leave the broker", poll=0.05)
    return last


async def kv_held(c: AsyncClient) -> bool:
    """Whether a worker reports KV cache blocks or sequences held (its last status report)."""
    return any(w.kv_seqs or w.kv_blocks for w in (await c.status()).workers)


async def kv_freed(c: AsyncClient) -> None:
    """Wait until every worker reports its KV cache empty: no sequence, no block."""

    async def empty() -> bool:
        return not await kv_held(c)

    await until(empty, "the workers' KV cache to be freed", poll=0.05)


def test_a_client_gone_mid_stream_stops_its_sequence(served: tuple[LocalMesh, str]) -> None:
    mesh, url = served
    ask = {
        "model": "lm",
        "prompt": "Once upon",
        "max_tokens": ENOUGH,
        "temperature": 0,
        "stream": True,
    }

    async def main() -> None:
        async with AsyncClient(mesh.frontend, timeout=60) as c:

            async def row() -> tuple[int, int]:
                m = next(m for m in (await c.status()).models if m.name == "lm")
                return m.running_seqs + m.waiting_seqs, m.tokens_generated

            _, start = await row()
            async with (
                httpx.AsyncClient(timeout=30) as http,
                http.stream("POST", f"{url}/v1/completions", json=ask) as answer,
            ):
                assert answer.status_code == 200
                seen = 0
                async for line in answer.aiter_lines():
                    if line.startswith("data: {"):
                        assert json.loads(line[6:])["choices"][0]["finish_reason"] is None
                        seen += 1
                        if seen == 2:
                            break  # leaving the block closes the connection
            running, made = await settled(row)
            # Freed on the broker well before its tokens were all made (a few were on their way).
            assert running == 0 and 0 < made - start < ENOUGH
            await kv_freed(c)  # and its KV memory on the workers

    asyncio.run(main())


def test_a_client_gone_before_a_blocking_answer_stops_its_sequence(
    served: tuple[LocalMesh, str],
) -> None:
    mesh, url = served
    ask = {"model": "lm", "prompt": "Once upon", "max_tokens": ENOUGH, "temperature": 0}

    async def main() -> None:
        async with AsyncClient(mesh.frontend, timeout=60) as c:

            async def row() -> tuple[int, int]:
                m = next(m for m in (await c.status()).models if m.name == "lm")
                return m.running_seqs + m.waiting_seqs, m.tokens_generated

            _, start = await row()
            async with httpx.AsyncClient(timeout=30) as http:
                call = asyncio.ensure_future(http.post(f"{url}/v1/completions", json=ask))

                async def generating() -> bool:
                    running, made = await row()
                    return bool(running and made > start) and await kv_held(c)

                await until(generating, "the sequence to generate, its KV held", poll=0.02)
                assert not call.done()
                call.cancel()  # the client gives up: its connection closes
                with contextlib.suppress(asyncio.CancelledError):
                    await call
            running, made = await settled(row)
            assert running == 0 and 0 < made - start < ENOUGH
            await kv_freed(c)

    asyncio.run(main())


@pytest.fixture(scope="module")
def keyed(
    served: tuple[LocalMesh, str],
    tmp_path_factory: pytest.TempPathFactory,
    start_gateway: Callable[..., AbstractContextManager[str]],
) -> Iterator[tuple[str, str, str]]:
    """A second gateway in front of the same mesh, with API keys (two client keys, as
    `flowmesh keys add --api` writes them) and one stream per key: (url, key a, key b)."""
    keys = tmp_path_factory.mktemp("api-keys")
    (_, a), (_, b) = (add_api_key(keys, name, "client") for name in ("a", "b"))
    args = ["--api-keys", str(keys / "api_keys.json"), "--max-streams-per-key", "1"]
    with start_gateway(served[0].frontend, args=args) as url:
        yield url, a, b


def _api(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def test_api_keys_let_in_only_their_bearers(keyed: tuple[str, str, str]) -> None:
    url, a, _ = keyed
    got = _api(url, a).completions.create(model="lm", prompt=PROMPT, max_tokens=2, temperature=0)
    assert got.choices[0].finish_reason == "length"
    with pytest.raises(openai.AuthenticationError) as wrong:
        _api(url, a + "x").models.list()
    assert wrong.value.status_code == 401 and wrong.value.code == "unauthorized"
    bare = httpx.get(f"{url}/v1/models", timeout=30)  # no Authorization at all
    assert bare.status_code == 401 and bare.headers["www-authenticate"] == "Bearer"
    assert bare.json()["error"]["type"] == "authentication_error"
    # KServe v2 the same, in its own error body; the probes stay open.
    v2 = triton.InferenceServerClient(url.removeprefix("http://"))
    with pytest.raises(InferenceServerException) as refused:
        v2.get_model_metadata("lm")
    assert refused.value.status() == "401"
    assert v2.get_model_metadata("lm", headers={"Authorization": f"Bearer {a}"})["name"] == "lm"
    assert v2.is_server_live() and v2.is_server_ready()


def _open_streams(url: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        if family.name == "flowmesh_gateway_open_streams":
            return family.samples[0].value
    raise AssertionError("no open streams gauge")


@contextlib.contextmanager
def _held_stream(url: str, key: str) -> Iterator[None]:
    """A stream of key's that stays open: asked for eight sequences' worth of events over a
    socket with a tiny receive buffer, read up to its first event and no further, so that the
    gateway's writes stall (TCP's flow control) long before the events are all sent."""
    host, port = url.removeprefix("http://").split(":")
    ask = json.dumps(
        {"model": "lm", "prompt": ["Once upon"] * 8, "max_tokens": ENOUGH, "stream": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(ask)}\r\n\r\n"
    ).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connect: the window
        sock.connect((host, int(port)))
        sock.sendall(head + ask)
        seen = b""
        while b"data: {" not in seen:
            got = sock.recv(256)
            assert got, seen
            seen += got
        assert seen.startswith(b"HTTP/1.1 200"), seen
        yield


def test_streams_past_the_per_key_limit_get_429_while_others_run(
    keyed: tuple[str, str, str],
) -> None:
    url, a, b = keyed
    # Greedy: a sampled token may be the end of the sequence, and these streams must run out
    # their tokens ("length").
    stream = {"model": "lm", "prompt": "hi", "stream": True, "temperature": 0}
    with _held_stream(url, a):
        assert _open_streams(url) == 1
        with pytest.raises(openai.RateLimitError) as over:  # a's one stream is open
            _api(url, a).completions.create(max_tokens=2, **stream)
        assert over.value.status_code == 429 and "1 streams" in over.value.message
        assert _open_streams(url) == 1  # still held: the 429 was no accident of timing
        # Another key's stream, and a's own blocking call, run meanwhile.
        events = list(_api(url, b).completions.create(max_tokens=3, **stream))
        assert events and events[-1].choices[0].finish_reason == "length"
        assert _api(url, a).completions.create(model="lm", prompt="hi", max_tokens=2).choices
    # Gone: its slot is given back once the gateway sees it go.
    until_blocking(
        lambda: _open_streams(url) == 0, "the held stream's slot to be given back", poll=0.05
    )
    events = list(_api(url, a).completions.create(max_tokens=2, **stream))
    assert events[-1].choices[0].finish_reason == "length"


def test_metrics_count_requests_first_bytes_and_streams(keyed: tuple[str, str, str]) -> None:
    url, a, _ = keyed
    api = _api(url, a)
    api.completions.create(model="lm", prompt="hi", max_tokens=2)
    list(api.completions.create(model="lm", prompt="hi", max_tokens=2, stream=True))
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="nope", prompt="hi", max_tokens=2)
    httpx.get(f"{url}/v1/models", timeout=30)  # no key: 401
    # Refused at the door before the mesh saw the name (n=2 is not supported): a 400 that
    # would otherwise make a series of whatever name a caller chose.
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model="made-up-by-caller", prompt="hi", max_tokens=2, n=2)
    scraped = httpx.get(f"{url}/metrics", timeout=30)  # open, like the probes
    assert scraped.status_code == 200
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(scraped.text)
        for s in family.samples
    }

    def requests(route: str, status: str, model: str) -> float:
        labels = (("model", model), ("route", route), ("status", status))
        return samples.get(("flowmesh_gateway_requests_total", labels), 0.0)

    assert requests("/v1/completions", "200", "lm") >= 2
    # An unknown model's name, or a refused caller's, is no label value (any name would be).
    assert requests("/v1/completions", "404", "") >= 1
    assert requests("/v1/models", "401", "") >= 1
    assert requests("/v1/completions", "400", "") >= 1
    assert not any("nope" in str(key) or "made-up" in str(key) for key in samples)
    first = ("flowmesh_gateway_first_byte_seconds_count", (("route", "/v1/completions"),))
    assert samples[first] >= 3
    assert ("flowmesh_gateway_open_streams", ()) in samples


# The tests below freeze the broker (SIGSTOP) for a moment: while it is frozen nothing it would
# answer comes, whatever the machine's speed, so the gateway is caught waiting for a tokenizer
# or a first token. Last in the module, as a frozen broker's peers are the module's too.


async def _gateway_counts(http: httpx.AsyncClient, url: str) -> tuple[float, float]:
    """(open streams, requests answered 499: the client gone) from the gateway's /metrics."""
    streams = gone = 0.0
    for family in text_string_to_metric_families((await http.get(f"{url}/metrics")).text):
        for s in family.samples:
            if s.name == "flowmesh_gateway_open_streams":
                streams = s.value
            elif s.name == "flowmesh_gateway_requests_total" and s.labels["status"] == "499":
                gone += s.value
    return streams, gone


def test_a_client_gone_before_its_streams_first_token_stops_its_sequence(
    served: tuple[LocalMesh, str],
) -> None:
    """Before its first token a stream has written nothing, so only a watch on the connection
    sees its client go: then its sequence is stopped and its stream slot given back at once,
    not when a first token comes."""
    mesh, url = served
    broker = mesh.child("broker").proc
    ask = {"model": "lm", "prompt": "Once upon", "max_tokens": ENOUGH, "temperature": 0}

    async def main() -> None:
        async with (
            AsyncClient(mesh.frontend, timeout=60) as c,
            httpx.AsyncClient(timeout=60) as http,
        ):

            async def row() -> tuple[int, int]:
                m = next(m for m in (await c.status()).models if m.name == "lm")
                return m.running_seqs + m.waiting_seqs, m.tokens_generated

            async def streams(n: int) -> bool:
                return (await _gateway_counts(http, url))[0] == n

            # The gateway has the model's tokenizer: the stream waits for its first token only.
            warm = await http.post(f"{url}/v1/completions", json={**ask, "max_tokens": 1})
            assert warm.status_code == 200
            _, start = await row()
            broker.send_signal(signal.SIGSTOP)
            try:
                call = asyncio.ensure_future(
                    http.post(f"{url}/v1/completions", json={**ask, "stream": True})
                )
                await until(lambda: streams(1), "the stream to wait for its first token")
                call.cancel()  # the client gives up: its connection closes
                with contextlib.suppress(asyncio.CancelledError):
                    await call
                # Given back while the broker is still frozen: no token came meanwhile.
                gone = "the gone stream's slot to be given back"
                await until(lambda: streams(0), gone, timeout=20)
            finally:
                broker.send_signal(signal.SIGCONT)
            # Its Generate reached the broker with its StopGenerate after it: stopped there.
            running, made = await settled(row)
            assert running == 0 and made - start < ENOUGH
            await kv_freed(c)

    asyncio.run(main())


def test_the_tokenizer_fetch_outlives_the_first_caller_leaving(
    served: tuple[LocalMesh, str], start_gateway: Callable[..., AbstractContextManager[str]]
) -> None:
    """The first request for a model fetches its tokenizer for every request that comes
    meanwhile; its client leaving (its request cancelled) must not fail theirs."""
    mesh, _ = served
    broker = mesh.child("broker").proc
    stream = {"model": "lm", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True}
    chat = {"model": "lm", "messages": CHAT, "max_tokens": 3, "temperature": 0, "stream": True}
    # A gateway of its own: it has fetched no tokenizer yet.
    with start_gateway(mesh.frontend) as url:
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 200  # connected

        async def main() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as http:

                async def streams(n: int) -> bool:
                    return await _gateway_counts(http, url) == (n, 0)

                async def gone() -> bool:
                    return (await _gateway_counts(http, url))[1] == 1

                broker.send_signal(signal.SIGSTOP)  # the fetch is not answered meanwhile
                try:
                    first = asyncio.ensure_future(http.post(f"{url}/v1/completions", json=stream))
                    # A stream holds its slot from before it asks for the tokenizer.
                    await until(lambda: streams(1), "the first stream to fetch the tokenizer")
                    others = [
                        asyncio.ensure_future(http.post(f"{url}/v1/completions", json=stream)),
                        asyncio.ensure_future(http.post(f"{url}/v1/chat/completions", json=chat)),
                    ]
                    await until(lambda: streams(3), "two more streams to wait for it")
                    first.cancel()  # its client leaves: the gateway cancels its request
                    with contextlib.suppress(asyncio.CancelledError):
                        await first
                    # Seen gone (its 499) while the fetch is still unanswered; what became
                    # of the others is for their answers to tell.
                    await until(gone, "the gateway to see the first one gone")
                finally:
                    broker.send_signal(signal.SIGCONT)
                return await asyncio.gather(*others)

        for answer in asyncio.run(main()):
            assert answer.status_code == 200, answer.text
            assert answer.text.rstrip().endswith("data: [DONE]") and '"error"' not in answer.text


def test_a_model_refused_a_tokenizer_is_asked_again_once_deployed_anew(
    served: tuple[LocalMesh, str], api: openai.OpenAI
) -> None:
    """A model without a tokenizer is refused text prompts; deployed again under its name as a
    language model (by another client: this gateway hears nothing of it), it is answered."""
    mesh, _ = served
    assert mesh.data_roots
    root = Path(mesh.data_roots[0])  # where the mesh reads models from
    model_dir = tiny_lm_dir(root / "tiny-m", "llama", seed=2, layers=1, hidden=16)
    with mesh.client() as c:
        c.deploy("m", "flowmesh.examples:mlp", kwargs={"width": 8, "depth": 1}, seed=1)
    try:
        with pytest.raises(openai.BadRequestError, match="not a language model"):
            api.completions.create(model="m", prompt=PROMPT, max_tokens=2)
        with mesh.client() as c:
            c.undeploy("m")
            c.deploy("m", hf=str(model_dir), stages=1, replicas=1, max_seqs=1)
            sdk = c.generate("m", PROMPT, max_tokens=3, temperature=0.0)
        got = api.completions.create(model="m", prompt=PROMPT, max_tokens=3, temperature=0)
        assert got.choices[0].text == sdk.text
    finally:
        with mesh.client() as c, contextlib.suppress(ModelNotFound):
            c.undeploy("m")
