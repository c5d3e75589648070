"""A language model's token ids are checked against what it can take before a stage computes:
an id outside the vocabulary, or a sequence longer than a table of learned positions, is refused
BAD_REQUEST naming the input, the value and the limit (not a MODEL_ERROR from deep inside the
embedding). Tiny Hugging Face directories (GPT-2: learned positions; Llama: rotary, no position
limit) and OPT through its example factory, cut in two stages, run by an in-process executor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flowmesh.errors import Code, FlowmeshError
from flowmesh.spec import DEFAULT_ALLOW, ModelSpec
from flowmesh.testing import assert_forward_close
from gpu_worker.device import CpuStandIn
from gpu_worker.executor import Executor
from gpu_worker.stage_loader import prepare_stage
from partitioner.stage_plans import make_stage_plan
from tests.support.archs import spec_of
from tests.support.stages import MIB

VOCAB, POSITIONS = 97, 16


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=POSITIONS,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=POSITIONS,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, tuple[ModelSpec, nn.Module]]:  # type: ignore[no-untyped-def]
    """name -> (a spec of the saved directory, the model that wrote it)."""
    out = {}
    for name, make in (("gpt2", _gpt2), ("llama", _llama)):
        torch.manual_seed(4)
        model = make().eval()
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = (ModelSpec(name=name, hf=str(path)), model)
    return out


async def _two_stages(spec: ModelSpec) -> Executor:
    """An executor holding both stages of `spec`, loaded, keyed (name, 0) and (name, 1)."""
    ex = Executor(CpuStandIn(16 * MIB))
    plan = make_stage_plan(spec, stages=2)
    for i in range(2):
        blocks, host = prepare_stage(spec, plan, i, ex.device, DEFAULT_ALLOW)
        ex.add_stage((spec.name, i), blocks, host)
        await ex.load((spec.name, i))
    return ex


async def _through(ex: Executor, name: str, ids: torch.Tensor) -> torch.Tensor:
    hidden = (await ex.run((name, 0), [{"input_ids": ids}])).parts[0][""]
    return (await ex.run((name, 1), [{"": hidden}])).parts[0][""]


async def _refused(
    ex: Executor, name: str, parts: list[dict[str, torch.Tensor]], separate: bool = False
) -> str:
    with pytest.raises(FlowmeshError) as info:
        await ex.run((name, 0), parts, separate=separate)
    assert info.value.code == Code.BAD_REQUEST, info.value
    return info.value.reason


@pytest.mark.parametrize("name", ["gpt2", "llama"])
async def test_ids_outside_the_vocabulary_are_refused_naming_the_limit(dirs, name) -> None:
    spec, model = dirs[name]
    ex = await _two_stages(spec)
    try:
        good = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected = model(input_ids=good, use_cache=False).logits
        assert_forward_close(await _through(ex, name, good), expected)
        runs = ex.counters["runs"]
        high = good.clone()
        high[1, 3] = VOCAB + 3
        assert await _refused(ex, name, [{"input_ids": high}]) == (
            f"input 'input_ids': token id {VOCAB + 3} outside the vocabulary ({VOCAB} tokens)"
        )
        low = good.clone()
        low[0, 0] = -1
        # An unnamed input is named as the model declares it.
        assert await _refused(ex, name, [{"": low}]) == (
            f"input 'input_ids': token id -1 outside the vocabulary ({VOCAB} tokens)"
        )
        # A bad part of a run of several, even one computing each part on its own: refused
        # before any part computes.
        computed: list[int] = []
        first = ex.stages[(name, 0)].blocks[0]
        hook = first.register_forward_hook(lambda *_: computed.append(1))
        try:
            parts = [{"input_ids": good}, {"input_ids": high}]
            assert "token id" in await _refused(ex, name, parts, separate=True)
        finally:
            hook.remove()
        assert computed == []
        assert ex.counters["run_errors"] == 3 and ex.counters["runs"] == runs + 3
        # The stage still serves.
        assert_forward_close(await _through(ex, name, good), expected)
    finally:
        ex.close()


async def test_a_sequence_longer_than_learned_positions_is_refused(dirs) -> None:
    spec, _ = dirs["gpt2"]
    ex = await _two_stages(spec)
    try:
        ids = torch.zeros(1, POSITIONS + 5, dtype=torch.int64)
        assert await _refused(ex, "gpt2", [{"input_ids": ids}]) == (
            f"input 'input_ids': {POSITIONS + 5} positions, the model takes at most {POSITIONS}"
        )
        floats = torch.zeros(1, 4)
        assert await _refused(ex, "gpt2", [{"input_ids": floats}]) == (
            "input 'input_ids': token ids must be integers, got float32"
        )
        await _through(ex, "gpt2", ids[:, :POSITIONS])  # the longest it takes runs
    finally:
        ex.close()


async def test_opt_positions_and_rotary_models_without_a_position_limit() -> None:
    # OPT's table of positions has two rows more than it takes (its offset): the limit is the
    # config's max_position_embeddings, not the table's length.
    spec = spec_of("hf_opt")
    ex = await _two_stages(spec)
    try:
        ids = torch.zeros(1, 17, dtype=torch.int64)
        assert await _refused(ex, spec.name, [{"input_ids": ids}]) == (
            "input 'input_ids': 17 positions, the model takes at most 16"
        )
        await _through(ex, spec.name, ids[:, :16])
    finally:
        ex.close()


async def test_rotary_positions_have_no_limit_to_check(dirs) -> None:
    spec, model = dirs["llama"]
    ex = await _two_stages(spec)
    try:
        ids = torch.randint(
            0, VOCAB, (1, POSITIONS + 4), generator=torch.Generator().manual_seed(2)
        )
        with torch.no_grad():
            expected = model(input_ids=ids, use_cache=False).logits
        assert_forward_close(await _through(ex, "llama", ids), expected)
    finally:
        ex.close()
