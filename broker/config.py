"""The broker's settings: heartbeats, limits, timeouts and retry counts, in one frozen record."""

from __future__ import annotations

from dataclasses import dataclass

from flowmesh.spec import DEFAULT_ALLOW


@dataclass(frozen=True)
class BrokerConfig:
    heartbeat_s: float = 1.0
    liveness: int = 3
    allow: tuple[str, ...] = DEFAULT_ALLOW
    max_queue: int = 4096  # per model; beyond it, OVERLOADED
    default_timeout_s: float = 60.0
    deploy_timeout_s: float = 600.0
    default_replicas: int = 2
    starvation_s: float = 2.0  # a request waiting this long may evict models with queued work
    max_retries: int = 1  # re-runs of a request whose worker died
    # Every call to a peer has a deadline, so a lost or never-sent answer cannot leave state
    # waiting forever: a load not confirmed in time is dropped; a stage that does not answer a
    # run in time has hung, and its replica is re-created (elsewhere when possible).
    load_timeout_s: float = 120.0
    run_timeout_s: float = 120.0
    repair_backoff_s: float = 5.0  # after a failed replica repair, before trying again
