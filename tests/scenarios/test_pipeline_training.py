"""Pipeline-parallel training through the mesh (issue 23 §2), on an in-process mesh of three
workers (tests/support/inproc.py: the real broker core, worker cores and hands, every message
through the real codec, the real SDK): the models and optimizers of the exactness table, with
and without a clip, opened with `pipeline=2` and `pipeline=3` and two micro-batches a step, all
48 jobs' steps in flight at once, each micro-batch's activations and gradients going worker to
worker. Per-step losses and the final tensors (read back from each job's checkpoint) equal a
plain PyTorch loop's on the same seeds and data, with `torch.testing.assert_close` at rtol 1e-5
/ atol 1e-6; the stages sit on distinct workers; what a pipelined job cannot do is refused,
and it saves and evaluates through its stages."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from client_sdk import errors, views
from flowmesh.modelio.build import build_seeded
from flowmesh.reference import train
from tests.support import training
from tests.support.inproc import InProcMesh
from tests.support.mesh import roots_at
from tests.support.torch_threads import one_thread  # noqa: F401 (fixture)
from tests.support.train_grid import ALLOW, ATOL, BATCH, MODELS, OPTIMIZERS, RNG_SEED, RTOL
from tests.support.train_grid import data_for as grid_data
from tests.support.training import teacher

TRAIN_BYTES = 4 << 20  # each stage resident: no memory flow

ACCUMULATE = 2  # the pipeline's micro-batches per step
STEPS = 8
CLIP = 0.2
# Every model and optimizer of the exactness table (tests/scenarios/test_training_exactness.py),
# with and without a clip, over 2 and 3 workers: 48 jobs.
CASES = [
    (model, opt, stages, clip)
    for model in MODELS
    for opt in OPTIMIZERS
    for clip in (None, CLIP)
    for stages in (2, 3)
]


def plain(model: str, opt: str, clip: float | None, data: Any) -> tuple[list[float], Any]:
    net = build_seeded(MODELS[model], ALLOW)
    losses = train(net, OPTIMIZERS[opt], data, clip=clip, accumulate=ACCUMULATE,
                   rng_seed=RNG_SEED)  # fmt: skip
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}


async def run(mesh: InProcMesh, data: dict[str, Any], out: Path) -> list[Any]:
    async with mesh.async_client(timeout=600.0) as client:

        async def one(i: int, case: tuple[Any, ...]) -> Any:
            model, opt, stages, clip = case
            s = MODELS[model]
            job = await client.train_open(
                f"p{i}-{model}", s.factory, kwargs=s.kwargs, seed=s.seed,
                optimizer=OPTIMIZERS[opt], batch_size=BATCH, clip_grad_norm=clip,
                accumulate=ACCUMULATE, rng_seed=RNG_SEED, pipeline=stages, timeout=600.0,
            )  # fmt: skip
            steps = [job.step_async(x, y, timeout=600.0) for x, y in data[model]]
            results = await asyncio.gather(*steps)
            await job.save(str(out / f"p{i}"), timeout=600.0)
            info = job.info
            await job.close()
            state: dict[str, torch.Tensor] = {}
            for f in sorted((out / f"p{i}").glob("stage-*.safetensors")):
                state.update({k: v for k, v in load_file(str(f)).items() if "/" not in k})
            return info, results, state

        return await asyncio.gather(*(one(i, c) for i, c in enumerate(CASES)))


def rel(a: torch.Tensor, e: torch.Tensor) -> float:
    a, e = a.double(), e.double()
    scale = float(e.abs().max()) if e.numel() else 0.0
    diff = float((a - e).abs().max()) if e.numel() else 0.0
    return diff / scale if scale > 0 else diff


def test_pipelined_jobs_through_the_mesh_equal_plain_pytorch(tmp_path: Path) -> None:
    """The pipeline exactness table: `pytest -s` prints it (model x optimizer x stages x clip
    -> max relative difference of the losses and of the final tensors); it is also written to
    `$FLOWMESH_PIPELINE_TABLE` when that is set."""
    pytest.importorskip("transformers")
    data = {m: grid_data(m, seed=60 + i)[:STEPS] for i, m in enumerate(MODELS)}
    with InProcMesh(
        cpu_workers=3, memory_budget="8MiB", train_bytes=TRAIN_BYTES, allow=ALLOW,
        **roots_at(tmp_path),
    ) as mesh:  # fmt: skip
        got = asyncio.run(run(mesh, data, tmp_path))
    plains = {}
    rows, failures = [], []
    for (model, opt, stages, clip), (info, results, state) in zip(CASES, got, strict=True):
        name = f"{model}/{opt}/p{stages}/clip{clip}"
        assert len(info.pipeline) == len(set(info.pipeline)) == stages, info.pipeline
        assert info.worker == info.pipeline[0] and len(info.sub_models) == stages
        blocks = [r.blocks for r in info.sub_models]
        assert blocks[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(blocks))
        assert [r.step for r in results] == list(range(1, STEPS + 1))
        if (model, opt, clip) not in plains:
            plains[(model, opt, clip)] = plain(model, opt, clip, data[model])
        want, want_state = plains[(model, opt, clip)]
        got_losses = torch.tensor([r.loss for r in results], dtype=torch.float64)
        expect = torch.tensor(want, dtype=torch.float64)
        loss_rel = float(((got_losses - expect).abs() / expect.abs()).max())
        problems = []
        try:
            torch.testing.assert_close(got_losses.tolist(), want, rtol=RTOL, atol=ATOL)
        except AssertionError as exc:
            problems.append(f"losses: {str(exc).splitlines()[0]}")
        params = {n for n, _ in build_seeded(MODELS[model], ALLOW).named_parameters()}
        if params - set(state):
            problems.append(f"tensors missing from the checkpoint: {sorted(params - set(state))}")
        param_rel = 0.0
        for n in sorted(set(state) & set(want_state)):
            if want_state[n].is_floating_point():
                param_rel = max(param_rel, rel(state[n], want_state[n]))
            try:
                torch.testing.assert_close(state[n], want_state[n], rtol=RTOL, atol=ATOL)
            except AssertionError as exc:
                problems.append(f"{n}: {str(exc).splitlines()[0]}")
        if clip is not None and not any(r.metrics["grad_norm"] > clip for r in results):
            problems.append(f"the clip at {clip} was never exercised")
        # Forwards one after the other only where the model draws random numbers.
        serial = [r.metrics["serial_forwards"] for r in results]
        draws = model in ("gpt-dropout", "hf-gpt2-tied")
        if serial != ([1.0] * STEPS if draws else [1.0] + [0.0] * (STEPS - 1)):
            problems.append(f"forwards one after the other: {serial}")
        rows.append(
            [
                model,
                opt,
                str(stages),
                "-" if clip is None else f"{clip:g}",
                f"{loss_rel:.1e}",
                f"{param_rel:.1e}",
                "ok" if not problems else "FAIL",
            ]
        )
        if problems:
            failures.append(f"{name}: " + "; ".join(problems[:3]))
    header = ["model", "optimizer", "stages", "clip", "losses rel", "params rel", ""]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in [header, *rows]]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    text = (
        f"pipelined training through the mesh: {len(CASES)} jobs x {STEPS} steps of "
        f"{ACCUMULATE} micro-batches vs plain PyTorch (assert_close rtol {RTOL:g}, atol "
        f"{ATOL:g}); 'rel' = max |mesh - plain| / |plain| per loss, and per tensor relative to "
        "its largest |plain| value\n" + "\n".join(lines)
    )
    print("\n" + text)
    if os.environ.get("FLOWMESH_PIPELINE_TABLE"):
        Path(os.environ["FLOWMESH_PIPELINE_TABLE"]).write_text(text + "\n")
    assert not failures, f"{len(failures)} of {len(CASES)} jobs differ:\n" + "\n".join(failures)


def test_a_pipelined_job_is_refused_what_it_cannot_do_and_saves_and_evaluates(
    tmp_path: Path,
) -> None:
    s = MODELS["mlp"]
    with InProcMesh(
        cpu_workers=2, memory_budget="8MiB", train_bytes=TRAIN_BYTES, allow=ALLOW,
        **roots_at(tmp_path),
    ) as mesh, mesh.client(timeout=60) as c:  # fmt: skip
        kw: dict[str, Any] = {"kwargs": s.kwargs, "seed": s.seed, "optimizer": {"name": "sgd",
                              "lr": 0.1}, "batch_size": BATCH}  # fmt: skip
        with pytest.raises(errors.Unavailable, match="needs 3 ready workers"):
            c.train_open("three", s.factory, pipeline=3, **kw)
        with pytest.raises(errors.BadRequest, match="does not split into 3 micro-batches"):
            c.train_open("uneven", s.factory, pipeline=2, accumulate=3, **kw)
        job = c.train_open("two", s.factory, pipeline=2, **kw)
        x, y = grid_data("mlp", 0)[0]
        # More rows than it was opened for: refused, as a memory-flow job refuses them.
        with pytest.raises(errors.BadRequest, match=f"a batch of {2 * BATCH} is over the batch"):
            job.step(torch.cat([x, x]), torch.cat([y, y]))
        assert job.step(x, y).step == 1
        # Each stage's worker names the job in its inventory, with its stage's footprint; stage
        # 0's, where the steps go, with their answers too (what a restarted broker takes up).
        for stage, w in enumerate(job.info.pipeline):
            (held,) = mesh.worker(w).hands.inventory().jobs
            footprint = job.info.sub_models[stage].task_bytes
            assert (held.name, held.step, held.footprint) == ("two", 1, footprint)
            assert held.sub_models == [job.info.sub_models[stage]]
            # (Seq 1 was the refused step: taken, never run.)
            assert [(r.seq, r.step) for r in held.results] == ([(2, 1)] if stage == 0 else [])
            assert held.seq == (2 if stage == 0 else 0) and held.running == []
        assert job.save(str(tmp_path / "ck"))["step"] == 1
        assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
            "stage-0.safetensors",
            "stage-1.safetensors",
        ]
        # A checkpoint resumes the way it was saved, and says so when asked the other way.
        resumed = {k: v for k, v in kw.items() if k != "optimizer"}
        with pytest.raises(errors.BadRequest, match="is a pipelined job's checkpoint: resume"):
            c.train_open("flow", s.factory, resume=str(tmp_path / "ck"), **resumed)
        flow = c.train_open("flow", s.factory, **kw)
        flow.step(x, y)
        flow.save(str(tmp_path / "flow-ck"))
        flow.close()
        with pytest.raises(errors.BadRequest, match="memory-flow job's checkpoint, resume it"):
            c.train_open("piped", s.factory, resume=str(tmp_path / "flow-ck"), pipeline=2,
                         **resumed)  # fmt: skip
        # An evaluation through both stages: the model's held-out loss, nothing changed.
        first, again_ = job.eval(x, y), job.eval(x, y)
        assert first.loss == again_.loss and first.step == 1 and "accuracy" in first.metrics
        assert [j.pipeline for j in c.jobs()] == [job.info.pipeline]
        job.close()
        assert c.jobs() == []
        # Closed on both workers: the name opens again.
        again = c.train_open("two", s.factory, pipeline=2, **kw)
        assert again.step(x, y).step == 1


def test_a_stage_over_its_workers_training_bytes_is_refused_and_nothing_is_left(
    tmp_path: Path,
) -> None:
    s = MODELS["mlp"]
    big = {**s.kwargs, "width": 256}  # about 1 MiB a stage with Adam's state: over 512 KiB
    with InProcMesh(
        cpu_workers=2, memory_budget="8MiB", train_bytes=512 << 10, allow=ALLOW,
        **roots_at(tmp_path),
    ) as mesh, mesh.client(timeout=60) as c:  # fmt: skip
        kw: dict[str, Any] = {"seed": s.seed, "optimizer": {"name": "adam", "lr": 0.01},
                              "batch_size": BATCH}  # fmt: skip
        with pytest.raises(errors.TooBig, match=r"training bytes of worker .*more stages"):
            c.train_open("big", s.factory, kwargs=big, pipeline=2, **kw)
        assert c.jobs() == []
        mesh.wait_until(
            lambda: all(not w.hands.pipes for w in mesh.workers) or None, "stages closed", 10
        )
        small = c.train_open("big", s.factory, kwargs=s.kwargs, pipeline=2, **kw)
        assert small.step(*grid_data("mlp", 0)[0]).step == 1


def test_a_sweep_runs_its_trials_as_pipelined_jobs(tmp_path: Path) -> None:
    """`sweep(pipeline=2)`: every trial's job over both workers, evaluated through its stages
    for the pruner, each trial with its held-out loss."""
    opened: list[list[str]] = []
    with InProcMesh(
        cpu_workers=2, memory_budget="8MiB", train_bytes=TRAIN_BYTES, allow=ALLOW,
        **roots_at(tmp_path),
    ) as mesh:  # fmt: skip

        async def main() -> Any:
            async with mesh.async_client(timeout=120) as c:
                train_open = c.train_open

                async def recorded(*args: Any, **kw: Any) -> Any:  # the jobs the sweep opens
                    job = await train_open(*args, **kw)
                    opened.append(job.info.pipeline)
                    return job

                c.train_open = recorded  # type: ignore[method-assign]
                return await c.sweep(
                    name="piped", factory="flowmesh.examples:mlp",
                    space={"lr": {"type": "float", "low": 1e-3, "high": 0.1, "log": True}},
                    data=teacher(), trials=3, steps=4, eval_every=2, concurrency=2,
                    kwargs={"width": 16, "depth": 2, "in_features": 8, "out_features": 4},
                    optimizer={"name": "adam"}, batch=16, pipeline=2, show=False,
                    out_dir=tmp_path / "out",
                )  # fmt: skip

        result = asyncio.run(main())
    assert len(result.trials) == 3 and len(opened) == 3
    assert all(t.evals and t.state in ("COMPLETE", "PRUNED") for t in result.trials), result.trials
    assert all(len(p) == 2 and len(set(p)) == 2 for p in opened), opened
    # trials.json says where each trial's job trained: its stages' workers.
    saved = json.loads((tmp_path / "out" / "trials.json").read_text())
    assert sorted(t["workers"] for t in saved["trials"]) == sorted(opened)


def test_auto_pipelines_a_job_no_worker_holds_and_leaves_one_that_fits_to_one_worker(
    tmp_path: Path,
) -> None:
    """`pipeline="auto"`: a job of about 58 KiB with Adam's state, on workers of 40 KiB of
    training bytes each, is planned by the partitioner into two stages on the two most free
    workers, and trains as plain PyTorch does; a small job fits one worker whole and is left
    to it, the most free one left."""
    big, batches = training.spec(11), training.data(11, 4)
    expected, _ = training.plain(big, training.ADAM, batches, accumulate=2)
    small = training.spec(12)
    small = msgspec.structs.replace(small, kwargs={**small.kwargs, "width": 8})
    with InProcMesh(
        cpu_workers=3, memory_budget="8MiB", train_bytes=40 << 10, allow=ALLOW,
        **roots_at(tmp_path),
    ) as mesh, mesh.client(timeout=60) as c:  # fmt: skip

        def open_auto(name: str, s: Any) -> Any:
            return c.train_open(name, s.factory, kwargs=s.kwargs, seed=s.seed, pipeline="auto",
                                optimizer=training.ADAM, batch_size=training.BATCH,
                                accumulate=2)  # fmt: skip

        job = open_auto("big", big)
        assert len(set(job.info.pipeline)) == 2 and job.info.worker == job.info.pipeline[0]
        training.close([job.step(x, y).loss for x, y in batches], expected, "auto-pipelined")
        other = open_auto("small", small)
        assert other.info.pipeline == [] and other.info.worker not in job.info.pipeline
        assert {j.name: j.state for j in c.jobs()} == {"big": "ready", "small": "ready"}


def test_pipelined_stages_share_their_workers_training_bytes(tmp_path: Path) -> None:
    """A worker's pipelined stages stay resident: together they hold at most its training
    bytes, in its arena (their parameters and optimizer state, in a range held for the job's
    life, given back at close). A second job of the same size pipelined on the same two workers
    is refused too_big, saying beside what; with `pipeline="auto"` it goes to one worker by
    memory flow instead, and trains in what the held range leaves."""
    s = training.spec(13)
    kw = {"kwargs": s.kwargs, "seed": s.seed, "optimizer": training.ADAM,
          "batch_size": training.BATCH, "accumulate": 2}  # fmt: skip
    with InProcMesh(
        cpu_workers=2, memory_budget="8MiB", train_bytes=40 << 10, allow=ALLOW,
        **roots_at(tmp_path),
    ) as mesh, mesh.client(timeout=60) as c:  # fmt: skip
        first = c.train_open("first", s.factory, pipeline=2, **kw)
        # Status shows what they hold on each worker, and the arena range it lives in.
        held = {w: r.task_bytes for w, r in zip(first.info.pipeline, first.info.sub_models,
                                                 strict=True)}  # fmt: skip

        def piped() -> Any:
            st = c.status()
            got = {w.name: (w.stats.pipe_stages, w.stats.pipe_bytes) for w in st.workers}
            in_arena = all(0 < w.stats.training_held < held[w.name] for w in st.workers)
            return st if in_arena and got == {w: (1, b) for w, b in held.items()} else None

        st = mesh.wait_until(piped, "the workers' heartbeats to count their stages")
        in_arena = {w.name: w.stats.training_held for w in st.workers}
        text = views.format_status(st)
        for w, b in held.items():
            assert f"{w} training: " in text
            assert f"pipelined stages 1 holding {views.fmt_bytes(b)}" in text, text
        with pytest.raises(errors.TooBig, match=r"beside the .* of its other pipelined stages"):
            c.train_open("second", s.factory, pipeline=2, **kw)
        other = c.train_open("second", s.factory, pipeline="auto", **kw)
        assert other.info.pipeline == [] and len(first.info.pipeline) == 2
        x, y = training.data(13, 1)[0]
        assert first.step(x, y).step == 1 and other.step(x, y).step == 1
        other.close()
        first.close()
        # Opened right after the close, its stages take the ranges the closed one gave back.
        again = c.train_open("again", s.factory, pipeline=2, **kw)
        assert again.info.pipeline == first.info.pipeline

        def held_again() -> Any:
            st = c.status()
            got = {w.name: w.stats.training_held for w in st.workers}
            return got if all(w.stats.pipe_stages == 1 for w in st.workers) else None

        assert mesh.wait_until(held_again, "the new job's stages") == in_arena
        assert again.step(x, y).step == 1
        again.close()
        mesh.wait_until(
            lambda: all(w.stats.training_held == 0 for w in c.status().workers) or None,
            "the closed job's stages to give their arena ranges back",
        )
