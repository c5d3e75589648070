"""Prometheus metrics over HTTP for every process (`--metrics-port`; 0 or absent: off).

One source of truth: nothing here counts. At each scrape a collector reads the figures the
process already keeps for its status and heartbeats — the broker's `BrokerCore.status()` (the
very `flowmesh.reports.BrokerStatus` that `flowmesh status` prints), a worker's
`WorkerService.heartbeat_stats()` (what its heartbeats carry), a partitioner's — and maps them
to metric families with pure functions (`broker_families`, `worker_families`,
`partitioner_families`) that tests check in-process. The broker's distributions (latency, queue
wait, load wait, run time, batch size, load time) are prometheus_client histograms observed
where the broker answers (`broker.status.Timings`); status reads their sums and counts, the
collector yields them whole.

The state belongs to the event loop, so a scrape (on prometheus_client's HTTP thread) reads it
on the loop (`on_loop`) and waits at most `SCRAPE_TIMEOUT_S`: a loop that is stuck fails the
scrape, which Prometheus reports as the target being down.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
from collections.abc import Callable, Coroutine, Iterable, Mapping
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.process_collector import ProcessCollector

from flowmesh.reports import BrokerStatus, PartitionerStats, PeerRow, WorkerStats

log = logging.getLogger("flowmesh.metrics")

T = TypeVar("T")
SCRAPE_TIMEOUT_S = 5.0

# ============================================================== families from plain figures


class Families:
    """Metric families under construction, by name; `counter`/`gauge` add one sample."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._by_name: dict[str, Metric] = {}

    def _family(self, kind: str, name: str, doc: str, labels: tuple[str, ...]) -> Metric:
        full = f"{self.prefix}_{name}"
        family = self._by_name.get(full)
        if family is None:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = cls(full, doc, labels=list(labels))
            self._by_name[full] = family
        return family

    def counter(self, name: str, doc: str, value: Any, **labels: str) -> None:
        v = _number(value)
        if v is not None:
            family = self._family("counter", name, doc, tuple(labels))
            family.add_metric(list(labels.values()), v)  # type: ignore[attr-defined]

    def gauge(self, name: str, doc: str, value: Any, **labels: str) -> None:
        v = _number(value)
        if v is not None:
            family = self._family("gauge", name, doc, tuple(labels))
            family.add_metric(list(labels.values()), v)  # type: ignore[attr-defined]

    def declare(self, kind: str, name: str, doc: str, *labels: str) -> None:
        """A family that exists even with no sample yet (e.g. no model deployed)."""
        self._family(kind, name, doc, labels)

    def all(self) -> list[Metric]:
        return list(self._by_name.values())


def _number(value: Any) -> float | None:
    """A figure as a sample value; None (no sample) for what is not a finite number."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


# ============================================================== broker


def broker_families(st: BrokerStatus) -> list[Metric]:
    """The broker's status (`BrokerCore.status`) as metric families (histograms aside)."""
    f = Families("flowmesh_broker")
    f.declare("counter", "requests", "Requests accepted, by model and outcome", "model", "outcome")
    f.declare("counter", "requests_refused", "Requests refused on arrival", "model", "code")
    f.declare("gauge", "queue_depth", "Requests queued, by model", "model")
    f.gauge("uptime_seconds", "Seconds since the broker started", st.uptime_s)
    f.gauge("queued_requests", "Requests queued, all models", st.queued)
    f.gauge("inflight_batches", "Batches running on workers", st.inflight_batches)
    # Broker-wide totals without a per-model family (those sum over the model label).
    for key, metric, doc in (
        ("retried", "retried_requests", "Requests run again after their worker was lost"),
        ("hung_runs", "hung_runs", "Runs a worker did not answer in time"),
        ("expired_calls", "expired_calls", "Calls to peers that got no answer in time"),
        ("dropped_sends", "dropped_sends", "Messages not sent (peer gone or its queue full)"),
        ("heartbeat_losses", "heartbeat_losses", "Peers lost for missing heartbeats"),
        ("train_expired", "train_expired_calls", "Training calls that got no answer in time"),
        ("train_idle_closed", "train_idle_closed_jobs", "Training jobs closed for being idle"),
        ("auth_refused", "auth_refused", "Messages refused for their peer's key (CURVE)"),
        ("direct_batches", "direct_batches", "Batches whose activations went worker to worker"),
        (
            "activation_bytes_relayed",
            "activation_bytes_relayed",
            "Activation bytes the broker forwarded between stages",
        ),
    ):
        f.counter(metric, doc, getattr(st.totals, key))
    for code, n in st.refused_unknown_model.items():
        f.counter("requests_refused", "", n, model="", code=code)
    for m in st.models:
        name = m.name
        f.counter("requests", "", m.completed, model=name, outcome="ok")
        for code, n in m.errors_by_code.items():
            f.counter("requests", "", n, model=name, outcome=code)
        for code, n in m.refused.items():
            f.counter("requests_refused", "", n, model=name, code=code)
        f.gauge("queue_depth", "", m.queue, model=name)
        f.counter("model_loads", "Replica stage loads, by model", m.loads, model=name)
        f.counter("model_evictions", "Stage evictions, by model", m.evictions, model=name)
        f.counter("model_batches", "Batches started, by model", m.batches, model=name)
        f.gauge("model_bytes", "Device bytes of all of a model's stages", m.bytes, model=name)
        f.gauge("model_ready", "1 when the model serves, else 0", m.state == "ready", model=name)
        f.gauge("running_sequences", "Sequences generating, by model", m.running_seqs, model=name)
        f.gauge(
            "waiting_sequences", "Sequences waiting to join a batch", m.waiting_seqs, model=name
        )
        f.counter("generated_tokens", "Tokens generated, by model", m.tokens_generated, model=name)
        f.counter(
            "generation_iterations", "Generation iterations run", m.gen_iterations, model=name
        )
        doc = (
            "Preempted sequences run again, by kind (swap: KV parked in host memory and copied "
            "back; recompute: KV recomputed from the tokens; restart: KV lost)"
        )
        for kind, n in m.preemptions_by_kind.items():
            f.counter("preemptions", doc, n, model=name, kind=kind)
        f.gauge("generated_tokens_per_second", "New tokens per second, decayed", m.tokens_per_s,
                model=name)  # fmt: skip
        f.gauge(
            "model_live_replicas",
            "Replicas with every stage deployed",
            sum(1 for r in m.replicas if r.live),
            model=name,
        )
    for w in st.workers:
        name = w.name
        f.gauge("worker_ready", "1 once the worker heartbeats", w.ready, worker=name)
        f.gauge("worker_budget_bytes", "A worker's serving budget", w.budget_bytes, worker=name)
        f.gauge(
            "worker_resident_bytes",
            "Bytes of stages resident (or loading) on a worker's device",
            w.resident_bytes,
            worker=name,
        )
        f.gauge(
            "worker_host_bytes",
            "Bytes of stages a worker holds in host memory",
            w.host_bytes,
            worker=name,
        )
        f.counter("worker_loads", "Stage loads, by worker", w.loads, worker=name)
        f.counter("worker_evictions", "Stage evictions, by worker", w.evictions, worker=name)
        f.gauge("worker_inflight_runs", "Runs sent, not answered", w.inflight, worker=name)
        # Generation's KV cache, part of the resident bytes above.
        doc = "Bytes of generation's KV cache on a worker's device"
        f.gauge("worker_kv_bytes", doc, w.kv_bytes, worker=name)
        f.gauge("worker_kv_blocks", "KV cache blocks held on a worker", w.kv_blocks, worker=name)
        doc = "KV cache blocks a worker's KV limit still allows"
        f.gauge("worker_kv_blocks_free", doc, w.kv_blocks_free, worker=name)
        doc = "Most bytes the KV of a worker's models may take together"
        f.gauge("worker_kv_limit_bytes", doc, w.kv_limit_bytes, worker=name)
    peers: list[tuple[str, PeerRow]] = [("worker", w) for w in st.workers]
    peers += [("partitioner", p) for p in st.partitioners]
    for role, peer in peers:
        f.gauge(
            "peer_last_seen_seconds",
            "Seconds since the broker last heard from a peer",
            peer.last_seen_s,
            peer=peer.name,
            role=role,
        )
        f.gauge(
            "peer_missed_heartbeats",
            "Heartbeat intervals since the broker last heard from a peer",
            peer.missed_heartbeats,
            peer=peer.name,
            role=role,
        )
        f.counter(
            "peer_registrations",
            "Registrations of the same peer process",
            peer.registrations,
            peer=peer.name,
            role=role,
        )
    for j in st.jobs:
        job = j.name
        f.counter("train_steps", "Steps a training job has taken", j.step, train_job=job)
        f.gauge("train_last_loss", "Loss of a job's last step", j.last_loss, train_job=job)
        f.gauge("train_steps_per_second", "A job's recent step rate", j.steps_per_s, train_job=job)
        f.counter(
            "train_job_errors", "A job's steps answered with an error", j.errors, train_job=job
        )
        f.gauge("train_pending_calls", "A job's calls awaiting a worker", j.pending, train_job=job)
        f.counter("train_samples", "Rows a training job has trained", j.samples, train_job=job)
        doc = "A job's recent rate of rows trained"
        f.gauge("train_samples_per_second", doc, j.samples_per_s, train_job=job)
        doc = "Target tokens a language model's training job has trained"
        f.counter("train_tokens", doc, j.tokens, train_job=job)
        doc = "A job's recent rate of target tokens trained"
        f.gauge("train_tokens_per_second", doc, j.tokens_per_s, train_job=job)
        # Host tier <-> device copies of the job's steps, as its worker measured them.
        for direction, total, last in (
            ("in", j.bytes_in, j.step_bytes_in),
            ("out", j.bytes_out, j.step_bytes_out),
        ):
            doc = "Bytes a job's steps copied into the device arena (in) or back to the host (out)"
            f.counter("train_copied_bytes", doc, total, train_job=job, direction=direction)
            doc = "Bytes a job's last step copied in (in) or back (out)"
            f.gauge("train_step_copied_bytes", doc, last, train_job=job, direction=direction)
        doc = "Seconds a job's steps waited for device arena memory"
        f.counter("train_memory_wait_seconds", doc, j.memory_wait_s, train_job=job)
        doc = "Seconds a job's last step waited for device arena memory"
        f.gauge("train_step_memory_wait_seconds", doc, j.step_memory_wait_s, train_job=job)
        # One sample per sub-model, valued 1: its activation policy is the label.
        for i, m in enumerate(j.sub_models):
            f.gauge(
                "train_sub_model_activations",
                "A job's sub-model, labelled with its activation policy",
                1,
                train_job=job,
                sub_model=str(i),
                policy=m.activations or "unknown",
            )
    # A job's figures as it ended, kept after it closed (the latest jobs of each name).
    f.declare("gauge", "train_final_steps", "Steps of a job that ended", "train_job", "state")
    for j in st.finished_jobs:
        labels = {"train_job": j.name, "state": j.state}
        f.gauge("train_final_steps", "", j.step, **labels)
        doc = "Loss of the last step of a job that ended"
        f.gauge("train_final_loss", doc, j.last_loss, **labels)
        doc = "Steps answered with an error, of a job that ended"
        f.gauge("train_final_errors", doc, j.errors, **labels)
    return f.all()


# ============================================================== worker

# (stat key, metric name, kind, help): a worker's flat heartbeat figures.
WORKER_FIGURES: tuple[tuple[str, str, str, str], ...] = (
    ("loads", "loads", "counter", "Stages loaded onto the device"),
    ("evictions", "evictions", "counter", "Stages evicted from the device"),
    ("runs", "runs", "counter", "Runs finished (ok or not)"),
    ("run_errors", "run_errors", "counter", "Runs that failed"),
    ("rows", "rows", "counter", "Rows computed"),
    ("load_waits", "load_waits", "counter", "Loads that waited for training to give memory back"),
    ("evictions_chosen", "evictions_chosen", "counter", "Idle stages evicted to make room"),
    ("implicit_loads", "implicit_loads", "counter", "Stages brought back for a run"),
    ("hops_in", "hops_in", "counter", "Activation micro-batches from other workers"),
    ("hops_dropped", "hops_dropped", "counter", "Activations dropped (run given up or too early)"),
    ("direct_pending", "direct_runs_pending", "gauge", "Direct runs announced, not finished here"),
    ("peer_refused", "peer_refused", "counter", "Peer-socket connections refused (CURVE)"),
    ("budget_bytes", "budget_bytes", "gauge", "Device bytes for serving stages"),
    ("resident_bytes", "resident_bytes", "gauge", "Device bytes held by serving stages"),
    ("peak_bytes", "peak_bytes", "gauge", "Highest device bytes held by serving stages"),
    ("host_bytes", "host_bytes", "gauge", "Host bytes of deployed stages"),
    ("largest_free", "largest_free_bytes", "gauge", "Largest free range of the device arena"),
    ("inflight", "inflight_runs", "gauge", "Runs in progress"),
    ("kv_bytes", "kv_bytes", "gauge", "Device bytes of generation's KV cache"),
    ("kv_blocks", "kv_blocks", "gauge", "KV cache blocks held"),
    ("kv_blocks_free", "kv_blocks_free", "gauge", "KV cache blocks the KV limit still allows"),
    ("kv_seqs", "kv_sequences", "gauge", "Sequences holding KV cache blocks"),
    ("kv_limit_bytes", "kv_limit_bytes", "gauge", "Most KV bytes this worker's models may take"),
    ("kv_refused", "kv_refused", "counter", "Iterations whose KV blocks could not be placed"),
    ("kv_parked", "kv_parked", "counter", "Preempted sequences whose KV was parked in host memory"),
    ("kv_dropped", "kv_dropped", "counter", "Preempted sequences whose KV was dropped"),
    ("kv_restored", "kv_restored", "counter", "Parked sequences' KV copied back to the device"),
    ("kv_parked_bytes", "kv_parked_bytes", "gauge", "Host bytes of parked sequences' KV"),
    ("kv_parked_seqs", "kv_parked_sequences", "gauge", "Sequences whose KV is parked here"),
    ("arena_bytes", "arena_bytes", "gauge", "Device arena (serving and training)"),
    ("arena_in_use", "arena_in_use_bytes", "gauge", "Device arena bytes in use"),
    ("host_tier_bytes", "host_tier_budget_bytes", "gauge", "Pinned host tier (CUDA; 0 on CPU)"),
    ("host_tier_used_bytes", "host_tier_used_bytes", "gauge", "Pinned host tier bytes in use"),
    ("train_budget_bytes", "train_budget_bytes", "gauge", "Device bytes guaranteed to training"),
    ("train_reserved_bytes", "train_reserved_bytes", "gauge", "Device bytes training holds"),
    ("train_resident_bytes", "train_resident_bytes", "gauge", "Training tasks' resident bytes"),
    ("train_step_errors", "train_step_errors", "counter", "Training steps that failed"),
    ("train_tasks_reclaimed", "train_tasks_reclaimed", "counter", "Tasks serving took memory from"),
    (
        "train_stash_device_bytes",
        "train_stash_device_bytes",
        "gauge",
        "Training stashes kept on the device beside the arena",
    ),
    (
        "train_stash_device_limit",
        "train_stash_device_limit_bytes",
        "gauge",
        "Most bytes training stashes may keep on the device",
    ),
    (
        "train_stash_device_kept_bytes",
        "train_stash_device_kept_bytes",
        "counter",
        "Training stash bytes that stayed on the device",
    ),
    (
        "train_stash_host_bytes",
        "train_stash_host_bytes",
        "counter",
        "Training stash bytes copied to the host tier",
    ),
    ("dropped_sends", "dropped_sends", "counter", "Messages to the broker dropped"),
    ("reconnects", "reconnects", "counter", "Fresh sockets after the broker fell silent"),
)


def worker_families(
    name: str, stats: WorkerStats, train: Mapping[str, Any] | None = None
) -> list[Metric]:
    """A worker's figures (what its heartbeats carry, `WorkerService.heartbeat_stats()`) and, if
    it trains, its trainer's (`TrainingExecutor.stats()`, in process), labelled with the
    worker's name. A figure the worker does not report (None) is left out."""
    f = Families("flowmesh_worker")
    for key, metric, kind, doc in WORKER_FIGURES:
        value = getattr(stats, key)
        if value is not None:
            getattr(f, kind)(metric, doc, value, worker=name)
    doc = "Bytes copied between host and device, by direction and purpose"
    f.counter(
        "copied_bytes",
        doc,
        stats.bytes_loaded,
        worker=name,
        direction="host_to_device",
        purpose="serving",
    )
    if train is not None:
        for key, direction in (("bytes_in", "host_to_device"), ("bytes_out", "device_to_host")):
            f.counter(
                "copied_bytes",
                doc,
                train.get(key, 0),
                worker=name,
                direction=direction,
                purpose="training",
            )
        for job, j in (train.get("jobs") or {}).items():
            f.counter(
                "train_steps",
                "Steps a training job took here",
                j.get("step"),
                worker=name,
                train_job=job,
            )
            f.gauge(
                "train_last_loss",
                "Loss of a job's last step",
                j.get("last_loss"),
                worker=name,
                train_job=job,
            )
    states: dict[str, int] = {}
    for state in stats.stages.values():
        states[state] = states.get(state, 0) + 1
    for state, n in sorted(states.items()):
        f.gauge("stages", "Deployed stages, by state", n, worker=name, state=state)
    return f.all()


def partitioner_families(name: str, stats: PartitionerStats) -> list[Metric]:
    f = Families("flowmesh_partitioner")
    doc = "Plans computed, by outcome"
    f.counter("plans", doc, stats.planned, partitioner=name, outcome="ok")
    f.counter("plans", doc, stats.failed, partitioner=name, outcome="failed")
    f.gauge("inflight_plans", "Plans being computed", stats.inflight, partitioner=name)
    f.counter(
        "dropped_sends",
        "Messages to the broker dropped",
        stats.dropped_sends,
        partitioner=name,
    )
    f.counter(
        "reconnects",
        "Fresh sockets after the broker fell silent",
        stats.reconnects,
        partitioner=name,
    )
    return f.all()


# ============================================================== collectors


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], T]) -> T:
    """`fn()` run on `loop`'s thread (where the state it reads changes), from any thread."""
    if _running_loop() is loop:
        return fn()
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(fn())
        except BaseException as exc:
            done.set_exception(exc)

    loop.call_soon_threadsafe(run)
    return done.result(SCRAPE_TIMEOUT_S)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class Collector:
    """A prometheus_client collector: `families()` on each scrape."""

    def __init__(self, families: Callable[[], Iterable[Metric]]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return list(self.families())


def broker_collector(service: Any, loop: asyncio.AbstractEventLoop) -> Collector:
    import time

    core = service.core

    def families() -> list[Metric]:
        st = on_loop(loop, lambda: core.status(time.monotonic()))
        return [*broker_families(st), *core.serving.timings.collect()]

    return Collector(families)


def worker_collector(service: Any, loop: asyncio.AbstractEventLoop) -> Collector:
    def read() -> tuple[WorkerStats, dict[str, Any] | None]:
        trainer = getattr(service, "trainer", None)
        return service.heartbeat_stats(), trainer.stats() if trainer is not None else None

    def families() -> list[Metric]:
        stats, train = on_loop(loop, read)
        return worker_families(service.name, stats, train)

    return Collector(families)


def partitioner_collector(service: Any, loop: asyncio.AbstractEventLoop) -> Collector:
    def families() -> list[Metric]:
        stats = on_loop(loop, service.heartbeat_stats)
        return partitioner_families(service.name, stats)

    return Collector(families)


# ============================================================== the HTTP endpoint


def start(port: int, collector: Collector, addr: str = "0.0.0.0") -> Callable[[], None]:
    """Serve /metrics on `addr:port` (a thread of prometheus_client's); returns the stop."""
    registry = CollectorRegistry()
    registry.register(collector)
    ProcessCollector(registry=registry)  # process_resident_memory_bytes, CPU seconds, fds
    try:
        server, thread = start_http_server(port, addr, registry=registry)
    except OSError as exc:
        raise SystemExit(f"--metrics-port {port}: cannot listen on {addr}:{port}: {exc}") from None
    log.info("metrics on http://%s:%d/metrics", addr, port)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return stop


async def serve_with_metrics(
    serve: Coroutine[Any, Any, None],
    port: int | None,
    collector: Callable[[asyncio.AbstractEventLoop], Collector],
) -> None:
    """Run a process's `serve()`, with /metrics on `port` while it runs (none if 0/None)."""
    if not port:
        await serve
        return
    try:
        stop = start(port, collector(asyncio.get_running_loop()))
    except BaseException:
        serve.close()  # never started
        raise
    try:
        await serve
    finally:
        # Off the loop: shutdown() waits for a scrape in progress, which may wait on the loop.
        threading.Thread(target=stop, name="metrics-stop", daemon=True).start()
