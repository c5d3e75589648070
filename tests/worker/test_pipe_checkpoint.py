"""Pipelined checkpoints on disk (`gpu_worker.pipe_checkpoint`), with real stages stepped in
process and real files: each stage's worker writes its part with no commit between them, so a
job resumed cut into fewer stages saves over its checkpoint, a save that fails on one stage
after another put its file in place leaves the last complete save to resume from, and two
saves' files never mix; a directory settles to one file per stage once a save is complete, and
one the writer before per-save keys left reads its complete save. What a resume reads equals
what was saved bit for bit (tensors, optimizer state, RNG state)."""

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
from gpu_worker import pipe_checkpoint
from gpu_worker.pipe_checkpoint import load_stage, read_pipe_meta, save_stage
from gpu_worker.pipe_stage import job_rng, step_in_process
from gpu_worker.train_config import TrainConfig
from gpu_worker.train_job import RngState
from tests.support.torch_threads import one_thread  # noqa: F401 (fixture)
from tests.support.train_cases import Data, data_for, pipe_stages

CFG = TrainConfig({"name": "adam", "lr": 0.01}, accumulate=2, seed=21)
SETTLED = ["stage-0.safetensors", "stage-1.safetensors"]


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
    two = Job("mlp", 2)
    two.train(data[:2])
    two.save_all(ck)
    at_2, rng_2 = two.state(), two.rng
    two.train(data[2:4])
    two.save(ck, 0)
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
