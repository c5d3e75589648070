"""A pipelined training job through a real mesh (issue 23 §2): three worker processes, the
job's stages one on each, every hop over the workers' own peer sockets. Its losses equal plain
PyTorch's (`torch.testing.assert_close`, rtol 1e-5 / atol 1e-6); a stage's worker killed under
pending steps fails them `worker_lost`, naming the last checkpoint, the workers left hold
nothing of the job, and the job resumes from the checkpoint on them, cut into two stages, to
the same losses; `flowmesh train --pipeline 2` trains on the two left, and `--pipeline auto`
pipelines a job neither holds whole. The in-process grid of
models is tests/scenarios/test_pipeline_training.py."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest
from safetensors.torch import save_file

from client_sdk import cli, errors
from client_sdk.mesh import LocalMesh
from flowmesh.modelio.build import build_seeded
from tests.support.lm import tiny_lm_dir
from tests.support.mesh import FAST, roots_at
from tests.support.training import ADAM, BATCH, close, data, plain, spec

TRAIN_BYTES = 1 << 20


def test_a_job_over_three_workers_trains_exactly_and_fails_cleanly_when_one_is_lost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s, batches = spec(9), data(9, 8)
    expected, _ = plain(s, ADAM, batches, clip=0.5, accumulate=2)
    ckpt = str(tmp_path / "ck")
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
        losses = [job.step(x, y).loss for x, y in batches[:3]]
        assert job.save(ckpt) == {"path": ckpt, "step": 3}
        losses += [job.step(x, y).loss for x, y in batches[3:5]]
        close(losses, expected[:5], "losses over three workers")
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
            assert f"last saved at step 3 to {ckpt!r}" in info.value.reason
        assert c.jobs() == []
        # Its other stages were closed: it resumes from the checkpoint on the two workers left,
        # cut into two stages, and goes on as if nothing had happened after step 3.
        again = c.train_open("piped", s.factory, pipeline=2, resume=ckpt,
                             **{**kw, "optimizer": None})  # fmt: skip
        assert set(again.info.pipeline) == {workers[0], workers[2]} and again.info.step == 3
        assert again.info.config.clip_grad_norm == 0.5  # the checkpoint's configuration
        rest = [again.step(x, y) for x, y in batches[3:]]
        assert [r.step for r in rest] == [4, 5, 6, 7, 8]
        close([r.loss for r in rest], expected[3:], "losses after the resume")
        again.close()
        # The same from the command line: `flowmesh train --pipeline 2`.
        args = ["train", s.factory, "--kwargs", json.dumps(s.kwargs), "--steps", "3", "--batch",
                str(BATCH), "--accumulate", "2", "--pipeline", "2", "--samples", "24", "--json",
                "--name", "cli-piped", "--broker", m.frontend]  # fmt: skip
        capsys.readouterr()
        assert cli.main(args) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["steps"] == 3 and len(out["losses"]) == 3 and len(out["pipeline"]) == 2
        # `--pipeline auto`, with the real partitioner: a job of about 1.2 MiB with Adam's
        # state fits neither worker's 1 MiB of training bytes whole, and two stages do.
        wide = {**s.kwargs, "width": 160}
        args[args.index("--kwargs") + 1] = json.dumps(wide)
        args[args.index("--pipeline") + 1] = "auto"
        args[args.index("--name") + 1] = "cli-auto"
        assert cli.main(args) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["steps"] == 3 and sorted(out["pipeline"]) == sorted({workers[0], workers[2]})
        # A Hugging Face directory in place of a factory: `flowmesh train --hf DIR`.
        lm_dir = tiny_lm_dir(tmp_path / "tiny-llama", "llama", seed=3, max_positions=32)
        hf_args = ["train", "--hf", str(lm_dir), "--steps", "2", "--batch", "4", "--seq", "8",
                   "--pipeline", "2", "--json", "--name", "cli-hf",
                   "--broker", m.frontend]  # fmt: skip
        assert cli.main(hf_args) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["steps"] == 2 and len(out["pipeline"]) == 2
        assert all(math.isfinite(v) for v in out["losses"])
        # A weights file to start from: `--weights` (its --seed the random stream's alone).
        weights = tmp_path / "w.safetensors"
        save_file(build_seeded(s).state_dict(), str(weights))
        w_args = [*args[:args.index("--name")], "--name", "cli-w", "--weights", str(weights),
                  "--broker", m.frontend]  # fmt: skip
        w_args[w_args.index("--kwargs") + 1] = json.dumps(s.kwargs)
        assert cli.main(w_args) == 0
        assert json.loads(capsys.readouterr().out)["steps"] == 3


def test_a_pipelined_job_goes_on_across_a_broker_restart(tmp_path: Path) -> None:
    """The broker killed (SIGKILL) and started again on its state directory: the job it kept
    waits for both stages' workers, then goes on with the losses of an uninterrupted run; a
    step sent to the frozen broker is sent again by the client and run once."""
    s, batches = spec(10), data(10, 6)
    expected, _ = plain(s, ADAM, batches, accumulate=2)
    kw = {"kwargs": s.kwargs, "seed": s.seed, "optimizer": ADAM, "batch_size": BATCH,
          "accumulate": 2, "timeout": 60}  # fmt: skip
    with (
        LocalMesh(
            cpu_workers=2, memory_budget="8MiB", train_bytes=TRAIN_BYTES,
            broker_args=["--state-dir", str(tmp_path / "state")], run_dir=tmp_path / "run",
            **roots_at(tmp_path), **FAST,
        ) as m,
        m.client(timeout=60) as c,
    ):  # fmt: skip
        job = c.train_open("kept", s.factory, pipeline=2, **kw)
        workers = job.info.pipeline
        losses = [job.step(x, y).loss for x, y in batches[:2]]
        m.restart_broker()
        (row,) = c.jobs()
        assert (row.name, row.state, row.pipeline, row.step) == ("kept", "ready", workers, 2)
        losses += [job.step(x, y).loss for x, y in batches[2:4]]
        # A step sent while the broker is frozen, then killed: its client sends it again to the
        # broker that restarted, which holds it until the job's workers are back.
        m.child("broker").proc.send_signal(signal.SIGSTOP)
        pending = job.step_async(*batches[4])
        m.restart_broker(wait=False)
        assert pending.result(60).step == 5
        losses.append(pending.result().loss)
        losses.append(job.step(*batches[5]).loss)
        close(losses, expected, "losses across two broker restarts")
        assert c.jobs()[0].step == 6
        job.close()
        assert c.jobs() == []
