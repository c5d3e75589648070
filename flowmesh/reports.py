"""What the broker reports about itself, declared once: the status (`BrokerStatus`) with its rows
for models, workers, partitioners and training jobs, and its totals.

The broker builds these (`broker.status`, `BrokerCore.status`, the training router's job rows);
`StatusReply`, `JobsReply`, `Deployed` and `TrainOpened` carry them; the CLI, the metrics, the
demo and the tests read them by attribute. Like every nested part of a message, a row takes no
field it does not declare, and a client's decoder refuses a malformed one (a `DecodeError` with
a code and a reason). `msgspec.to_builtins` gives the plain data `flowmesh status --json`
prints, with the field names below as its keys.

The scalar types the messages share (`Count`, `Finite`) and a peer's heartbeat figures
(`WorkerStats`, `PartitionerStats`) are declared here too, so that `flowmesh.messages` imports
this module and not the other way round. No torch import.
"""

from __future__ import annotations

import sys
from typing import Annotated

import msgspec
from msgspec import Meta, field

from flowmesh.spec import TensorSpec
from flowmesh.train_spec import TrainConfig

Count = Annotated[int, Meta(ge=0)]  # bytes, stages, steps, seqs, frames
_BIG = sys.float_info.max
Finite = Annotated[float, Meta(ge=-_BIG, le=_BIG)]  # no NaN, no infinity

class _Row(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A part of a report: every field named when built, nothing unknown on receipt."""


# -- what a peer reports with its heartbeats, stored by the broker and shown by status


MAX_HELD_ENTRIES = 4096  # a worker lists each stage it holds, once per map
# "model/stage" -> a figure of that stage; bounded, so that a peer cannot grow every later status.
PerStage = Annotated[dict[str, Count], Meta(max_length=MAX_HELD_ENTRIES)]


class WorkerStats(_Row, tag="worker", tag_field="role"):
    """A worker's heartbeat figures (`gpu_worker.hands.Hands.stats`): its serving executor's
    counters and memory, its arena, its host tier, generation's KV cache, direct runs and, when
    it trains, its trainer's. Each has the value a worker that does not report it stands for;
    a wrong type or value is refused on receipt (BAD_MESSAGE, naming the field)."""

    # -- serving runs and loads (`gpu_worker.executor.Executor.counters`)
    loads: Count = 0
    evictions: Count = 0
    runs: Count = 0
    run_errors: Count = 0
    bytes_loaded: Count = 0
    rows: Count = 0
    load_waits: Count = 0  # loads that waited for training to give memory back
    evictions_chosen: Count = 0  # idle stages evicted to make room for a load
    implicit_loads: Count = 0  # stages brought back because a run asked for them
    prefetches: Count = 0  # next stages loaded while the stage before them computed
    gen_runs: Count = 0  # iterations of generation
    kv_refused: Count = 0  # iterations whose KV blocks could not be placed
    # Preempted sequences: KV parked in host memory, or dropped to be recomputed; parked KV
    # copied back.
    kv_parked: Count = 0
    kv_dropped: Count = 0
    kv_restored: Count = 0
    # -- serving memory, as the stages see it (the arena's figures cannot exceed the budget by
    # construction; these can, if the bookkeeping is wrong)
    budget_bytes: Count = 0
    resident_bytes: Count = 0
    peak_bytes: Count = 0
    resident_stages: PerStage = msgspec.field(default_factory=dict)
    stage_bytes_peak: Count = 0
    largest_free: Count = 0
    host_bytes: Count = 0
    inflight: Count = 0
    # "model/stage" -> its state ("host", "loading", "resident", ...)
    stages: Annotated[dict[str, str], Meta(max_length=MAX_HELD_ENTRIES)] = msgspec.field(
        default_factory=dict
    )
    stages_prepared: Count = 0
    # Stages being read and built ("model/stage" -> [bytes read, bytes in all]).
    preparing: Annotated[dict[str, list[Count]], Meta(max_length=MAX_HELD_ENTRIES)] = (
        msgspec.field(default_factory=dict)
    )
    # -- generation's KV cache: bytes and blocks held (in the serving budget, counted in
    # resident_bytes too), the sequences holding them, what its models' KV may take together
    # (`gpu_worker.kv_cache.kv_limit_bytes`) and the blocks that limit still allows (None before
    # a KV cache is made here: no block size to count in)
    kv_bytes: Count = 0
    kv_blocks: Count = 0
    kv_seqs: Count = 0
    kv_limit_bytes: Count = 0
    kv_blocks_free: Count | None = None
    kv_parked_bytes: Count = 0  # preempted sequences' KV parked in host memory here
    kv_parked_seqs: Count = 0
    # The KV bytes per stage holding some, for the broker's eviction choice: a stage's resident
    # bytes are its weights + its live KV.
    kv_stage_bytes: PerStage = msgspec.field(default_factory=dict)
    # -- the device: the prefault's seconds (None: switched off), the pinned host tier (0 on a
    # CPU stand-in), NVML's figures (None without NVML)
    prefault_s: Finite | None = None
    host_tier_bytes: Count = 0
    host_tier_used_bytes: Count = 0
    host_tier_peak_bytes: Count = 0
    host_tier_largest_free: Count = 0
    host_tier_buffers: Count = 0
    gpu_name: str | None = None
    gpu_total_bytes: Count | None = None
    gpu_used_bytes: Count | None = None
    gpu_util_pct: Count | None = None
    # -- the one arena, serving and training (`gpu_worker.memory.Memory.stats`)
    arena_bytes: Count = 0
    arena_in_use: Count = 0
    arena_peak: Count = 0
    arena_largest_free: Count = 0
    serving_in_use: Count = 0
    training_in_use: Count = 0
    training_held: Count = 0  # held for pipelined stages' lives, at the arena's top
    memory_claims: Count = 0
    train_reclaimed_bytes: Count = 0
    train_borrowed_peak: Count = 0
    # -- answers and direct runs
    lane_answers: Count = 0  # runs answered from a compute lane
    reader_runs: Count = 0  # runs answered from the reader thread
    hops_in: Count = 0
    hops_early: Count = 0
    hops_dropped: Count = 0
    direct_runs: Count = 0
    direct_pending: Count = 0  # announced runs not finished here
    # -- training (`gpu_worker.train_executor.TrainingExecutor.stats`; 0 for a worker that
    # takes no jobs)
    train_jobs: Count = 0
    train_steps: Count = 0
    train_step_errors: Count = 0
    train_budget_bytes: Count = 0
    train_reserved_bytes: Count = 0
    train_resident_bytes: Count = 0
    train_evals: Count = 0
    train_reserved_peak: Count = 0
    train_resident_peak: Count = 0
    train_bytes_in: Count = 0
    train_tasks: Count = 0
    train_tasks_admitted: Count = 0
    train_tasks_started: Count = 0
    train_job_switches: Count = 0
    train_tasks_reclaimed: Count = 0
    # What a step's tasks left for its later ones (activations, what a forward saved for its
    # backward): bytes kept on the device beside the arena now, at most, and the room's limit;
    # all told, bytes kept there and bytes copied to the host tier (`gpu_worker.resident_room`).
    train_stash_device_bytes: Count = 0
    train_stash_device_peak: Count = 0
    train_stash_device_limit: Count = 0
    train_stash_device_kept_bytes: Count = 0
    train_stash_host_bytes: Count = 0
    # Pipelined jobs' stages held here, and the bytes they keep resident with their gradients
    # (their parameters and optimizer state in the arena: `training_held`).
    pipe_stages: Count = 0
    pipe_bytes: Count = 0
    # -- every peer's (`flowmesh.peer.Peer.peer_stats`); the key counters only with CURVE keys
    dropped_sends: Count = 0
    reconnects: Count = 0
    auth_refusals: Count | None = None
    peer_refused: Count | None = None  # peer-socket keys no run named


class PartitionerStats(_Row, tag="partitioner", tag_field="role"):
    """A partitioner's heartbeat figures (`partitioner.service.PartitionerService.stats`)."""

    planned: Count = 0
    failed: Count = 0
    inflight: Count = 0  # plans being computed
    dropped_sends: Count = 0
    reconnects: Count = 0
    auth_refusals: Count | None = None


PeerStats = WorkerStats | PartitionerStats


# -- models


class StageRow(_Row):
    """Stage `index` of a model's plan: its device bytes, its blocks [start, stop) and the
    names of its first and last block."""

    index: Count
    bytes: Count
    blocks: list[Count]
    first: str
    last: str


class ReplicaRow(_Row):
    """One copy of a model: stage i on `workers[i]`; `live` once every stage is deployed."""

    workers: list[str]
    live: bool
    inflight: Count


class ModelRow(_Row):
    """A deployed model (`broker.status.model_status`); also what a deploy is answered with."""

    name: str
    state: str
    factory: str | None
    dtype: str
    inputs: dict[str, TensorSpec]  # its declared inputs
    bytes: Count
    stages: list[StageRow]
    replicas: list[ReplicaRow]
    # Replicas able to run / wanted now (the deployed count plus what autoscaling added).
    replicas_live: Count
    replicas_desired: Count
    replicas_floor: Count
    scale_ups: Count
    scale_downs: Count
    resident_on: list[str]
    queue: Count
    requests: Count
    completed: Count
    errors: Count
    errors_by_code: dict[str, Count]
    refused: dict[str, Count]  # requests refused at the door, by code
    loads: Count
    evictions: Count
    batches: Count
    mean_ms: float  # over the latest answered requests
    p99_ms: float
    # Means over every answered request (the same histograms as /metrics).
    queue_wait_ms: float
    load_wait_ms: float
    run_ms: float
    mean_batch: float
    slo_ms: float | None
    # Of the answered requests, the fraction within the model's latency objective.
    within_slo: float | None
    rate_per_s: float  # decayed arrival rate as of the model's last request
    prefetches: Count
    # Generation (language models): sequences running on replicas and waiting to join, new
    # tokens generated, iterations run (each a Run through every stage).
    running_seqs: Count = 0
    waiting_seqs: Count = 0
    tokens_generated: Count = 0
    gen_iterations: Count = 0
    preemptions: Count = 0  # sequences taken off for memory and run again later
    restarts: Count = 0  # sequences started again elsewhere after their worker was lost
    tokens_per_s: float = 0.0  # decayed rate of new tokens as of the model's last one
    # Quantiles read from the broker's TTFT and inter-token histograms (the ones /metrics has).
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    itl_p50_ms: float = 0.0
    itl_p99_ms: float = 0.0
    # Of the preempted sequences that ran again: those resumed from their KV, parked in their
    # workers' host memory, and those whose KV was recomputed from their tokens.
    swaps: Count = 0
    recomputes: Count = 0

    @property
    def preemptions_by_kind(self) -> dict[str, int]:
        """What became of the sequences taken off a replica: "swap" (preempted for memory, its
        KV parked in host memory and copied back when it joined again), "recompute" (preempted,
        its KV recomputed from its tokens) and "restart" (its KV lost with a worker or an
        evicted stage: started again from its tokens)."""
        return {"swap": self.swaps, "recompute": self.recomputes, "restart": self.restarts}


# -- peers


class PeerRow(_Row):
    """What the broker knows of every peer (`broker.status.peer_rows`)."""

    name: str
    ready: bool
    pid: Count
    registrations: Count
    last_seen_s: float
    # Heartbeat intervals since the peer was last heard (liveness of them loses it).
    missed_heartbeats: Count


class PartitionerRow(PeerRow):
    inflight: Count  # plans asked for, not answered
    stats: PartitionerStats  # its latest heartbeat's figures


class WorkerRow(PeerRow):
    device: str
    kind: str
    budget_bytes: Count
    resident_bytes: Count
    peak_bytes: Count
    # The broker's own view, current as soon as a StageReady arrives (the worker's heartbeat
    # figure lags a beat); stages being deployed count at planned size.
    host_bytes: Count
    resident: list[str]  # "model/stage"
    loads: Count
    load_bytes: Count
    mean_load_ms: float
    evictions: Count
    inflight: Count  # runs sent, not answered
    reserved_for: str | None  # draining for a starving model
    # Where the previous stage of a direct run sends it activations ("": relayed).
    peer_endpoint: str
    stats: WorkerStats  # its latest heartbeat's figures

    # Generation's KV cache here, from its heartbeat figures (counted in resident_bytes there).
    @property
    def kv_bytes(self) -> int:
        return self.stats.kv_bytes

    @property
    def kv_blocks(self) -> int:
        return self.stats.kv_blocks

    @property
    def kv_seqs(self) -> int:
        return self.stats.kv_seqs

    @property
    def kv_limit_bytes(self) -> int:
        return self.stats.kv_limit_bytes

    @property
    def kv_blocks_free(self) -> int:
        """KV blocks the limit still allows beside those held (the worker's `kv_blocks_free`)."""
        return self.stats.kv_blocks_free or 0


# -- training jobs


class SubModelRow(_Row):
    """A training job's sub-model: its blocks [start, stop), host-tier bytes, the arena bytes
    its largest task takes, and its activation policy: what the backward does for the
    activations of the step's forward ("recompute": runs the forward again from the kept
    input; "keep": the forward's graph is kept until the backward, as a pipelined job's stage
    keeps each micro-batch's; "selective": the forward's matrix products' outputs are kept,
    the rest computed again from its input; "none": forward and backward are one task, nothing
    is kept between them; "": a worker that reports none)."""

    blocks: list[Count]
    host_bytes: Count
    task_bytes: Count
    activations: str = ""


class OpenedJob(_Row):
    """What a worker answers a training job's opening with (`JobOpened`)."""

    name: str
    worker: str
    step: Count
    sub_models: list[SubModelRow]
    footprint: Count
    host_bytes: Count
    largest_task: Count
    config: TrainConfig  # what the worker runs (a checkpoint's, when resumed)


class JobRow(_Row):
    """A training job as the broker reports it (`flowmesh jobs`, `TrainOpened`)."""

    name: str
    worker: str
    state: str
    factory: str | None
    # How it trains; None for a job resumed with its checkpoint's configuration until its
    # worker has opened it and said which.
    config: TrainConfig | None
    batch: Count
    step: Count
    last_loss: float | None
    steps_per_s: float
    pending: Count  # calls awaiting the worker
    sub_models: list[SubModelRow]
    footprint: Count
    saved_step: Count | None
    saved_path: str | None
    errors: Count
    age_s: float
    # Progress, from the step answers (`flowmesh.messages.TrainStepResult`): rows trained per
    # second over the same recent steps as `steps_per_s`, and rows in all; what the last step
    # moved between the host tier and the device (`step_bytes_in`: into the arena,
    # `step_bytes_out`: written back) and how long its tasks waited for arena memory; and the
    # same figures summed over every step answered.
    samples_per_s: float = 0.0
    samples: Count = 0
    # Target tokens (a language model's steps: integer targets over a sequence), as samples.
    tokens_per_s: float = 0.0
    tokens: Count = 0
    step_bytes_in: Count = 0
    step_bytes_out: Count = 0
    step_memory_wait_s: Finite = 0.0
    bytes_in: Count = 0
    bytes_out: Count = 0
    memory_wait_s: Finite = 0.0
    # A pipelined job's stages' workers, in stage order (empty: one worker, `worker`).
    pipeline: list[str] = field(default_factory=list)


# -- the broker as a whole


class Totals(_Row):
    """The broker's counters since it started."""

    requests: Count = 0
    completed: Count = 0
    errors: Count = 0
    batches: Count = 0
    retried: Count = 0  # requests run again after their worker was lost
    hung_runs: Count = 0
    expired_calls: Count = 0
    dropped_sends: Count = 0
    direct_batches: Count = 0  # multi-stage batches whose activations went worker to worker
    activation_bytes_relayed: Count = 0  # activations forwarded by the broker between stages
    heartbeat_losses: Count = 0
    auth_refused: Count = 0  # messages refused for their peer's key (CURVE)
    zap_refused: Count = 0  # connections refused by the ZAP handler
    names_refused: Count = 0  # registrations under a name taken by another key
    train_steps: Count = 0
    train_step_errors: Count = 0
    train_expired: Count = 0
    train_idle_closed: Count = 0


class BrokerStatus(_Row):
    """What `flowmesh status` shows and the broker's /metrics reads (`BrokerCore.status`)."""

    uptime_s: float
    protocol: int
    heartbeat_s: float
    workers: list[WorkerRow]
    partitioners: list[PartitionerRow]
    models: list[ModelRow]
    refused_unknown_model: dict[str, Count]  # requests naming no deployed model, by code
    queued: Count
    inflight_batches: Count
    jobs: list[JobRow]
    # Jobs that ended, as they were at the end (state "closed", or "lost" with their worker):
    # the latest of each name, oldest first, a bounded number (the training router's).
    finished_jobs: list[JobRow]
    # After a restart, until the workers named in the state store came back.
    restoring: bool
    totals: Totals
