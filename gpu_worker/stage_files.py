"""A pipelined job's stage files in a checkpoint directory, found and read (the layout
`gpu_worker.pipe_checkpoint` writes): apart from it so that `gpu_worker.train_checkpoint`, whose
saves go among them, reads them without importing the module that imports it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import safe_open

FORMAT = "flowmesh-pipelined-checkpoint"
PREFIX = "stage-"
SUFFIX = ".safetensors"

Key = tuple[str, int, int, str]  # a save's: job, stage count, step, id


def stage_file(directory: Path, stage: int) -> Path:
    """Where `stage`'s file of the newest save is put."""
    return directory / f"{PREFIX}{stage}{SUFFIX}"


def aside_file(directory: Path, meta: dict[str, Any]) -> Path:
    """Where a stage's file of an older save is set aside (named by its key, but the job)."""
    tail = f".{meta['save']}" if meta.get("save") else ""
    name = f"{PREFIX}{meta['stage']}-of-{meta['stages']}.step-{meta['step']}{tail}{SUFFIX}"
    return directory / name


def key_of(meta: dict[str, Any]) -> Key:
    return (str(meta.get("job", "")), meta["stages"], meta["step"], str(meta.get("save", "")))


@dataclass
class Save:
    """One save's stage files found in a directory: `files` the one read per stage (the
    `stage-<k>` one if there are two), `paths` all of them."""

    key: Key
    files: dict[int, Path] = field(default_factory=dict)
    metas: dict[int, dict[str, Any]] = field(default_factory=dict)
    paths: list[Path] = field(default_factory=list)
    mtime: float = 0.0  # its newest file's

    @property
    def stages(self) -> int:
        return self.key[1]

    @property
    def step(self) -> int:
        return self.key[2]

    @property
    def complete(self) -> bool:
        return len(self.files) == self.stages

    def order(self) -> tuple[int, float]:
        return (self.step, self.mtime)


def _meta(path: Path) -> dict[str, Any] | None:
    """The header of a stage file; None if `path` is no flowmesh pipelined stage (an OSError
    reading it is raised)."""
    try:
        with safe_open(str(path), "pt") as f:
            raw = (f.metadata() or {}).get("flowmesh")
        meta = json.loads(raw) if raw else {}
    except OSError:
        raise
    except Exception:  # not safetensors, or a header that is not JSON
        return None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return None
    stage, stages, step = meta.get("stage"), meta.get("stages"), meta.get("step")
    if not all(type(v) is int for v in (stage, stages, step)) or not 0 <= stage < stages:
        return None
    if step < 0 or not isinstance(meta.get("save", ""), str):
        return None
    return meta


def is_stage_file(path: Path) -> bool:
    """Whether `path` is a stage file of a pipelined save, in place or set aside (an OSError
    reading it is raised)."""
    return path.name.startswith(PREFIX) and path.name.endswith(SUFFIX) and _meta(path) is not None


def scan(directory: Path) -> tuple[list[Save], list[str]]:
    """The saves whose stage files are in `directory`, and the names of the files there named
    as stage files that are not."""
    saves: dict[Key, Save] = {}
    odd: list[str] = []
    for path in sorted(directory.glob(f"{PREFIX}*{SUFFIX}")):
        try:
            meta = _meta(path)
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            continue  # set aside or removed by a save under way: seen under its new name
        if meta is None:
            odd.append(path.name)
            continue
        key = key_of(meta)
        save = saves.setdefault(key, Save(key))
        k = meta["stage"]
        if k not in save.files or path == stage_file(directory, k):
            save.files[k], save.metas[k] = path, meta
        save.paths.append(path)
        save.mtime = max(save.mtime, mtime)
    return list(saves.values()), odd
