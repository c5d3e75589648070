"""Stages: each holds exactly the whole model's tensors for its blocks (bit for bit, from a seed
or a file) and reads only those; composed, they compute the model's outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from msgspec.structs import replace
from safetensors.torch import save_file

from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.build import build_seeded
from flowmesh.modelio.chain import chain_of, run_chain
from flowmesh.modelio.profile import profile
from flowmesh.modelio.stages import StageModule, build_stage, materialize_stage
from flowmesh.spec import ModelSpec
from flowmesh.testing import assert_forward_close, assert_same_bits
from partitioner.stage_plans import make_stage_plan
from tests.support.archs import ARCHS, inputs_of, model_output, spec_of
from tests.support.toy_models import TOY_ALLOW


def save_whole_model(model: torch.nn.Module, path: Path) -> Path:
    """What a user ships: the state_dict with tied tensors once, under their first name (as
    Hugging Face checkpoints are; safetensors refuses shared tensors anyway)."""
    seen: set[int] = set()
    tensors = {}
    for name, t in model.state_dict().items():
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            tensors[name] = t.contiguous()
    save_file(tensors, str(path))
    return path


def assert_holds_the_models_tensors(stage: StageModule, model: torch.nn.Module) -> None:
    whole = model.state_dict()
    for name, tensor in stage.state_dict().items():
        original = stage.tensor_names[name]
        # bit-exact: a stage's tensor against the whole model's (copied or read from a file)
        assert_same_bits(tensor, whole[original], f"stage {stage.index} {name} ({original})")


def compose(stages: list[StageModule], x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        for stage in stages:
            x = stage(x)
    return x


@pytest.fixture(scope="module", params=list(ARCHS))
def arch_case(request, tmp_path_factory):
    arch = request.param
    spec = spec_of(arch)
    model = build_seeded(spec)
    x = inputs_of(arch)
    with torch.no_grad():
        chained = run_chain(chain_of(model), x)
        own = model_output(arch, model, x)
    path = save_whole_model(model, tmp_path_factory.mktemp(arch) / "model.safetensors")
    return arch, spec, path, x, chained, own, profile(spec)


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_stages_compose_to_the_chain_and_the_model(arch_case, parts):
    _arch, spec, path, x, chained, own, prof = arch_case
    model = build_seeded(spec)
    plan = make_stage_plan(spec, parts, profile=prof)
    seeded = [materialize_stage(spec, plan, i) for i in range(parts)]
    from_file_spec = replace(spec, seed=None, weights=str(path))
    from_file = [materialize_stage(from_file_spec, plan, i) for i in range(parts)]
    for stages in (seeded, from_file):
        for stage in stages:
            assert_holds_the_models_tensors(stage, model)
        out = compose(stages, x)
        assert_forward_close(out, chained)
        assert_forward_close(out, own)


@pytest.mark.parametrize("arch", ["hf_gpt2", "small_resnet"])
def test_stage_holds_only_its_own_tensors(arch):
    spec = spec_of(arch)
    prof = profile(spec)
    plan = make_stage_plan(spec, 3, profile=prof)
    seen: set[str] = set()
    for i, (a, b) in enumerate(plan.ranges):
        mine = {t for block in prof.blocks[a:b] for t in block.tensors}
        meta = build_stage(spec, plan, i)
        assert all(t.device.type == "meta" for t in meta.state_dict(keep_vars=True).values())
        stage = build_stage(spec, plan, i, device="cpu")
        assert set(stage.tensor_names.values()) == mine
        assert set(stage.tensor_names) == set(stage.state_dict())
        distinct = {id(t): t for t in stage.state_dict(keep_vars=True).values()}
        assert sum(t.numel() * t.element_size() for t in distinct.values()) == plan.range_bytes[i]
        seen |= mine
    assert seen == set(prof.tensor_bytes)


def test_tied_weights_stay_tied_within_a_stage():
    spec = spec_of("hf_gpt2")
    plan = make_stage_plan(spec, 1)
    stage = materialize_stage(spec, plan, 0)
    assert stage.blocks[0].wte.weight is stage.blocks[-1].lm_head.weight
    # Split apart, the head stage holds its own copy of wte, read from the same file tensor.
    two = make_stage_plan(spec, 2)
    head = materialize_stage(spec, two, 1)
    assert head.tensor_names["blocks.2.lm_head.weight"] == "transformer.wte.weight"


def test_stage_copies_rather_than_aliases_its_source():
    spec = spec_of("mlp")
    model = build_seeded(spec)
    plan = make_stage_plan(spec, 2)
    stage = materialize_stage(spec, plan, 0, model)
    assert_holds_the_models_tensors(stage, model)
    with torch.no_grad():
        stage.blocks[0].weight.add_(1.0)
    # bit-exact: writing to the stage's copy must leave the model's bytes alone
    assert not torch.equal(stage.blocks[0].weight, model[0].weight)


def test_a_stage_reads_only_its_tensors_from_the_file(tmp_path):
    spec = spec_of("hf_opt")
    model = build_seeded(spec)
    plan = make_stage_plan(spec, 3)
    stage1 = materialize_stage(spec, plan, 1, model)
    # A file holding only stage 1's tensors is enough for stage 1 ...
    wanted = set(stage1.tensor_names.values())
    partial = {n: t.contiguous() for n, t in model.state_dict().items() if n in wanted}
    save_file(partial, str(tmp_path / "part.safetensors"))
    from_part = materialize_stage(spec, plan, 1, str(tmp_path / "part.safetensors"))
    assert_holds_the_models_tensors(from_part, model)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        assert_forward_close(from_part(x), stage1(x))
    # ... and not for stage 0, which says which tensor it misses.
    with pytest.raises(FlowmeshError) as info:
        materialize_stage(spec, plan, 0, str(tmp_path / "part.safetensors"))
    assert info.value.code == Code.BAD_REQUEST
    assert "model.decoder.embed_tokens.weight" in info.value.reason
    assert "missing" in info.value.reason


def test_misshaped_tensor_is_named(tmp_path):
    spec = spec_of("tiny_gpt")
    tensors = {n: t.contiguous() for n, t in build_seeded(spec).state_dict().items()}
    tensors["1.fc.weight"] = torch.zeros(3, 3)
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path))
    plan = make_stage_plan(spec, 2)
    assert plan.ranges == ((0, 2), (2, 5))  # block "1" is in stage 0
    with pytest.raises(FlowmeshError) as info:
        materialize_stage(replace(spec, seed=None, weights=str(path)), plan, 0)
    assert info.value.code == Code.BAD_REQUEST
    assert "'1.fc.weight'" in info.value.reason and "(3, 3)" in info.value.reason
    # The other stage does not hold that tensor and loads fine.
    materialize_stage(replace(spec, seed=None, weights=str(path)), plan, 1)


def test_plan_of_another_model_or_index_is_refused():
    plan = make_stage_plan(spec_of("mlp"), 2)
    with pytest.raises(FlowmeshError) as info:
        build_stage(spec_of("tiny_gpt"), plan, 0)
    assert info.value.code == Code.PLAN_ERROR and "digest" in info.value.reason
    with pytest.raises(FlowmeshError) as info:
        build_stage(spec_of("mlp"), plan, 2)
    assert info.value.code == Code.PLAN_ERROR and "0..1" in info.value.reason


def test_two_input_model_first_stage_takes_keywords():
    spec = ModelSpec(name="t", factory="tests.support.toy_models:two_inputs", seed=3)
    model = build_seeded(spec, TOY_ALLOW)
    prof = profile(spec, allow=TOY_ALLOW)
    plan = make_stage_plan(spec, 2, profile=prof)
    first, second = (materialize_stage(spec, plan, i, allow=TOY_ALLOW) for i in range(2))
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    with torch.no_grad():
        assert_forward_close(second(first(x=x, y=y)), model(x, y))


def test_an_uncuttable_model_serves_as_one_stage_and_refuses_more():
    spec = ModelSpec(name="dd", factory="tests.support.toy_models:data_dependent", seed=3)
    plan = make_stage_plan(spec, 1, allow=TOY_ALLOW)
    assert plan.block_names == ("model",) and plan.ranges == ((0, 1),)
    stage = materialize_stage(spec, plan, 0, allow=TOY_ALLOW)
    x = torch.randn(5, 4)
    with torch.no_grad():
        assert_forward_close(stage(x), build_seeded(spec, TOY_ALLOW)(x))
    with pytest.raises(FlowmeshError) as info:
        make_stage_plan(spec, 2, allow=TOY_ALLOW)
    assert info.value.code == Code.NOT_A_CHAIN
    assert "single block" in info.value.reason and "control flow" in info.value.reason
    with pytest.raises(FlowmeshError) as info:
        make_stage_plan(spec, None, mem_cap=100, allow=TOY_ALLOW)
    assert info.value.code == Code.NOT_A_CHAIN and "nn.Sequential" in info.value.reason
