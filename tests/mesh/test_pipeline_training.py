"""A pipelined training job through a real mesh (issue 23 §2): three worker processes, the
job's stages one on each, every hop over the workers' own peer sockets. Its losses equal plain
PyTorch's (`torch.testing.assert_close`, rtol 1e-5 / atol 1e-6); a stage's worker killed under
pending steps fails them `worker_lost`, saying no checkpoint was saved, and the workers left
hold nothing of the job (the name opens again on them); `flowmesh train --pipeline 2` trains
on the two left. The in-process grid of models is tests/scenarios/test_pipeline_training.py."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from client_sdk import cli, errors
from client_sdk.mesh import LocalMesh
from tests.support.mesh import FAST, roots_at
from tests.support.training import ADAM, BATCH, close, data, plain, spec

TRAIN_BYTES = 1 << 20


def test_a_job_over_three_workers_trains_exactly_and_fails_cleanly_when_one_is_lost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s, batches = spec(9), data(9, 8)
    expected, _ = plain(s, ADAM, batches[:5], clip=0.5, accumulate=2)
    kw = {"kwargs": s.kwargs, "seed": s.seed, "optimizer": ADAM, "batch_size": BATCH,
          "clip_grad_norm": 0.5, "accumulate": 2, "timeout": 60}  # fmt: skip
    with (
        LocalMesh(
            cpu_workers=3, memory_budget="8MiB", train_bytes=TRAIN_BYTES, **roots_at(tmp_path),
            **FAST,
        ) as m,
        m.client(timeout=60) as c,
    ):  # fmt: skip
        job = c.train_open("piped", s.factory, pipeline=3, **kw)
        workers = job.info.pipeline
        assert len(set(workers)) == 3 and job.info.worker == workers[0]
        losses = [job.step(x, y).loss for x, y in batches[:5]]
        close(losses, expected, "losses over three workers")
        (row,) = c.jobs()
        assert row.pipeline == workers and row.step == 5

        # The middle stage's worker stops: the steps sent now wait on it; then it dies.
        m.child(workers[1]).proc.send_signal(signal.SIGSTOP)
        pending = [job.step_async(x, y) for x, y in batches[5:7]]
        m.wait_until(lambda: True if c.jobs()[0].pending == 2 else None, "two pending steps", 10)
        m.kill(workers[1])
        for fut in pending:
            with pytest.raises(errors.WorkerLost) as info:
                fut.result(30)
            assert f"worker {workers[1]} was lost" in info.value.reason
            assert "saved no checkpoint" in info.value.reason
        assert c.jobs() == []
        # Its other stages were closed: the name opens again on the two workers left.
        again = c.train_open("piped", s.factory, pipeline=2, **kw)
        assert set(again.info.pipeline) == {workers[0], workers[2]}
        assert again.step(*batches[0]).step == 1
        again.close()
        # The same from the command line: `flowmesh train --pipeline 2`.
        args = ["train", s.factory, "--kwargs", json.dumps(s.kwargs), "--steps", "3", "--batch",
                str(BATCH), "--accumulate", "2", "--pipeline", "2", "--samples", "24", "--json",
                "--name", "cli-piped", "--broker", m.frontend]  # fmt: skip
        capsys.readouterr()
        assert cli.main(args) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["steps"] == 3 and len(out["losses"]) == 3
