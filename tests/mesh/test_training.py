"""Training jobs through a real mesh: a worker killed under a job, and `flowmesh jobs` (the
in-process scenarios are tests/scenarios/test_training.py).

Every training result is compared with the reference loop (`flowmesh.reference`) on the same
seed and data, with `torch.testing.assert_close` at rtol 1e-5 / atol 1e-6, never bit for bit.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from client_sdk import cli, errors
from client_sdk.mesh import LocalMesh
from tests.support.mesh import (
    FAST,
    roots_at,
)
from tests.support.training import (
    ADAM,
    TRAIN_BYTES,
    close,
    data,
    open_kw,
    plain,
    spec,
)


def test_a_killed_worker_fails_pending_steps_and_the_job_resumes_elsewhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s, batches = spec(7), data(7, 6)
    expected, _ = plain(s, ADAM, batches)
    ckpt = str(tmp_path / "ck")
    with (
        LocalMesh(
            cpu_workers=2,
            memory_budget="8MiB",
            train_bytes=TRAIN_BYTES,
            **roots_at(tmp_path),
            **FAST,
        ) as m,
        m.client(timeout=60) as c,
    ):
        job = c.train_open("fragile", s.factory, **open_kw(s, ADAM))
        home = job.info.worker
        first = [job.step(x, y) for x, y in batches[:2]]
        assert cli.main(["jobs", "--broker", m.frontend]) == 0  # the CLI's view of open jobs
        assert "fragile" in capsys.readouterr().out
        # The worker's measured figures crossed in its answers: rows, bytes copied per step.
        (row,) = c.jobs()
        assert row.samples == 2 * len(batches[0][1]) and row.step_bytes_in > 0 < row.bytes_out
        job.save(ckpt)
        m.child(home).proc.send_signal(signal.SIGSTOP)  # steps sent now stay pending
        pending = [job.step_async(x, y) for x, y in batches[2:4]]
        m.wait_until(lambda: True if c.jobs()[0].pending == 2 else None, "two pending steps", 10)
        m.kill(home)
        for fut in pending:
            with pytest.raises(errors.WorkerLost) as info:
                fut.result(30)
            assert "last saved at step 2" in info.value.reason
        assert c.jobs() == []
        again = c.train_open("fragile", s.factory, **{**open_kw(s, None), "resume": ckpt})
        assert again.info.worker != home and again.info.step == 2
        rest = [again.step(x, y) for x, y in batches[2:]]
    close([r.loss for r in first + rest], expected, "losses across the lost worker")


SMOOTHED = {"factory": "flowmesh.losses:label_smoothing", "kwargs": {"eps": 0.2}}
