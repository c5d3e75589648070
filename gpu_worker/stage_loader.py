"""Preparing a stage on a worker: its blocks' structure plus its tensors in the host tier.

Runs on the worker's deploy thread (reading weights and materialising take time). The stage's
module keeps only structure (meta tensors): its real bytes live once, in the host tier, and are
bound to device views when the stage is loaded.

A stage deployed with a safetensors file (`spec.weights`) or a Hugging Face directory
(`spec.hf`: only the shards holding this stage's tensors are opened) is read straight from the
file(s) into its place in the host buffer: the layout comes from the meta stage's shapes and
dtypes, the buffer is allocated once, and each tensor's byte range is read into its slot (one
copy; a tensor stored in another dtype goes through a temporary and a cast). Seeded stages are
materialised on the CPU first and copied in.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch import nn

from flowmesh.modelio import hf_dir
from flowmesh.modelio.plan import Plan
from flowmesh.modelio.stages import StageModule, materialize_stage, meta_stage
from flowmesh.modelio.weights import read_weights_into
from flowmesh.spec import ModelSpec
from gpu_worker.device import Device
from gpu_worker.host_tier import HostStage
from gpu_worker.model_code import building_model

# Told (bytes read so far, bytes to read) while a stage's weights are read in.
Progress = Callable[[int, int], None]


def prepare_stage(
    spec: ModelSpec,
    plan: Plan,
    index: int,
    device: Device,
    allow: tuple[str, ...],
    progress: Progress | None = None,
) -> tuple[list[nn.Module], HostStage]:
    if spec.weights is not None or spec.hf is not None:
        # Tracing touches process-wide state that running model code uses (`model_code`).
        with building_model():
            stage = meta_stage(spec, plan, index, allow=allow)
        return list(stage.blocks), read_stage(stage, spec, device.host_buffer, progress)
    # Seeding and tracing touch process-wide state that running model code uses (`model_code`).
    with building_model():
        stage = materialize_stage(spec, plan, index, allow=allow)
    # keep_vars: the tensors themselves, so ties across blocks are seen and stored once
    groups = [dict(block.state_dict(keep_vars=True)) for block in stage.blocks]
    host = HostStage.build(groups, allocate=device.host_buffer)
    stage.to("meta")  # drop the CPU copies: the host tier holds the only one
    if progress is not None:
        progress(host.nbytes, host.nbytes)
    return list(stage.blocks), host


def read_stage(
    stage: StageModule,
    source: str | ModelSpec,
    allocate: Callable[[int], torch.Tensor] | None = None,
    progress: Progress | None = None,
) -> HostStage:
    """`stage`'s tensors (a meta stage, see `meta_stage`) read straight into a host buffer from
    `allocate`: from the safetensors file at `source`, or the spec's own (its Hugging Face
    directory, else its weights file); tensors tied in the model are stored once."""
    groups: list[list[tuple[str, Hashable, torch.Tensor]]] = []
    for i, block in enumerate(stage.blocks):
        # The original name is the tensor's identity: the same name is the same (tied) tensor.
        groups.append(
            [
                (local, stage.tensor_names[f"blocks.{i}.{local}"], t)
                for local, t in block.state_dict(keep_vars=True).items()
            ]
        )
    host = HostStage.allocate_for(groups, allocate)
    dests: dict[str, torch.Tensor] = {}
    for b, (region, entries) in enumerate(zip(host.regions, groups, strict=True)):
        for k, (slot, (_local, original, _t)) in enumerate(zip(region.slots, entries, strict=True)):
            if slot.alias is None:
                dests.setdefault(original, host.slot_view(b, k))
    total, done = sum(t.nbytes for t in dests.values()), 0

    def read(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    read(0)
    if isinstance(source, str):
        read_weights_into(source, dests, read)
    elif source.hf is not None:
        hf_dir.read_weights_into(source.hf, dests, stage.base_prefix, read)
    else:
        assert source.weights is not None
        read_weights_into(source.weights, dests, read)
    return host
