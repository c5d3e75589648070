"""The gateway's Prometheus metrics, served at `GET /metrics`: requests by route, status and
model, time to first byte by route, and open streams.

Unlike the mesh's processes (`flowmesh.metrics`, whose collectors read figures kept for status),
the gateway keeps no status of its own, so these are prometheus_client's own counters, in a
registry of the app's (two apps in one process, as in tests, count apart).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "flowmesh_gateway"
# Seconds: from a few milliseconds (a small infer) to a long prompt's prefill.
FIRST_BYTE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    """The families, registered in `registry`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            f"{PREFIX}_requests",
            "HTTP requests answered, by route template, status and model",
            ["route", "status", "model"],
            registry=self.registry,
        )
        self.first_byte = Histogram(
            f"{PREFIX}_first_byte_seconds",
            "seconds from a request's arrival to the first byte of its answer's body",
            ["route"],
            buckets=FIRST_BYTE_BUCKETS,
            registry=self.registry,
        )
        self.open_streams = Gauge(
            f"{PREFIX}_open_streams",
            "server-sent event streams open now",
            registry=self.registry,
        )
