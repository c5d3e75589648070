"""Checkpoints of a pipelined training job (issue 23 §2): one file per stage in one directory.

Each stage's worker writes its part of a save as one safetensors file: every tensor the stage
uses under its `state_dict` name (a tied weight in both stages that use it), the optimizer state
of the parameters it owns as `optimizer/<parameter>/<key>`, and, from stage 0, the job's RNG
state (`rng/cpu`, `rng/cuda`); its header (`flowmesh`, JSON) holds the job, the stage, the
stage count, the step, the save's id (one the coordinator gives, or "") and the training
configuration. The directory must be one every stage's worker reaches (one host, or shared
storage) for a resume elsewhere.

A save is known by its key (job, stage count, step, id) and its files by their headers, never
by their names. The stages write with no commit between them, so:

- a stage puts its file in place as `stage-<k>.safetensors` (written beside it, flushed, then
  `os.replace`d), after moving the one there, if it is of another save, aside to
  `stage-<k>-of-<n>.step-<step>[.<id>].safetensors`: a save never overwrites another's file;
- a stage that finds every stage's file of its save present once its own is in place (the save
  complete) removes the files of every other save (a complete one of a higher step too: another
  run's, saved over), but an incomplete one of a later step (a later save of this job, under
  way after a save given up on); so after a complete save the directory holds its
  `stage-<k>.safetensors` files alone, the layout it always had;
- a resume reads the complete save of the highest step (of one step, the one written last),
  whatever stage count it was cut into, and leaves the rest aside: a save cut short or failed
  on some stage (a full disk, roots refusing), or the stage files of an older cut beside a
  newer one (a job resumed on fewer workers), never hide the last complete save nor mix with
  it. A directory of plain `stage-<k>.safetensors` files written before saves had keys reads
  the same way (no id).

Two saves of one key are one save to a resume. With no id, a job resumed from an older save
that saves again at the step of a save that failed on some stage, cut the same way, may leave
a mix of the two saves' files that reads as complete (until a later save completes); an id the
coordinator draws for each save (`save_stage(..., save_id=...)`) rules that out.

A resume reads the tensors each new stage uses from whichever stage file holds them, by name,
so a job may resume cut into another number of stages (after losing a worker, say).

A stage saves where a memory-flow save would (`gpu_worker.train_checkpoint._check_target`, run
by each stage before it writes): into a new or empty directory, or one holding flowmesh
checkpoints alone, of either kind, never beside other files. A save complete removes a
memory-flow checkpoint there too (its job.json first, with which it is no checkpoint), as a
memory-flow save removes the stage files it was saved over once its own are in place; until
then the older checkpoint is the one a resume reads. A directory holding a complete checkpoint
of each kind (a removal cut short) is resumed neither way (`train_checkpoint.both_kinds`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from flowmesh.errors import Code, FlowmeshError, bad_request
from flowmesh.roots import io_error
from gpu_worker.pipe_stage import PipeStage
from gpu_worker.stage_files import (
    FORMAT,
    PREFIX,
    SUFFIX,
    Key,
    Save,
    _meta,
    aside_file,
    key_of,
    scan,
    stage_file,
)
from gpu_worker.train_checkpoint import (
    _check_target,
    _write_new,
    _write_safetensors,
    both_kinds,
    memory_flow_step,
    remove_memory_flow,
)
from gpu_worker.train_config import TrainConfig
from gpu_worker.train_job import RngState

log = logging.getLogger("gpu_worker.pipe_checkpoint")

SAVE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # it goes into file names


def newest(directory: str | os.PathLike[str]) -> Save:
    """The complete save a resume reads: of the highest step, of one step the one written
    last."""
    d = Path(directory)
    try:
        saves, odd = scan(d)
    except OSError as exc:
        raise io_error(exc, str(d)) from None
    complete = [s for s in saves if s.complete]
    flow = memory_flow_step(d)  # `gpu_worker.train_checkpoint`'s
    if not complete:
        if not saves and not odd:
            hint = ""
            if (d / "job.json").exists():
                hint = ": it is a memory-flow job's checkpoint, resume it with pipeline=1"
            raise bad_request(f"{d} holds no pipelined checkpoint (no {PREFIX}K{SUFFIX}){hint}")
        found = [
            f"step {s.step} of {s.stages} stages has stages {sorted(s.files)} only"
            for s in sorted(saves, key=Save.order)
        ]
        if odd:
            found.append(f"{len(odd)} files are not pipelined stages ({', '.join(odd[:3])})")
        if flow is not None:
            found.append(
                f"beside them a memory-flow job's checkpoint of step {flow}: resume it with "
                "pipeline=1"
            )
        raise bad_request(
            f"{d} holds no complete pipelined checkpoint (a save cut short or failed on some "
            f"stage): {'; '.join(found)}"
        )
    best = max(complete, key=Save.order)
    if flow is not None:
        raise both_kinds(str(d), flow, best.step, best.stages)
    later = [s for s in saves if not s.complete and s.order() > best.order()]
    if later:
        log.warning(
            "%s: reading the save of step %d; later saves are incomplete (steps %s)",
            d, best.step, sorted({s.step for s in later}),
        )  # fmt: skip
    return best


def _sync(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the renames too
    finally:
        os.close(fd)


def _set_aside(directory: Path, stage: int, key: Key) -> None:
    """Move `stage`'s file in place aside if it is of another save than `key`'s."""
    plain = stage_file(directory, stage)
    try:
        meta = _meta(plain)
        if meta is not None and key_of(meta) != key:
            os.replace(plain, aside_file(directory, meta))
    except FileNotFoundError:
        pass  # none, or removed meanwhile by another stage's complete save
    # Not a stage (or of this save's key): replaced, as a save always replaced it.


def _prune(directory: Path, key: Key) -> None:
    """Once the save of `key` is complete, remove the files of every other save but an
    incomplete one of a later step, and a memory-flow checkpoint's."""
    saves, _ = scan(directory)
    mine = next((s for s in saves if s.key == key), None)
    if mine is None or not mine.complete:
        return
    try:
        if remove_memory_flow(directory):
            _sync(directory)
    except OSError as exc:
        raise FlowmeshError(
            Code.IO_ERROR,
            f"{directory}: the save of step {mine.step} is complete, but the memory-flow "
            "checkpoint there could not be removed (its job.json: "
            f"{os.strerror(exc.errno) if exc.errno else exc}); a resume refuses the directory "
            "until it is",
        ) from None
    for s in saves:
        if s is not mine and not s.complete and s.step > mine.step:
            continue
        keep = set(mine.files.values()) if s is mine else set()
        for path in s.paths:
            if path in keep:
                continue
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                if s.complete and s.order() > mine.order():
                    raise FlowmeshError(
                        Code.IO_ERROR,
                        f"{directory}: the save of step {mine.step} is complete, but a resume "
                        f"would read the save of step {s.step} there, whose {path.name} could "
                        f"not be removed: {os.strerror(exc.errno) if exc.errno else exc}",
                    ) from None
                log.warning("%s: an older save's file stays: %s", path, exc)


def save_stage(
    stage: PipeStage,
    directory: str | os.PathLike[str],
    step: int,
    rng: RngState | None,
    save_id: str = "",
) -> Path:
    """Write `stage`'s part of the job's save at `step` (`rng`: the job's, from stage 0;
    `save_id`: the save's, the same on every stage, where the coordinator gives one); once the
    save is complete, remove the older saves' files."""
    if save_id and not SAVE_ID.fullmatch(save_id):
        raise bad_request("a save's id is 1 to 64 letters, digits, '-' or '_'")
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
    meta = {
        "format": FORMAT,
        "job": stage.job,
        "stage": stage.stage,
        "stages": len(stage.ranges),
        "step": step,
        "save": save_id,
        "config": stage.config.to_dict(),
    }
    text = json.dumps(meta)
    _check_target(out, f"checkpoint {str(out)!r}")
    try:
        out.mkdir(parents=True, exist_ok=True)
        tmp = _write_new(out, lambda f: _write_safetensors(f, tensors, text))
        try:
            _set_aside(out, stage.stage, key_of(meta))
            os.replace(tmp, stage_file(out, stage.stage))
        finally:
            tmp.unlink(missing_ok=True)  # put in place already, unless that failed
        _sync(out)
        _prune(out, key_of(meta))
    except OSError as exc:
        raise io_error(exc, str(out)) from None
    return out


def read_pipe_meta(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The header of stage 0's file of the save a resume reads (`newest`): its step, stage
    count and configuration."""
    return dict(newest(directory).metas[0])


def config_of(meta: dict[str, Any]) -> TrainConfig:
    return TrainConfig.from_dict(meta["config"])


def _read(
    save: Save, wanted: set[str], owned: set[str]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], list[torch.Tensor | None]]:
    """From `save`'s files: the `wanted` tensors, the optimizer state of the `owned`
    parameters, and the job's RNG state."""
    found: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}
    rng: list[torch.Tensor | None] = [None, None]
    for k in range(save.stages):
        with safe_open(str(save.files[k]), "pt") as f:
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
    return found, states, rng


def load_stage(stage: PipeStage, directory: str | os.PathLike[str]) -> tuple[int, RngState]:
    """Set `stage`'s tensors and optimizer state from the save in `directory` a resume reads
    (`newest`), whatever cut it was saved under; its step and the job's RNG state."""
    d = Path(directory)
    wanted = set(stage.tensors)
    owned = {i.name: i for i in stage.owned}
    for tries_left in (2, 1, 0):
        save = newest(d)
        try:
            found, states, rng = _read(save, wanted, set(owned))
            break
        except FileNotFoundError as exc:  # a save under way set a file aside: look again
            if not tries_left:
                raise io_error(exc, str(d)) from None
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
    return save.step, (cpu, rng[1].to(torch.uint8) if rng[1] is not None else None)


def owned_by(stage: PipeStage, params: list[Any]) -> list[Any]:
    """The stage's owned tensor infos for an optimizer group's parameters, in the group's order."""
    by_id = {id(i.tensor): i for i in stage.owned}
    return [by_id[id(t)] for t in params]
