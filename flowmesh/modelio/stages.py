"""Building one stage (or chunk) of a plan as a module holding only its own tensors.

`build_stage` reads the model on the meta device and keeps the blocks of one plan range;
`materialize_stage` fills them with real tensors: from the spec's weights file only the stage's
tensors are read, for a seeded spec they are taken from the seeded whole model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio import hf_dir
from flowmesh.modelio.build import build_meta, build_seeded
from flowmesh.modelio.chain import Block, chain_of
from flowmesh.modelio.inputs import declared_inputs, make_inputs
from flowmesh.modelio.plan import Plan
from flowmesh.modelio.weights import conform, read_weights
from flowmesh.spec import DEFAULT_ALLOW, ModelSpec


class StageModule(nn.Module):
    """Blocks `start..stop-1` of a model's chain, run in order.

    The first block takes what that block of the chain takes (the model's inputs for stage 0,
    the previous stage's output otherwise). `tensor_names` maps each `state_dict` name of this
    module to the name of the same tensor in the whole model's `state_dict`.
    """

    def __init__(self, blocks: list[Block], start: int, index: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(b.module for b in blocks)
        self.block_names = tuple(b.name for b in blocks)
        self.start, self.stop, self.index = start, start + len(blocks), index
        self.base_prefix = ""  # the model's base_model_prefix, for weights files that omit it
        self.tensor_names: dict[str, str] = {
            f"blocks.{i}.{local}": original
            for i, b in enumerate(blocks)
            for local, original in b.tensor_names.items()
        }

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.blocks[0](*args, **kwargs)
        for block in self.blocks[1:]:
            out = block(out)
        return out


def _check_plan(spec: ModelSpec, plan: Plan, index: int, blocks: list[Block]) -> tuple[int, int]:
    if plan.spec_digest != spec.digest():
        raise FlowmeshError(
            Code.PLAN_ERROR,
            f"the plan is for model digest {plan.spec_digest}, but this spec's is {spec.digest()}",
        )
    names = tuple(b.name for b in blocks)
    if names != plan.block_names:
        raise FlowmeshError(
            Code.PLAN_ERROR,
            f"the plan lists {len(plan.block_names)} blocks, the model's chain has {len(names)} "
            "with different names: the plan was made by another partitioner version; re-plan",
        )
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < plan.parts:
        raise FlowmeshError(
            Code.PLAN_ERROR, f"stage index {index!r} is outside the plan's 0..{plan.parts - 1}"
        )
    return plan.ranges[index]


def _meta_stage(spec: ModelSpec, plan: Plan, index: int, allow: Iterable[str]) -> StageModule:
    model = build_meta(spec, allow)
    inputs = declared_inputs(spec, model)
    # The same example the profiler reads the chain with, so both see the same blocks.
    blocks = chain_of(model, make_inputs(inputs, 1, 1, "meta") if inputs is not None else None)
    start, stop = _check_plan(spec, plan, index, blocks)
    # The stage references only its blocks' submodules; the rest of the meta model is dropped.
    stage = StageModule(blocks[start:stop], start, index)
    # How the model's base is named ("transformer." for GPT-2), which some weights files omit.
    stage.base_prefix = getattr(model, "base_model_prefix", "") or ""
    return stage


def build_stage(
    spec: ModelSpec,
    plan: Plan,
    index: int,
    *,
    device: str | torch.device = "meta",
    allow: Iterable[str] = DEFAULT_ALLOW,
) -> StageModule:
    """Stage `index` of `plan`: on "meta" (structure only), or materialised on `device` from the
    spec's weights or seed (see `materialize_stage`)."""
    if torch.device(device).type == "meta":
        return _meta_stage(spec, plan, index, allow).eval()
    return materialize_stage(spec, plan, index, device=device, allow=allow)


def meta_stage(
    spec: ModelSpec, plan: Plan, index: int, *, allow: Iterable[str] = DEFAULT_ALLOW
) -> StageModule:
    """Stage `index` of `plan` with structure only (meta tensors), checked to be loadable: every
    parameter and buffer is a tensor of the model's `state_dict` (`tensor_names` says which), so
    a reader can fill its tensors in place, e.g. straight into a worker's host tier."""
    stage = _meta_stage(spec, plan, index, allow).eval()
    for prefix, module in stage.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for kind in ("_parameters", "_buffers"):
            for name, old in getattr(module, kind).items():
                if old is not None and dot + name not in stage.tensor_names:
                    raise _not_loadable(stage, dot + name)
    return stage


def _not_loadable(stage: StageModule, local: str) -> FlowmeshError:
    return FlowmeshError(
        Code.PLAN_ERROR,
        f"stage {stage.index}: {local!r} is not in the model's state_dict (a "
        "non-persistent buffer), so it cannot be loaded from weights",
    )


def materialize_stage(
    spec: ModelSpec,
    plan: Plan,
    index: int,
    source: str | nn.Module | None = None,
    *,
    device: str | torch.device = "cpu",
    allow: Iterable[str] = DEFAULT_ALLOW,
) -> StageModule:
    """Stage `index` of `plan` with real tensors on `device`.

    `source` is where the tensors come from: a safetensors file of the whole model (only this
    stage's tensors are read), a whole model whose `state_dict` has the original names (its
    tensors are copied), or None for the spec's own: the Hugging Face directory `spec.hf` (only
    this stage's tensors, from the shards holding them), `spec.weights`, else the seeded model.
    For a seeded spec that means building the whole model once on the CPU with `build_seeded`; that
    costs the model's size in host memory for a moment, which is acceptable because seeded models
    are test and demo models: a production model comes with a weights file.
    Tensors tied in the model (GPT-2's lm_head and wte) stay one tensor within a stage.
    """
    stage = _meta_stage(spec, plan, index, allow)
    expected = stage.state_dict(keep_vars=True)
    wanted: dict[str, torch.Tensor] = {}  # original name -> a meta tensor of the expected shape
    for local, original in stage.tensor_names.items():
        wanted.setdefault(original, expected[local])
    if source is None and spec.hf is not None:
        # A Hugging Face directory: only this stage's tensors, from the file(s) holding them.
        values = hf_dir.read_weights(
            spec.hf, {n: n for n in wanted}, expected=wanted, base_prefix=stage.base_prefix
        )
        _assign(stage, values, torch.device(device))
        return stage.eval()
    if source is None:
        source = spec.weights if spec.weights is not None else build_seeded(spec, allow)
    if isinstance(source, str):
        values = read_weights(source, {n: n for n in wanted}, expected=wanted)
    else:
        values = _take(source, wanted)
    _assign(stage, values, torch.device(device))
    return stage.eval()


def _take(model: nn.Module, wanted: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    out = {}
    for name, want in wanted.items():
        if name not in state:
            raise FlowmeshError(Code.BAD_REQUEST, f"the source model has no tensor {name!r}")
        out[name] = conform(state[name], want, f"the source model's tensor {name!r}")
    return out


@torch.no_grad()
def _assign(stage: StageModule, values: dict[str, torch.Tensor], device: torch.device) -> None:
    """Replace every meta parameter and buffer of `stage` by its value, one object per original
    tensor so that ties survive. Values are copied: the stage never aliases its source."""
    made: dict[str, torch.Tensor] = {}
    for prefix, module in stage.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for kind in ("_parameters", "_buffers"):
            slots: dict[str, torch.Tensor | None] = getattr(module, kind)
            for name, old in slots.items():
                if old is None:
                    continue
                local = dot + name
                original = stage.tensor_names.get(local)
                if original is None:
                    raise _not_loadable(stage, local)
                if original not in made:
                    value = values[original].to(device=device, copy=True)
                    if isinstance(old, nn.Parameter):
                        value = nn.Parameter(value, requires_grad=old.requires_grad)
                    made[original] = value
                slots[name] = made[original]
