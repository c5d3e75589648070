"""Requests checked against what the model and the mesh can take, before they run, through a real
mesh of two CPU workers without training bytes:
- token ids outside a Hugging Face model's vocabulary, and a sequence longer than its learned
  positions, come back `BadRequest` naming the input, the value and the limit (not a
  `ModelError` from deep inside the embedding), for a direct run over two stages and a one-stage
  run alike, and the other requests of a batch are still answered;
- a sweep on a mesh that takes no training jobs is refused at once with the answer `flowmesh
  train` gets, by the SDK and by `flowmesh sweep --quiet`, and writes nothing;
- `flowmesh deploy` without weights says which seed the model is initialised from."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from client_sdk.client import AsyncClient
from client_sdk.errors import BadRequest, Unavailable
from client_sdk.mesh import LocalMesh
from client_sdk.train_data import Dataset
from flowmesh.testing import assert_forward_close
from tests.support.cli import flowmesh

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
    mesh: LocalMesh, gpt2_dir: tuple[Path, torch.nn.Module], stages: int
) -> None:
    path, model = gpt2_dir
    name = f"gpt2-{stages}"
    async with AsyncClient(mesh.frontend) as c:
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


def _teacher(rows: int = 64) -> Dataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 8, generator=g)
    return Dataset({"": x}, (x @ torch.randn(8, 4, generator=g)).argmax(1), "teacher")


SWEEP_TOML = """
name = "no-training"
factory = "flowmesh.examples:mlp"
trials = 4
steps = 4
eval_every = 2
out = "results"

[kwargs]
width = 16
depth = 2
in_features = 8
out_features = 4

[space.lr]
type = "float"
low = 1e-4
high = 1e-1
log = true
"""


async def test_a_sweep_on_a_mesh_that_cannot_train_is_refused_at_once(
    mesh: LocalMesh, tmp_path: Path
) -> None:
    train = flowmesh("train", "flowmesh.examples:mlp", "--steps", "1", "--broker", mesh.frontend)
    assert train.returncode == 1
    refusal = train.stderr.strip().removeprefix("flowmesh train: ")
    assert "no ready worker takes training jobs (start workers with --train-bytes)" in refusal

    async with AsyncClient(mesh.frontend) as c:
        with pytest.raises(Unavailable) as info:
            await c.sweep(
                name="sdk",
                factory="flowmesh.examples:mlp",
                kwargs={"width": 16, "depth": 2, "in_features": 8, "out_features": 4},
                space={"lr": {"type": "float", "low": 1e-4, "high": 0.1, "log": True}},
                data=_teacher(),
                trials=6,
                steps=4,
                eval_every=2,
                out_dir=tmp_path / "sdk",
                show=False,
            )
        assert str(info.value) == refusal
        assert not (tmp_path / "sdk").exists()

    config = tmp_path / "sweep.toml"
    config.write_text(SWEEP_TOML)
    run = flowmesh("sweep", "--quiet", "--broker", mesh.frontend, str(config))
    assert run.returncode == 1
    assert run.stderr.strip() == f"flowmesh sweep: {refusal}", run.stderr
    assert run.stdout == "" and not (tmp_path / "results").exists()


def test_deploy_without_weights_says_the_seed_it_is_initialised_from(mesh: LocalMesh) -> None:
    for extra, seed in (([], 0), (["--seed", "5"], 5)):
        done = flowmesh(
            "deploy", "seeded", "flowmesh.examples:mlp", "--kwargs", '{"width": 32}', *extra,
            "--broker", mesh.frontend,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[-1] == (
            f"seeded: no weights given: initialised from seed {seed}"
        ), done.stdout
        assert flowmesh("undeploy", "seeded", "--broker", mesh.frontend).returncode == 0
