"""Through an in-process mesh (tests/support/inproc.py): a client's paths reach only under the
workers' and the partitioner's roots. Weights, a Hugging Face directory, a checkpoint to resume
or to save outside them are refused with not_allowed, naming the roots and quoting nothing, and
nothing is created there."""

from __future__ import annotations

from pathlib import Path

import pytest

from client_sdk import errors
from tests.support.inproc import InProcMesh

KIB = 1 << 10
MLP = {"width": 32, "depth": 3, "in_features": 8, "out_features": 5}


def test_paths_outside_the_roots_are_refused(tmp_path: Path) -> None:
    data, ckpt = tmp_path / "data", tmp_path / "ckpt"
    data.mkdir()
    roots = f"({data}, {ckpt}; an operator adds one with --data-root or --checkpoint-root)"
    with (
        InProcMesh(
            cpu_workers=1,
            memory_budget="8MiB",
            train_bytes=96 * KIB,
            data_roots=[data],
            checkpoint_roots=[ckpt],
        ) as mesh,
        mesh.client(timeout=60) as c,
    ):
        with pytest.raises(errors.NotAllowed) as shadow:
            c.deploy("shadow", "flowmesh.examples:mlp", kwargs=MLP, weights="/etc/shadow")
        assert shadow.value.reason.endswith(  # after the broker's "worker worker-0: "
            "worker worker-0 refused weights '/etc/shadow': it reads only under its data and "
            f"checkpoint roots {roots}"
        )
        with pytest.raises(errors.NotAllowed) as plan:
            c.plan(hf="/etc")
        assert plan.value.reason.startswith("partitioner partitioner-0 refused hf directory")

        job = c.train_open(
            "j", "flowmesh.examples:mlp", kwargs=MLP, seed=0,
            optimizer={"name": "sgd", "lr": 0.1}, batch_size=4, timeout=60,
        )  # fmt: skip
        for path in (f"{ckpt}/../elsewhere/x", str(tmp_path / "elsewhere" / "a" / "b")):
            with pytest.raises(errors.NotAllowed) as save:
                job.save(path)
            assert save.value.reason == (
                f"worker worker-0 refused checkpoint {path!r}: it writes only under its "
                f"checkpoint roots ({ckpt}; an operator adds one with --data-root or "
                "--checkpoint-root)"
            )
        assert not (tmp_path / "elsewhere").exists()
        assert job.save(str(ckpt / "run"))["step"] == 0  # inside: saved, its parents made
        with pytest.raises(errors.NotAllowed):
            c.train_open("k", "flowmesh.examples:mlp", kwargs=MLP, resume="/etc", batch_size=4)
