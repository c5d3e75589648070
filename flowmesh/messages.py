"""Every message flowmesh sends, declared once: a `msgspec.Struct` per message type.

A message's header is a msgpack map: its type `t` (the struct's tag), its fields, and the
protocol version `v`. The declarations below are the schema both ways: `flowmesh.codec` encodes a
message from its struct and decodes a header straight into the union of all of them, and msgspec
checks every field's type and constraint on receipt (`Id`, `Count`: integers >= 0, never a
bool). Tensors are not header values: `tensors` maps a name to a tensor in a process, and travels
as one raw frame per tensor after the header, listed in it as `[name, dtype, shape]`
(`flowmesh.codec`).

The payloads a message carries are declared once where they belong, and checked on receipt like
every field: the model spec (`flowmesh.spec.ModelSpec`), the plan (`flowmesh.modelio.plan.Plan`),
the training configuration (`flowmesh.train_spec.TrainConfig`), what a peer says of itself as it
registers (`PeerInfo`); a refusal inside one is answered BAD_REQUEST, naming the field. Values
still typed `Any` (a spec's kwargs) are plain data: maps keyed by strings, lists, scalars; the
codec refuses anything else in them. What the broker reports of itself (status, model and job
rows) is declared in `flowmesh.reports`.

This module does not import torch, so the broker can stay free of it.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, ClassVar, Literal, Union

import msgpack
import msgspec
from msgspec import Meta, field

from flowmesh.modelio.plan import Plan
from flowmesh.reports import (
    BrokerStatus,
    Count,
    Finite,
    JobRow,
    ModelRow,
    OpenedJob,
    PartitionerStats,
    PeerStats,
    SubModelRow,
    WorkerStats,
)
from flowmesh.spec import ModelSpec, TensorSpec
from flowmesh.train_spec import TrainConfig

PROTOCOL_VERSION = 1

# Bytes per element of every dtype that may travel.
ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

Id = Annotated[int, Meta(ge=0)]  # a call's, run's or ticket's id
Seconds = Annotated[float, Meta(ge=0)]  # a duration (NaN is not one)

# A tensor as the header lists it: [name, dtype, shape]. How many dims a process takes is its
# `Limits.max_dims`, checked by the codec with the frames' sizes.
Dtype = Literal[tuple(ITEMSIZE)]  # type: ignore[valid-type]
TensorMeta = tuple[str, Dtype, list[Count]]
# In a process: name -> torch tensor or `codec.TensorRef`. On the wire: the header's list of
# `TensorMeta`, one per frame after the header (the codec turns one into the other).
Tensors = Union[dict[str, Any], list[TensorMeta]]  # noqa: UP007 (msgspec reads it at run time)
# A batch's tensors part by part (`Run`, `RunResult`; part k is the k-th of the run's `parts`):
# in a process one name -> tensor map per part; on the wire one list of `TensorMeta` per part,
# the frames following part after part.
PartTensors = list[Union[dict[str, Any], list[TensorMeta]]]  # noqa: UP007 (as `Tensors`)
# The keyword inputs of a training batch, each a tensor of that name: distinct, at least one,
# none named 'targets' (the batch's targets).
KeywordInputs = Annotated[
    list[Annotated[str, Meta(min_length=1, pattern="^(?!targets$)")]], Meta(min_length=1)
]


def batch_names(inputs: list[str] | None) -> list[str]:
    """The tensors a training batch (`TrainStep`, `TrainEval`) carries, inputs first."""
    return [*(["inputs"] if inputs is None else inputs), "targets"]


class Message(msgspec.Struct, tag_field="t", forbid_unknown_fields=True, kw_only=True):
    """Base of all message types. `TYPE` is the wire name (the tag); `HAS_TENSORS`: whether
    the type carries tensor frames; `PARTED`: whether its tensors are `PartTensors` (one map
    per part of a batch) rather than `Tensors`. `v` is set for every message sent, checked on
    receipt."""

    TYPE: ClassVar[str] = ""
    HAS_TENSORS: ClassVar[bool] = False
    PARTED: ClassVar[bool] = False

    v: Annotated[int, Meta(ge=PROTOCOL_VERSION, le=PROTOCOL_VERSION)] = PROTOCOL_VERSION


# -- client <-> broker


class Deploy(Message, tag="deploy"):
    id: Id
    spec: ModelSpec
    timeout_ms: int | None = None


class Deployed(Message, tag="deployed"):
    id: Id
    model: ModelRow


class Undeploy(Message, tag="undeploy"):
    id: Id
    model: str
    # How long the model's running generations may take to end before it goes, refusing new
    # calls meanwhile: None, the broker's `undeploy_drain_s`; 0, at once (they fail).
    drain_s: Annotated[float, Meta(ge=0, le=86400)] | None = None


class Undeployed(Message, tag="undeployed"):
    id: Id
    model: str
    drained: Count = 0  # generations that ended while the undeploy waited for them
    cut: Count = 0  # generations still running when it went (answered model_not_found)
    waited_s: Seconds = 0.0


class Infer(Message, tag="infer"):
    id: Id
    model: str
    tensors: Tensors = field(default_factory=dict)
    timeout_ms: int | None = None


class ResultInfo(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The broker's account of one answered request (milliseconds; `batch`: the requests that
    shared its forward; `workers`: its replica's, stage by stage)."""

    latency_ms: float = 0.0
    queue_ms: float = 0.0
    run_ms: float = 0.0
    compute_ms: float = 0.0
    load_wait_ms: float = 0.0
    batch: Count = 1
    workers: list[str] = field(default_factory=list)


class Result(Message, tag="result"):
    id: Id
    tensors: Tensors = field(default_factory=dict)
    info: ResultInfo = field(default_factory=ResultInfo)


class Status(Message, tag="status"):
    id: Id


class StatusReply(Message, tag="status_reply"):
    id: Id
    status: BrokerStatus


class PlanRequest(Message, tag="plan"):
    """Ask for a plan. kind 'stages' (serving) or 'chunks' (training sub-models)."""

    id: Id
    spec: ModelSpec
    kind: str = "stages"
    stages: int | None = None
    mem_cap: Count | None = None
    target_bytes: Count | None = None
    optimizer: str = "adam"
    batch: Count = 1
    measure: bool = False
    timeout_ms: int | None = None


class PlanAsk(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What the broker asks a partitioner to plan (`PlanJob.request`): a PlanRequest's fields,
    with `mem_cap` filled in from the workers' budgets when the client gave none; for kind
    "pipeline" (a training job opened with `pipeline="auto"`), the free training bytes of the
    workers its stages may go to, and its optimizer (a name, or a config mapping)."""

    spec: ModelSpec
    kind: str = "stages"
    stages: int | None = None
    mem_cap: Count | None = None
    target_bytes: Count | None = None
    optimizer: str | dict[str, Any] = "adam"
    batch: Count = 1
    measure: bool = False
    worker_bytes: list[Count] = field(default_factory=list)


class PlanReply(Message, tag="plan_reply"):
    """A plan, and the model's declared inputs (dtype, shape) when it has any."""

    id: Id
    plan: Plan
    inputs: dict[str, TensorSpec] | None = None


class Error(Message, tag="error"):
    id: Id | None
    code: str
    reason: str


class Hello(Message, tag="hello"):
    """A client's first message on each connection: it asks for the broker's limits, and sends
    nothing else until they are known (`Welcome`)."""

    id: Id


class Welcome(Message, tag="welcome"):
    """The broker's `Limits` on what a client may send it. Beyond `max_message_bytes` a request
    is refused, and beyond twice that the broker's socket drops the connection that carried it
    (taking the answers of every call in flight on it): a client refuses such calls unsent."""

    id: Id
    max_message_bytes: Count
    max_header_bytes: Count


# -- generation (language models), client <-> broker
#
# Text is the client's: it encodes prompts and decodes tokens with the model's own tokenizer
# (`TokenizerInfo`, read by the broker from the model's Hugging Face directory), and it watches
# for stop strings, stopping a sequence with `StopGenerate`; the mesh moves token ids only, as an
# API server in front of an inference engine does.

# A token id, a sequence's length: bounded so that no value from the wire overflows an int64.
TOKEN_ID_LIMIT = 1 << 31  # a token id on the wire is below this
TokenId = Annotated[int, Meta(ge=0, lt=TOKEN_ID_LIMIT)]
MAX_GEN_TOKENS = 1 << 20


class Sampling(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How a sequence picks its next tokens: the most likely one at temperature 0; otherwise a
    draw from softmax(logits / temperature) cut to the `top_k` most likely (0: no cut) and then
    to the smallest set whose probability reaches `top_p`, from a generator seeded with `seed`
    (None: an unseeded one). A sequence ends at `max_tokens` new tokens ("length"; None: once
    prompt and new tokens fill the model's context), or on the
    model's end-of-sequence ids or one of `stop_ids` ("stop"), the stopping token kept."""

    max_tokens: Annotated[int, Meta(ge=1, le=MAX_GEN_TOKENS)] | None = 16
    temperature: Annotated[float, Meta(ge=0, le=1000)] = 0.0
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Meta(ge=0, lt=1 << 31)] = 0
    seed: Annotated[int, Meta(ge=0, le=(1 << 63) - 1)] | None = None
    stop_ids: list[TokenId] = field(default_factory=list)
    ignore_eos: bool = False


class Generate(Message, tag="generate"):
    """Generate a continuation of each prompt (token ids), one sequence per prompt. Answered by
    one `Generated`; with `stream`, each sequence's new tokens first come as `GenChunk`s."""

    id: Id
    model: str
    prompts: list[list[TokenId]]
    sampling: Sampling = field(default_factory=Sampling)
    stream: bool = False
    timeout_ms: int | None = None
    # The `TokenizerReply.digest` of the codec the prompts were encoded (and the answer will be
    # decoded) with; "": none used. Another than the model's now: refused TOKENIZER_CHANGED.
    tokenizer: str = ""


class GenChunk(Message, tag="gen_chunk"):
    """New tokens of one sequence of a streamed `Generate` (`id` is the Generate's), in order;
    the sequence's last chunk carries its `finish` ("stop" or "length")."""

    id: Id
    index: Count  # which prompt of the Generate
    ids: list[TokenId]
    finish: str | None = None


class GenOutput(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One sequence's result: every new token, why it ended, and its timings (first token from
    the Generate's arrival, then the time from each token to the next)."""

    ids: list[TokenId]
    finish: str  # "stop" | "length"
    prompt_tokens: Count
    ttft_ms: float = 0.0
    token_ms: list[float] = field(default_factory=list)


class Generated(Message, tag="generated"):
    id: Id
    outputs: list[GenOutput]


class StopGenerate(Message, tag="stop_generate"):
    """Stop sequences of a running `Generate` (`id` is the Generate's; `indexes` None: all of
    them) as if they had ended with "stop": a stop string the client saw, or a client going away.
    Their KV memory is freed at once; the Generate is still answered with `Generated`. Not
    answered itself (a late one, for a Generate already answered, changes nothing)."""

    id: Id
    indexes: list[Count] | None = None


class TokenizerInfo(Message, tag="tokenizer_info"):
    """Ask for a deployed language model's tokenizer."""

    id: Id
    model: str


class TokenizerReply(Message, tag="tokenizer_reply"):
    """A model's tokenizer as its directory has it: `tokenizer.json` (the `tokenizers` library's
    format), the chat template ("" when it has none), the ids that end a sequence, the bos and
    eos strings its chat template sees ("": those of the ids), and the longest sequence
    (prompt + new tokens) the deployment takes."""

    id: Id
    model: str
    tokenizer_json: str
    chat_template: str = ""
    eos_ids: list[TokenId] = field(default_factory=list)
    bos_id: TokenId | None = None
    max_context: Count = 0
    bos_token: str = ""
    eos_token: str = ""
    digest: str = ""  # a hash of the fields above the codec is built from (Generate.tokenizer)


# -- training jobs, client <-> broker; the broker sends the same types on to the job's worker
# under its own call id (a job command), and the worker answers with the matching reply.


class TrainOpen(Message, tag="train_open"):
    """Open training job `job` of `spec` (weights: its `weights` file, or its seed). `config` is
    the training configuration (optimizer, loss, clip_grad_norm, accumulate, seed); `resume` a
    checkpoint directory to continue from; `chunk_bytes` the sub-models' target footprint."""

    id: Id
    job: str
    spec: ModelSpec
    config: TrainConfig | None  # None: the checkpoint's (`resume`)
    batch: Count
    resume: str | None = None
    chunk_bytes: Count | None = None
    timeout_ms: int | None = None
    # Its sub-models over this many workers, activations and gradients going worker to
    # worker (pipeline-parallel); 0 or 1: one worker, by memory flow; "auto": the broker
    # chooses, pipelining only a job that does not fit one worker's free training bytes
    # (`broker.training_router`).
    pipeline: Annotated[int, Meta(ge=0, le=64)] | Literal["auto"] = 0
    # Closed by the broker once no call has named it, nor been in flight for it, for this many
    # seconds: a job whose client died (a killed sweep driver, a lost notebook) gives its
    # memory back. None: open until closed.
    idle_close_s: Annotated[float, Meta(gt=0)] | None = None


class TrainOpened(Message, tag="train_opened"):
    """The broker's answer to a client's TrainOpen: the job's row, as `jobs` reports it."""

    id: Id
    job: JobRow


class JobOpened(Message, tag="job_opened"):
    """A worker's answer to the broker's TrainOpen: what it opened."""

    id: Id
    job: OpenedJob


class TrainStep(Message, tag="train_step"):
    """One step of `job`. `seq` numbers a job's steps: they run in that order, and a step whose
    `seq` was already taken is never applied again. Its batch: the tensors `batch_names`
    lists, no more ('targets', and the model's input: one tensor 'inputs' when `inputs` is
    None, else each keyword input that `inputs` names, by its name)."""

    id: Id
    job: str
    seq: Count
    inputs: KeywordInputs | None = None
    tensors: Tensors = field(default_factory=dict)
    timeout_ms: int | None = None


class TrainStepResult(Message, tag="train_step_result"):
    """A step's outcome. What the worker measured of it: `bytes_in` / `bytes_out`, the bytes
    its copies moved from the host tier into the device arena and back (parameters, gradients,
    optimizer state, buffers; not activations), and `memory_wait_s`, the seconds its tasks
    waited for arena memory while each headed the job's chain (0 from a worker that measures
    none, or for an answer a restarted broker took up from an inventory), and `activations`,
    each sub-model's activation policy in the step (empty: not reported)."""

    id: Id
    job: str
    seq: Count
    loss: float
    step: Count
    metrics: dict[str, float] = field(default_factory=dict)
    bytes_in: Count = 0
    bytes_out: Count = 0
    memory_wait_s: Seconds = 0.0
    activations: list[str] = field(default_factory=list)


class TrainEval(Message, tag="train_eval"):
    """Evaluate `job` on a batch after the steps sent before it: loss and metrics, nothing
    updated (eval mode, no gradients, the job's RNG stream untouched). Batch (`inputs`,
    `tensors`) as in `train_step`. No `seq`: an evaluation changes nothing, so running it twice
    is harmless."""

    id: Id
    job: str
    inputs: KeywordInputs | None = None
    tensors: Tensors = field(default_factory=dict)
    timeout_ms: int | None = None


class TrainEvalResult(Message, tag="train_eval_result"):
    """`step`: the steps applied before the evaluation; `metrics`: 'accuracy' for class
    targets, 'nonfinite', 'seconds'."""

    id: Id
    job: str
    loss: float
    step: Count
    metrics: dict[str, float] = field(default_factory=dict)


class TrainSave(Message, tag="train_save"):
    """Checkpoint `job` after the steps sent before it, into directory `path` on its worker."""

    id: Id
    job: str
    path: str
    timeout_ms: int | None = None


class TrainSaved(Message, tag="train_saved"):
    id: Id
    job: str
    path: str
    step: Count


class TrainClose(Message, tag="train_close"):
    id: Id
    job: str
    timeout_ms: int | None = None


class TrainClosed(Message, tag="train_closed"):
    id: Id
    job: str


class PipePeer(msgspec.Struct, forbid_unknown_fields=True):
    """A stage's worker in a pipelined training job: its peer endpoint and key."""

    worker: str
    endpoint: str
    key: str = ""


class PipeOpen(Message, tag="pipe_open"):
    """Broker -> each worker of a pipelined training job (`TrainOpen` with `pipeline` above 1):
    open stage `stage` of the model's chain cut into as many stages as `peers` (every worker
    cuts it alike: `gpu_worker.pipe_stage.cut_even`). `peers`: every stage's worker, in stage
    order; the stages' hops carry `ticket`. Answered `JobOpened`."""

    id: Id
    job: str
    spec: ModelSpec
    config: TrainConfig | None  # None: the checkpoint's (`resume`)
    batch: Count
    stage: Count
    ticket: Annotated[int, Meta(ge=1)]
    peers: list[PipePeer]
    resume: str | None = None  # a pipelined checkpoint's directory (any stage count)


PIPE_HOPS = ("target", "act", "grad", "rng", "tied_grad", "norms", "total", "tied_value", "done",
             "fail", "abort", "save", "saved")  # fmt: skip


class PipeHop(Message, tag="pipe_hop"):
    """Worker -> worker of one pipelined training job, on the peer sockets (`stage`: the
    sender's): a step's targets, a micro-batch's activation or gradient, the RNG state, tied
    weights' gradients and values, gradient norms and their total, a stage's end of the step,
    a failure and the abort that follows it, a checkpoint's save and each stage's answer
    (`gpu_worker.pipe_runner`)."""

    id: Id
    job: str
    ticket: Annotated[int, Meta(ge=1)]
    seq: Count
    stage: Count
    kind: Literal[PIPE_HOPS]  # type: ignore[valid-type]
    micro: Count = 0
    tensors: Tensors = field(default_factory=dict)
    orders: list[Count] = field(default_factory=list)  # norms: each parameter's place
    values: list[float] = field(default_factory=list)  # norms, or the total
    loss: float = 0.0
    drew: bool = False  # its forwards drew random numbers
    code: str = ""
    reason: str = ""
    updated: bool = False  # a failure after this stage's update: the job is broken
    path: str = ""  # save: the checkpoint directory, as the client named it
    # save: its id, drawn by the coordinator, in every stage's file (`gpu_worker.pipe_checkpoint`)
    save_id: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{0,64}$")] = ""
    evaluating: bool = False  # the hops of an evaluation (no backward, nothing updated)


class Jobs(Message, tag="jobs"):
    id: Id


class JobsReply(Message, tag="jobs_reply"):
    id: Id
    jobs: list[JobRow]


# -- what a worker holds as it registers


class _Part(msgspec.Struct, forbid_unknown_fields=True):
    """A nested payload: every field required, nothing unknown."""


class HeldStage(_Part):
    """A stage a worker holds; `digest` is `stage_digest` of what it was built from."""

    model: str
    stage: Count
    nbytes: Count
    resident: bool
    digest: str


class StepOk(_Part, tag_field="t", tag="ok"):
    """The answer a training step got: its loss, the job's step count after it, metrics."""

    seq: Count
    loss: float
    step: Count
    metrics: dict[str, float]


class StepFailed(_Part, tag_field="t", tag="error"):
    """A training step that failed, with the code and reason it was answered with."""

    seq: Count
    code: str
    reason: str


StepAnswer = Union[StepOk, StepFailed]  # noqa: UP007 (msgspec reads it at run time)


class HeldJob(_Part):
    """A training job a worker holds: its step count, the highest step seq it took, its
    footprint, its latest step answers and the seqs still running, and its sub-models as it
    opened them (a pipelined job's stage: one row, its blocks)."""

    name: str
    step: Count
    seq: Count
    footprint: Count
    results: list[StepAnswer]
    running: list[Count]
    sub_models: list[SubModelRow] = field(default_factory=list)


class Inventory(_Part):
    stages: list[HeldStage] = field(default_factory=list)
    jobs: list[HeldJob] = field(default_factory=list)


# -- workers / services <-> broker


class PeerInfo(_Part, kw_only=True):
    """What a peer says of itself as it registers, beyond `Register`'s own fields. Each field
    has the default a peer that does not report it stands for; a wrong type or value is refused
    on receipt (BAD_REQUEST, naming the field)."""

    # The secret of this process's first registration, proving that a registration on a fresh
    # socket comes from the same process (`flowmesh.peer`, `broker.peers.same_process`).
    session: str = ""
    # -- a worker's
    compute_lanes: Annotated[int, Meta(ge=1, le=1024)] = 2  # runs it computes at once
    threads: Count = 0  # its torch CPU threads (--threads; 0: torch's default)
    train_bytes: Count = 0  # device bytes guaranteed to training (0: it takes no jobs)
    arena_bytes: Count = 0  # its device arena, serving and training together
    peer_endpoint: str = ""  # where other workers send it activations ("": by the broker)
    # What its device measured as it opened: the prefault's seconds (None: switched off) and
    # its pinned host tier (0 on a CPU stand-in). Heartbeats report them again, as stats.
    prefault_s: Seconds | None = None
    host_tier_bytes: Count = 0
    host_tier_used_bytes: Count = 0
    # -- a partitioner's
    measure_device: str = ""  # where it times blocks' forwards when a plan asks for it


class Register(Message, tag="register"):
    id: Id
    role: str  # "worker" | "partitioner"
    name: str
    pid: Count
    device: str = ""
    kind: str = ""  # "cuda" | "cpu"
    budget_bytes: Count = 0
    info: PeerInfo = field(default_factory=PeerInfo)
    # What the process holds as it registers, so that a broker that restarted takes it up
    # instead of having it read again. Empty for a fresh process.
    inventory: Inventory = field(default_factory=Inventory)


def _canonical(value: Any) -> Any:
    if isinstance(value, dict):
        return [[k, _canonical(value[k])] for k in sorted(value, key=repr)]
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    return value


def stage_digest(spec: ModelSpec | dict[str, Any], plan: Plan | dict[str, Any], stage: int) -> str:
    """What a worker's copy of a stage was built from (the model's spec, its plan, the stage's
    index), as a short hash: a restarted broker adopts a stage a worker reports only when its
    digest is the one the broker's own record gives. Hashed in the stored form (`to_dict`),
    so a spec or plan digests the same typed or as the data a state directory keeps."""
    if isinstance(spec, ModelSpec):
        spec = spec.to_dict()
    if isinstance(plan, Plan):
        plan = plan.to_dict()
    packed = msgpack.packb(_canonical([spec, plan, stage]), use_bin_type=True)
    return hashlib.sha256(packed).hexdigest()[:24]


class RegisterAck(Message, tag="register_ack"):
    id: Id
    heartbeat_s: Annotated[float, Meta(gt=0)]
    liveness: Annotated[int, Meta(ge=1)]
    # True when the broker already knew this very process and kept what it holds (it only
    # re-registered); False when the broker starts afresh with it, so it must drop its stages.
    kept: bool = False
    # The mesh's allow-list of factory modules: set once on the broker, applied by every
    # partitioner and worker (which may narrow it with their own --allow, never widen it).
    allow: list[str] | None = None


class Heartbeat(Message, tag="heartbeat"):
    # A peer's figures (`WorkerStats`, `PartitionerStats`, declared in `flowmesh.reports` with
    # the rows of status that show them); None from the broker, whose beats say only it is there.
    stats: PeerStats | None = None


class Disconnect(Message, tag="disconnect"):
    reason: str


class DeployStage(Message, tag="deploy_stage"):
    id: Id
    model: str
    stage: Count
    spec: ModelSpec
    plan: Plan


class StageReady(Message, tag="stage_ready"):
    id: Id
    model: str
    stage: Count
    nbytes: Count
    seconds: Seconds


class DropStage(Message, tag="drop_stage"):
    id: Id
    model: str
    stage: Count


class Load(Message, tag="load"):
    """Bring a stage onto the device. The worker makes room itself, evicting its idle stages
    worth least, never one in `keep` ([[model, stage], ...]: stages the broker has work queued
    or in flight for), and reports what it holds afterwards with `Resident`."""

    id: Id
    model: str
    stage: Count
    keep: list[tuple[str, Count]] = field(default_factory=list)


class Loaded(Message, tag="loaded"):
    id: Id
    model: str
    stage: Count
    nbytes: Count
    seconds: Seconds


class Resident(Message, tag="resident"):
    """A worker's device contents after it changed them by its own choice (room made for a
    load, a stage brought back for a run): [[model, stage, nbytes], ...], loading ones
    included. `after_load` is the id of the last Load it had handled (0: none), so the broker
    knows which of its expectations the report already answers."""

    stages: list[tuple[str, Count, Count]]
    after_load: Id = 0


class Evict(Message, tag="evict"):
    id: Id
    model: str
    stage: Count


class SeqStep(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One sequence's share of a generation iteration: `count` new tokens (its whole prompt at
    prefill, then 1) at positions `start`..`start + count - 1`; the tokens before `start` are in
    the stage's KV cache. `drawn` is how many tokens it has generated before this iteration."""

    seq: Id
    start: Count
    count: Annotated[int, Meta(ge=1)]
    sampling: Sampling
    drawn: Count = 0


class GenStep(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A Run that is one iteration of generation: the sequences in it, in the order of their
    tokens in the Run's tensor (stage 0: `ids`, int64, every sequence's new tokens one after the
    other; later stages: the hidden states of those tokens, the previous stage's output). The
    last stage answers with `tokens` (int64, one new token per sequence, in this order).
    `evict_live`: its model has waited past the starvation limit for KV room, so the room its
    new blocks need may be made by evicting other models' stages that hold live sequences (they
    are preempted, their KV parked where that pays); else only idle stages go.

    `follows`: the id of the Run of this model's previous iteration on this stage, still in
    flight when this one is sent (a model of one stage only: its worker samples the tokens).
    Each sequence's one new token is the one that iteration draws for it, not `ids` (zeros,
    as many): the worker takes it once that iteration is done, so that the next iteration is
    already queued there and no round trip to the broker comes between two tokens (the
    overlap scheduling of SGLang and vLLM). It fails, changing nothing, when that iteration
    did not run or failed here."""

    seqs: list[SeqStep]
    evict_live: bool = False
    follows: Id = 0


class Run(Message, tag="run"):
    """Run one batch through a stage. `parts` is [[request tag, rows], ...] in batch order;
    `tensors[k]` is part k's inputs by name (none for a direct run's later stages)."""

    PARTED: ClassVar[bool] = True

    id: Id
    model: str
    stage: Count
    parts: list[tuple[Id, Count]]
    tensors: PartTensors = field(default_factory=list)
    # A direct run (`ticket` non-zero): every stage's worker gets its Run at once; stage 0's
    # inputs travel with it, each later stage's arrive from the stage before as `Hop`s (the
    # batch cut into `chunks` micro-batches that flow through the stages one after another).
    # `next_peer`: the peer endpoint of the next stage's worker, "" for the last stage, which
    # answers the broker with the whole batch's RunResult. Under CURVE keys, `next_key` is
    # that worker's public key (its peer socket's server key) and `from_key` the previous
    # stage's worker's, the only key whose activations this run takes (z85 text; "" without
    # keys).
    ticket: Id = 0
    from_peer: bool = False
    next_peer: str = ""
    chunks: Count = 1
    next_key: str = ""
    from_key: str = ""
    # Each part is a forward of its own (requests of a model taking one per forward, sent
    # together to save messages and hand-offs), not rows of one batch.
    separate: bool = False
    # Not None: a generation iteration (see GenStep), with a KV cache on each stage's worker.
    gen: GenStep | None = None


class FreeSeqs(Message, tag="free_seqs"):
    """Sequences that ended (or were stopped): drop their KV blocks on this stage now. Not
    answered; a sequence the worker does not hold is ignored.

    With `park`, sequences preempted for memory instead: their device blocks are freed, and
    each one's KV is kept in the worker's host memory where copying it back costs less than
    recomputing it (a step that starts where it stopped brings it back), else dropped. Answered
    with `SeqsParked`."""

    model: str
    stage: Count
    seqs: list[Id]
    park: bool = False


class SeqsParked(Message, tag="seqs_parked"):
    """A worker's answer to `FreeSeqs` with `park`: the sequences whose KV it keeps in host
    memory, and those it dropped (to be recomputed from their tokens)."""

    model: str
    stage: Count
    parked: list[Id]
    dropped: list[Id]


class Hop(Message, tag="hop"):
    """One micro-batch of a direct run's activations, from a stage's worker to the next one's
    (never through the broker). Accepted only with the ticket of a Run the broker announced."""

    id: Id
    ticket: Id
    model: str
    stage: Count
    chunk: Count
    tensors: Tensors = field(default_factory=dict)


class CancelRun(Message, tag="cancel_run"):
    """The broker gave up a direct run: forget its state here (its Hops may still come)."""

    id: Id


# A worker's seconds for a run: finite (no bound below a year is one a run reaches).
RunSeconds = Annotated[float, Meta(ge=0, le=365 * 86400)]


class RunInfo(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A worker's account of one run: computing, and waiting for its stage's weights."""

    compute_s: RunSeconds = 0.0
    wait_s: RunSeconds = 0.0


class RunResult(Message, tag="run_result"):
    """A stage's outputs for a `Run`: `tensors[k]`, part k's, by name."""

    PARTED: ClassVar[bool] = True

    id: Id
    model: str
    stage: Count
    tensors: PartTensors = field(default_factory=list)
    info: RunInfo = field(default_factory=RunInfo)


class PlanJob(Message, tag="plan_job"):
    """The broker asks a partitioner to plan; same fields as PlanRequest."""

    id: Id
    request: PlanAsk


# -- any socket


class Bundle(Message, tag="bundle"):
    """Several messages sent as one: under load, one send, one wake-up and one read stand for
    many (a client's calls of one event-loop turn, the answers of one grouped run).

    In a process `members` holds each member's frames; on the wire the header carries `counts`,
    the number of frames of each member, and the members' frames follow it, one member after
    the other. `decode` only splits them: each member is decoded and handled on its own, in
    order, as if it had come alone, so that a bad member is answered by its own error and the
    others go on. A bundle never holds a bundle.

    Only a peer known to take bundles is sent one: the broker bundles what it sends a client
    once that client has sent it a bundle, so that a client of its own that does not know them
    (one speaking the protocol over a plain socket) never gets one."""

    members: list[Annotated[int, Meta(ge=1)]] = field(name="counts")


# The payloads that messages carry (declared elsewhere, or above): a refusal inside one is
# BAD_REQUEST, as their receivers answered when they checked them by hand.
PAYLOADS: tuple[type, ...] = (ModelSpec, Plan, TrainConfig, TensorSpec, PlanAsk, PeerInfo)


def _declared() -> dict[str, type[Message]]:
    out: dict[str, type[Message]] = {}
    todo = list(Message.__subclasses__())
    while todo:
        cls = todo.pop(0)
        todo += cls.__subclasses__()
        tag = cls.__struct_config__.tag
        if not isinstance(tag, str) or tag in out:
            raise TypeError(f"message type {cls.__name__}: missing or repeated wire name {tag!r}")
        cls.TYPE = tag
        cls.HAS_TENSORS = "tensors" in cls.__struct_fields__
        out[tag] = cls
    return out


_TYPES = _declared()


def message_types() -> dict[str, type[Message]]:
    """Every message type by its wire name."""
    return dict(_TYPES)


# What `flowmesh.protocol` re-exports: every message type, and the types of their parts.
__all__ = [
    *(cls.__name__ for cls in _TYPES.values()),
    "ITEMSIZE",
    "PROTOCOL_VERSION",
    "BrokerStatus",
    "Count",
    "Finite",
    "GenOutput",
    "GenStep",
    "HeldJob",
    "HeldStage",
    "Id",
    "Inventory",
    "JobRow",
    "Message",
    "ModelRow",
    "OpenedJob",
    "SubModelRow",
    "PAYLOADS",
    "PeerInfo",
    "PIPE_HOPS",
    "PipePeer",
    "PlanAsk",
    "ResultInfo",
    "RunInfo",
    "Sampling",
    "Seconds",
    "SeqStep",
    "PartitionerStats",
    "PeerStats",
    "WorkerStats",
    "StepAnswer",
    "StepFailed",
    "StepOk",
    "KeywordInputs",
    "PartTensors",
    "TensorMeta",
    "Tensors",
    "TOKEN_ID_LIMIT",
    "TokenId",
    "batch_names",
    "message_types",
    "stage_digest",
]
