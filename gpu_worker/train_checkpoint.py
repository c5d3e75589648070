"""Training checkpoints: a job's tensors, optimizer state, step and RNG state in safetensors.

A checkpoint is a directory holding

- `state.safetensors`: the model's tensors under their original `state_dict` names (so the file
  doubles as a weights file for serving the trained model), each optimizer state tensor as
  `optimizer/<parameter>/<key>` (the step counters too) and the job's RNG state as `rng/cpu`
  (and `rng/cuda`);
- `job.json`: the job's training configuration (optimizer, loss spec: a built-in name or a loss
  factory with its kwargs, clipping, accumulation, seed), step, sub-model ranges and optimizer
  hyper-parameters (also embedded in the safetensors header under "flowmesh"). A resume without
  a configuration continues with this one; one with another loss is refused.

Tensors are matched by name, not by sub-model, so a job may resume under another chunk plan.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from flowmesh.errors import Code, FlowmeshError

if TYPE_CHECKING:
    from gpu_worker.train_job import TrainingJob

FORMAT = "flowmesh-training-checkpoint"
VERSION = 1
STATE_FILE = "state.safetensors"
META_FILE = "job.json"


def _bad(reason: str) -> FlowmeshError:
    return FlowmeshError(Code.BAD_REQUEST, reason)


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def save_checkpoint(job: TrainingJob, path: str | os.PathLike[str]) -> Path:
    """Write `job`'s checkpoint to the directory `path` (created; files replaced atomically).
    The job must be idle: the executor runs this as a task of the job's chain."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {n: i.home for n, i in job.tensors.items()}
    scalars: dict[str, dict[str, Any]] = {}
    for sub in job.subs:
        opt = sub.optimizer
        if opt is None:
            continue
        for n in sub.owned:
            info = job.tensors[n]
            for key, value in opt.state.get(info.tensor, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optimizer/{n}/{key}"] = value
                else:
                    scalars.setdefault(n, {})[key] = _jsonable(value)
    tensors["rng/cpu"] = job.rng[0]
    if job.rng[1] is not None:
        tensors["rng/cuda"] = job.rng[1]
    groups = [
        None
        if sub.optimizer is None
        else [
            {k: _jsonable(v) for k, v in g.items() if k != "params"}
            for g in sub.optimizer.param_groups
        ]
        for sub in job.subs
    ]
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "job": job.name,
        "step": job.step_count,
        "config": job.config.to_dict(),
        "ranges": [list(r) for r in job.ranges],
        "param_groups": groups,
        "optimizer_scalars": scalars,
    }
    text = json.dumps(meta, indent=1, sort_keys=True)
    tmp_state, tmp_meta = out / f".{STATE_FILE}.tmp", out / f".{META_FILE}.tmp"
    # safetensors refuses tensors that share memory; the host tier's are views of slabs.
    save_file(
        {k: v.detach().contiguous().clone() for k, v in tensors.items()},
        str(tmp_state),
        metadata={"flowmesh": text},
    )
    tmp_meta.write_text(text + "\n")
    os.replace(tmp_state, out / STATE_FILE)
    os.replace(tmp_meta, out / META_FILE)
    return out


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's JSON (what a resuming `train_open` needs to rebuild the job)."""
    try:
        meta = json.loads((Path(path) / META_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise _bad(f"checkpoint {str(path)!r}: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _bad(f"checkpoint {str(path)!r} is not a flowmesh training checkpoint")
    if meta.get("version") != VERSION:
        raise _bad(f"checkpoint {str(path)!r} has version {meta.get('version')!r}, not {VERSION}")
    return meta


def load_checkpoint(job: TrainingJob, path: str | os.PathLike[str]) -> int:
    """Load a checkpoint into an idle job (same model and optimizer); returns its step."""
    from safetensors import safe_open

    meta = read_meta(path)
    saved = meta["config"]["optimizer"]
    want = job.config.optimizer
    if (
        str(saved.get("name", saved.get("type"))).lower()
        != str(want.get("name", want.get("type"))).lower()
    ):
        raise _bad(f"checkpoint {str(path)!r} was trained with {saved}, the job uses {want}")
    saved_loss = meta["config"].get("loss", "cross_entropy")
    want_loss = job.config.to_dict()["loss"]
    if saved_loss != want_loss:
        raise _bad(
            f"checkpoint {str(path)!r} was trained with loss {saved_loss!r}, the job asks for "
            f"{want_loss!r}; resume without a training configuration to continue with the "
            "checkpoint's own (its optimizer and loss)"
        )
    file = Path(path) / STATE_FILE
    try:
        handle = safe_open(str(file), framework="pt", device="cpu")
    except Exception as exc:
        raise _bad(f"checkpoint {str(file)!r} unreadable: {exc}") from None
    with handle as f, torch.no_grad():
        names = set(f.keys())
        for n, info in job.tensors.items():
            if n not in names:
                raise _bad(f"checkpoint {str(path)!r} has no tensor {n!r}")
            t = f.get_tensor(n)
            if t.shape != info.home.shape or t.dtype != info.home.dtype:
                raise _bad(
                    f"checkpoint tensor {n!r} is {t.dtype} {tuple(t.shape)}, the model's is "
                    f"{info.home.dtype} {tuple(info.home.shape)}"
                )
            info.home.copy_(t)
        hyper = next((g[0] for g in meta.get("param_groups", []) if g), None)
        scalars = meta.get("optimizer_scalars", {})
        for sub in job.subs:
            opt = sub.optimizer
            if opt is None:
                continue
            if hyper is not None:
                for group in opt.param_groups:
                    for key, value in hyper.items():
                        if key in group and not isinstance(group[key], torch.Tensor):
                            group[key] = tuple(value) if isinstance(group[key], tuple) else value
            for n in sub.owned:
                info = job.tensors[n]
                if not info.trainable:
                    continue
                prefix = f"optimizer/{n}/"
                state: dict[str, Any] = dict(scalars.get(n, {}))
                for key in (k[len(prefix) :] for k in names if k.startswith(prefix)):
                    value = f.get_tensor(prefix + key)
                    home = info.state_homes.get(key)
                    if home is not None:
                        home.copy_(value)
                        value = home
                    state[key] = value
                if state:
                    opt.state[info.tensor] = state
                else:
                    opt.state.pop(info.tensor, None)
                job.state_valid[n] = bool(state)
        cuda = f.get_tensor("rng/cuda") if "rng/cuda" in names else job.rng[1]
        job.rng = (f.get_tensor("rng/cpu"), cuda if job.rng[1] is not None else None)
    for n in job.grad_valid:
        job.grad_valid[n] = False
    job.step_count = int(meta["step"])
    return job.step_count
