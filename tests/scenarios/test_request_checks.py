"""Requests checked against what the model can take, before they run, through an in-process
mesh of two CPU workers (tests/support/inproc.py): token ids outside a Hugging Face model's
vocabulary, and a sequence longer than its learned positions, come back `BadRequest` naming the
input, the value and the limit (not a `ModelError` from deep inside the embedding), for a direct
run over two stages and a one-stage run alike, and the other requests of a batch are still
answered. The checks of the command line's refusals stay on a real mesh
(tests/mesh/test_request_checks.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from client_sdk.errors import BadRequest
from flowmesh.testing import assert_forward_close
from tests.support.inproc import InProcMesh

VOCAB, POSITIONS = 97, 16


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=POSITIONS,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(8)
    model = GPT2LMHeadModel(cfg).eval()
    path = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(path)
    return path, model


@pytest.mark.parametrize("stages", [2, 1])
async def test_token_ids_past_the_model_are_a_bad_request_naming_the_limit(
    mesh: InProcMesh, gpt2_dir: tuple[Path, torch.nn.Module], stages: int
) -> None:
    path, model = gpt2_dir
    name = f"gpt2-{stages}"
    async with mesh.async_client() as c:
        row = await c.deploy(name, hf=str(path), stages=stages, replicas=1)
        assert len(row.stages) == stages
        direct = (await c.status()).totals.direct_batches
        try:
            good = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
            with torch.no_grad():
                expected = model(input_ids=good, use_cache=False).logits
            high = good.clone()
            high[0, 4] = VOCAB + 3
            with pytest.raises(BadRequest) as info:
                await c.infer(name, high)
            assert info.value.reason == (
                f"input 'input_ids': token id {VOCAB + 3} outside the vocabulary ({VOCAB} tokens)"
            )
            with pytest.raises(BadRequest) as info:
                await c.infer(name, {"input_ids": torch.zeros(1, POSITIONS + 4, dtype=torch.int64)})
            assert info.value.reason == (
                f"input 'input_ids': {POSITIONS + 4} positions, the model takes at most {POSITIONS}"
            )
            # Sent together (the broker may batch them): the bad one is refused, the rest served.
            asked = [good] * 3 + [high] + [good] * 3
            answers = await asyncio.gather(
                *(c.infer(name, x) for x in asked), return_exceptions=True
            )
            for x, got in zip(asked, answers, strict=True):
                if x is high:
                    assert isinstance(got, BadRequest), got
                else:
                    assert not isinstance(got, BaseException), got
                    assert_forward_close(got, expected)
            if stages == 2:  # the two stages' runs went worker to worker
                assert (await c.status()).totals.direct_batches > direct
        finally:
            await c.undeploy(name)
