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
    # Requests one client may have queued or running at once; beyond it, OVERLOADED: a client
    # flooding one model cannot take the whole queue from the others.
    max_client_inflight: int = 1024
    # Which model's work starts first on a worker: the earliest deadline, a request's arrival
    # plus its model's slo_ms, or plus this for a model without one (no SLOs: oldest first).
    default_slo_s: float = 10.0
    # Prefetch: a model asked for at least this often (requests/s, decayed over 30 s) and held
    # nowhere is loaded into free device bytes before its next request (never by evicting).
    prefetch_min_rate: float = 0.01
    prefetch: bool = True
    # Which resident stages a load expects to go: "value" (arrival rate x seconds to copy back,
    # least recently used among equals), "lru" (least recently used by bytes alone), or
    # "count" (Computron's: at most as many stages per worker as its budget holds of the
    # largest it hosts, least recently used first, evicted by the broker). The last two exist
    # for the serving benchmark's ablations.
    eviction: str = "value"
    default_timeout_s: float = 60.0
    # An undeploy lets the model's running generations end, for at most this long, before
    # the model goes (new calls are refused meanwhile; what still runs then fails). An
    # Undeploy's own `drain_s` wins; 0 here: at once unless asked.
    undeploy_drain_s: float = 30.0
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
    # A model cut into stages over several workers runs direct when every one of them has a
    # peer endpoint: each stage's worker sends its output straight to the next one's, the batch
    # cut into micro-batches so that the stages overlap: `micro_batches` of them, or with 0 one
    # per stage, each of at least `micro_batch_rows` rows (a small batch is not cut: every
    # micro-batch reads all of a stage's weights again). Otherwise, or with `direct` off,
    # activations travel through the broker.
    direct: bool = True
    micro_batches: int = 0
    micro_batch_rows: int = 64
    # A model that takes one request per forward (max_batch_size 1, one stage) still gets its
    # queued requests sent in one run, up to this many, each computed on its own one after
    # the other: one message and one hand-off to a compute lane for several requests. What is
    # queued is spread over the runs its worker may take, so that a short queue still runs on
    # every lane. 1: one run per request.
    group_runs: int = 8
    # Iterations of a language model's generation in flight at once per replica: its running
    # sequences split into that many groups, each group's iteration at its own stage while
    # the others are at theirs (0: one per stage; never more than its stages). 1 by default:
    # where the stages' workers share a few cores the groups only add work per token
    # (BENCHMARKS.md, "Generation"); a worker per device is where they can overlap.
    gen_groups: int = 1
    # A language model of one stage: the next iteration of a group is sent as soon as the one
    # in flight is, to follow it on the worker (`GenStep.follows`), so that no round trip to
    # the broker comes between two tokens. Off: each is sent once the last one answered.
    gen_overlap: bool = True
    # Where the broker keeps what it promised (deployed models, training jobs, the allow-list),
    # in an SQLite database (`broker.store`); None: nothing is kept across a restart.
    state_dir: str | None = None
    # Autoscaling (`policy.scale_step`): one more replica of a model whose queue holds
    # `scale_queue_high` requests per live replica, or whose offered load (arrivals/s x seconds
    # per request) is over `scale_up_load` of its replicas, for `scale_up_after_s`; one fewer
    # (never below the deployed count) once idle and under `scale_down_load` of one replica
    # fewer (or, unmeasured, under `scale_cool_rate` requests/s) for `scale_down_after_s`.
    # At most one change per `scale_cooldown_s`.
    # Off by default until measured beside the other policies (`--autoscale 1` turns it on).
    autoscale: bool = False
    scale_queue_high: int = 8
    scale_up_load: float = 0.8
    scale_down_load: float = 0.4
    scale_cool_rate: float = 0.05
    scale_up_after_s: float = 5.0
    scale_down_after_s: float = 60.0
    scale_cooldown_s: float = 30.0
    # The seconds a model's arrival rate is averaged over (`flowmesh.value.ArrivalRate`'s tau),
    # which autoscaling, prefetching and the eviction value read: how long a burst stays in it.
    rate_window_s: float = 30.0
