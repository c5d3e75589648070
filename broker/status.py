"""What `flowmesh status` shows, built from the broker's plain state by pure functions.

Kept apart from the rooms so a newcomer finds every figure's source in one place, and so that
the registry (which answers a deploy with its model's row) and the facade build the same rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from broker.policy import percentile
from broker.state import Model, Peer


def model_status(model: Model, peers: Mapping[str, Peer]) -> dict[str, Any]:
    ranges = (model.plan or {}).get("ranges", [])
    names = (model.plan or {}).get("block_names", [])
    stages = []
    for i, nbytes in enumerate(model.stage_bytes):
        a, b = ranges[i] if i < len(ranges) else (0, 0)
        stages.append(
            {
                "index": i,
                "bytes": nbytes,
                "blocks": [a, b],
                "first": names[a] if a < len(names) else "",
                "last": names[b - 1] if 0 < b <= len(names) else "",
            }
        )
    resident_on = sorted({w.name for w in peers.values() for k in w.resident if k[0] == model.name})
    lat = list(model.latency_ms)
    return {
        "name": model.name,
        "state": model.state.value,
        "factory": model.spec.factory,
        "dtype": model.spec.dtype,
        "inputs": {
            n: {"dtype": t.dtype, "shape": list(t.shape)} for n, t in (model.inputs or {}).items()
        },
        "bytes": sum(model.stage_bytes),
        "stages": stages,
        "replicas": [
            {"workers": r.workers, "live": r.live, "inflight": r.inflight} for r in model.replicas
        ],
        "resident_on": resident_on,
        "queue": len(model.queue),
        "requests": model.requests,
        "completed": model.completed,
        "errors": model.errors,
        "loads": model.loads,
        "evictions": model.evictions,
        "batches": model.batches,
        "mean_ms": sum(lat) / len(lat) if lat else 0.0,
        "p99_ms": percentile(lat, 99),
    }


def peer_rows(
    peers: Mapping[str, Peer], now: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(workers, partitioners), each sorted by name."""
    workers, partitioners = [], []
    for peer in sorted(peers.values(), key=lambda w: w.name):
        row = {
            "name": peer.name,
            "ready": peer.ready,
            "pid": peer.pid,
            "registrations": peer.registrations,
            "last_seen_s": round(now - peer.last_seen, 3),
        }
        if peer.role == "partitioner":
            partitioners.append({**row, "inflight": peer.inflight_plans, "stats": peer.stats})
            continue
        workers.append(
            {
                **row,
                "device": peer.device,
                "kind": peer.kind,
                "budget_bytes": peer.budget,
                "resident_bytes": peer.used,
                "peak_bytes": int(peer.stats.get("peak_bytes", 0)),
                "host_bytes": int(peer.stats.get("host_bytes", 0)),
                "resident": sorted(f"{k[0]}/{k[1]}" for k in peer.resident),
                "loads": peer.loads,
                "evictions": peer.evictions,
                "inflight": peer.inflight_runs,
                "reserved_for": peer.reserved_for,
                "stats": peer.stats,
            }
        )
    return workers, partitioners
