"""Training jobs through an in-process mesh (tests/support/inproc.py: one CPU worker).

Every training result is compared with the reference loop (`flowmesh.reference`) on the same
seed and data, with `torch.testing.assert_close` at rtol 1e-5 / atol 1e-6, never bit for bit.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from client_sdk import errors
from flowmesh.modelio.build import build_seeded
from flowmesh.reference import train
from flowmesh.reports import JobRow
from flowmesh.spec import ModelSpec
from tests.support.inproc import InProcMesh
from tests.support.mesh import (
    deploy,
    fresh_stats,
    mesh_options,
    mlp_spec,
    reference,
)
from tests.support.training import (
    ADAM,
    ADAMW,
    ALLOW_MODULES,
    BATCH,
    STEPS,
    TRAIN_BYTES,
    close,
    data,
    open_kw,
    plain,
    saved_state,
    spec,
)

pytestmark = mesh_options(cpu_workers=1, train_bytes=TRAIN_BYTES, allow=ALLOW_MODULES)


def test_job_through_the_mesh_equals_plain_pytorch(mesh: InProcMesh, tmp_path: Path) -> None:
    s, batches = spec(1), data(1)
    expected, params = plain(s, ADAMW, batches)
    with mesh.client(timeout=60) as c:
        job = c.train_open("exact", s.factory, **open_kw(s, ADAMW))
        assert len(job.info.sub_models) >= 2 and job.info.worker == "worker-0"
        results = [job.step(x, y) for x, y in batches]
        listed = {j.name: j for j in c.jobs()}
        saved = job.save(str(tmp_path / "ckpt"))
        job.close()
        assert "exact" not in {j.name for j in c.jobs()}
    close([r.loss for r in results], expected, "per-step losses")
    assert [r.step for r in results] == list(range(1, STEPS + 1))
    assert listed["exact"].step == STEPS and listed["exact"].last_loss == results[-1].loss
    assert saved["step"] == STEPS
    got = saved_state(saved["path"])
    assert set(got) == set(params)
    for name, t in params.items():
        close(got[name], t, f"parameter {name} after training")


def test_two_jobs_concurrently_while_serving(mesh: InProcMesh, tmp_path: Path) -> None:
    jobs = {"a": (spec(2), ADAMW, data(2)), "b": (spec(3), ADAM, data(3))}
    solo = {n: plain(s, o, d)[0] for n, (s, o, d) in jobs.items()}
    served = mlp_spec("served", width=64, depth=2, seed=4)
    forward = reference(served)
    with mesh.client(timeout=60) as c:
        deploy(c, served)
    queries = [torch.randn(2, 64, generator=torch.Generator().manual_seed(i)) for i in range(6)]

    async def run() -> tuple[dict[str, list[Any]], list[Any], list[JobRow]]:
        async with mesh.async_client(timeout=60) as ac:
            opened = {
                n: await ac.train_open(f"flow-{n}", s.factory, **open_kw(s, o))
                for n, (s, o, _) in jobs.items()
            }
            infos = [j.info for j in opened.values()]
            # Every step of both jobs in flight at once, inference requests among them.
            steps = {
                n: [asyncio.ensure_future(opened[n].step_async(x, y)) for x, y in d]
                for n, (_, _, d) in jobs.items()
            }
            answers = await asyncio.gather(*(ac.infer("served", q) for q in queries))
            results = {n: await asyncio.gather(*fs) for n, fs in steps.items()}
            for j in opened.values():
                await j.close()
            return results, answers, infos

    results, answers, infos = asyncio.run(run())
    assert sum(i.footprint for i in infos) > TRAIN_BYTES, "the jobs must not fit together"
    for n, rs in results.items():
        close([r.loss for r in rs], solo[n], f"job {n} vs its solo run")
        assert [r.step for r in rs] == list(range(1, STEPS + 1)), "steps out of order"
    for q, out in zip(queries, answers, strict=True):
        close(out, forward(q), "inference beside training")
    with mesh.client(timeout=60) as c:
        stats = fresh_stats(c, "worker-0")
    assert stats.train_budget_bytes == TRAIN_BYTES
    assert 0 < stats.train_resident_peak <= stats.arena_bytes  # one arena, borrowed


def test_a_bad_step_fails_alone(mesh: InProcMesh) -> None:
    s, batches = spec(5), data(5, 3)
    expected, _ = plain(s, ADAMW, [batches[0], batches[2]])
    with mesh.client(timeout=60) as c:
        job = c.train_open("bad", s.factory, **open_kw(s, ADAMW))
        first = job.step(*batches[0])
        x, y = batches[1]
        with pytest.raises(errors.BadRequest) as info:
            job.step(x, y[:3])  # 3 targets for a batch of 8
        assert "targets have 3 rows" in info.value.reason
        after = job.step(*batches[2])
        (row,) = [j for j in c.jobs() if j.name == "bad"]
        job.close()
    close([first.loss, after.loss], expected, "losses around the failed step")
    assert after.step == 2 and row.errors == 1


def test_save_close_resume_continues_the_same_run(mesh: InProcMesh, tmp_path: Path) -> None:
    s, batches = spec(6), data(6)
    expected, params = plain(s, ADAM, batches)
    half = STEPS // 2
    ckpt = str(tmp_path / "half")
    with mesh.client(timeout=60) as c:
        job = c.train_open("resumable", s.factory, **open_kw(s, ADAM))
        first = [job.step(x, y) for x, y in batches[:half]]
        assert job.save(ckpt)["step"] == half
        job.close()
        # Other init seed: everything must come from the checkpoint; optimizer from its config.
        again = c.train_open(
            "resumable", s.factory, **{**open_kw(s, None), "seed": 99, "resume": ckpt}
        )
        assert again.info.step == half
        rest = [again.step(x, y) for x, y in batches[half:]]
        final = again.save(str(tmp_path / "end"))
        again.close()
    close([r.loss for r in first + rest], expected, "losses across the resume")
    assert [r.step for r in rest] == list(range(half + 1, STEPS + 1))
    got = saved_state(final["path"])
    for name, t in params.items():
        close(got[name], t, f"parameter {name} after resuming")


def test_a_job_with_keyword_inputs_equals_plain_pytorch(mesh: InProcMesh) -> None:
    """A model taking two keyword inputs (`x`, `mask`), trained with accumulation and evaluated;
    a batch that lacks one of them, or names one 'targets', is refused and the job goes on."""
    s = ModelSpec(name="gated", factory="tests.support.train_models:gated_mlp", seed=6)
    g = torch.Generator().manual_seed(6)
    batches = [
        (
            {"x": torch.randn(BATCH, 8, generator=g), "mask": torch.rand(BATCH, 4, generator=g)},
            torch.randint(0, 5, (BATCH,), generator=g),
        )
        for _ in range(4)
    ]
    (hx, hy), ahead = batches[-1], batches[:-1]
    model = build_seeded(s, ALLOW_MODULES)
    expected = train(model, ADAMW, ahead, accumulate=2)
    with torch.no_grad():
        held_loss = F.cross_entropy(model(**hx), hy).item()
    with mesh.client(timeout=60) as c:
        job = c.train_open("gated", s.factory, **{**open_kw(s, ADAMW), "accumulate": 2})
        losses = [job.step(x, y).loss for x, y in ahead[:2]]
        with pytest.raises(errors.BadRequest) as info:
            job.step({"x": hx["x"]}, hy)
        with pytest.raises(ValueError, match="'targets'"):
            job.step({**hx, "targets": hy}, hy)
        losses.append(job.step(*ahead[2]).loss)
        held = job.eval(hx, hy)
        job.close()
    close(losses, expected, "per-step losses with keyword inputs")
    close(held.loss, held_loss, "eval loss with keyword inputs")
    assert held.step == 3 and "mask" in info.value.reason


def test_eval_between_steps_equals_plain_pytorch_and_changes_no_later_step(
    mesh: InProcMesh,
) -> None:
    """Dropout and BatchNorm: the eval must run in eval mode, update no running statistic and
    draw nothing from the job's random stream, or the steps after it would differ."""
    s = ModelSpec(name="bn", factory="tests.support.train_models:dropout_bn_mlp", seed=8)
    batches, (hx, hy) = data(8, 6), data(80, 1)[0]
    kw = {**open_kw(s, ADAM), "rng_seed": 5}

    model = build_seeded(s, ALLOW_MODULES)
    plain_losses = train(model, ADAM, batches[:3], rng_seed=5)
    model.eval()
    with torch.no_grad():
        logits = model(hx)
    expected = F.cross_entropy(logits, hy).item()
    accuracy = (logits.argmax(-1) == hy).float().mean().item()

    with mesh.client(timeout=60) as c:
        job = c.train_open("with-eval", s.factory, **kw)
        first = [job.step_async(x, y) for x, y in batches[:3]]
        evaluated = job.eval_async(hx, hy)  # sent behind three steps in flight
        rest = [job.step_async(x, y) for x, y in batches[3:]]
        with_eval = [f.result(60).loss for f in first + rest]
        ev = evaluated.result(60)
        again = job.eval(hx, hy)  # the blocking call, after all six steps
        job.close()
        plain_job = c.train_open("without-eval", s.factory, **kw)
        without = [plain_job.step(x, y).loss for x, y in batches]
        plain_job.close()
    assert ev.step == 3 and again.step == 6
    close(with_eval[:3], plain_losses, "steps before the eval vs plain PyTorch")
    close(ev.loss, expected, "eval loss vs plain PyTorch in eval mode")
    close(ev.metrics["accuracy"], accuracy, "eval accuracy")
    close(with_eval, without, "steps around an eval vs the same run without it")


SMOOTHED = {"factory": "flowmesh.losses:label_smoothing", "kwargs": {"eps": 0.2}}


def test_a_loss_factory_through_the_mesh_resumes_with_its_checkpoint(
    mesh: InProcMesh, tmp_path: Path
) -> None:
    """`loss=` a factory on the allow-list (with kwargs): the same losses as plain PyTorch with
    label smoothing, and a resume from its checkpoint continues with that loss. A factory from a
    module off the worker's allow-list fails the open with NOT_ALLOWED, saying the worker
    refused it; a malformed one with BAD_REQUEST."""
    s, batches = spec(9), data(9, 6)
    expected, _ = plain(
        s, ADAM, batches, loss=lambda out, y: F.cross_entropy(out, y, label_smoothing=0.2)
    )
    ckpt = str(tmp_path / "smoothed")
    with mesh.client(timeout=60) as c:
        job = c.train_open("smoothed", s.factory, **{**open_kw(s, ADAM), "loss": SMOOTHED})
        first = [job.step(x, y) for x, y in batches[:3]]
        job.save(ckpt)
        job.close()
        again = c.train_open("smoothed", s.factory, **{**open_kw(s, None), "resume": ckpt})
        rest = [again.step(x, y) for x, y in batches[3:]]
        again.close()
        with pytest.raises(errors.NotAllowed) as refused:
            c.train_open("refused", s.factory, **{**open_kw(s, ADAM), "loss": "json:loads"})
        with pytest.raises(errors.BadRequest) as malformed:
            c.train_open("malformed", s.factory, **{**open_kw(s, ADAM), "loss": "hinge"})
        assert "refused" not in {j.name for j in c.jobs()}
    close([r.loss for r in first + rest], expected, "label-smoothed losses across the resume")
    assert "the worker refused loss factory 'json:loads'" in refused.value.reason
    assert "loss 'hinge'" in malformed.value.reason
    meta = json.loads((Path(ckpt) / "job.json").read_text())
    assert meta["config"]["loss"] == SMOOTHED


@pytest.mark.parametrize("policy", ["recompute", "keep"])
def test_a_forced_activation_policy_trains_exactly_and_is_reported(
    mesh: InProcMesh, policy: str
) -> None:
    s, batches = spec(7), data(7)
    expected, _ = plain(s, ADAMW, batches)
    with mesh.client(timeout=60) as c:
        job = c.train_open(f"act-{policy}", s.factory, **open_kw(s, ADAMW), activations=policy)
        try:
            losses = [job.step(x, y).loss for x, y in batches]
            (row,) = [j for j in c.jobs() if j.name == f"act-{policy}"]
        finally:
            job.close()
    close(losses, expected, f"per-step losses, activations={policy}")
    # Every sub-model but the last (its forward and backward are one task: "none").
    *kept, last = [m.activations for m in row.sub_models]
    assert kept and set(kept) == {policy} and last == "none"


def test_jobs_show_the_policy_each_step_ran_with(mesh: InProcMesh) -> None:
    """Under "auto" a job's first step recomputes and its second keeps (each measured once
    before the worker chooses): `jobs` follows what each answered step ran with."""
    s, batches = spec(9), data(9)
    with mesh.client(timeout=60) as c:
        job = c.train_open("act-auto", s.factory, **open_kw(s, ADAMW))
        try:
            seen = []
            for x, y in batches[:2]:
                job.step(x, y)
                (row,) = [j for j in c.jobs() if j.name == "act-auto"]
                seen.append([m.activations for m in row.sub_models])
        finally:
            job.close()
    parts = len(seen[0])
    assert seen == [
        ["recompute"] * (parts - 1) + ["none"],
        ["keep"] * (parts - 1) + ["none"],
    ]


def test_an_unknown_activation_policy_is_refused(mesh: InProcMesh) -> None:
    s = spec(8)
    with mesh.client(timeout=60) as c, pytest.raises(errors.BadRequest, match="activations"):
        c.train_open("act-bad", s.factory, **open_kw(s, ADAMW), activations="sometimes")
