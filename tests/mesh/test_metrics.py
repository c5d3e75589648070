"""Prometheus metrics (`--metrics-port`) and `flowmesh status` read the same figures.

In-process: the mapping from status and heartbeat figures to metric families, exact. On a real
mesh (broker, partitioner, two CPU workers, each with /metrics on its own port): traffic, then
every process scraped over HTTP and its numbers compared with what `status` reports.
"""

from __future__ import annotations

import asyncio
import io
import json
import random
import re
import socket
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from broker.config import BrokerConfig
from broker.core import BrokerCore
from client_sdk import cli, errors
from client_sdk.mesh import LocalMesh
from flowmesh import metrics
from flowmesh import protocol as p
from flowmesh.reports import Totals
from flowmesh.spec import ModelSpec
from flowmesh.testing import assert_forward_close
from tests.support.inproc import InProcMesh
from tests.support.mesh import deploy, fresh_stats, mesh_options, mlp_spec, reference
from tests.support.reports import (
    broker_status,
    job_row,
    model_row,
    partitioner_row,
    replica_row,
    worker_row,
)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(families: Any) -> Samples:
    """{(sample name, sorted labels): value} of metric families (parsed or collected)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def value(got: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in got, f"no sample {name}{labels}; have {sorted(k for k in got if k[0] == name)}"
    return got[key]


def total(got: Samples, name: str, **labels: str) -> float:
    """The sum of `name` over every label set that includes `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in got.items() if n == name and want <= set(ls))


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return samples(text_string_to_metric_families(r.read().decode()))


def free_port_range(n: int) -> int:
    """A base port with `n` consecutive ports free on loopback now."""
    for _ in range(100):
        base = random.randrange(20_000, 60_000 - n)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


# ============================================================== in-process: the mapping


BROKER_STATUS = broker_status(
    uptime_s=12.5,
    queued=3,
    inflight_batches=1,
    totals=Totals(dropped_sends=2, heartbeat_losses=1),
    refused_unknown_model={"model_not_found": 4},
    models=[
        model_row(
            "m",
            state="ready",
            completed=7,
            errors_by_code={"timeout": 2},
            refused={"overloaded": 5},
            queue=3,
            loads=2,
            evictions=1,
            batches=6,
            bytes=1024,
            replicas=[replica_row("w0", live=True), replica_row("w0", live=False)],
        )
    ],
    workers=[
        worker_row(
            "w0",
            ready=True,
            budget_bytes=4096,
            resident_bytes=1024,
            host_bytes=2048,
            loads=2,
            evictions=1,
            inflight=0,
            last_seen_s=0.25,
            missed_heartbeats=0,
            registrations=1,
        )
    ],
    partitioners=[partitioner_row("p0", last_seen_s=3.0, missed_heartbeats=3, registrations=2)],
    jobs=[
        job_row("j", step=5, last_loss=0.5, steps_per_s=2.0, errors=0),
        job_row("k", step=0, last_loss=None, steps_per_s=0.0, errors=0),
    ],
    finished_jobs=[job_row("done", state="closed", step=9, last_loss=0.25, errors=1)],
)


def test_broker_status_maps_to_families_exactly() -> None:
    got = samples(metrics.broker_families(BROKER_STATUS))
    b = "flowmesh_broker_"
    assert value(got, b + "requests_total", model="m", outcome="ok") == 7
    assert value(got, b + "requests_total", model="m", outcome="timeout") == 2
    assert value(got, b + "requests_refused_total", model="m", code="overloaded") == 5
    assert value(got, b + "requests_refused_total", model="", code="model_not_found") == 4
    assert value(got, b + "queue_depth", model="m") == 3
    assert value(got, b + "model_live_replicas", model="m") == 1
    assert value(got, b + "worker_resident_bytes", worker="w0") == 1024
    assert value(got, b + "worker_budget_bytes", worker="w0") == 4096
    assert value(got, b + "worker_host_bytes", worker="w0") == 2048
    assert value(got, b + "peer_missed_heartbeats", peer="p0", role="partitioner") == 3
    assert value(got, b + "dropped_sends_total") == 2
    assert value(got, b + "heartbeat_losses_total") == 1
    assert value(got, b + "train_steps_total", train_job="j") == 5
    assert value(got, b + "train_last_loss", train_job="j") == 0.5
    # No loss yet: no sample, rather than a made-up number.
    assert (b + "train_last_loss", (("train_job", "k"),)) not in got
    # A job that ended: its final figures, by how it ended.
    assert value(got, b + "train_final_steps", train_job="done", state="closed") == 9
    assert value(got, b + "train_final_loss", train_job="done", state="closed") == 0.25
    assert value(got, b + "train_final_errors", train_job="done", state="closed") == 1


WORKER_STATS = p.WorkerStats(
    loads=3,
    evictions=1,
    bytes_loaded=300,
    resident_bytes=100,
    budget_bytes=1000,
    host_bytes=500,
    host_tier_bytes=4096,
    host_tier_used_bytes=512,
    stages={"m/0": "resident", "m/1": "host", "n/0": "host"},
    dropped_sends=0,
    reconnects=2,
    prefault_s=None,  # not a number: no sample
)
WORKER_TRAIN: dict[str, Any] = {
    "bytes_in": 64,
    "bytes_out": 32,
    "jobs": {"j": {"step": 4, "last_loss": 1.25}},
}


def test_worker_figures_map_to_families_exactly() -> None:
    got = samples(metrics.worker_families("w0", WORKER_STATS, WORKER_TRAIN))
    w = "flowmesh_worker_"
    assert value(got, w + "loads_total", worker="w0") == 3
    assert value(got, w + "resident_bytes", worker="w0") == 100
    assert value(got, w + "host_tier_budget_bytes", worker="w0") == 4096
    assert value(got, w + "reconnects_total", worker="w0") == 2
    copied = w + "copied_bytes_total"
    assert value(got, copied, worker="w0", direction="host_to_device", purpose="serving") == 300
    assert value(got, copied, worker="w0", direction="host_to_device", purpose="training") == 64
    assert value(got, copied, worker="w0", direction="device_to_host", purpose="training") == 32
    assert value(got, w + "stages", worker="w0", state="host") == 2
    assert value(got, w + "train_steps_total", worker="w0", train_job="j") == 4
    assert value(got, w + "train_last_loss", worker="w0", train_job="j") == 1.25
    assert not [k for k in got if "prefault" in k[0]]


def dashboard_series() -> set[str]:
    """Every flowmesh series the Grafana dashboard plots, by name."""
    dash = json.loads((Path(__file__).parents[2] / "scripts/grafana_dashboard.json").read_text())
    exprs = [t["expr"] for panel in dash["panels"] for t in panel.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"flowmesh_[a-z_]+", e)}
    assert used, "no flowmesh metric in the dashboard"
    return used


def missing_from(used: set[str], names: set[str]) -> set[str]:
    suffix = re.compile(r"_(bucket|sum|count|total)$")
    return {m for m in used if m not in names and suffix.sub("", m) not in names}


def cpu_worker_figures() -> tuple[p.WorkerStats, dict[str, Any]]:
    """A CPU worker's heartbeat figures (what its /metrics reads) and its trainer's, in process."""
    with InProcMesh(cpu_workers=1, memory_budget="8MiB", train_bytes="1MiB") as mesh:
        with mesh.client() as c:
            stats = fresh_stats(c, "worker-0")
        train = mesh.on_loop(lambda: mesh.worker("worker-0").trainer.stats())
    return stats, train


def test_the_dashboard_plots_only_metrics_the_processes_export() -> None:
    from broker.status import Timings

    stats, train = cpu_worker_figures()
    workers = {f.name for f in metrics.worker_families("w", stats, train)}
    names = {f.name for f in metrics.broker_families(BROKER_STATUS)}
    names |= {f.name for f in Timings().collect()}
    names |= {f.name for f in metrics.partitioner_families("p", p.PartitionerStats(planned=1))}
    used = dashboard_series()
    assert not missing_from(used, names | workers), missing_from(used, names | workers)
    # Every worker series the dashboard plots has a sample from a CPU worker too (the stand-in
    # has no pinned host tier: it reports the tier's figures as zero rather than not at all).
    plotted = {m for m in used if m.startswith("flowmesh_worker_")}
    assert plotted and not missing_from(plotted, workers), missing_from(plotted, workers)


def test_broker_refusals_and_answers_are_counted_where_status_reads_them() -> None:
    core = BrokerCore(BrokerConfig(), now=0.0)
    with pytest.raises(Exception, match="no model"):
        core.on_client(b"c", p.Infer(id=1, model="nope", tensors={}), 0.0)
    st = core.status(1.0)
    assert st.refused_unknown_model == {"model_not_found": 1}
    got = samples([*metrics.broker_families(st), *core.serving.timings.collect()])
    assert value(got, "flowmesh_broker_requests_refused_total", model="", code="model_not_found")
    assert value(got, "flowmesh_broker_uptime_seconds") == 1.0


def test_status_has_host_bytes_at_deploy_and_counts_missed_heartbeats() -> None:
    from tests.support.broker import MIB, Harness

    h = Harness()  # heartbeat 1 s, liveness 3
    h.partitioner()
    h.worker("w0")
    h.deploy("m", [3 * MIB], replicas=1)
    # No heartbeat since the stage was ready: the broker's own view, not the worker's last beat.
    (w,) = h.core.status(h.now).workers
    assert w.host_bytes == 3 * MIB and w.missed_heartbeats == 0
    h.now = 2.5
    (w,) = h.core.status(h.now).workers
    assert w.missed_heartbeats == 2
    h.now = 3.5
    h.core.tick(h.now)
    st = h.core.status(h.now)
    assert st.workers == [] and st.totals.heartbeat_losses == 2  # the worker and the partitioner
    assert (
        value(samples(metrics.broker_families(st)), "flowmesh_broker_heartbeat_losses_total") == 2
    )


def test_on_loop_reads_on_the_loop_thread_and_times_out_when_it_is_stuck(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        here = threading.get_ident()
        # From another thread: the function runs on the loop's thread.
        got = await asyncio.to_thread(metrics.on_loop, loop, threading.get_ident)
        assert got == here
        assert metrics.on_loop(loop, lambda: 5) == 5  # on the loop itself: directly

    asyncio.run(main())
    stuck = asyncio.new_event_loop()  # never run: like a loop blocked in a long call
    try:
        monkeypatch.setattr(metrics, "SCRAPE_TIMEOUT_S", 0.1)
        with pytest.raises(TimeoutError):
            metrics.on_loop(stuck, lambda: 1)
    finally:
        stuck.close()


def test_the_endpoint_serves_the_collector() -> None:
    port = free_port_range(1)
    calls = []

    def families() -> list[Any]:
        calls.append(1)
        return metrics.partitioner_families(
            "p0", p.PartitionerStats(planned=2, failed=1, inflight=0)
        )

    stop = metrics.start(port, metrics.Collector(families), addr="127.0.0.1")
    try:
        got = scrape(port)
    finally:
        stop()
    assert value(got, "flowmesh_partitioner_plans_total", partitioner="p0", outcome="ok") == 2
    assert value(got, "flowmesh_partitioner_plans_total", partitioner="p0", outcome="failed") == 1
    assert "process_resident_memory_bytes" in {k[0] for k in got} and calls == [1]


def test_a_taken_port_is_a_clear_startup_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(SystemExit, match=f"--metrics-port {port}"):
            metrics.start(port, metrics.Collector(list), addr="127.0.0.1")


# ============================================================== a real mesh


# The metrics ports are taken as the mesh starts (free then), not at import.
pytestmark = mesh_options(train_bytes="256KiB", metrics_port=lambda: free_port_range(4))


def test_metrics_and_status_report_the_same_serving_figures(mesh: LocalMesh) -> None:
    ports = mesh.metrics_ports()
    assert set(ports) == {"broker", "partitioner", "worker-0", "worker-1"}
    spec = mlp_spec("metered", seed=5)
    n = 5
    with mesh.client() as c:
        deploy(c, spec)
        # Right after the deploy returns, status holds each worker's host bytes already.
        st = c.status()
        (row,) = [m for m in st.models if m.name == "metered"]
        hosted = sum(w.host_bytes for w in st.workers)
        assert hosted >= row.bytes > 0
        infos = []
        for _ in range(n):
            x = torch.randn(2, 256)
            out, info = c.infer_with_info("metered", x)
            assert_forward_close(out, reference(spec)(x))
            infos.append(info)
        with pytest.raises(errors.BadRequest):
            c.infer("metered", torch.randn(2, 7))  # wrong shape: refused on arrival
        for info in infos:
            assert info["batch"] == 1
            assert info["run_ms"] >= info["load_wait_ms"] >= 0 and info["queue_ms"] >= 0
            assert info["latency_ms"] == pytest.approx(info["queue_ms"] + info["run_ms"])
        st = c.status()
        # The worker's own figures, from a heartbeat sent after the traffic was answered.
        fresh = {w: fresh_stats(c, w) for w in ("worker-0", "worker-1")}
        broker = scrape(ports["broker"])
        workers = {w: scrape(ports[w]) for w in ("worker-0", "worker-1")}
        part = scrape(ports["partitioner"])

    (row,) = [m for m in st.models if m.name == "metered"]
    b = "flowmesh_broker_"
    assert row.completed == n
    assert value(broker, b + "requests_total", model="metered", outcome="ok") == n
    assert value(broker, b + "requests_refused_total", model="metered", code="bad_request") == 1
    assert row.refused == {"bad_request": 1}
    assert value(broker, b + "request_latency_seconds_count", model="metered") == n
    assert value(broker, b + "request_latency_seconds_sum", model="metered") == pytest.approx(
        sum(i["latency_ms"] for i in infos) / 1000
    )
    assert value(broker, b + "request_queue_wait_seconds_count", model="metered") == n
    assert value(broker, b + "batch_size_count", model="metered") == row.batches == n
    # Means in status are the histograms' sums over counts.
    mean_run = sum(i["run_ms"] for i in infos) / n
    assert row.run_ms == pytest.approx(mean_run)
    assert row.load_wait_ms == pytest.approx(sum(i["load_wait_ms"] for i in infos) / n)
    assert row.mean_batch == 1.0
    # Loads: counted by the broker per worker, their bytes and times from Loaded.
    loads = sum(w.loads for w in st.workers)
    assert loads >= row.loads >= 1
    assert total(broker, b + "worker_load_seconds_count") == loads
    assert total(broker, b + "worker_load_bytes_total") == sum(
        w.load_bytes for w in st.workers
    )
    assert sum(w.load_bytes for w in st.workers) >= row.bytes
    for w in st.workers:
        name = w.name
        assert value(broker, b + "worker_resident_bytes", worker=name) == w.resident_bytes
        assert value(broker, b + "worker_host_bytes", worker=name) == w.host_bytes
        assert value(broker, b + "worker_loads_total", worker=name) == w.loads
        if w.loads:
            assert w.mean_load_ms > 0
        # The worker's own endpoint: the figures its heartbeats carry.
        got, stats = workers[name], fresh[name]
        wm = "flowmesh_worker_"
        assert value(got, wm + "loads_total", worker=name) == stats.loads
        assert value(got, wm + "resident_bytes", worker=name) == stats.resident_bytes
        assert value(got, wm + "budget_bytes", worker=name) == stats.budget_bytes
        assert value(got, wm + "host_bytes", worker=name) == stats.host_bytes == w.host_bytes
        copied = value(
            got,
            wm + "copied_bytes_total",
            worker=name,
            direction="host_to_device",
            purpose="serving",
        )
        assert copied == stats.bytes_loaded
    assert (
        sum(
            value(
                workers[w],
                "flowmesh_worker_copied_bytes_total",
                worker=w,
                direction="host_to_device",
                purpose="serving",
            )
            for w in workers
        )
        >= row.bytes
    )
    assert (
        value(part, "flowmesh_partitioner_plans_total", partitioner="partitioner-0", outcome="ok")
        >= 1
    )


def test_a_training_step_shows_in_the_steps_metric(mesh: LocalMesh) -> None:
    s = ModelSpec(
        name="metered-train",
        factory="flowmesh.examples:mlp",
        kwargs={"width": 32, "depth": 4, "in_features": 8, "out_features": 5},
        seed=1,
    )
    ports = mesh.metrics_ports()
    with mesh.client(timeout=60) as c:
        job = c.train_open(
            "metered-job",
            s.factory,
            kwargs=s.kwargs,
            seed=1,
            optimizer={"name": "sgd", "lr": 0.1},
            batch_size=8,
            chunk_bytes=32 * 1024,
            timeout=60,
        )
        losses = [job.step(torch.randn(8, 8), torch.randint(0, 5, (8,))).loss for _ in range(3)]
        (row,) = [j for j in c.status().jobs if j.name == "metered-job"]
        broker = scrape(ports["broker"])
        worker = scrape(ports[row.worker])
        job.close()
    assert row.step == 3
    assert value(broker, "flowmesh_broker_train_steps_total", train_job="metered-job") == 3
    assert value(
        broker, "flowmesh_broker_train_last_loss", train_job="metered-job"
    ) == pytest.approx(losses[-1])
    got = value(
        worker, "flowmesh_worker_train_steps_total", worker=row.worker, train_job="metered-job"
    )
    assert got == 3


def ensure_deployed(c: Any, spec: ModelSpec) -> None:
    if spec.name not in {m.name for m in c.status().models}:
        deploy(c, spec)


def test_status_watch_draws_workers_models_and_jobs(mesh: LocalMesh) -> None:
    with mesh.client() as c:
        ensure_deployed(c, mlp_spec("metered", seed=5))
    args = cli.build_parser().parse_args(
        ["status", "--broker", mesh.frontend, "--watch", "0.05", "--timeout", "10"]
    )
    assert args.watch == 0.05
    assert cli.watch_status(args, rounds=2) == 0
    with mesh.client() as c:
        st = c.status()
    from rich.console import Console

    console = Console(file=io.StringIO(), width=200)
    console.print(cli.status_view(st))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "worker-0" in text and "worker-1" in text and "models (times in ms)" in text
    assert "metered" in text


def test_the_scrape_reflects_traffic_since_the_last_one(mesh: LocalMesh) -> None:
    port = mesh.metrics_ports()["broker"]
    before = total(scrape(port), "flowmesh_broker_requests_total", model="metered", outcome="ok")
    with mesh.client() as c:
        ensure_deployed(c, mlp_spec("metered", seed=5))
        c.infer("metered", torch.randn(1, 256))

    def counted() -> float | None:
        now = total(scrape(port), "flowmesh_broker_requests_total", model="metered", outcome="ok")
        return now if now != before else None

    assert mesh.wait_until(counted, "the scrape to count the request", timeout=30) == before + 1
