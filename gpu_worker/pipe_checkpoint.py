"""Checkpoints of a pipelined training job (issue 23 §2): one file per stage in one directory.

Each stage's worker writes `stage-<k>.safetensors` into the job's checkpoint directory: every
tensor the stage uses under its `state_dict` name (a tied weight in both stages that use it),
the optimizer state of the parameters it owns as `optimizer/<parameter>/<key>`, and, from stage
0, the job's RNG state (`rng/cpu`, `rng/cuda`); its header holds the step, the stage count and
the training configuration (`flowmesh`, JSON). The directory must be one every stage's worker
reaches (one host, or shared storage) for a resume elsewhere.

A resume reads the tensors each new stage uses from whichever stage file holds them, by name, so
a job may resume cut into another number of stages (after losing a worker, say). Each file is
written beside the old one and put in place whole (`os.replace`), so a save cut short leaves
each stage's old file or its new one; the step in every file says which save it came from, and
a resume refuses files of different steps.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from flowmesh.errors import Code, FlowmeshError, bad_request
from flowmesh.roots import io_error
from gpu_worker.pipe_stage import PipeStage
from gpu_worker.train_checkpoint import _write_new, _write_safetensors
from gpu_worker.train_config import TrainConfig
from gpu_worker.train_job import RngState

FORMAT = "flowmesh-pipelined-checkpoint"
PREFIX = "stage-"


def stage_file(directory: Path, stage: int) -> Path:
    return directory / f"{PREFIX}{stage}.safetensors"


def save_stage(
    stage: PipeStage, directory: str | os.PathLike[str], step: int, rng: RngState | None
) -> Path:
    """Write `stage`'s part of the job's checkpoint at `step` (`rng`: the job's, from stage 0)."""
    out = Path(directory)
    tensors: dict[str, torch.Tensor] = {}
    for name, info in stage.tensors.items():
        tensors[name] = info.tensor.detach()
    opt = stage.optimizer
    if opt is not None:
        for info in stage.owned:
            for key, value in opt.state.get(info.tensor, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optimizer/{info.name}/{key}"] = value
    if rng is not None:
        tensors["rng/cpu"] = rng[0]
        if rng[1] is not None:
            tensors["rng/cuda"] = rng[1]
    meta = json.dumps(
        {
            "format": FORMAT,
            "job": stage.job,
            "stage": stage.stage,
            "stages": len(stage.ranges),
            "step": step,
            "config": stage.config.to_dict(),
        }
    )
    try:
        out.mkdir(parents=True, exist_ok=True)
        tmp = _write_new(out, lambda f: _write_safetensors(f, tensors, meta))
        os.replace(tmp, stage_file(out, stage.stage))
    except OSError as exc:
        raise io_error(exc, str(out)) from None
    return out


def _meta(path: Path) -> dict[str, Any]:
    with safe_open(str(path), "pt") as f:
        raw = (f.metadata() or {}).get("flowmesh")
    meta = json.loads(raw) if raw else {}
    if meta.get("format") != FORMAT:
        raise bad_request(f"{path} is not a stage of a pipelined flowmesh checkpoint")
    return meta


def read_pipe_meta(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's step, stage count and configuration (from stage 0's file), its files
    checked to be of one save."""
    d = Path(directory)
    try:
        files = sorted(d.glob(f"{PREFIX}*.safetensors"))
        if not files:
            hint = ""
            if (d / "job.json").exists():  # `gpu_worker.train_checkpoint`'s
                hint = ": it is a memory-flow job's checkpoint, resume it with pipeline=1"
            raise bad_request(
                f"{d} holds no pipelined checkpoint (no {PREFIX}K.safetensors){hint}"
            )
        metas = [_meta(f) for f in files]
    except OSError as exc:
        raise io_error(exc, str(d)) from None
    stages = {m["stages"] for m in metas}
    steps = {m["step"] for m in metas}
    if len(stages) != 1 or len(steps) != 1 or len(metas) != next(iter(stages)):
        raise FlowmeshError(
            Code.BAD_REQUEST,
            f"{d}: its stage files are not of one save (stages {sorted(stages)}, steps "
            f"{sorted(steps)}, {len(metas)} files)",
        )
    return next(m for m in metas if m["stage"] == 0)


def config_of(meta: dict[str, Any]) -> TrainConfig:
    return TrainConfig.from_dict(meta["config"])


def load_stage(stage: PipeStage, directory: str | os.PathLike[str]) -> tuple[int, RngState]:
    """Set `stage`'s tensors and optimizer state from the checkpoint in `directory`, whatever
    cut it was saved under; its step and the job's RNG state."""
    d = Path(directory)
    meta = read_pipe_meta(d)
    wanted = set(stage.tensors)
    owned = {i.name: i for i in stage.owned}
    found: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}
    rng: list[torch.Tensor | None] = [None, None]
    try:
        for k in range(meta["stages"]):
            with safe_open(str(stage_file(d, k)), "pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if key in wanted and key not in found:
                        found[key] = f.get_tensor(key)
                    elif key.startswith("optimizer/"):
                        _, name, slot = key.split("/", 2)
                        if name in owned:
                            states.setdefault(name, {})[slot] = f.get_tensor(key)
                    elif key == "rng/cpu":
                        rng[0] = f.get_tensor(key)
                    elif key == "rng/cuda":
                        rng[1] = f.get_tensor(key)
    except OSError as exc:
        raise io_error(exc, str(d)) from None
    missing = sorted(wanted - set(found))
    if missing:
        raise bad_request(f"{d}: the checkpoint lacks tensors {missing[:5]} of this model")
    if rng[0] is None:
        raise bad_request(f"{d}: the checkpoint lacks the job's random state")
    with torch.no_grad():
        for name, t in found.items():
            info = stage.tensors[name]
            info.tensor.copy_(t.to(device=info.tensor.device, dtype=info.tensor.dtype))
    opt = stage.optimizer
    if opt is not None and states:
        saved = opt.state_dict()
        params = [i.tensor for g in opt.param_groups for i in (owned_by(stage, g["params"]))]
        by_index = {}
        for index, t in enumerate(params):
            name = next(i.name for i in stage.owned if i.tensor is t)
            if name in states:
                by_index[index] = {
                    k: v.to(t.device) if v.dim() else v for k, v in states[name].items()
                }
        opt.load_state_dict({"state": by_index, "param_groups": saved["param_groups"]})
    cpu = rng[0].to(torch.uint8)
    return int(meta["step"]), (cpu, rng[1].to(torch.uint8) if rng[1] is not None else None)


def owned_by(stage: PipeStage, params: list[Any]) -> list[Any]:
    """The stage's owned tensor infos for an optimizer group's parameters, in the group's order."""
    by_id = {id(i.tensor): i for i in stage.owned}
    return [by_id[id(t)] for t in params]
