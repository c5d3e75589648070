"""What `flowmesh status` shows, built from the broker's plain state by pure functions.

Kept apart from the rooms so a newcomer finds every figure's source in one place, and so that
the registry (which answers a deploy with its model's row) and the facade build the same rows.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from typing import Any

from prometheus_client import Counter, Histogram
from prometheus_client.metrics_core import Metric

from broker.policy import percentile
from broker.state import Model, Peer
from flowmesh.reports import (
    ModelRow,
    PartitionerRow,
    PartitionerStats,
    ReplicaRow,
    StageRow,
    WorkerRow,
)

# Seconds, from a warm sub-millisecond run to a cold load of a large model.
TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Seconds, from a token of a warm tiny model (under a millisecond) to a first token that waited
# for a load and a queue: 1-2-5 steps, so a quantile read from them is within one step.
TOKEN_BUCKETS = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
)  # fmt: skip


def bucket_quantile(q: float, bounds: tuple[float, ...], cumulative: list[float]) -> float:
    """The q-quantile (0..1) of a histogram from its cumulative bucket counts (`bounds` the upper
    bounds, the last count the +Inf bucket's), interpolated linearly inside the bucket as
    Prometheus's `histogram_quantile` does, so status and a dashboard read the same figure; the
    largest finite bound when it falls in +Inf; 0.0 for no observations."""
    total = cumulative[-1] if cumulative else 0.0
    if total <= 0:
        return 0.0
    rank = q * total
    below, lower = 0.0, 0.0
    for bound, count in zip(bounds, cumulative, strict=False):
        if count >= rank:
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        below, lower = count, bound
    return bounds[-1]


class Timings:
    """What each answered request waited for and ran, by model, and each worker's loads.

    prometheus_client histograms, not registered anywhere global: the broker's /metrics
    collector yields them whole (`collect`), and `flowmesh status` reads their sums and counts
    (`means`), so both show the same figures. Observed by the serving router as it answers a
    request, starts a batch, or hears that a load finished.
    """

    def __init__(self) -> None:
        def hist(name: str, doc: str, label: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, [label], buckets=buckets, registry=None)

        self.latency = hist(
            "flowmesh_broker_request_latency_seconds",
            "Arrival at the broker to the answer, per answered request",
            "model",
            TIME_BUCKETS,
        )
        self.queue_wait = hist(
            "flowmesh_broker_request_queue_wait_seconds",
            "Arrival to the start of the request's batch",
            "model",
            TIME_BUCKETS,
        )
        self.load_wait = hist(
            "flowmesh_broker_request_load_wait_seconds",
            "Time the request's runs waited on the workers for stage weights to arrive",
            "model",
            TIME_BUCKETS,
        )
        self.run = hist(
            "flowmesh_broker_request_run_seconds",
            "Start of the request's batch to the last stage's answer (load wait included)",
            "model",
            TIME_BUCKETS,
        )
        self.batch = hist(
            "flowmesh_broker_batch_size",
            "Requests per batch started",
            "model",
            BATCH_BUCKETS,
        )
        self.load = hist(
            "flowmesh_broker_worker_load_seconds",
            "Seconds a worker took to load a stage onto its device (Loaded.seconds)",
            "worker",
            TIME_BUCKETS,
        )
        self.load_bytes = Counter(
            "flowmesh_broker_worker_load_bytes",
            "Stage bytes loaded onto a worker's device (host to device)",
            ["worker"],
            registry=None,
        )
        self.ttft = hist(
            "flowmesh_broker_time_to_first_token_seconds",
            "Arrival of a Generate to a sequence's first new token, per sequence",
            "model",
            TOKEN_BUCKETS,
        )
        self.itl = hist(
            "flowmesh_broker_inter_token_latency_seconds",
            "Time from one new token of a sequence to its next",
            "model",
            TOKEN_BUCKETS,
        )
        self._children: dict[str, tuple[Histogram, ...]] = {}
        self._token_children: dict[str, tuple[Histogram, Histogram]] = {}
        self._workers: set[str] = set()  # those with load series

    def keep_only(self, models: Container[str], workers: Container[str]) -> None:
        """Drop the series of models no longer deployed and of workers no longer registered: a
        broker lives for weeks, models come and go, and a CPU worker's name changes with its
        pid. (A name back later starts its series again, as a counter reset.)"""
        for name in [m for m in self._children if m not in models]:
            del self._children[name]
            for h in (self.latency, self.queue_wait, self.load_wait, self.run, self.batch):
                h.remove(name)
        for name in [m for m in self._token_children if m not in models]:
            del self._token_children[name]
            self.ttft.remove(name)
            self.itl.remove(name)
        for name in [w for w in self._workers if w not in workers]:
            self._workers.discard(name)
            self.load.remove(name)
            self.load_bytes.remove(name)

    def answered(self, model: str, info: Mapping[str, Any]) -> None:
        """One request answered with `info` (the Result's, in milliseconds)."""
        latency, queue_wait, load_wait, run, _ = self._of(model)
        latency.observe(info["latency_ms"] / 1000)
        queue_wait.observe(info["queue_ms"] / 1000)
        load_wait.observe(info["load_wait_ms"] / 1000)
        run.observe(info["run_ms"] / 1000)

    def batch_started(self, model: str, requests: int) -> None:
        self._of(model)[4].observe(requests)

    def _of(self, model: str) -> tuple[Histogram, ...]:
        """A model's histogram children, looked up once (`labels` takes a lock and builds a
        key on every call; these run for every request answered)."""
        got = self._children.get(model)
        if got is None:
            got = self._children[model] = tuple(
                h.labels(model)
                for h in (self.latency, self.queue_wait, self.load_wait, self.run, self.batch)
            )
        return got

    def _tokens_of(self, model: str) -> tuple[Histogram, Histogram]:
        got = self._token_children.get(model)
        if got is None:
            got = self._token_children[model] = (self.ttft.labels(model), self.itl.labels(model))
        return got

    def first_token(self, model: str, seconds: float) -> None:
        """A sequence's first new token came `seconds` after its call arrived."""
        self._tokens_of(model)[0].observe(seconds)

    def next_token(self, model: str, seconds: float) -> None:
        """A sequence's next new token came `seconds` after its previous one."""
        self._tokens_of(model)[1].observe(seconds)

    def token_quantiles(self, model: str) -> dict[str, float]:
        """A model's TTFT and inter-token p50 and p99 (ms), read from the histograms' buckets."""
        out = {}
        for name, metric in (("ttft", self.ttft), ("itl", self.itl)):
            counts = [0.0] * (len(TOKEN_BUCKETS) + 1)
            for family in metric.collect():
                for s in family.samples:
                    if s.name.endswith("_bucket") and s.labels.get("model") == model:
                        le = s.labels["le"]
                        at = len(TOKEN_BUCKETS) if le == "+Inf" else TOKEN_BUCKETS.index(float(le))
                        counts[at] = s.value
            for q in (50, 99):
                out[f"{name}_p{q}_ms"] = 1000 * bucket_quantile(q / 100, TOKEN_BUCKETS, counts)
        return out

    def loaded(self, worker: str, nbytes: int, seconds: float) -> None:
        self._workers.add(worker)
        self.load.labels(worker).observe(seconds)
        self.load_bytes.labels(worker).inc(nbytes)

    def collect(self) -> Iterable[Metric]:
        for metric in (
            self.latency,
            self.queue_wait,
            self.load_wait,
            self.run,
            self.batch,
            self.load,
            self.load_bytes,
            self.ttft,
            self.itl,
        ):
            yield from metric.collect()

    @staticmethod
    def sums(metric: Histogram | Counter) -> dict[str, tuple[float, float]]:
        """{label value: (sum, count)} of a one-label histogram; a counter's count is 0."""
        out: dict[str, list[float]] = {}
        for family in metric.collect():
            for s in family.samples:
                value = next((v for k, v in s.labels.items() if k != "le"), "")
                if s.name.endswith("_sum") or s.name.endswith("_total"):
                    out.setdefault(value, [0.0, 0.0])[0] = s.value
                elif s.name.endswith("_count"):
                    out.setdefault(value, [0.0, 0.0])[1] = s.value
        return {k: (v[0], v[1]) for k, v in out.items()}

    def model_means(self) -> dict[str, dict[str, float]]:
        """Per model: requests answered and the mean of each timing (ms) and of batch sizes."""
        out: dict[str, dict[str, float]] = {}
        for key, metric in (
            ("queue_wait_ms", self.queue_wait),
            ("load_wait_ms", self.load_wait),
            ("run_ms", self.run),
        ):
            for model, (total, n) in self.sums(metric).items():
                row = out.setdefault(model, {})
                row["answered"] = n
                row[key] = 1000 * total / n if n else 0.0
        for model, (total, n) in self.sums(self.batch).items():
            out.setdefault(model, {})["mean_batch"] = total / n if n else 0.0
        return out

    def worker_loads(self) -> dict[str, dict[str, float]]:
        """Per worker: loads timed, their bytes and mean seconds."""
        out: dict[str, dict[str, float]] = {}
        for worker, (total, n) in self.sums(self.load).items():
            out[worker] = {"timed_loads": n, "mean_load_ms": 1000 * total / n if n else 0.0}
        for worker, (total, _) in self.sums(self.load_bytes).items():
            out.setdefault(worker, {})["load_bytes"] = total
        return out


def model_status(
    model: Model,
    peers: Mapping[str, Peer],
    timing: Mapping[str, float] | None = None,
    refused: Mapping[str, int] | None = None,
    gen: Any = None,
) -> ModelRow:
    """A model's row; `timing` is its entry of `Timings.model_means()`, `refused` its requests
    refused at the door by code (`ServingRouter.refused`), `gen` its generation figures
    (`GenerationRoom.figures`)."""
    ranges = model.plan.ranges if model.plan is not None else ()
    names = model.plan.block_names if model.plan is not None else ()
    stages = []
    for i, nbytes in enumerate(model.stage_bytes):
        a, b = ranges[i] if i < len(ranges) else (0, 0)
        stages.append(
            StageRow(
                index=i,
                bytes=nbytes,
                blocks=[a, b],
                first=names[a] if a < len(names) else "",
                last=names[b - 1] if 0 < b <= len(names) else "",
            )
        )
    resident_on = sorted({w.name for w in peers.values() for k in w.resident if k[0] == model.name})
    lat = list(model.latency_ms)
    timing = timing or {}
    return ModelRow(
        name=model.name,
        state="draining" if model.drain is not None else model.state.value,
        factory=model.spec.factory,
        dtype=model.spec.dtype,
        inputs=dict(model.inputs or {}),
        bytes=sum(model.stage_bytes),
        stages=stages,
        replicas=[
            ReplicaRow(workers=list(r.workers), live=r.live, inflight=r.inflight)
            for r in model.replicas
        ],
        replicas_live=sum(r.live for r in model.replicas),
        replicas_desired=model.desired_replicas,
        replicas_floor=model.floor_replicas or model.desired_replicas,
        scale_ups=model.scale_ups,
        scale_downs=model.scale_downs,
        resident_on=resident_on,
        queue=len(model.queue),
        requests=model.requests,
        completed=model.completed,
        errors=model.errors,
        errors_by_code=dict(sorted(model.errors_by_code.items())),
        refused=dict(sorted((refused or {}).items())),
        loads=model.loads,
        evictions=model.evictions,
        batches=model.batches,
        mean_ms=sum(lat) / len(lat) if lat else 0.0,
        p99_ms=percentile(lat, 99),
        queue_wait_ms=timing.get("queue_wait_ms", 0.0),
        load_wait_ms=timing.get("load_wait_ms", 0.0),
        run_ms=timing.get("run_ms", 0.0),
        mean_batch=timing.get("mean_batch", 0.0),
        slo_ms=model.spec.slo_ms,
        within_slo=(model.within_slo / model.completed if model.completed else None)
        if model.spec.slo_ms is not None
        else None,
        rate_per_s=model.rate.value,
        prefetches=model.prefetches,
        running_seqs=gen.running if gen is not None else 0,
        waiting_seqs=gen.waiting if gen is not None else 0,
        tokens_generated=gen.tokens if gen is not None else 0,
        gen_iterations=gen.iterations if gen is not None else 0,
        preemptions=gen.preemptions if gen is not None else 0,
        restarts=gen.restarts if gen is not None else 0,
        swaps=gen.swaps if gen is not None else 0,
        recomputes=gen.recomputes if gen is not None else 0,
        tokens_per_s=gen.tokens_per_s if gen is not None else 0.0,
        ttft_p50_ms=gen.ttft_p50_ms if gen is not None else 0.0,
        ttft_p99_ms=gen.ttft_p99_ms if gen is not None else 0.0,
        itl_p50_ms=gen.itl_p50_ms if gen is not None else 0.0,
        itl_p99_ms=gen.itl_p99_ms if gen is not None else 0.0,
    )


def peer_rows(
    peers: Mapping[str, Peer],
    now: float,
    loads: Mapping[str, Mapping[str, float]] | None = None,
    heartbeat_s: float = 1.0,
) -> tuple[list[WorkerRow], list[PartitionerRow]]:
    """(workers, partitioners), each sorted by name; `loads` is `Timings.worker_loads()`."""
    workers, partitioners = [], []
    for peer in sorted(peers.values(), key=lambda w: w.name):
        row: dict[str, Any] = {
            "name": peer.name,
            "ready": peer.ready,
            "pid": peer.pid,
            "registrations": peer.registrations,
            "last_seen_s": round(now - peer.last_seen, 3),
            "missed_heartbeats": int(max(0.0, now - peer.last_seen) // heartbeat_s),
        }
        stats = peer.stats
        if isinstance(stats, PartitionerStats):  # a partitioner's, by its role
            partitioners.append(PartitionerRow(**row, inflight=peer.inflight_plans, stats=stats))
            continue
        timed = (loads or {}).get(peer.name, {})
        workers.append(
            WorkerRow(
                **row,
                device=peer.device,
                kind=peer.kind,
                budget_bytes=peer.budget,
                resident_bytes=peer.used,
                peak_bytes=stats.peak_bytes,
                host_bytes=sum(peer.hosted.values()),
                resident=sorted(f"{k[0]}/{k[1]}" for k in peer.resident),
                loads=peer.loads,
                load_bytes=int(timed.get("load_bytes", 0)),
                mean_load_ms=timed.get("mean_load_ms", 0.0),
                evictions=peer.evictions,
                inflight=peer.inflight_runs,
                reserved_for=peer.reserved_for,
                peer_endpoint=peer.info.peer_endpoint,
                stats=stats,
            )
        )
    return workers, partitioners
