"""The demo's serving part on a real mesh, shortened: the same trace alone and then beside a
training job, every answer checked once the traffic is over, and both runs' latencies printed
side by side (issue 22: serving's latency alone and beside training, in the same run).

The whole demo (`flowmesh demo`) takes about a minute on two cores; this runs its serving code on
two small models, so that a change that breaks it fails the suite.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from client_sdk import demo
from client_sdk.loadgen import arrival_times, zipf_choices
from client_sdk.mesh import LocalMesh
from flowmesh.spec import ModelSpec
from tests.support.mesh import FAST

REQUESTS = 24
STEPS = 4
SERVED = [
    ("mlp", "flowmesh.examples:mlp", {"width": 64, "depth": 2}),
    (
        "gpt",
        "flowmesh.examples:tiny_gpt",
        {"vocab": 64, "d_model": 32, "n_layers": 2, "n_heads": 2, "max_len": 32},
    ),
]


def test_the_same_trace_alone_and_beside_training_checked_after_the_traffic(
    capsys: pytest.CaptureFixture[str],
) -> None:
    specs = {
        name: ModelSpec(name=name, factory=f, kwargs=kw, seed=i, max_batch_size=8)
        for i, (name, f, kw) in enumerate(SERVED)
    }
    name, factory, kwargs, optimizer = demo.TRAIN_JOBS[-1]  # the smallest job
    train_specs = {name: ModelSpec(name=name, factory=factory, kwargs=kwargs, seed=100)}
    optimizers = {name: optimizer}
    data = {name: demo.train_batches(train_specs[name], demo.corpus(), 200, STEPS)}
    rng = random.Random(0)
    times = arrival_times(REQUESTS, rate=80.0, cv=2.0, rng=rng)
    trace = list(zip(times, zipf_choices(list(specs), REQUESTS, 1.1, rng), strict=True))
    # The demo's heartbeat (0.5 s, 5 s to be declared lost): on two loaded cores, the 2 s that
    # FAST allows were missed while the models were built.
    options = {**FAST, "heartbeat_s": 0.5}
    with LocalMesh(
        cpu_workers=2, memory_budget="8MiB", train_bytes=demo.TRAIN_BYTES, **options
    ) as mesh:
        asyncio.run(demo.deploy_all(mesh.frontend, specs))
        alone = asyncio.run(demo.serve(mesh.frontend, trace, specs, 0, 4))

        async def beside_training() -> tuple[demo.Served, dict[str, demo.Trained]]:
            return await asyncio.gather(
                demo.serve(mesh.frontend, trace, specs, 0, 4),
                demo.train_all(mesh.frontend, train_specs, optimizers, data),
            )

        beside, trained = asyncio.run(beside_training())
        status = asyncio.run(demo.fetch_status(mesh.frontend, after_s=1.0))

    # Served answers come back unchecked; every one of both runs is checked afterwards.
    for run in (alone, beside):
        assert run.overall()["ok"] == len(run.answers) == REQUESTS, run.tallies
    checked, expected = demo.references(
        specs, alone.answers + beside.answers, train_specs, optimizers, data
    )
    wanted = [m for _, m in trace] * 2
    for model, c in checked.items():
        assert (c.exact + c.close, c.wrong) == (wanted.count(model), 0), (model, c)
    # On a thread of a pool, each op on one thread: the losses of the loop run on its own.
    # bit-exact: the same ops on the same single-threaded kernels, only in another thread
    assert expected == {name: demo.plain_losses(train_specs[name], optimizer, data[name])}
    assert trained[name].errors == [] and len(trained[name].losses) == STEPS

    assert demo.report(status, alone, beside, checked, 0.0) == 0
    out = capsys.readouterr().out
    assert "alone: mean / p99 ms" in out and "beside training" in out.splitlines()[1], out
    lines = [line for line in out.splitlines() if line.startswith("serving ")]
    assert [line.split(":")[0] for line in lines] == ["serving alone", "serving beside training"]
    for line, run in zip(lines, (alone, beside), strict=True):
        r = run.overall()
        assert f"{REQUESTS} answers" in line and f"mean {r['mean_ms']:.1f} ms" in line, line
    assert "the same trace twice on the same workers" in out
    assert "OK: every output matches its reference" in out
