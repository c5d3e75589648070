"""The SDK's side of a Generate (`client_sdk.generation.GenRun`) fed the broker's own messages in
process: the chunks of a stream, then its answer, in the order and groupings a connection hands
them over (a sequence's last chunk may be read together with the answer), and stop strings
watched for in the decoded text."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from client_sdk.errors import BadRequest
from client_sdk.generation import Chunk, GenAsk, GenRun, _prompts, _SeqText
from flowmesh import protocol as p
from flowmesh.errors import Code
from flowmesh.modelio.tokenizer import TextCodec
from tests.support.lm import build_tokenizer


class Told:
    """What the run tells the broker (StopGenerate), as its connection would send it."""

    def __init__(self) -> None:
        self.sent: list[p.Message] = []

    def notify(self, msg: p.Message) -> bool:
        self.sent.append(msg)
        return True


class Client:
    def __init__(self) -> None:
        self.connection = Told()


def fed(
    codec: TextCodec | None,
    parts: list[list[p.GenChunk | None]],
    answer: p.Generated,
    stops: list[str] | None = None,
) -> tuple[list[Chunk], GenRun]:
    """Run a one-prompt stream whose connection hands over `parts`, each list at once (None:
    the answer has come), the answer being `answer`."""

    async def main() -> tuple[list[Chunk], GenRun]:
        run = GenRun(Client(), GenAsk(model="m"), stream=True)
        run.seqs = [_SeqText(0, codec, stops or [])]
        run.msg = p.Generate(id=7, model="m", prompts=[[1]], sampling=p.Sampling(), stream=True)
        done: asyncio.Future[p.Message] = asyncio.get_running_loop().create_future()
        done.set_result(answer)
        run._task = asyncio.ensure_future(done)
        await run._task
        got: list[Chunk] = []
        for batch in parts:  # each as one read of the connection hands it over
            for item in batch:
                run._parts.put_nowait(item)
            await run._step()
            got += run._ready
            run._ready.clear()
        assert run.ended
        return got, run

    return asyncio.run(main())


def generated(ids: list[int], finish: str = "length") -> p.Generated:
    return p.Generated(id=7, outputs=[p.GenOutput(ids=ids, finish=finish, prompt_tokens=1)])


def test_a_last_chunk_read_with_the_answer_counts_once() -> None:
    chunks, run = fed(
        None,
        [
            [p.GenChunk(id=7, index=0, ids=[5])],
            [p.GenChunk(id=7, index=0, ids=[6], finish="length"), None],
        ],
        generated([5, 6]),
    )
    assert [c.ids for c in chunks] == [[5], [6]]
    assert chunks[-1].finish_reason == "length"
    assert run.generations is not None and run.generations[0].ids == [5, 6]
    assert run.generations[0].completion_tokens == 2


def test_tokens_only_in_the_answer_come_as_a_last_chunk() -> None:
    chunks, run = fed(None, [[p.GenChunk(id=7, index=0, ids=[5]), None]], generated([5, 6, 8]))
    assert [c.ids for c in chunks] == [[5], [6, 8]] and chunks[-1].finish_reason == "length"
    assert run.generations is not None and run.generations[0].ids == [5, 6, 8]


def test_a_stop_string_ends_the_text_before_it_and_stops_the_sequence() -> None:
    tok = build_tokenizer()
    codec = TextCodec(tok.to_str())
    ids = codec.encode("Hello! How are you", special=False)
    stream = [[p.GenChunk(id=7, index=0, ids=[t])] for t in ids]
    chunks, run = fed(codec, [*stream, [None]], generated(ids, "stop"), stops=[" are"])
    assert "".join(c.text or "" for c in chunks) == "Hello! How"
    assert chunks[-1].finish_reason == "stop"
    assert run.generations is not None and run.generations[0].text == "Hello! How"
    # The broker was told to stop it once, as soon as the stop string showed.
    told = run.client.connection.sent
    assert told == [p.StopGenerate(id=7, indexes=[0])]


class _NoChatCodecs:
    """A model whose tokenizer has no chat template (`Codecs.get`'s answer)."""

    async def get(self, model: str, *, needed: bool, timeout: float | None) -> TextCodec:
        return TextCodec(build_tokenizer().to_str())


def _refusal(ask: GenAsk) -> Exception:
    client = Client()
    client.codecs = _NoChatCodecs()  # type: ignore[attr-defined]
    run = GenRun(client, ask, stream=False)  # type: ignore[arg-type]
    try:
        asyncio.run(run.start())
    except Exception as exc:
        assert client.connection.sent == []  # refused before anything was sent
        return exc
    raise AssertionError(f"{ask} was not refused")


def test_what_the_client_refuses_is_a_typed_bad_request() -> None:
    cases = [
        (
            GenAsk("lm", prompt="hi", ids=[1, 2]),
            "generate needs exactly one of prompt=..., ids=... or messages=... (got prompt and "
            "ids)",
        ),
        (GenAsk("lm", ids=[1, -5]), f"generate: token id -5 is outside 0..{(1 << 31) - 1}"),
        (
            GenAsk("lm", messages=[]),
            "generate: messages must be one prompt or a non-empty list of them (message dicts, "
            "each chat at least one message)",
        ),
        # The model's tokenizer refuses the chat (it has no template): typed as well.
        (GenAsk("lm", messages=[{"role": "user", "content": "hi"}]), "no chat template"),
    ]
    for ask, words in cases:
        exc = _refusal(ask)
        assert isinstance(exc, BadRequest) and exc.code == Code.BAD_REQUEST, (ask, exc)
        assert words in exc.reason, (words, exc.reason)


def test_ids_take_any_sequence_of_ints_numpy_and_torch_arrays_included() -> None:
    """A tokenizer's output as it comes (`return_tensors="np"` or "pt"), or numpy ints in a list:
    1-D is one prompt, 2-D a batch, every id a Python int (once a raw TypeError, or a
    misleading BadRequest for 2-D)."""
    one = [[1, 5, 6]]
    cases = [
        ([1, 5, 6], one, False),
        ((1, 5, 6), one, False),
        (range(1, 4), [[1, 2, 3]], False),
        (np.array([1, 5, 6]), one, False),
        (np.array([1, 5, 6], dtype=np.uint16), one, False),
        (torch.tensor([1, 5, 6]), one, False),
        (torch.tensor([1, 5, 6], dtype=torch.int32), one, False),
        ([np.int64(1), np.int32(5), torch.tensor(6)], one, False),
        (np.array([[1, 5, 6], [2, 3, 4]]), [[1, 5, 6], [2, 3, 4]], True),
        (torch.tensor([[1, 5, 6]]), one, True),
        ([np.array([1, 5, 6]), torch.tensor([2, 3])], [[1, 5, 6], [2, 3]], True),
        ([[1, 5, 6], (2, 3)], [[1, 5, 6], [2, 3]], True),
    ]
    for ids, prompts, batch in cases:
        kind, items, is_batch = _prompts(GenAsk("lm", ids=ids))
        assert (kind, items, is_batch) == ("ids", prompts, batch), ids
        assert all(type(i) is int for x in items for i in x), (ids, items)


def test_ids_that_are_not_ints_are_refused_naming_what_is_wrong() -> None:
    """Bools, floats, strings and deeper nesting: a BadRequest before anything is sent (a bool
    once went to the broker, which refused it as a bad message)."""
    cases = [
        ([True, 5], "ids[0] is a bool (True)"),
        ([1, np.bool_(False)], "ids[1] is a bool (False)"),
        ([[1, 2], [3, True]], "ids[1][1] is a bool (True)"),
        ([1, 2.0], "ids[1] is a float (2.0)"),
        (np.array([1.0, 2.0]), "ids is of type ndarray with dtype float64"),
        (torch.tensor([[1.0]]), "ids is of type Tensor with dtype float32"),
        (torch.tensor([True, False]), "ids is of type Tensor with dtype bool"),
        ([[[1, 2]]], "ids[0][0] is of type list: ids are one prompt"),
        (np.zeros((1, 2, 3), dtype=np.int64), "ids[0][0] is of type list"),
        ([1, [2, 3]], "ids mixes token ids and sequences of them (ids[0] is of type int)"),
        ("1 5 6", "ids is of type str"),
        (7, "ids is of type int"),
        ([1, None], "ids[1] is of type NoneType, not a token id"),
        ([1, "5"], "ids[1] is of type str, not a token id"),
        ([[1, -5]], "generate: token id -5 is outside 0.."),
    ]
    for ids, words in cases:
        exc = _refusal(GenAsk("lm", ids=ids))
        assert isinstance(exc, BadRequest) and exc.code == Code.BAD_REQUEST, (ids, exc)
        assert exc.reason.startswith("generate: ") and words in exc.reason, (words, exc.reason)
