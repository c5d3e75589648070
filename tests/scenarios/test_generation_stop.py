"""A generate call cancelled, or a stream closed early, stops its sequences on the broker at once
(README: the broker frees their memory), on an in-process mesh (tests/support/inproc.py).

The in-process connection once dropped the messages the broker does not answer (StopGenerate:
`Connection.notify`), so that these paths passed here without the broker ever being told: the
sequences ran on to their end. Each test waits for the model to run no sequence, and checks
that its sequences made far fewer tokens than they were allowed: stopped, not ended by
themselves.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from client_sdk.client import AsyncClient
from tests.support.inproc import InProcMesh
from tests.support.lm import tiny_lm_dir
from tests.support.waiting import until

MAX_TOKENS = 2000  # far more than the sequences make before they are stopped
PROMPTS = [[1, 5, 6], [1, 7, 8, 9]]


@pytest.fixture(scope="module")
def lm(mesh: InProcMesh, tmp_path_factory: pytest.TempPathFactory) -> InProcMesh:
    base = Path(mesh.data_roots[0]) if mesh.data_roots else tmp_path_factory.getbasetemp()
    model_dir = tiny_lm_dir(base / "stop-llama", "llama", seed=5, max_positions=MAX_TOKENS + 64)
    with mesh.client() as c:
        c.deploy("lm", hf=str(model_dir), stages=1, replicas=1, max_context=MAX_TOKENS + 64)
    return mesh


async def lm_row(client: AsyncClient) -> object:
    (row,) = [m for m in (await client.status()).models if m.name == "lm"]
    return row


async def running(client: AsyncClient) -> int:
    return (await lm_row(client)).running_seqs  # type: ignore[attr-defined]


async def tokens(client: AsyncClient) -> int:
    return (await lm_row(client)).tokens_generated  # type: ignore[attr-defined]


async def assert_stopped(client: AsyncClient, before: int, seqs: int) -> None:
    """The model runs no sequence any more (nor keeps one waiting), and those of the call made
    far fewer tokens than they were allowed."""
    await until(lambda: _none_running(client), "the sequences to be stopped", 20.0, 0.02)
    row = await lm_row(client)
    assert row.waiting_seqs == 0, row  # type: ignore[attr-defined]
    assert row.tokens_generated - before < seqs * MAX_TOKENS // 2, row  # type: ignore[attr-defined]


async def _none_running(client: AsyncClient) -> bool:
    return await running(client) == 0


async def test_a_cancelled_generate_call_stops_its_sequences(lm: InProcMesh) -> None:
    async with lm.async_client() as client:
        before = await tokens(client)
        calls = [
            asyncio.create_task(
                client.generate("lm", ids=ids, max_tokens=MAX_TOKENS, ignore_eos=True)
            )
            for ids in PROMPTS
        ]
        await until(lambda: _all_running(client), "the calls' sequences to run", 60.0, 0.02)
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        assert all(call.cancelled() for call in calls)
        await assert_stopped(client, before, len(PROMPTS))


async def _all_running(client: AsyncClient) -> bool:
    return await running(client) == len(PROMPTS)


async def test_a_stream_closed_early_stops_its_sequences(lm: InProcMesh) -> None:
    async with lm.async_client() as client:
        before = await tokens(client)
        stream = client.generate_stream("lm", ids=PROMPTS, max_tokens=MAX_TOKENS, ignore_eos=True)
        got = 0
        async for chunk in stream:
            got += len(chunk.ids)
            if got >= 8:
                break
        await stream.aclose()
        assert stream.generations is None  # it did not end by itself
        await assert_stopped(client, before, len(PROMPTS))


async def test_a_blocking_stream_closed_early_stops_its_sequences(lm: InProcMesh) -> None:
    async with lm.async_client() as watcher:
        before = await tokens(watcher)

        def read_a_little() -> None:
            with (
                lm.client() as c,
                c.generate_stream(
                    "lm", ids=PROMPTS, max_tokens=MAX_TOKENS, ignore_eos=True
                ) as stream,
            ):
                for got, _ in enumerate(stream):
                    if got >= 8:
                        break

        await asyncio.to_thread(read_a_little)
        await assert_stopped(watcher, before, len(PROMPTS))
