"""Where a checkpoint may be written, and what a failed or cut-short save leaves: in-process, a
small job on a CPU stand-in through the training executor, as a worker runs it.

A save goes into a new or empty directory or over a flowmesh checkpoint, never over other
files; it is atomic (the state file, which carries the job's JSON, is put in place first); a
write the disk refuses is an io_error naming the path, the old checkpoint stays whole and the
job trains on.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.chain import chain_of
from gpu_worker import train_checkpoint
from gpu_worker.device import CpuStandIn
from gpu_worker.train_checkpoint import META_FILE, STATE_FILE, load_checkpoint, read_meta
from gpu_worker.train_config import TrainConfig
from gpu_worker.train_executor import TrainingExecutor
from gpu_worker.train_job import TrainingJob
from tests.support.torch_threads import one_thread  # noqa: F401  (autouse)

MIB = 1 << 20
CFG = TrainConfig({"name": "adam", "lr": 0.01}, seed=1)


def make_job(name: str = "run") -> TrainingJob:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    blocks = chain_of(model)
    return TrainingJob(name, blocks, [(0, 1), (1, len(blocks))], CFG, CpuStandIn(MIB))


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)


@pytest.fixture
def trainer() -> Iterator[tuple[TrainingExecutor, TrainingJob]]:
    job = make_job()
    with TrainingExecutor(job.device) as ex:
        ex.open(job)
        yield ex, job


def step(ex: TrainingExecutor, i: int) -> float:
    return ex.submit("run", *batch(i)).result(timeout=60).loss


def save_error(ex: TrainingExecutor, path: Path) -> FlowmeshError:
    with pytest.raises(FlowmeshError) as info:
        ex.save("run", path).result(timeout=60)
    return info.value


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_a_save_goes_into_a_new_or_empty_directory_or_over_a_checkpoint(
    trainer: tuple[TrainingExecutor, TrainingJob], tmp_path: Path
) -> None:
    ex, job = trainer
    step(ex, 0)
    new = tmp_path / "runs" / "a" / "ckpt"  # its parents are made
    assert ex.save("run", new).result(timeout=60) == new
    assert sorted(os.listdir(new)) == [META_FILE, STATE_FILE]  # no temporary left
    # The state file is a plain safetensors file of the job's tensors.
    state = load_file(str(new / STATE_FILE))
    for n, info in job.tensors.items():
        assert torch.equal(state[n], info.home), n  # bit-exact: tensors written to a file
    (tmp_path / "empty").mkdir()
    ex.save("run", tmp_path / "empty").result(timeout=60)
    step(ex, 1)
    ex.save("run", new).result(timeout=60)  # over a checkpoint: replaced
    assert read_meta(new)["step"] == 2


def test_a_save_never_writes_over_other_files(
    trainer: tuple[TrainingExecutor, TrainingJob], tmp_path: Path
) -> None:
    ex, _ = trainer
    step(ex, 0)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / META_FILE).write_text('{"not": "ours"}')
    (theirs / STATE_FILE).write_bytes(b"someone's data")
    before = files(theirs)
    err = save_error(ex, theirs)
    assert err.code == Code.NOT_ALLOWED
    assert err.reason == (
        f"checkpoint {str(theirs)!r} holds files that are not a flowmesh checkpoint; save into "
        "a new or empty directory, or over a flowmesh checkpoint"
    )
    assert files(theirs) == before
    (tmp_path / "a-file").write_text("x")
    assert save_error(ex, tmp_path / "a-file").code == Code.NOT_ALLOWED
    assert (tmp_path / "a-file").read_text() == "x"
    assert step(ex, 1) > 0  # the job trains on


def test_a_full_disk_is_an_io_error_that_leaves_the_old_checkpoint_and_the_job(
    trainer: tuple[TrainingExecutor, TrainingJob], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ex, job = trainer
    step(ex, 0)
    ckpt = tmp_path / "ckpt"
    ex.save("run", ckpt).result(timeout=60)
    before = files(ckpt)
    write = train_checkpoint._write_safetensors

    def full(f: BinaryIO, tensors: dict[str, Any], meta: str) -> None:
        write(f, tensors, meta)  # as far as the disk lets it, then it is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(train_checkpoint, "_write_safetensors", full)
    step(ex, 1)
    err = save_error(ex, ckpt)
    assert (err.code, err.reason) == (
        Code.IO_ERROR,
        f"checkpoint {str(ckpt)!r}: No space left on device",
    )
    assert files(ckpt) == before  # the old files, and no temporary left beside them
    monkeypatch.undo()
    assert [r.step for r in (ex.submit("run", *batch(i)).result(60) for i in (2, 3))] == [3, 4]
    ex.save("run", ckpt).result(timeout=60)
    assert read_meta(ckpt)["step"] == job.step_count == 4


def test_a_save_cut_short_between_its_two_files_resumes_the_new_one(
    trainer: tuple[TrainingExecutor, TrainingJob], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ex, job = trainer
    step(ex, 0)
    ckpt = tmp_path / "ckpt"
    ex.save("run", ckpt).result(timeout=60)
    step(ex, 1)
    replace = os.replace

    def die_before_the_json(src: Any, dst: Any) -> None:
        if Path(dst).name == META_FILE:
            raise OSError(errno.EIO, os.strerror(errno.EIO))  # where a crash would stop it
        replace(src, dst)

    monkeypatch.setattr(os, "replace", die_before_the_json)
    assert save_error(ex, ckpt).code == Code.IO_ERROR
    monkeypatch.undo()
    assert read_meta(ckpt)["step"] == 2  # the state file's JSON, not the old job.json's
    again = make_job("again")
    assert load_checkpoint(again, ckpt) == 2
    for n, info in job.tensors.items():
        # bit-exact: a checkpoint's tensors written and read back (data movement)
        assert torch.equal(again.tensors[n].home, info.home), n


def test_what_is_not_a_checkpoint_is_named_never_quoted(tmp_path: Path) -> None:
    job = make_job()
    cases = {
        "no-json": {},
        "foreign-json": {META_FILE: b'{"secret": "SECRET"}'},
        "bad-utf8": {META_FILE: b'{"format": "\xffSECRET"}'},
    }
    for name, content in cases.items():
        d = tmp_path / name
        d.mkdir()
        for f, data in content.items():
            (d / f).write_bytes(data)
        with pytest.raises(FlowmeshError) as info:
            load_checkpoint(job, d)
        assert info.value.code == Code.BAD_REQUEST
        assert info.value.reason.startswith(f"checkpoint {str(d)!r} is not a flowmesh training")
        assert "SECRET" not in info.value.reason and "0xff" not in info.value.reason
    # A checkpoint whose state file is not safetensors: named, not quoted.
    d = tmp_path / "bad-state"
    with TrainingExecutor(job.device) as ex:
        ex.open(job)
        ex.save("run", d).result(timeout=60)
    (d / STATE_FILE).write_bytes(b"root:*:20000:SECRET")
    with pytest.raises(FlowmeshError) as info:
        load_checkpoint(make_job("again"), d)
    assert info.value.reason == f"checkpoint {str(d / STATE_FILE)!r} is not a safetensors file"
