"""The broker's state as plain data: peers, models, replicas, residency, requests and batches.

Nothing here talks to sockets or reads clocks; the broker's rooms (the parts of
`broker.registry`, `broker.serving_router`) change it in response to events.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from flowmesh.eviction import StageKey
from flowmesh.modelio.plan import Plan
from flowmesh.protocol import PartitionerStats, PeerInfo, TensorRef, WorkerStats
from flowmesh.spec import ModelSpec, TensorSpec
from flowmesh.value import ArrivalRate


class Phase(Enum):
    LOADING = "loading"
    RESIDENT = "resident"


@dataclass
class Residency:
    """A stage that occupies (or is about to occupy) device bytes on a worker."""

    key: StageKey
    nbytes: int
    phase: Phase
    last_used: float
    inflight: int = 0  # batches sent to this worker for this stage and not answered


@dataclass
class Peer:
    """A registered worker or partitioner."""

    name: str
    addr: bytes  # ZeroMQ routing id
    role: str
    pid: int
    device: str = ""
    kind: str = ""
    budget: int = 0
    info: PeerInfo = field(default_factory=PeerInfo)  # what it registered with
    ready: bool = False  # set by the first heartbeat after registration
    last_seen: float = 0.0
    # Its latest heartbeat's figures: a worker's, or a partitioner's (by its role).
    stats: WorkerStats | PartitionerStats = field(default_factory=WorkerStats)
    key: str = ""  # its CURVE public key (z85), from the key directory; "" without keys
    # workers only
    hosted: dict[StageKey, int] = field(default_factory=dict)  # stage -> device bytes
    resident: dict[StageKey, Residency] = field(default_factory=dict)
    inflight_runs: int = 0
    max_inflight: int = 4
    loads: int = 0
    evictions: int = 0
    # Stages we expect the worker to evict for a load (-> that Load's id), out of `resident`
    # until its `Resident` report says what it did.
    leaving: dict[StageKey, int] = field(default_factory=dict)
    reserved_for: str | None = None  # draining for a starving model
    registrations: int = 1  # registrations of this same process (a re-register keeps state)
    # partitioners only
    inflight_plans: int = 0

    @property
    def used(self) -> int:
        return sum(r.nbytes for r in self.resident.values())

    @property
    def free(self) -> int:
        return self.budget - self.used


@dataclass
class Replica:
    """One copy of a model: stage i lives on worker `workers[i]`; distinct workers, but for a
    streamed replica (`policy.shared_placement`: more stages than workers)."""

    workers: list[str]
    ready: list[bool]
    inflight: int = 0  # batches anywhere in this replica's pipeline
    # Being removed by the autoscaler: takes no new batch; dropped once nothing runs on it.
    draining: bool = False

    @property
    def live(self) -> bool:
        return all(self.ready) and not self.draining

    @property
    def streamed(self) -> bool:
        """Some worker holds several of its stages: they take turns on its device, each brought
        in by its run (the worker prefetches the next while one computes), one batch at a time."""
        return len(set(self.workers)) < len(self.workers)


@dataclass
class Request:
    tag: int  # broker-wide request number
    client: bytes
    client_id: int
    model: str
    tensors: dict[str, TensorRef]
    rows: int
    signature: tuple[Any, ...]  # requests with equal signatures can share a batch
    arrived: float
    deadline: float
    retries: int = 0
    solo: bool = False  # a batch it was in failed on model code: run it alone


@dataclass
class Batch:
    """Requests travelling together through a replica's stages."""

    run_id: int
    model: str
    replica: Replica
    requests: list[Request]
    stage: int
    worker: str
    started: float
    deadline: float = float("inf")  # the current stage must answer by then, or it hung
    info: dict[str, float] = field(default_factory=dict)
    # Where the batch is counted as running: the very objects, so that leaving never touches
    # a residency (or peer) that replaced them meanwhile. A direct run counts on every stage.
    counted_on: list[tuple[Peer, Residency | None]] = field(default_factory=list)
    direct: bool = False  # announced to every stage at once; activations go worker to worker
    separate: bool = False  # requests computed one by one in one run (`Run.separate`)
    # A generation iteration (`broker.generation.Iteration`: its `step`, the sequences in it)
    # instead of requests; its `parts`, fixed at its first stage, go with it to the next ones.
    gen: Any = None
    parts: list[list[int]] | None = None
    # The deploy it runs for: a model deployed again under the same name since is another
    # (`ServingRouter._model_of`), whose queue, figures and residencies are not this one's.
    owner: Model | None = None


@dataclass
class Call:
    """A request to a worker or partitioner that awaits its answer (until `deadline`)."""

    kind: str  # "plan" | "stage" | "load"
    peer: str
    deadline: float
    data: dict[str, Any] = field(default_factory=dict)


class ModelState(Enum):
    PLANNING = "planning"
    DEPLOYING = "deploying"
    READY = "ready"
    UNAVAILABLE = "unavailable"  # every replica lost, none repairable


@dataclass
class Drain:
    """An undeploy waiting for the model's running generations to end (`broker.catalogue`):
    new calls are refused meanwhile, and the model goes when they have ended or at `until`."""

    since: float
    until: float
    running: int  # generation calls running when it began
    waiters: list[tuple[bytes, int]] = field(default_factory=list)  # the Undeploys to answer


@dataclass
class Model:
    spec: ModelSpec
    state: ModelState
    inputs: dict[str, TensorSpec] | None = None
    plan: Plan | None = None
    stage_bytes: list[int] = field(default_factory=list)  # device bytes per stage
    replicas: list[Replica] = field(default_factory=list)
    desired_replicas: int = 1
    queue: deque[Request] = field(default_factory=deque)
    deploy_client: tuple[bytes, int] | None = None
    deploy_deadline: float = 0.0
    repair_after: float = 0.0  # a failed replica repair is not tried again before this
    avoid: set[str] = field(default_factory=set)  # workers where a run of this model hung
    # counters for status
    requests: int = 0
    completed: int = 0
    errors: int = 0
    errors_by_code: dict[str, int] = field(default_factory=dict)  # code -> requests
    loads: int = 0
    evictions: int = 0
    batches: int = 0
    latency_ms: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    within_slo: int = 0  # answered requests whose latency met spec.slo_ms
    prefetches: int = 0  # loads started before any request asked (into free bytes only)
    # Its last load failed or was never confirmed: no prefetch until a request loads it again.
    prefetch_hold: bool = False
    rate: ArrivalRate = field(default_factory=ArrivalRate)  # requests per second, decayed
    # Autoscaling (`policy.scale_step`): the deployed count it never shrinks below (0: the
    # desired count), since when the model looked hot / cool in a row, its last change, counts.
    floor_replicas: int = 0
    hot_since: float | None = None
    cool_since: float | None = None
    last_scaled: float = float("-inf")
    scale_ups: int = 0
    scale_downs: int = 0
    # A language model's files as the broker read them (`broker.lm_files.LmFiles`, read off
    # the event loop once per deploy), and whether that read is under way.
    lm: Any = None
    lm_reading: bool = False
    drain: Drain | None = None  # being undeployed, once its running generations end

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def n_stages(self) -> int:
        return len(self.stage_bytes)
