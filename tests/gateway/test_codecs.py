"""The tokenizers the gateway's client keeps (`client_sdk.generation.Codecs`), in process over a
scripted broker connection: what no real mesh can time (a fetch cancelled under its waiters),
and how long a refusal is believed. The races through a real gateway and mesh (a caller leaving
mid-fetch, a model deployed anew): test_openai.py."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from client_sdk.client import AsyncClient
from client_sdk.errors import BadRequest
from client_sdk.generation import Codecs
from flowmesh import protocol as p
from flowmesh.errors import Code
from tests.support.lm import BOS_ID, EOS_ID, build_tokenizer
from tests.support.waiting import within_turns


class ScriptedBroker:
    """The connection's `call` for TokenizerInfo only: each is answered once the test opens
    `gate`, with the tokenizer (`has_tokenizer`) or the broker's refusal of one."""

    def __init__(self) -> None:
        self.ids = itertools.count(1)
        self.gate = asyncio.Event()
        self.has_tokenizer = True
        self.asked = 0

    def next_id(self) -> int:
        return next(self.ids)

    async def call(self, msg: p.Message, timeout: float | None) -> p.Message:
        assert isinstance(msg, p.TokenizerInfo)
        self.asked += 1
        await self.gate.wait()
        if not self.has_tokenizer:
            raise BadRequest(Code.BAD_REQUEST, f"{msg.model!r} has no tokenizer")
        return p.TokenizerReply(
            id=msg.id,
            model=msg.model,
            tokenizer_json=build_tokenizer().to_str(),
            eos_ids=[EOS_ID],
            bos_id=BOS_ID,
        )

    async def close(self) -> None:
        pass


def codecs_over(broker: ScriptedBroker) -> Codecs:
    return AsyncClient("tcp://127.0.0.1:1", connection=broker).codecs  # type: ignore[arg-type]


async def test_a_fetch_cancelled_under_its_waiters_is_made_again_not_kept() -> None:
    broker = ScriptedBroker()
    codecs = codecs_over(broker)
    waiter = asyncio.ensure_future(codecs.get("lm", needed=True, timeout=None))
    await within_turns(lambda: broker.asked == 1, "the tokenizer to be asked for")
    codecs._codecs["lm"].cancel()  # the fetch itself (the loop closing, say), not its waiter
    await within_turns(lambda: broker.asked == 2, "the waiter to ask again")
    broker.gate.set()
    codec = await waiter  # not the fetch's CancelledError
    assert codec is not None and codec.encode("hello") == build_tokenizer().encode("hello").ids
    # Kept now: the next call asks nothing.
    assert await codecs.get("lm", needed=True, timeout=None) is codec and broker.asked == 2


async def test_a_refusal_is_believed_a_while_only_by_calls_that_can_do_without() -> None:
    broker = ScriptedBroker()
    broker.has_tokenizer = False
    broker.gate.set()
    codecs = codecs_over(broker)
    codecs.REFUSAL_S = 3600.0  # not past in this test
    assert await codecs.get("m", needed=False, timeout=None) is None
    assert await codecs.get("m", needed=False, timeout=None) is None
    assert broker.asked == 1  # believed: token ids in, no codec needed
    # A call that needs a codec asks again: the model may have been deployed anew since.
    with pytest.raises(BadRequest, match="no tokenizer"):
        await codecs.get("m", needed=True, timeout=None)
    assert broker.asked == 2
    broker.has_tokenizer = True  # deployed again, with a tokenizer
    assert await codecs.get("m", needed=True, timeout=None) is not None
    assert broker.asked == 3
    # Past REFUSAL_S, a call that can do without asks again too.
    codecs._codecs.clear()
    broker.has_tokenizer = False
    assert await codecs.get("m", needed=False, timeout=None) is None
    codecs.REFUSAL_S = -1.0  # past already
    broker.has_tokenizer = True
    assert await codecs.get("m", needed=False, timeout=None) is not None
    assert broker.asked == 5
