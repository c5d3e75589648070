"""Generation on the client's side: prompts made token ids, the broker's tokens made text, stop
strings watched for, and streams (what `AsyncClient.generate` / `generate_stream` and their
blocking twins run).

The mesh moves token ids only. The client fetches a model's tokenizer once (`TokenizerInfo`,
cached per model name; `flowmesh.modelio.tokenizer.TextCodec`), encodes prompts with it and
decodes each sequence's tokens as they come, on a thread (never on the event loop). A stop
string is looked for in the decoded text: the text ends before it, the sequence is stopped on
the broker (`StopGenerate`, which frees its memory there) and ends with finish_reason "stop";
tokens that were already on their way are dropped. A stream closed early, or a generate call
cancelled, stops every sequence of its Generate the same way. A Generate is never sent twice
(a stream cannot be replayed): a connection lost under it fails it with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import operator
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from client_sdk.errors import BadRequest, ClientError, ModelNotFound, error_from
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.tokenizer import StreamDecoder, TextCodec

# The clients (client_sdk.client imports this module): typed by name only, no import cycle.
AsyncClient = Any
Client = Any


@dataclass(frozen=True)
class Generation:
    """One sequence's result. `text`: the new tokens' text (None when the model has no
    tokenizer), cut before a stop string; `ids`: the new tokens (a stopping eos or stop id
    kept); `finish_reason`: "stop" (eos, a stop id or string, a stop asked for) or "length"
    (max_tokens); `ttft_ms`: from the broker's receipt of the call to the first token;
    `token_ms`: the time from each token to the next."""

    text: str | None
    ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float
    token_ms: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Chunk:
    """New tokens of sequence `index` of a stream, and their text ("" while a character or a
    possible stop string is incomplete; None without a tokenizer). The sequence's last chunk
    carries its `finish_reason`."""

    index: int
    ids: list[int]
    text: str | None
    finish_reason: str | None = None


@dataclass(frozen=True)
class GenAsk:
    """A generate call's arguments as the client methods take them (see `AsyncClient.generate`)."""

    model: str
    prompt: str | Sequence[str] | None = None
    ids: Sequence[int] | Sequence[Sequence[int]] | None = None
    messages: Sequence[Any] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    stop: str | Sequence[str] | None = None
    timeout: float | None = None


@dataclass(frozen=True)
class _Refusal:
    """The broker's refusal of a model's tokenizer, and the loop's time it came."""

    error: ClientError
    at: float


class Codecs:
    """Each model's `TextCodec`, fetched once, for the KEPT models used last: a client that
    lives long (the gateway's) sees models come and go, and a tokenizer is megabytes.

    A fetch runs as a task of its own that every call asking for the model waits on (shielded):
    a caller cancelled meanwhile (its HTTP client left) leaves the fetch to the others. The
    broker's refusal (a model without a tokenizer) is believed for REFUSAL_S seconds by calls
    that can do without one, and never by a call that needs one: that call would fail on it,
    and the model may have been deployed again since with a tokenizer (from another client,
    which this one does not hear of), so it asks again."""

    KEPT = 64
    # Seconds a refusal is taken as the answer by calls that go on without a codec (token ids
    # in, no stop strings): they would otherwise ask the broker again on every call.
    REFUSAL_S = 5.0

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        # Each model's fetch: its codec, or the broker's refusal to give one.
        self._codecs: OrderedDict[str, asyncio.Task[TextCodec | _Refusal]] = OrderedDict()

    async def get(self, model: str, *, needed: bool, timeout: float | None) -> TextCodec | None:
        """`model`'s codec; when it has none, None, or (`needed`) the broker's refusal."""
        while True:
            fetch = self._fetch_of(model, needed, timeout)
            try:
                got = await asyncio.shield(fetch)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if fetch.cancelled() and task is not None and not task.cancelling():
                    continue  # the fetch was cancelled, not this call: fetch again
                raise
            if isinstance(got, _Refusal):
                if needed:
                    raise type(got.error)(got.error.code, got.error.reason)
                return None
            return got

    def _fetch_of(
        self, model: str, needed: bool, timeout: float | None
    ) -> asyncio.Task[TextCodec | _Refusal]:
        """The fetch of `model`'s codec to wait on: the one under way or kept, else a new one."""
        loop = asyncio.get_running_loop()
        fetch = self._codecs.get(model)
        if fetch is not None and not self._stale(fetch, needed, loop.time()):
            self._codecs.move_to_end(model)
            return fetch
        fetch = self._codecs[model] = loop.create_task(self._fetch(model, timeout))
        self._codecs.move_to_end(model)
        fetch.add_done_callback(functools.partial(self._fetched, model))
        while len(self._codecs) > self.KEPT:  # the used longest ago (its waiters hold it)
            self._codecs.popitem(last=False)
        return fetch

    def _stale(self, fetch: asyncio.Task[TextCodec | _Refusal], needed: bool, now: float) -> bool:
        """Whether a kept fetch's answer is not to be believed (see the class's docstring)."""
        if not fetch.done():
            return False
        if fetch.cancelled() or fetch.exception() is not None:
            return True  # (dropped when it ended; here only if its done callback has not run)
        got = fetch.result()
        return isinstance(got, _Refusal) and (needed or now - got.at > self.REFUSAL_S)

    def _fetched(self, model: str, fetch: asyncio.Task[TextCodec | _Refusal]) -> None:
        """A fetch ended: one that failed (or was cancelled) is not kept, so the next call asks
        again; its waiters, if any, raise its error themselves."""
        failed = fetch.cancelled() or fetch.exception() is not None  # (retrieved: not logged)
        if failed and self._codecs.get(model) is fetch:
            del self._codecs[model]

    async def _fetch(self, model: str, timeout: float | None) -> TextCodec | _Refusal:
        conn = self.client.connection
        try:
            reply = await conn.call(p.TokenizerInfo(id=conn.next_id(), model=model), timeout)
        except BadRequest as exc:  # a model without a tokenizer (or no language model)
            return _Refusal(exc, asyncio.get_running_loop().time())
        assert isinstance(reply, p.TokenizerReply)
        return await asyncio.to_thread(TextCodec.from_reply, reply)

    def forget(self, model: str) -> None:
        """Drop `model`'s codec (it was undeployed: a model of that name may be another)."""
        fut = self._codecs.get(model)
        if fut is not None and fut.done():
            del self._codecs[model]


def _sampling(ask: GenAsk) -> p.Sampling:
    try:
        return msgspec.convert(ask.sampling, p.Sampling)
    except msgspec.ValidationError as exc:
        raise BadRequest(Code.BAD_REQUEST, f"generate: {exc}") from None


def _stops(stop: str | Sequence[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) and s for s in stops):
        raise BadRequest(Code.BAD_REQUEST, "generate: stop strings must be non-empty strings")
    return stops


def _bad_ids(why: str) -> BadRequest:
    return BadRequest(Code.BAD_REQUEST, f"generate: {why}")


def _items(x: Any) -> list[Any] | None:
    """`x`'s items when it is a sequence (a list or tuple, a numpy or torch array: its values
    as Python's), None when it is one value (an int, a numpy or torch scalar, a string)."""
    if hasattr(x, "tolist") and callable(x.tolist):  # numpy / torch, array.array
        x = x.tolist()
    if isinstance(x, str | bytes | bytearray | dict) or not isinstance(x, Iterable):
        return None
    return list(x)


def _id(x: Any, where: str) -> int:
    """Token id `x` (at `where`, named in the refusal) as a Python int: an int, a numpy or torch
    integer scalar, anything with `__index__`; never a bool, a float or a sequence."""
    if hasattr(x, "tolist") and callable(x.tolist):  # numpy / torch scalars: Python's
        x = x.tolist()
    if isinstance(x, bool):
        raise _bad_ids(f"{where} is a bool ({x}), not a token id (ids are ints)")
    if isinstance(x, float):
        raise _bad_ids(f"{where} is a float ({x!r}), not a token id (ids are ints)")
    if _items(x) is not None:
        raise _bad_ids(
            f"{where} is of type {type(x).__name__}: ids are one prompt (a sequence of ints) or a "
            f"batch (a sequence of such sequences), nested no deeper"
        )
    try:
        token = operator.index(x)
    except TypeError:
        raise _bad_ids(
            f"{where} is of type {type(x).__name__}, not a token id (ids are ints)"
        ) from None
    if not 0 <= token < p.TOKEN_ID_LIMIT:
        raise _bad_ids(f"token id {token} is outside 0..{p.TOKEN_ID_LIMIT - 1} ({where})")
    return token


def _ids(ids: Any) -> tuple[list[list[int]], bool]:
    """`ids=` as the prompts' token ids, and whether it is a batch: a sequence of ints is one
    prompt, a sequence of such sequences a batch (a numpy or torch integer array: 1-D, one
    prompt; 2-D, a batch). BadRequest naming what else it holds: a bool, a float, a string,
    deeper nesting, ids mixed with sequences."""
    dtype = getattr(ids, "dtype", None)
    if dtype is not None:  # an array: of ints, or refused as a whole
        name = str(dtype).removeprefix("torch.")
        if name.startswith(("bool", "float", "bfloat", "half", "double", "complex")):
            raise _bad_ids(
                f"ids is of type {type(ids).__name__} with dtype {name}: token ids are ints "
                "(an integer array)"
            )
    top = _items(ids)
    if top is None:
        raise _bad_ids(
            f"ids is of type {type(ids).__name__}: it must be a sequence of token ids (one "
            "prompt) or a sequence of such sequences (a batch)"
        )
    rows = [_items(x) for x in top]
    batch = any(r is not None for r in rows)
    if batch and not all(r is not None for r in rows):
        first = next(i for i, r in enumerate(rows) if r is None)
        raise _bad_ids(
            f"ids mixes token ids and sequences of them (ids[{first}] is of type "
            f"{type(top[first]).__name__}): give one prompt's ids, or a batch of such sequences"
        )
    if not batch:
        return [[_id(x, f"ids[{j}]") for j, x in enumerate(top)]], False
    return [
        [_id(x, f"ids[{i}][{j}]") for j, x in enumerate(row or ())] for i, row in enumerate(rows)
    ], True


def _prompts(ask: GenAsk) -> tuple[str, list[Any], bool]:
    """What the prompts are ("text", "ids" or "chat"), one item per sequence, and whether the
    call is a batch (its result a list)."""
    given = [n for n in ("prompt", "ids", "messages") if getattr(ask, n) is not None]
    if len(given) != 1:
        raise BadRequest(
            Code.BAD_REQUEST,
            "generate needs exactly one of prompt=..., ids=... or messages=..."
            + (f" (got {' and '.join(given)})" if given else ""),
        )
    if ask.prompt is not None:
        batch = not isinstance(ask.prompt, str)
        items, kind = list(ask.prompt) if batch else [ask.prompt], "text"
        ok = all(isinstance(t, str) for t in items)
    elif ask.ids is not None:
        (items, batch), kind, ok = _ids(ask.ids), "ids", True
    else:
        chats = list(ask.messages or [])
        batch = bool(chats) and not isinstance(chats[0], dict)
        items, kind = [list(c) for c in chats] if batch else [chats], "chat"
        ok = all(c and all(isinstance(m, dict) for m in c) for c in items)
    if not items or not ok:
        raise BadRequest(
            Code.BAD_REQUEST,
            f"generate: {given[0]} must be one prompt or a non-empty list of them "
            f"({'str' if kind == 'text' else 'int ids' if kind == 'ids' else 'message dicts'}"
            f"{', each chat at least one message' if kind == 'chat' else ''})",
        )
    return kind, items, batch


def _encode(codec: TextCodec | None, kind: str, items: list[Any]) -> list[list[int]]:
    """The prompts' ids (on a thread: tokenizing is not for the event loop)."""
    if kind == "ids":
        return items
    assert codec is not None
    if kind == "chat":
        return [codec.encode_chat(chat) for chat in items]
    return [codec.encode(text) for text in items]


class _SeqText:
    """One sequence's tokens and text so far, and its end (see the module's docstring)."""

    def __init__(self, index: int, codec: TextCodec | None, stops: list[str]) -> None:
        self.index = index
        self.stops = stops
        self.decoder: StreamDecoder | None = codec.stream() if codec is not None else None
        self.ids: list[int] = []
        self.text = ""  # given out
        self.held = ""  # decoded but not given out: it may be where a stop string begins
        self.finish: str | None = None
        self.stopped = False  # ended here, by a stop string (the broker is to be told)

    def push(self, ids: list[int], finish: str | None) -> Chunk | None:
        """New tokens from the broker (and its finish); the chunk to give out, None when the
        sequence has already ended here."""
        if self.finish is not None:
            return None  # tokens on their way when a stop string ended it
        self.ids.extend(ids)
        if self.decoder is None:
            self.finish = finish
            return Chunk(self.index, list(ids), None, finish)
        self.held += self.decoder.push(ids)
        if finish is not None:
            self.held += self.decoder.finish()
        out, hit = self._release(final=finish is not None)
        self.text += out
        if hit:
            self.finish, self.stopped = "stop", finish is None
        else:
            self.finish = finish
        return Chunk(self.index, list(ids), out, self.finish)

    def _release(self, final: bool) -> tuple[str, bool]:
        """The held text that can go out now, and whether a stop string ends it. Text held back
        always begins where a stop string could begin, so no stop string starts in text given
        out, and searching the held text finds each one first."""
        hits = [k for k in (self.held.find(s) for s in self.stops) if k >= 0]
        if hits:
            out, self.held = self.held[: min(hits)], ""
            return out, True
        keep = 0 if final else self._stop_prefix()
        out = self.held[: len(self.held) - keep]
        self.held = self.held[len(self.held) - keep :]
        return out, False

    def _stop_prefix(self) -> int:
        """The length of the longest end of the held text that a stop string begins with."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.held)), best, -1):
                if self.held.endswith(stop[:n]):
                    best = n
                    break
        return best


class GenRun:
    """One Generate: started by `start`, its chunks read with `next_chunk` (a stream) or its
    results with `results` (a stream of its own when stop strings must be watched)."""

    # Times a Generate refused TOKENIZER_CHANGED is encoded and sent again.
    RESTARTS = 2

    def __init__(self, client: AsyncClient, ask: GenAsk, *, stream: bool) -> None:
        self.client = client
        self.ask = ask
        self.stream = stream
        self.msg: p.Generate | None = None
        self.seqs: list[_SeqText] = []
        self.batch = False
        self._task: asyncio.Task[p.Message] | None = None
        self._parts: asyncio.Queue[p.GenChunk | None] = asyncio.Queue()
        self._ready: list[Chunk] = []
        self.generations: list[Generation] | None = None  # once the Generate is answered
        self.ended = False
        self._restarts = 0

    async def start(self) -> None:
        ask, conn = self.ask, self.client.connection
        sampling, stops = _sampling(ask), _stops(ask.stop)
        kind, items, self.batch = _prompts(ask)
        codec = await self.client.codecs.get(
            ask.model, needed=kind != "ids" or bool(stops), timeout=ask.timeout
        )
        try:
            prompts = (
                items if kind == "ids" else await asyncio.to_thread(_encode, codec, kind, items)
            )
        except ClientError:
            raise
        except FlowmeshError as exc:  # a chat template that refuses the messages, say: typed
            raise error_from(exc.code, exc.reason) from None
        self.seqs = [_SeqText(i, codec, stops) for i in range(len(prompts))]
        self.msg = p.Generate(
            id=conn.next_id(),
            model=ask.model,
            prompts=prompts,
            sampling=sampling,
            # Stop strings are watched for in the text as it comes.
            stream=self.stream or bool(stops),
            timeout_ms=conn.timeout_ms(ask.timeout),
            tokenizer=codec.digest if codec is not None else "",
        )
        self._task = asyncio.get_running_loop().create_task(
            conn.call(self.msg, ask.timeout, on_part=self._on_part)
        )
        self._task.add_done_callback(lambda _: self._parts.put_nowait(None))

    def _on_part(self, part: p.Message) -> None:
        if isinstance(part, p.GenChunk):
            self._parts.put_nowait(part)

    async def next_chunk(self) -> Chunk | None:
        """The next chunk of the stream; None once every sequence has ended."""
        while not self._ready:
            if self.ended:
                return None
            await self._step()
        return self._ready.pop(0)

    async def results(self) -> list[Generation]:
        while not self.ended:
            await self._step()
        assert self.generations is not None
        return self.generations

    async def _step(self) -> None:
        """Take what has come (at least one message): chunks decoded on a thread, stop strings
        acted on, and the end."""
        items = [await self._parts.get()]
        while not self._parts.empty():
            items.append(self._parts.get_nowait())
        parts = [(c.index, list(c.ids), c.finish) for c in items if c is not None]
        if None in items and not parts and self._tokenizer_changed():
            # Refused at the door, before any token: encoded again with the model's new
            # tokenizer and sent again.
            self.client.codecs.forget(self.ask.model)
            self._restarts += 1
            await self.start()
            return
        reply = self._reply() if None in items else None
        chunks = await self._text(parts) if parts else []
        if reply is not None:
            # What the answer adds to the chunks taken (those just above included): were it
            # reckoned before them, a sequence's last chunk read with the answer would count
            # twice.
            rest = self._rest(reply)
            chunks += await self._text(rest) if rest else []
        self._ready.extend(c for c in chunks if c is not None)
        if reply is not None:
            outs = zip(self.seqs, reply.outputs, strict=True)
            self.generations = [self._generation(s, o) for s, o in outs]
            self.ended = True
            return
        stopped = [s.index for s in self.seqs if s.stopped]
        if stopped:
            self._tell_stop(stopped)
            for s in self.seqs:
                s.stopped = False

    def _tokenizer_changed(self) -> bool:
        """Whether the Generate was refused for a tokenizer the model no longer has, and may
        be sent again (at most `RESTARTS` times: a model deployed again and again meanwhile
        fails the call)."""
        assert self._task is not None and self._task.done()
        if self._task.cancelled() or self._restarts >= self.RESTARTS:
            return False
        exc = self._task.exception()
        return isinstance(exc, ClientError) and exc.code == Code.TOKENIZER_CHANGED

    def _reply(self) -> p.Generated:
        """The Generate's answer (its call has ended); its error raised."""
        assert self._task is not None and self._task.done()
        try:
            reply = self._task.result()
        except BaseException as exc:
            self.ended = True
            if isinstance(exc, ModelNotFound):
                self.client.codecs.forget(self.ask.model)
            raise
        assert isinstance(reply, p.Generated)
        return reply

    def _rest(self, reply: p.Generated) -> list[tuple[int, list[int], str | None]]:
        """What the Generated says of the sequences that did not end in chunks."""
        if len(reply.outputs) != len(self.seqs):
            raise ClientError(
                Code.INTERNAL,
                f"the broker answered {len(reply.outputs)} sequences for {len(self.seqs)} prompts",
            )
        return [
            (s.index, list(o.ids[len(s.ids) :]), o.finish)
            for s, o in zip(self.seqs, reply.outputs, strict=True)
            if s.finish is None
        ]

    async def _text(self, parts: list[tuple[int, list[int], str | None]]) -> list[Chunk | None]:
        def push() -> list[Chunk | None]:
            return [self._seq(i).push(ids, finish) for i, ids, finish in parts]

        if self.seqs and self.seqs[0].decoder is not None:
            return await asyncio.to_thread(push)  # decoding is not for the event loop
        return push()

    def _seq(self, index: int) -> _SeqText:
        if not 0 <= index < len(self.seqs):
            raise ClientError(Code.INTERNAL, f"the broker streamed sequence {index}: no such one")
        return self.seqs[index]

    @staticmethod
    def _generation(seq: _SeqText, out: p.GenOutput) -> Generation:
        n = len(seq.ids)
        return Generation(
            text=seq.text if seq.decoder is not None else None,
            ids=seq.ids,
            finish_reason=seq.finish or out.finish,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=n,
            ttft_ms=out.ttft_ms,
            token_ms=list(out.token_ms[: max(0, n - 1)]),
        )

    def _tell_stop(self, indexes: list[int] | None) -> None:
        assert self.msg is not None
        self.client.connection.notify(p.StopGenerate(id=self.msg.id, indexes=indexes))

    def abandon(self) -> None:
        """End the call here before its answer (a stream closed early, a cancelled call): its
        sequences are stopped on the broker, and its answer is not waited for."""
        if self.ended or self._task is None:
            self.ended = True
            return
        self.ended = True
        self._tell_stop(None)
        self._task.cancel()


async def generate(client: AsyncClient, ask: GenAsk) -> Generation | list[Generation]:
    run = GenRun(client, ask, stream=False)
    try:
        await run.start()
        outs = await run.results()
    finally:
        run.abandon()  # when cancelled, say: the broker stops the sequences at once
    return outs if run.batch else outs[0]


class AsyncGenStream:
    """`AsyncClient.generate_stream`'s answer: an async iterator of `Chunk`s, started by the
    first read. Closing it before its end (`aclose`, or leaving `async with`) stops the
    sequences on the broker; so does dropping it unfinished. `generations`: the results, once
    the stream has ended."""

    def __init__(self, client: AsyncClient, ask: GenAsk) -> None:
        self._run = GenRun(client, ask, stream=True)
        self._started = False

    @property
    def generations(self) -> list[Generation] | None:
        return self._run.generations

    def __aiter__(self) -> AsyncGenStream:
        return self

    async def __anext__(self) -> Chunk:
        run = self._run
        try:
            if not self._started:
                self._started = True
                await run.start()
            chunk = await run.next_chunk()
        except BaseException:
            run.abandon()
            raise
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        self._run.abandon()

    async def __aenter__(self) -> AsyncGenStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        run = self._run
        task = run._task
        if run.ended or task is None:
            return
        with contextlib.suppress(RuntimeError):  # its loop is closed: nothing to stop
            task.get_loop().call_soon_threadsafe(run.abandon)


_END = object()


class GenStream:
    """`Client.generate_stream`'s answer: an iterator of `Chunk`s, read on the client's loop
    thread (each chunk waited for at most the call's timeout). `close` (or leaving `with`, or
    dropping it unfinished) stops the sequences on the broker."""

    def __init__(self, client: Client, stream: AsyncGenStream, timeout: float | None) -> None:
        self._client = client
        self._stream = stream
        self._seconds = client._async.connection.seconds(timeout)
        self._done = False

    @property
    def generations(self) -> list[Generation] | None:
        return self._stream.generations

    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        if self._done:
            raise StopIteration
        try:
            chunk = self._client.runner.run(self._next(), self._seconds)
        except BaseException:
            self.close()
            raise
        if chunk is _END:
            self._done = True
            raise StopIteration
        return chunk

    async def _next(self) -> Any:
        try:
            return await self._stream.__anext__()
        except StopAsyncIteration:  # a coroutine's result, not an exception across threads
            return _END

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        if not self._client.runner.closed:
            with contextlib.suppress(Exception):
                self._client.runner.run(self._stream.aclose(), 5.0)

    def __enter__(self) -> GenStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not self._done:
            with contextlib.suppress(Exception):  # no waiting here: the loop stops it
                self._client.runner.submit(self._stream.aclose())


def blocking_stream(afn: Callable[..., AsyncGenStream]) -> Callable[..., GenStream]:
    """`Client.generate_stream` from `AsyncClient.generate_stream`: its signature and
    documentation, the stream read on the client's loop thread."""
    sig = inspect.signature(afn)

    def generate_stream(self: Client, /, *args: Any, **kwargs: Any) -> GenStream:
        bound = sig.bind(self, *args, **kwargs)
        bound.apply_defaults()
        stream = afn(self._async, *bound.args[1:], **bound.kwargs)
        return GenStream(self, stream, bound.arguments["timeout"])

    generate_stream.__name__ = generate_stream.__qualname__ = afn.__name__
    on_client = "On `Client`: an iterator (`GenStream`); `close()` it, or use `with`."
    generate_stream.__doc__ = f"{afn.__doc__}\n\n        {on_client}"
    generate_stream.__signature__ = sig.replace(  # type: ignore[attr-defined]
        return_annotation="GenStream"
    )
    return generate_stream
