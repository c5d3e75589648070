"""`flowmesh deploy` as a user runs it: a subprocess against a real mesh, with its progress bar
of the weights read (workers report what they are reading with their heartbeats), and a Hugging
Face directory deployed by `--hf` then asked by `flowmesh infer`."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from client_sdk.cli import main
from client_sdk.mesh import LocalMesh
from client_sdk.views import DeployWatch
from flowmesh.modelio.build import build_seeded
from flowmesh.reports import BrokerStatus, WorkerStats
from tests.support.cli import flowmesh
from tests.support.mesh import fresh_stats, mesh_options, mlp_spec
from tests.support.reports import broker_status, worker_row

pytestmark = mesh_options(memory_budget="16MiB")


def test_deploy_shows_the_weights_read_and_the_workers_report_reading(
    mesh: LocalMesh, tmp_path: Path
) -> None:
    spec = mlp_spec("weighty", width=512, depth=6, seed=3)
    path = tmp_path / "weighty.safetensors"
    save_file(build_seeded(spec).state_dict(), str(path))
    done = flowmesh(
        "deploy", "weighty", spec.factory, "--kwargs", '{"width": 512, "depth": 6}',
        "--weights", str(path), "--stages", "2", "--replicas", "1", "--progress",
        "--broker", mesh.frontend,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("deployed weighty:"), done.stdout
    assert "reading weights" in done.stderr and "weights read in" in done.stderr
    assert " MiB / " in done.stderr and " MB" not in done.stderr  # one unit: binary
    with mesh.client() as c:
        for w in c.status().workers:
            assert fresh_stats(c, w.name).preparing == {}  # nothing left half-read


def test_deploy_a_hugging_face_directory_then_infer_a_batch(
    mesh: LocalMesh, tmp_path: Path
) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32)
    torch.manual_seed(5)
    GPT2LMHeadModel(cfg).eval().save_pretrained(tmp_path / "gpt")
    deployed = flowmesh(
        "deploy", "gpt", "--hf", str(tmp_path / "gpt"), "--stages", "2", "--replicas", "1",
        "--slo-ms", "500", "--no-progress", "--broker", mesh.frontend,
    )  # fmt: skip
    assert deployed.returncode == 0, deployed.stderr
    assert deployed.stdout.startswith("deployed gpt: ") and "stage 1: " in deployed.stdout
    with mesh.client() as c:
        model = next(m for m in c.status().models if m.name == "gpt")
    assert model.factory is None and model.slo_ms == 500
    out = tmp_path / "out.safetensors"
    run = flowmesh(
        "infer", "gpt", "--batch", "2", "--seq", "8", "--output", str(out),
        "--broker", mesh.frontend,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "batch of 2 row(s) in a forward of 1 request(s)" in run.stdout, run.stdout
    assert {k: list(v.shape) for k, v in load_file(out).items()} == {"output": [2, 8, 64]}


def test_deploy_takes_a_factory_or_a_directory_not_both() -> None:
    # Refused before any connection: in this process (an interpreter's start saved), where
    # `SystemExit(message)` is what exits 1 with the message on stderr.
    with pytest.raises(SystemExit) as both:
        main(["deploy", "x", "flowmesh.examples:mlp", "--hf", "d", "--broker", "tcp://x:1"])
    assert "one of the two" in str(both.value.code), both.value


def test_deploy_watch_adds_up_the_stages_each_worker_reads() -> None:
    watch = DeployWatch("m")

    def status(**per_worker: dict[str, list[int]]) -> BrokerStatus:
        rows = [worker_row(w, stats=WorkerStats(preparing=p)) for w, p in per_worker.items()]
        return broker_status(workers=rows)

    assert watch.update(status(a={"m/0": [0, 100]}, b={"other/0": [5, 9]})) == (0, 100)
    assert watch.update(status(a={"m/0": [40, 100]}, b={"m/1": [10, 50]})) == (50, 150)
    # Stage 0 is no longer reported: it has been read whole.
    assert watch.update(status(a={}, b={"m/1": [30, 50]})) == (130, 150)
    assert watch.update(status(a={}, b={})) == (150, 150)
