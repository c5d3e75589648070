"""Worker-side stages of the example MLP, for executor tests: specs, meta blocks, host tier."""

from __future__ import annotations

from torch import nn

from flowmesh.modelio.build import build_meta, build_seeded
from flowmesh.spec import ModelSpec
from gpu_worker.host_tier import HostStage

MIB = 1 << 20


def stage_of(spec: ModelSpec) -> tuple[list[nn.Module], HostStage, nn.Module]:
    """Whole-model stage of a Sequential example: meta blocks, host tier, CPU reference."""
    ref = build_seeded(spec)
    host = HostStage.build([dict(b.state_dict()) for b in ref.children()])
    return list(build_meta(spec).children()), host, ref


def mlp(name: str, width: int = 256, depth: int = 4, seed: int = 0) -> ModelSpec:
    return ModelSpec(
        name=name,
        factory="flowmesh.examples:mlp",
        kwargs={"width": width, "depth": depth},
        seed=seed,
    )
