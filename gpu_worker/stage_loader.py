"""Preparing a stage on a worker: its blocks' structure plus its tensors in the host tier.

Runs on the worker's deploy thread (reading weights and materialising take time). The stage's
module keeps only structure (meta tensors): its real bytes live once, in the host tier, and are
bound to device views when the stage is loaded.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from flowmesh.spec import ModelSpec
from gpu_worker.device import Device
from gpu_worker.host_tier import HostStage
from gpu_worker.train_job import MODEL_CODE_LOCK
from partitioner.plan import Plan
from partitioner.stages import materialize_stage


def prepare_stage(
    spec: ModelSpec, plan: dict[str, Any], index: int, device: Device, allow: tuple[str, ...]
) -> tuple[list[nn.Module], HostStage]:
    # Seeding and tracing touch process-wide state a training task uses (see MODEL_CODE_LOCK).
    with MODEL_CODE_LOCK:
        stage = materialize_stage(spec, Plan.from_dict(plan), index, allow=allow)
    # keep_vars: the tensors themselves, so ties across blocks are seen and stored once
    groups = [dict(block.state_dict(keep_vars=True)) for block in stage.blocks]
    host = HostStage.build(groups, allocate=device.host_buffer)
    stage.to("meta")  # drop the CPU copies: the host tier holds the only one
    return list(stage.blocks), host
