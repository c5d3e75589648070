"""Training checkpoints: a job's tensors, optimizer state, step and RNG state in safetensors.

A checkpoint is a directory holding

- `state.safetensors`: the model's tensors under their original `state_dict` names (so the file
  doubles as a weights file for serving the trained model), each optimizer state tensor as
  `optimizer/<parameter>/<key>` (the step counters too) and the job's RNG state as `rng/cpu`
  (and `rng/cuda`);
- `job.json`: the job's training configuration (optimizer, loss spec: a built-in name or a loss
  factory with its kwargs, clipping, accumulation, seed, compute dtype: float32 in a checkpoint
  written before it had one), step, sub-model ranges and optimizer hyper-parameters (also
  embedded in the safetensors header under "flowmesh"). A resume without a configuration
  continues with this one; one with another loss is refused (another compute dtype is taken:
  the master weights are float32 either way).

Tensors are matched by name, not by sub-model, so a job may resume under another chunk plan.

A save goes into a new directory (its parents made), an empty one, or one that holds flowmesh
checkpoints alone (`_check_target`, which a pipelined job's stages run too): one of this kind,
whose two files it replaces, or a pipelined job's (`gpu_worker.pipe_checkpoint`: its stage files,
set-aside ones too), whose files it removes once its own are in place; never into a directory
holding anything else. It is atomic: both files are written in full beside the old ones and
flushed to the disk, then put in place, the state file first. The state file's copy of the JSON
is what a resume reads (`read_meta`), so a save cut short at any point leaves the old checkpoint
or the new one, never a mix. A write that fails (a full disk) is an io_error naming the path,
and leaves the old files as they were.

A directory holding a complete checkpoint of each kind (a save of one kind over the other cut
short before it removed the other's files, or one made before saves did) resumes neither way:
which is newer is not known, so `read_meta` and a pipelined resume refuse it, naming both.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch

from flowmesh.errors import Code, FlowmeshError, bad_request
from flowmesh.modelio.dtypes import SAFETENSORS_DTYPES
from flowmesh.roots import io_error, not_safetensors
from gpu_worker.stage_files import Save, is_stage_file, scan
from gpu_worker.train_config import TrainConfig
from gpu_worker.train_layout import SubModel, TensorInfo

log = logging.getLogger("gpu_worker.train_checkpoint")

FORMAT = "flowmesh-training-checkpoint"
VERSION = 1
STATE_FILE = "state.safetensors"
META_FILE = "job.json"
# Files a save writes before putting them in place (left only by a process killed mid-save).
TMP_PREFIX = ".flowmesh-tmp-"
DTYPE_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}


class Checkpointed(Protocol):
    """What a save reads of a job and a load sets (`gpu_worker.train_job.TrainingJob`): its host
    tier (`gpu_worker.train_layout`), optimizers, RNG state and step."""

    name: str
    config: TrainConfig
    ranges: list[tuple[int, int]]
    tensors: dict[str, TensorInfo]
    subs: list[SubModel]
    rng: tuple[torch.Tensor, torch.Tensor | None]
    step_count: int
    grad_valid: dict[str, bool]
    state_valid: dict[str, bool]


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


def _ours_json(path: Path) -> bool:
    """Whether `path` is a memory-flow checkpoint's job.json (FileNotFoundError if none)."""
    try:
        meta = json.loads(path.read_bytes())
    except ValueError:
        return False
    return isinstance(meta, dict) and meta.get("format") == FORMAT


def _ours_state(path: Path) -> bool:
    """Whether `path` is a memory-flow checkpoint's state file, by its header (one left
    without its job.json by a pipelined save that removed them, cut short)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            raw = (f.metadata() or {}).get("flowmesh")
        meta = json.loads(raw) if raw else None
    except OSError:
        raise
    except Exception:  # not safetensors, or a header that is not JSON
        return False
    return isinstance(meta, dict) and meta.get("format") == FORMAT


def memory_flow_step(directory: Path) -> int | None:
    """The step of the memory-flow checkpoint in `directory` (its job.json's), None if none."""
    try:
        meta = json.loads((directory / META_FILE).read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return None
    step = meta.get("step")
    return step if type(step) is int else -1


def both_kinds(where: str, flow_step: int, pipe_step: int, stages: int) -> FlowmeshError:
    """The refusal to resume a directory holding a complete checkpoint of each kind."""
    return bad_request(
        f"{where} holds two checkpoints: a memory-flow job's of step {flow_step} ({META_FILE}, "
        f"{STATE_FILE}) and a pipelined job's of step {pipe_step} over {stages} stages "
        "(stage-K.safetensors), left by a save of one kind over the other that did not finish "
        "removing the other's files; which is newer is not known, so neither is resumed: "
        "remove the files of the one not wanted, or save into the directory again"
    )


def _check_target(out: Path, where: str) -> None:
    """Refuse to save anywhere but into a new or empty directory, or one holding flowmesh
    checkpoints alone: a memory-flow one's files, a pipelined one's stage files (set-aside ones
    too: `gpu_worker.pipe_checkpoint`) and a save's temporaries. Both kinds' saves run it."""
    try:
        names = [n for n in os.listdir(out) if not n.startswith(TMP_PREFIX)]
    except FileNotFoundError:
        return
    except NotADirectoryError:
        # It, or a directory it would be made in, is a file: name the one that is.
        first = next((d for d in (out, *out.parents) if d.exists()), out)
        what = where if first == out else f"{where}: {str(first)!r}"
        raise FlowmeshError(Code.NOT_ALLOWED, f"{what} is a file, not a directory") from None
    except OSError as exc:
        raise io_error(exc, where) from None
    ours_json: bool | None = None
    for name in names:
        path = out / name
        try:
            if not stat.S_ISREG(path.stat().st_mode):
                ours = False
            elif name == META_FILE:
                ours = ours_json = _ours_json(path)
            elif name == STATE_FILE:
                if ours_json is None and META_FILE in names:
                    try:
                        ours_json = _ours_json(out / META_FILE)
                    except FileNotFoundError:
                        ours_json = False
                ours = bool(ours_json) or _ours_state(path)
            else:
                ours = is_stage_file(path)
        except FileNotFoundError:
            continue  # removed or set aside meanwhile by a save of another stage
        except OSError as exc:
            raise io_error(exc, where) from None
        if not ours:
            raise FlowmeshError(
                Code.NOT_ALLOWED,
                f"{where} holds files that are not a flowmesh checkpoint; save into a new or "
                "empty directory, or over a flowmesh checkpoint",
            )


def remove_memory_flow(directory: Path) -> bool:
    """Remove the memory-flow checkpoint in `directory` (a pipelined save over it is complete):
    its job.json first, with which it is no checkpoint, then its state file. Whether there was
    one; an OSError removing the job.json is raised (a resume would find both kinds)."""
    meta = directory / META_FILE
    try:
        ours = _ours_json(meta)
    except FileNotFoundError:
        ours = False
    except OSError as exc:
        log.warning("%s: not removed: %s", meta, exc)
        return False
    if ours:
        meta.unlink(missing_ok=True)
    state = directory / STATE_FILE
    try:
        if ours or _ours_state(state):
            state.unlink()
            return True
    except FileNotFoundError:
        pass
    except OSError as exc:  # no checkpoint without its job.json; the next save replaces it
        log.warning("%s: an older checkpoint's file stays: %s", state, exc)
    return ours


def _remove_pipelined(out: Path, where: str, step: int) -> None:
    """Once a memory-flow save is in place in `out`, remove the files of the pipelined saves
    there, set-aside ones too; an error if a complete one stays (a resume would refuse the
    directory)."""
    failed: OSError | None = None
    try:
        saves, _ = scan(out)
        for save in saves:
            for path in save.paths:
                try:
                    path.unlink(missing_ok=True)
                except OSError as exc:
                    failed = failed or exc
                    log.warning("%s: an older checkpoint's file stays: %s", path, exc)
        if saves:
            _sync_dir(out)
        stays = any(s.complete for s in scan(out)[0])
    except OSError as exc:
        failed, stays = exc, True
    if stays:
        reason = "it is there still"
        if failed is not None:
            reason = os.strerror(failed.errno) if failed.errno else str(failed)
        raise FlowmeshError(
            Code.IO_ERROR,
            f"{where}: the save of step {step} is in place, but the pipelined checkpoint there "
            f"could not be removed ({reason}); a resume refuses the directory until its "
            "stage-*.safetensors files are removed",
        )


def _sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the renames and removals too
    finally:
        os.close(fd)


def _write_new(directory: Path, write: Callable[[BinaryIO], None]) -> Path:
    """A new file in `directory`, written by `write` and flushed to the disk (removed if that
    fails)."""
    tmp = directory / f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    with open(tmp, "xb") as f:
        try:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return tmp


def _write_safetensors(f: BinaryIO, tensors: dict[str, torch.Tensor], meta: str) -> None:
    """`tensors` as a safetensors file, each written from its own memory: no copy of the whole
    checkpoint is made, and a failing write is the OSError it is (safetensors' own writer
    raises its own error type, errno lost)."""
    header: dict[str, Any] = {"__metadata__": {"flowmesh": meta}}
    offset = 0
    for name, t in tensors.items():
        code = DTYPE_CODES.get(t.dtype)
        if code is None:
            raise bad_request(
                f"checkpoint tensor {name!r} is {t.dtype}, which a checkpoint cannot hold"
            )
        header[name] = {
            "dtype": code,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.numel() * t.element_size()],
        }
        offset += t.numel() * t.element_size()
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data 8-aligned, as safetensors writes it
    f.write(struct.pack("<Q", len(raw)) + raw)
    for t in tensors.values():
        if t.numel():
            flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            f.write(memoryview(flat.numpy()))


def save_checkpoint(job: Checkpointed, path: str | os.PathLike[str]) -> Path:
    """Write `job`'s checkpoint to the directory `path`: a new or empty one, or over a flowmesh
    checkpoint, atomically (see the module). The job must be idle: the executor runs this as a
    task of the job's chain."""
    out = Path(path)
    where = f"checkpoint {str(out)!r}"
    _check_target(out, where)
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
    written: list[Path] = []
    try:
        out.mkdir(parents=True, exist_ok=True)
        written.append(_write_new(out, lambda f: _write_safetensors(f, tensors, text)))
        written.append(_write_new(out, lambda f: f.write(text.encode() + b"\n")))
        # The state file first: it carries the JSON that a resume reads (`read_meta`).
        os.replace(written[0], out / STATE_FILE)
        os.replace(written[1], out / META_FILE)
        _sync_dir(out)
    except OSError as exc:
        raise io_error(exc, where) from None
    finally:
        for tmp in written:
            tmp.unlink(missing_ok=True)  # put in place already, unless the save failed
    # In place: a pipelined checkpoint it was saved over goes (until then it was the one read).
    _remove_pipelined(out, where, job.step_count)
    return out


def _parse_meta(raw: str | bytes, where: str) -> dict[str, Any]:
    try:
        meta = json.loads(raw)
    except ValueError:  # the parser's text may quote the file
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise bad_request(f"{where} is not a flowmesh training checkpoint")
    if meta.get("version") != VERSION:
        # A flowmesh checkpoint's own field, shown as a number only.
        version = meta.get("version")
        shown = version if isinstance(version, int) else "another"
        raise bad_request(f"{where} has version {shown}, this worker reads {VERSION}")
    return meta


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's JSON (what a resuming `train_open` needs to rebuild the job): job.json
    marks the directory a flowmesh checkpoint; the state file's copy, put in place first by a
    save, is the one returned (the same, unless a save was cut short between the two). Refused
    where a complete pipelined checkpoint is beside it (`both_kinds`)."""
    meta = _read_meta(path)
    try:
        saves, _ = scan(Path(path))
    except OSError as exc:
        raise io_error(exc, f"checkpoint {str(path)!r}") from None
    complete = [s for s in saves if s.complete]
    if complete:
        best = max(complete, key=Save.order)
        step = meta.get("step")
        shown = step if type(step) is int else -1
        raise both_kinds(f"checkpoint {str(path)!r}", shown, best.step, best.stages)
    return meta


def _read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    from safetensors import safe_open

    where = f"checkpoint {str(path)!r}"
    try:
        meta = _parse_meta((Path(path) / META_FILE).read_bytes(), where)
    except (FileNotFoundError, NotADirectoryError):
        if any(Path(path).glob("stage-*.safetensors")):  # `gpu_worker.pipe_checkpoint`'s
            raise bad_request(
                f"{where} is a pipelined job's checkpoint: resume it pipelined "
                "(train_open(..., pipeline=N, resume=...), N of 2 or more)"
            ) from None
        raise bad_request(
            f"{where} is not a flowmesh training checkpoint (no {META_FILE})"
        ) from None
    except OSError as exc:
        raise io_error(exc, where) from None
    try:
        with safe_open(str(Path(path) / STATE_FILE), framework="pt", device="cpu") as f:
            embedded = (f.metadata() or {}).get("flowmesh")
    except Exception:  # what is wrong with the state file, `load_checkpoint` says
        return meta
    return _parse_meta(embedded, where) if embedded else meta


def load_checkpoint(job: Checkpointed, path: str | os.PathLike[str]) -> int:
    """Load a checkpoint into an idle job (same model and optimizer); returns its step."""
    from safetensors import safe_open

    meta = read_meta(path)
    saved = meta["config"]["optimizer"]
    want = job.config.optimizer
    if (
        str(saved.get("name", saved.get("type"))).lower()
        != str(want.get("name", want.get("type"))).lower()
    ):
        raise bad_request(f"checkpoint {str(path)!r} was trained with {saved}, the job uses {want}")
    saved_loss = meta["config"].get("loss", "cross_entropy")
    want_loss = job.config.to_dict()["loss"]
    if saved_loss != want_loss:
        raise bad_request(
            f"checkpoint {str(path)!r} was trained with loss {saved_loss!r}, the job asks for "
            f"{want_loss!r}; resume without a training configuration to continue with the "
            "checkpoint's own (its optimizer and loss)"
        )
    file = Path(path) / STATE_FILE
    try:
        handle = safe_open(str(file), framework="pt", device="cpu")
    except OSError as exc:
        raise io_error(exc, f"checkpoint {str(file)!r}") from None
    except Exception:  # safetensors' own error types, whose text may quote the file
        raise not_safetensors(f"checkpoint {str(file)!r}") from None
    with handle as f, torch.no_grad():
        names = set(f.keys())
        for n, info in job.tensors.items():
            if n not in names:
                raise bad_request(f"checkpoint {str(path)!r} has no tensor {n!r}")
            t = f.get_tensor(n)
            if t.shape != info.home.shape or t.dtype != info.home.dtype:
                raise bad_request(
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
