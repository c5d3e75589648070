"""Reports as the broker sends them (`flowmesh.reports`), built with small figures: every field
the type declares, with the ones a test names set as it names them."""

from __future__ import annotations

from typing import Any

from flowmesh.reports import (
    BrokerStatus,
    JobRow,
    ModelRow,
    PartitionerRow,
    PartitionerStats,
    ReplicaRow,
    StageRow,
    Totals,
    WorkerRow,
    WorkerStats,
)


def stage_row(index: int = 0, **fields: Any) -> StageRow:
    base: dict[str, Any] = dict(
        index=index, bytes=1 << 20, blocks=[index, index + 1], first="", last=""
    )
    return StageRow(**{**base, **fields})


def replica_row(*workers: str, **fields: Any) -> ReplicaRow:
    return ReplicaRow(**{"workers": list(workers) or ["w0"], "live": True, "inflight": 0, **fields})


def model_row(name: str = "m", **fields: Any) -> ModelRow:
    base: dict[str, Any] = dict(
        name=name,
        state="ready",
        factory="flowmesh.examples:mlp",
        dtype="float32",
        inputs={},
        bytes=1 << 20,
        stages=[stage_row()],
        replicas=[replica_row()],
        replicas_live=1,
        replicas_desired=1,
        replicas_floor=1,
        scale_ups=0,
        scale_downs=0,
        resident_on=[],
        queue=0,
        requests=0,
        completed=0,
        errors=0,
        errors_by_code={},
        refused={},
        loads=0,
        evictions=0,
        batches=0,
        mean_ms=0.0,
        p99_ms=0.0,
        queue_wait_ms=0.0,
        load_wait_ms=0.0,
        run_ms=0.0,
        mean_batch=0.0,
        slo_ms=None,
        within_slo=None,
        rate_per_s=0.0,
        prefetches=0,
    )
    return ModelRow(**{**base, **fields})


def _peer(name: str) -> dict[str, Any]:
    return dict(name=name, ready=True, pid=1, registrations=1, last_seen_s=0.0, missed_heartbeats=0)


def worker_row(name: str = "w0", **fields: Any) -> WorkerRow:
    base: dict[str, Any] = dict(
        _peer(name),
        device="cpu",
        kind="cpu",
        budget_bytes=100 << 20,
        resident_bytes=0,
        peak_bytes=0,
        host_bytes=0,
        resident=[],
        loads=0,
        load_bytes=0,
        mean_load_ms=0.0,
        evictions=0,
        inflight=0,
        reserved_for=None,
        peer_endpoint="",
        stats=WorkerStats(),
    )
    return WorkerRow(**{**base, **fields})


def partitioner_row(name: str = "part", **fields: Any) -> PartitionerRow:
    return PartitionerRow(**{**_peer(name), "inflight": 0, "stats": PartitionerStats(), **fields})


def job_row(name: str = "j", **fields: Any) -> JobRow:
    base: dict[str, Any] = dict(
        name=name,
        worker="w0",
        state="ready",
        factory="flowmesh.examples:mlp",
        config=None,
        batch=4,
        step=0,
        last_loss=None,
        steps_per_s=0.0,
        pending=0,
        sub_models=[],
        footprint=0,
        saved_step=None,
        saved_path=None,
        errors=0,
        age_s=0.0,
    )
    return JobRow(**{**base, **fields})


def broker_status(totals: Totals | None = None, **fields: Any) -> BrokerStatus:
    base: dict[str, Any] = dict(
        uptime_s=0.0,
        protocol=1,
        heartbeat_s=1.0,
        workers=[],
        partitioners=[],
        models=[],
        refused_unknown_model={},
        queued=0,
        inflight_batches=0,
        jobs=[],
        finished_jobs=[],
        restoring=False,
    )
    return BrokerStatus(**{**base, **fields}, totals=totals or Totals())
