"""Pipelined checkpoints on disk (`gpu_worker.pipe_checkpoint`), with real stages stepped in
process and real files: each stage's worker writes its part with no commit between them, so a
job resumed cut into fewer stages saves over its checkpoint, a save that fails on one stage
after another put its file in place leaves the last complete save to resume from, and two
saves' files never mix; a directory settles to one file per stage once a save is complete, and
one the writer before per-save keys left reads its complete save. A save of either kind (a
pipelined one, or a memory-flow one of the same model through the training executor) goes only
where flowmesh checkpoints are, and replaces one of the other kind once complete; a directory
holding a complete checkpoint of each kind resumes neither way. What a resume reads equals what
was saved bit for bit (tensors, optimizer state, RNG state)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flowmesh.errors import Code, FlowmeshError
from gpu_worker import pipe_checkpoint, train_checkpoint
from gpu_worker.device import CpuStandIn
from gpu_worker.pipe_checkpoint import load_stage, read_pipe_meta, save_stage
from gpu_worker.pipe_stage import job_rng, step_in_process
from gpu_worker.train_checkpoint import META_FILE, STATE_FILE, load_checkpoint, read_meta
from gpu_worker.train_config import TrainConfig
from gpu_worker.train_executor import TrainingExecutor
from gpu_worker.train_job import RngState, TrainingJob
from tests.support.torch_threads import one_thread  # noqa: F401 (fixture)
from tests.support.train_cases import Data, blocks_of, build, data_for, even_ranges, pipe_stages

CFG = TrainConfig({"name": "adam", "lr": 0.01}, accumulate=2, seed=21)
SETTLED = ["stage-0.safetensors", "stage-1.safetensors"]
FLOW = [META_FILE, STATE_FILE]


class Job:
    """A pipelined job's stages in one process: its steps, its RNG state, each stage's save
    (as that stage's worker makes it) and its resume (every stage's load)."""

    def __init__(self, kind: str, stages: int) -> None:
        self.stages = pipe_stages(kind, CFG, stages)
        self.rng: RngState = job_rng(CFG.seed)
        self.step = 0

    def train(self, data: Data) -> None:
        for x, y in data:
            _, self.rng, _ = step_in_process(self.stages, x, y, self.rng)
            self.step += 1

    def save(self, path: Path, stage: int, **kw: Any) -> None:
        rng = self.rng if stage == 0 else None
        save_stage(self.stages[stage], path, self.step, rng, **kw)

    def save_all(self, path: Path, **kw: Any) -> None:
        for k in range(len(self.stages)):
            self.save(path, k, **kw)

    def resume(self, path: Path) -> None:
        loaded = [load_stage(s, path) for s in self.stages]
        assert len({step for step, _ in loaded}) == 1, loaded
        self.step, self.rng = loaded[0]

    def state(self) -> dict[str, torch.Tensor]:
        """Every tensor the stages own and its optimizer state, by name (copies)."""
        out: dict[str, torch.Tensor] = {}
        for s in self.stages:
            out.update(s.state_dict())
            assert s.optimizer is not None
            for info in s.owned:
                for key, value in s.optimizer.state.get(info.tensor, {}).items():
                    out[f"optimizer/{info.name}/{key}"] = value.detach().to("cpu", copy=True)
        return out


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    assert any(k.startswith("optimizer/") for k in want)  # the updates made optimizer state
    for k, t in want.items():
        # bit-exact: tensors written to a file and read back, pure data movement
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k


def same_rng(got: RngState, want: RngState) -> None:
    # bit-exact: the RNG state's bytes written to a file and read back, pure data movement
    assert torch.equal(got[0], want[0]) and got[1] is None and want[1] is None


def names(path: Path) -> list[str]:
    return sorted(f.name for f in path.iterdir())


@pytest.mark.parametrize("kind", ["mlp", "gpt2"])
def test_a_job_resumed_on_fewer_workers_saves_over_its_checkpoint(
    tmp_path: Path, kind: str
) -> None:
    """Saved over 3 stages at step 2, resumed over 2 (a worker lost), saved again at step 4 in
    the same directory: the 3-stage save's `stage-2` file goes with it, and the directory reads
    the step-4 save, which resumes over 3 stages again."""
    ck = tmp_path / "ck"
    data = data_for(kind, steps=4)
    three = Job(kind, 3)
    three.train(data[:2])
    three.save_all(ck)
    assert names(ck) == [*SETTLED, "stage-2.safetensors"]

    two = Job(kind, 2)
    two.resume(ck)
    assert two.step == 2
    same(two.state(), three.state())
    same_rng(two.rng, three.rng)
    two.train(data[2:])
    two.save_all(ck)
    meta = read_pipe_meta(ck)
    assert (meta["stages"], meta["step"]) == (2, 4)
    assert names(ck) == SETTLED

    again = Job(kind, 3)
    again.resume(ck)
    assert again.step == 4
    same(again.state(), two.state())
    same_rng(again.rng, two.rng)


def _disk_full(*_: Any) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def cut_short_after_stage_0(ck: Path, data: Data) -> tuple[Job, dict[str, torch.Tensor], RngState]:
    """A two-stage job's save of step 2 complete in `ck`, then its save of step 4 written by
    stage 0 alone (its older file set aside): the job, and its state and RNG at step 2."""
    two = Job("mlp", 2)
    two.train(data[:2])
    two.save_all(ck)
    at_2, rng_2 = two.state(), two.rng
    two.train(data[2:4])
    two.save(ck, 0)
    return two, at_2, rng_2


@pytest.mark.parametrize("failing", ["disk_full", "never_written"])
def test_a_save_failing_on_one_stage_leaves_the_last_complete_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """A save at step 4 over a complete save of step 2: stage 0's file is put in place, stage
    1's fails (its disk full, or its worker's roots refuse the path and it writes nothing).
    The directory resumes the step-2 save, over 2 or 3 stages; the next save completes and
    the directory settles to it."""
    ck = tmp_path / "ck"
    data = data_for("mlp", steps=6)
    two, at_2, rng_2 = cut_short_after_stage_0(ck, data)
    if failing == "disk_full":
        with monkeypatch.context() as m:
            m.setattr(pipe_checkpoint, "_write_safetensors", _disk_full)
            with pytest.raises(FlowmeshError) as err:
                two.save(ck, 1)
        assert err.value.code == Code.IO_ERROR and "No space left" in err.value.reason
    assert read_pipe_meta(ck)["step"] == 2
    for stages in (2, 3):
        back = Job("mlp", stages)
        back.resume(ck)
        assert back.step == 2
        same(back.state(), at_2)
        same_rng(back.rng, rng_2)
    # The old stage 0 file set aside, nothing half written left.
    assert names(ck) == ["stage-0-of-2.step-2.safetensors", *SETTLED]

    two.train(data[4:])
    two.save_all(ck)
    assert names(ck) == SETTLED
    back = Job("mlp", 2)
    back.resume(ck)
    assert back.step == 6
    same(back.state(), two.state())


def _as_the_old_writer_wrote(path: Path) -> None:
    """`path` with the header the writer before per-save keys gave it (no save id)."""
    with safe_open(str(path), "pt") as f:
        meta = json.loads((f.metadata() or {})["flowmesh"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    meta.pop("save", None)
    save_file(tensors, str(path), metadata={"flowmesh": json.dumps(meta)})


def test_a_directory_the_old_writer_left_reads_its_complete_save(tmp_path: Path) -> None:
    """The old writer's files after a job saved over 3 stages was resumed over 2 and saved
    again in place: the 2-stage save's `stage-0`, `stage-1` and the 3-stage save's `stage-2`
    (which it refused to read). The 2-stage save is read, and the next save clears the rest."""
    old, ck = tmp_path / "old", tmp_path / "ck"
    data = data_for("mlp", steps=6)
    three = Job("mlp", 3)
    three.train(data[:2])
    three.save_all(old)
    two = Job("mlp", 2)
    two.resume(old)
    two.train(data[2:4])
    two.save_all(ck)
    shutil.copy(old / "stage-2.safetensors", ck / "stage-2.safetensors")
    for f in ck.iterdir():
        _as_the_old_writer_wrote(f)
    meta = read_pipe_meta(ck)
    assert (meta["stages"], meta["step"]) == (2, 4) and "save" not in meta
    back = Job("mlp", 3)
    back.resume(ck)
    same(back.state(), two.state())
    same_rng(back.rng, two.rng)

    two.train(data[4:])
    two.save_all(ck)
    assert names(ck) == SETTLED
    assert read_pipe_meta(ck)["step"] == 6


def test_saves_with_ids_never_mix_and_an_incomplete_directory_says_so(tmp_path: Path) -> None:
    """Job X saves at step 2, then at step 4 only its stage 1 writes before X is lost; Y resumes
    from step 2, trains on other data to step 4 and saves, only its stage 0 writing. With each
    save's id from the coordinator, the two step-4 halves are not one save: step 2 is read."""
    ck = tmp_path / "ck"
    x = Job("mlp", 2)
    x.train(data_for("mlp", steps=4)[:2])
    x.save_all(ck, save_id="a")
    at_2 = x.state()
    x.train(data_for("mlp", steps=4)[2:])
    x.save(ck, 1, save_id="b")
    y = Job("mlp", 2)
    y.resume(ck)
    y.train(data_for("mlp", steps=2, seed=5))
    assert y.step == x.step == 4
    y.save(ck, 0, save_id="c")
    assert names(ck) == [
        "stage-0-of-2.step-2.a.safetensors",
        "stage-0.safetensors",
        "stage-1-of-2.step-2.a.safetensors",
        "stage-1.safetensors",
    ]
    assert read_pipe_meta(ck)["step"] == 2
    back = Job("mlp", 2)
    back.resume(ck)
    same(back.state(), at_2)
    # Y's next save completes: the directory settles to it.
    y.save_all(ck, save_id="d")
    assert names(ck) == SETTLED
    assert read_pipe_meta(ck)["save"] == "d"

    with pytest.raises(FlowmeshError, match="a save's id is 1 to 64 letters"):
        y.save(tmp_path / "bad", 0, save_id="../up")
    lone = tmp_path / "lone"
    y.save(lone, 1)
    with pytest.raises(FlowmeshError, match=r"holds no complete pipelined checkpoint .*step 4 "
                       r"of 2 stages has stages \[1\] only"):  # fmt: skip
        read_pipe_meta(lone)
    with pytest.raises(FlowmeshError, match="holds no pipelined checkpoint"):
        read_pipe_meta(tmp_path / "nothing")


def test_a_stage_ending_an_older_save_late_keeps_the_later_save_under_way(tmp_path: Path) -> None:
    """The coordinator gave up on the save at step 2 (stage 1 slow) and went on: stage 0 has
    already written its part of the save at step 4 when stage 1 ends the step-2 save. That save
    complete, its older files go but the step-4 one stays, and once stage 1 writes its part the
    directory reads step 4."""
    ck = tmp_path / "ck"
    data = data_for("mlp", steps=4)
    two, late = Job("mlp", 2), Job("mlp", 2)
    two.train(data[:2])
    late.train(data[:2])
    two.save(ck, 0)
    two.train(data[2:])
    two.save(ck, 0)
    late.save(ck, 1)  # the step-2 save complete
    assert read_pipe_meta(ck)["step"] == 2
    assert names(ck) == ["stage-0-of-2.step-2.safetensors", *SETTLED]
    two.save(ck, 1)
    assert read_pipe_meta(ck)["step"] == 4
    assert names(ck) == SETTLED
    back = Job("mlp", 2)
    back.resume(ck)
    same(back.state(), two.state())


# -- the two kinds of checkpoint in one directory ----------------------------------------------


def flow_job(name: str = "flow") -> TrainingJob:
    """The pipelined jobs' model on one worker by memory flow, in two sub-models."""
    blocks = blocks_of("mlp", build("mlp"))
    return TrainingJob(name, blocks, even_ranges(len(blocks), 2), CFG, CpuStandIn(1 << 20))


def flow_save(path: Path, data: Data) -> dict[str, torch.Tensor]:
    """A memory-flow job trained on `data` and saved into `path` (through the training
    executor, as its worker does); its tensors as saved (copies). A refused save raises."""
    job = flow_job()
    with TrainingExecutor(job.device) as ex:
        ex.open(job)
        for x, y in data:
            ex.submit(job.name, x, y).result(timeout=60)
        ex.save(job.name, path).result(timeout=60)
        return {n: i.home.clone() for n, i in job.tensors.items()}


def flow_resume(path: Path, want: dict[str, torch.Tensor]) -> int:
    """A fresh memory-flow job resumed from `path` (its tensors held equal to `want`): its
    step."""
    job = flow_job("again")
    step = load_checkpoint(job, path)
    for n, info in job.tensors.items():
        # bit-exact: a checkpoint's tensors written to a file and read back (data movement)
        assert torch.equal(info.home, want[n]), n
    return step


def files(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


def test_a_pipelined_save_over_a_memory_flow_checkpoint_replaces_it_once_complete(
    tmp_path: Path,
) -> None:
    """A memory-flow save at step 5, then a pipelined one at step 2 into the same directory:
    while only stage 0 has written, the memory-flow checkpoint is the one a resume reads; once
    the save is complete its files go, and the directory resumes the step-2 save alone."""
    ck = tmp_path / "ck"
    data = data_for("mlp", steps=5)
    at_5 = flow_save(ck, data)
    assert names(ck) == FLOW
    two = Job("mlp", 2)
    two.train(data[:2])
    two.save(ck, 0)
    assert names(ck) == [META_FILE, "stage-0.safetensors", STATE_FILE]
    assert read_meta(ck)["step"] == 5
    assert flow_resume(ck, at_5) == 5
    with pytest.raises(FlowmeshError) as err:
        read_pipe_meta(ck)
    assert err.value.reason == (
        f"{ck} holds no complete pipelined checkpoint (a save cut short or failed on some "
        "stage): step 2 of 2 stages has stages [0] only; beside them a memory-flow job's "
        "checkpoint of step 5: resume it with pipeline=1"
    )

    two.save(ck, 1)
    assert names(ck) == SETTLED
    with pytest.raises(FlowmeshError, match="is a pipelined job's checkpoint: resume it"):
        read_meta(ck)
    for stages in (2, 3):
        back = Job("mlp", stages)
        back.resume(ck)
        assert back.step == 2
        same(back.state(), two.state())
        same_rng(back.rng, two.rng)


def test_a_memory_flow_save_over_a_pipelined_checkpoint_replaces_it_once_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pipelined save at step 2, then one at step 4 cut short after stage 0 (its old file set
    aside): a memory-flow save at step 5 into the directory that fails (a full disk) leaves it
    as it was; the next one removes every stage file, set-aside ones too, and the directory
    resumes the step-5 save alone."""
    ck = tmp_path / "ck"
    data = data_for("mlp", steps=5)
    _, at_2, rng_2 = cut_short_after_stage_0(ck, data)
    before = files(ck)
    assert list(before) == ["stage-0-of-2.step-2.safetensors", *SETTLED]

    with monkeypatch.context() as m:
        m.setattr(train_checkpoint, "_write_safetensors", _disk_full)
        with pytest.raises(FlowmeshError) as err:
            flow_save(ck, data)
    assert err.value.code == Code.IO_ERROR and "No space left" in err.value.reason
    assert files(ck) == before
    back = Job("mlp", 2)
    back.resume(ck)
    assert back.step == 2
    same(back.state(), at_2)
    same_rng(back.rng, rng_2)

    at_5 = flow_save(ck, data)
    assert names(ck) == FLOW
    assert read_meta(ck)["step"] == 5
    assert flow_resume(ck, at_5) == 5
    with pytest.raises(FlowmeshError) as err:
        read_pipe_meta(ck)
    assert err.value.reason == (
        f"{ck} holds no pipelined checkpoint (no stage-K.safetensors): it is a memory-flow "
        "job's checkpoint, resume it with pipeline=1"
    )


NOT_OURS = "holds files that are not a flowmesh checkpoint; save into a new or empty directory, "


@pytest.mark.parametrize("beside", ["nothing", "memory-flow", "pipelined"])
def test_a_save_of_either_kind_never_goes_beside_other_files(tmp_path: Path, beside: str) -> None:
    """A user's notes.txt in the directory, alone or beside a checkpoint of either kind: a
    pipelined save is refused as a memory-flow one is, and nothing there changes. So is one
    into a file, or over a file named as a stage file that is none."""
    ck = tmp_path / "ck"
    data = data_for("mlp", steps=1)
    if beside == "memory-flow":
        flow_save(ck, data)
    elif beside == "pipelined":
        Job("mlp", 2).save_all(ck)
    ck.mkdir(exist_ok=True)
    (ck / "notes.txt").write_text("my notes")
    before = files(ck)
    two = Job("mlp", 2)
    two.train(data)
    for k in (0, 1):
        with pytest.raises(FlowmeshError) as err:
            two.save(ck, k)
        assert (err.value.code, err.value.reason) == (
            Code.NOT_ALLOWED,
            f"checkpoint {str(ck)!r} {NOT_OURS}or over a flowmesh checkpoint",
        )
    with pytest.raises(FlowmeshError) as err:
        flow_save(ck, data)
    assert err.value.code == Code.NOT_ALLOWED and NOT_OURS in err.value.reason
    assert files(ck) == before

    (tmp_path / "a-file").write_text("x")
    with pytest.raises(FlowmeshError) as err:
        two.save(tmp_path / "a-file", 0)
    assert (err.value.code, err.value.reason) == (
        Code.NOT_ALLOWED,
        f"checkpoint {str(tmp_path / 'a-file')!r} is a file, not a directory",
    )
    # Under a file: the file is named, not the directory that is not there.
    under = tmp_path / "a-file" / "ck"
    with pytest.raises(FlowmeshError) as err:
        two.save(under, 0)
    assert (err.value.code, err.value.reason) == (
        Code.NOT_ALLOWED,
        f"checkpoint {str(under)!r}: {str(tmp_path / 'a-file')!r} is a file, not a directory",
    )
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "stage-0.safetensors").write_bytes(b"someone's data")
    with pytest.raises(FlowmeshError, match=NOT_OURS):
        two.save(odd, 0)
    assert files(odd) == {"stage-0.safetensors": b"someone's data"}


def _both(where: str, flow: int, pipe: int) -> str:
    return (
        f"{where} holds two checkpoints: a memory-flow job's of step {flow} (job.json, "
        f"state.safetensors) and a pipelined job's of step {pipe} over 2 stages "
        "(stage-K.safetensors), left by a save of one kind over the other that did not finish "
        "removing the other's files; which is newer is not known, so neither is resumed: remove "
        "the files of the one not wanted, or save into the directory again"
    )


def _refused_both_ways(ck: Path, flow: int, pipe: int) -> None:
    for resume in (read_meta, lambda d: load_checkpoint(flow_job(), d)):
        with pytest.raises(FlowmeshError) as err:
            resume(ck)
        assert (err.value.code, err.value.reason) == (
            Code.BAD_REQUEST, _both(f"checkpoint {str(ck)!r}", flow, pipe)
        )  # fmt: skip
    for resume in (read_pipe_meta, lambda d: Job("mlp", 2).resume(d)):
        with pytest.raises(FlowmeshError) as err:
            resume(ck)
        assert (err.value.code, err.value.reason) == (Code.BAD_REQUEST, _both(str(ck), flow, pipe))


@pytest.mark.parametrize("then", ["pipelined", "memory-flow"])
def test_a_directory_holding_both_kinds_resumes_neither_until_a_save_replaces_them(
    tmp_path: Path, then: str
) -> None:
    """A complete checkpoint of each kind in one directory (what a pipelined save over a
    memory-flow one left before saves removed the other kind's files): neither the step-5
    memory-flow one nor the step-2 pipelined one is resumed, either way; the next save of either
    kind goes over both and the directory resumes it alone."""
    flow, piped, ck = tmp_path / "flow", tmp_path / "piped", tmp_path / "ck"
    data = data_for("mlp", steps=5)
    flow_save(flow, data)
    two = Job("mlp", 2)
    two.train(data[:2])
    two.save_all(piped)
    ck.mkdir()
    for f in [*flow.iterdir(), *piped.iterdir()]:
        shutil.copy(f, ck / f.name)
    assert names(ck) == [META_FILE, *SETTLED, STATE_FILE]
    _refused_both_ways(ck, 5, 2)

    if then == "pipelined":
        two.train(data[2:3])
        two.save_all(ck)
        assert names(ck) == SETTLED
        back = Job("mlp", 2)
        back.resume(ck)
        assert back.step == 3
        same(back.state(), two.state())
    else:
        at_5 = flow_save(ck, data)
        assert names(ck) == FLOW
        assert flow_resume(ck, at_5) == 5


def test_a_removal_of_the_other_kind_cut_short_is_an_error_and_resumes_neither(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save of one kind over the other whose removal of the other's files fails (its
    permissions): the save is in place, it says the older checkpoint stays, and the directory
    is resumed neither way (never as the older save) until the next save removes it."""
    ck = tmp_path / "ck"
    data = data_for("mlp", steps=5)
    two = Job("mlp", 2)
    two.train(data[:2])
    two.save_all(ck)
    unlink = Path.unlink

    def refused(path: Path, missing_ok: bool = False) -> None:
        if path.name in (META_FILE, *SETTLED):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        unlink(path, missing_ok=missing_ok)

    with monkeypatch.context() as m:
        m.setattr(Path, "unlink", refused)
        with pytest.raises(FlowmeshError) as err:
            flow_save(ck, data)
    assert (err.value.code, err.value.reason) == (
        Code.IO_ERROR,
        f"checkpoint {str(ck)!r}: the save of step 5 is in place, but the pipelined checkpoint "
        "there could not be removed (Permission denied); a resume refuses the directory until "
        "its stage-*.safetensors files are removed",
    )
    assert names(ck) == [META_FILE, *SETTLED, STATE_FILE]
    _refused_both_ways(ck, 5, 2)
    at_5 = flow_save(ck, data)  # the next save removes them
    assert names(ck) == FLOW
    assert flow_resume(ck, at_5) == 5

    two.train(data[2:3])
    two.save(ck, 0)
    with monkeypatch.context() as m:
        m.setattr(Path, "unlink", refused)
        with pytest.raises(FlowmeshError) as err:
            two.save(ck, 1)
    assert (err.value.code, err.value.reason) == (
        Code.IO_ERROR,
        f"{ck}: the save of step 3 is complete, but the memory-flow checkpoint there could not "
        "be removed (its job.json: Permission denied); a resume refuses the directory until it "
        "is",
    )
    _refused_both_ways(ck, 5, 3)
    two.save_all(ck)
    assert names(ck) == SETTLED
    back = Job("mlp", 2)
    back.resume(ck)
    assert back.step == 3
    same(back.state(), two.state())
