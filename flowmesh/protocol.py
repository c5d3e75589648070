"""The wire protocol: every message type flowmesh sends, and the one codec for all of them.

A message is a multipart ZeroMQ message: routing frames (added and removed by the sockets), one
msgpack header, then one raw frame per tensor. The header carries the protocol version `v`, the
message type `t`, the message's fields, and `tensors`: `[name, dtype, shape]` for each tensor
frame, in frame order. Tensor bytes are never copied into the header; they are sent with
`copy=False` and read back with `torch.frombuffer`, so a decoded tensor shares the received frame's
memory. Processes that only forward tensors (the broker) never build tensors at all: they pass the
received frames on as `TensorRef`s.

Decoding validates everything (sizes, version, type, fields and their types, frame count, bytes
versus dtype x shape) and raises `DecodeError` with a code; the receiver answers with `Error` and
keeps running. No pickle anywhere.

This module does not import torch at import time, so the broker can stay free of it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import reprlib
import types
import typing
import warnings
from dataclasses import dataclass, field
from math import prod
from typing import Any, ClassVar, Union

import msgpack
import msgspec
import numpy

from flowmesh.errors import Code, FlowmeshError

PROTOCOL_VERSION = 1

# Members of one bundle at most: a bound on the work one received message makes.
MAX_BUNDLE = 256
# Bundles are for small messages, whose sends cost more than their bytes: a sender bundles no
# more than this many bytes together, and sends a larger message alone.
BUNDLE_BYTES = 1 << 20

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

# numpy's dtype of each dtype that may travel, but bfloat16 (numpy has none).
_NUMPY_DTYPES = {name: numpy.dtype(name) for name in ITEMSIZE if name != "bfloat16"}


@dataclass(frozen=True)
class Limits:
    """Explicit bounds on what a process accepts; anything beyond gets a TOO_LARGE error."""

    max_message_bytes: int = 1 << 30
    max_header_bytes: int = 1 << 20
    max_tensors: int = 1024
    max_dims: int = 16
    max_str_len: int = 1 << 20
    max_container_len: int = 1 << 16


DEFAULT_LIMITS = Limits()


class DecodeError(FlowmeshError):
    """A received message that cannot be accepted; `ref` is its id when one could be read."""

    def __init__(self, code: Code, reason: str, ref: int | None = None) -> None:
        super().__init__(code, reason)
        self.ref = ref


# --------------------------------------------------------------------------- tensors


class TensorRef:
    """A received tensor frame: dtype and shape known, bytes untouched until `tensor()`."""

    __slots__ = ("dtype", "frame", "shape")

    def __init__(self, dtype: str, shape: tuple[int, ...], frame: Any) -> None:
        self.dtype = dtype
        self.shape = shape
        self.frame = frame

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * ITEMSIZE[self.dtype]

    def tensor(self) -> Any:
        """A torch tensor over the frame's memory (no copy). Treat it as read-only."""
        torch, torch_dtype = _torch_api()
        dtype = torch_dtype(self.dtype)
        if prod(self.shape) == 0:
            return torch.empty(self.shape, dtype=dtype)
        buf = self.frame.buffer if hasattr(self.frame, "buffer") else memoryview(self.frame)
        if buf.readonly:  # bytes (tests, in-process use): torch warns, then shares the memory
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return torch.frombuffer(buf, dtype=dtype).reshape(self.shape)
        # Through numpy: a view as well, in half the time of torch.frombuffer + reshape (a
        # received tensor is made on every request's path, in the worker and in the client).
        np_dtype = _NUMPY_DTYPES.get(self.dtype)
        if np_dtype is None:  # bfloat16, which numpy lacks: its bits, as torch.frombuffer does
            return torch.frombuffer(buf, dtype=dtype).reshape(self.shape)
        return torch.from_numpy(numpy.frombuffer(buf, np_dtype).reshape(self.shape))

    def __repr__(self) -> str:
        return f"TensorRef({self.dtype}, {list(self.shape)})"


@functools.cache
def _torch_api() -> tuple[Any, Any]:
    """torch and its dtype lookup, imported on first use (the broker never needs them)."""
    import torch

    from flowmesh.build import torch_dtype

    return torch, torch_dtype


@functools.cache
def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_frame(t: Any) -> tuple[str, tuple[int, ...], Any]:
    """(dtype, shape, buffer) for a torch tensor or a TensorRef; the buffer is not a copy
    when the tensor is already contiguous on the CPU."""
    if isinstance(t, TensorRef):
        return t.dtype, t.shape, t.frame
    torch, _ = _torch_api()
    if not isinstance(t, torch.Tensor):
        raise FlowmeshError(Code.BAD_REQUEST, f"expected a tensor, got {type(t).__name__}")
    dtype = _dtype_name(t.dtype)
    if dtype not in ITEMSIZE:
        raise FlowmeshError(Code.BAD_TENSOR, f"dtype {dtype} cannot travel")
    shape = tuple(t.shape)
    if t.requires_grad:
        t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.to("cpu").contiguous()
    if t.dtype is torch.bfloat16:  # numpy has no bfloat16: send its bits
        t = t.view(torch.int16)
    return dtype, shape, t.numpy()


# --------------------------------------------------------------------------- messages

_REGISTRY: dict[str, type[Message]] = {}


@dataclass
class Message:
    """Base of all message types. `TYPE` is the wire name; `tensors` travel as frames."""

    TYPE: ClassVar[str] = ""
    HAS_TENSORS: ClassVar[bool] = False


def message(type_name: str) -> Any:
    """Declare a message type: a dataclass registered under its wire name."""

    def wrap(cls: type) -> type:
        if type_name in _REGISTRY:
            raise TypeError(f"message type {type_name!r} declared twice")
        cls.TYPE = type_name
        cls.HAS_TENSORS = "tensors" in cls.__annotations__
        dc = dataclass(cls)
        _REGISTRY[type_name] = dc
        return dc

    return wrap


# -- client <-> broker


@message("deploy")
class Deploy(Message):
    id: int
    spec: dict[str, Any]
    timeout_ms: int | None = None


@message("deployed")
class Deployed(Message):
    id: int
    model: dict[str, Any]


@message("undeploy")
class Undeploy(Message):
    id: int
    model: str


@message("undeployed")
class Undeployed(Message):
    id: int
    model: str


@message("infer")
class Infer(Message):
    id: int
    model: str
    tensors: dict[str, Any] = field(default_factory=dict)
    timeout_ms: int | None = None


@message("result")
class Result(Message):
    id: int
    tensors: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


@message("status")
class Status(Message):
    id: int


@message("status_reply")
class StatusReply(Message):
    id: int
    status: dict[str, Any]


@message("plan")
class PlanRequest(Message):
    """Ask for a plan. kind 'stages' (serving) or 'chunks' (training sub-models)."""

    id: int
    spec: dict[str, Any]
    kind: str = "stages"
    stages: int | None = None
    mem_cap: int | None = None
    target_bytes: int | None = None
    optimizer: str = "adam"
    batch: int = 1
    measure: bool = False
    timeout_ms: int | None = None


@message("plan_reply")
class PlanReply(Message):
    """A plan, and the model's declared inputs (dtype, shape) when it has any."""

    id: int
    plan: dict[str, Any]
    inputs: dict[str, Any] | None = None


@message("error")
class Error(Message):
    id: int | None
    code: str
    reason: str


@message("hello")
class Hello(Message):
    """A client's first message on each connection: it asks for the broker's limits, and sends
    nothing else until they are known (`Welcome`)."""

    id: int


@message("welcome")
class Welcome(Message):
    """The broker's `Limits` on what a client may send it. Beyond `max_message_bytes` a request
    is refused, and beyond twice that the broker's socket drops the connection that carried it
    (taking the answers of every call in flight on it): a client refuses such calls unsent."""

    id: int
    max_message_bytes: int
    max_header_bytes: int


# -- training jobs, client <-> broker; the broker sends the same types on to the job's worker
# under its own call id (a job command), and the worker answers with the matching reply.


@message("train_open")
class TrainOpen(Message):
    """Open training job `job` of `spec` (weights: its `weights` file, or its seed). `config` is
    the training configuration (optimizer, loss, clip_grad_norm, accumulate, seed); `resume` a
    checkpoint directory to continue from; `chunk_bytes` the sub-models' target footprint."""

    id: int
    job: str
    spec: dict[str, Any]
    config: dict[str, Any]
    batch: int
    resume: str | None = None
    chunk_bytes: int | None = None
    timeout_ms: int | None = None


@message("train_opened")
class TrainOpened(Message):
    id: int
    job: dict[str, Any]


@message("train_step")
class TrainStep(Message):
    """One step of `job`. `seq` numbers a job's steps: they run in that order, and a step whose
    `seq` was already taken is never applied again. Tensors: 'inputs' (or 'inputs/<name>' per
    named input) and 'targets'."""

    id: int
    job: str
    seq: int
    tensors: dict[str, Any] = field(default_factory=dict)
    timeout_ms: int | None = None


@message("train_step_result")
class TrainStepResult(Message):
    id: int
    job: str
    seq: int
    loss: float
    step: int
    metrics: dict[str, float] = field(default_factory=dict)


@message("train_eval")
class TrainEval(Message):
    """Evaluate `job` on a batch after the steps sent before it: loss and metrics, nothing
    updated (eval mode, no gradients, the job's RNG stream untouched). Tensors as in
    `train_step`. No `seq`: an evaluation changes nothing, so running it twice is harmless."""

    id: int
    job: str
    tensors: dict[str, Any] = field(default_factory=dict)
    timeout_ms: int | None = None


@message("train_eval_result")
class TrainEvalResult(Message):
    """`step`: the steps applied before the evaluation; `metrics`: 'accuracy' for class
    targets, 'nonfinite', 'seconds'."""

    id: int
    job: str
    loss: float
    step: int
    metrics: dict[str, float] = field(default_factory=dict)


@message("train_save")
class TrainSave(Message):
    """Checkpoint `job` after the steps sent before it, into directory `path` on its worker."""

    id: int
    job: str
    path: str
    timeout_ms: int | None = None


@message("train_saved")
class TrainSaved(Message):
    id: int
    job: str
    path: str
    step: int


@message("train_close")
class TrainClose(Message):
    id: int
    job: str
    timeout_ms: int | None = None


@message("train_closed")
class TrainClosed(Message):
    id: int
    job: str


@message("jobs")
class Jobs(Message):
    id: int


@message("jobs_reply")
class JobsReply(Message):
    id: int
    jobs: list[dict[str, Any]]


# -- workers / services <-> broker


@message("register")
class Register(Message):
    id: int
    role: str  # "worker" | "partitioner"
    name: str
    pid: int
    device: str = ""
    kind: str = ""  # "cuda" | "cpu"
    budget_bytes: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    # What the process holds as it registers, so that a broker that restarted takes it up
    # instead of having it read again: {"stages": [{"model", "stage", "nbytes", "resident",
    # "digest"}], "jobs": [{"name", "step", "seq", "footprint", "results", "running"}]}.
    # Empty for a fresh process; entries are checked by the broker (`broker.registry`).
    inventory: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def _canonical(value: Any) -> Any:
    if isinstance(value, dict):
        return [[k, _canonical(value[k])] for k in sorted(value, key=repr)]
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    return value


def stage_digest(spec: dict[str, Any], plan: dict[str, Any], stage: int) -> str:
    """What a worker's copy of a stage was built from (the model's spec, its plan, the stage's
    index), as a short hash: a restarted broker adopts a stage a worker reports only when its
    digest is the one the broker's own record gives."""
    packed = msgpack.packb(_canonical([spec, plan, stage]), use_bin_type=True)
    return hashlib.sha256(packed).hexdigest()[:24]


@message("register_ack")
class RegisterAck(Message):
    id: int
    heartbeat_s: float
    liveness: int
    # True when the broker already knew this very process and kept what it holds (it only
    # re-registered); False when the broker starts afresh with it, so it must drop its stages.
    kept: bool = False
    # The mesh's allow-list of factory modules: set once on the broker, applied by every
    # partitioner and worker (which may narrow it with their own --allow, never widen it).
    allow: list[str] | None = None


@message("heartbeat")
class Heartbeat(Message):
    stats: dict[str, Any] = field(default_factory=dict)


@message("disconnect")
class Disconnect(Message):
    reason: str


@message("deploy_stage")
class DeployStage(Message):
    id: int
    model: str
    stage: int
    spec: dict[str, Any]
    plan: dict[str, Any]


@message("stage_ready")
class StageReady(Message):
    id: int
    model: str
    stage: int
    nbytes: int
    seconds: float


@message("drop_stage")
class DropStage(Message):
    id: int
    model: str
    stage: int


@message("load")
class Load(Message):
    """Bring a stage onto the device. The worker makes room itself, evicting its idle stages
    worth least, never one in `keep` ([[model, stage], ...]: stages the broker has work queued
    or in flight for), and reports what it holds afterwards with `Resident`."""

    id: int
    model: str
    stage: int
    keep: list[list[Any]] = field(default_factory=list)


@message("loaded")
class Loaded(Message):
    id: int
    model: str
    stage: int
    nbytes: int
    seconds: float


@message("resident")
class Resident(Message):
    """A worker's device contents after it changed them by its own choice (room made for a
    load, a stage brought back for a run): [[model, stage, nbytes], ...], loading ones
    included. `after_load` is the id of the last Load it had handled (0: none), so the broker
    knows which of its expectations the report already answers."""

    stages: list[list[Any]]
    after_load: int = 0


@message("evict")
class Evict(Message):
    id: int
    model: str
    stage: int


@message("run")
class Run(Message):
    """Run one batch through a stage. `parts` is [[request tag, rows], ...] in batch order;
    part k's tensors are named 'k/<input name>'."""

    id: int
    model: str
    stage: int
    parts: list[list[int]]
    tensors: dict[str, Any] = field(default_factory=dict)
    # A direct run (`ticket` non-zero): every stage's worker gets its Run at once; stage 0's
    # inputs travel with it, each later stage's arrive from the stage before as `Hop`s (the
    # batch cut into `chunks` micro-batches that flow through the stages one after another).
    # `next_peer`: the peer endpoint of the next stage's worker, "" for the last stage, which
    # answers the broker with the whole batch's RunResult. Under CURVE keys, `next_key` is
    # that worker's public key (its peer socket's server key) and `from_key` the previous
    # stage's worker's, the only key whose activations this run takes (z85 text; "" without
    # keys).
    ticket: int = 0
    from_peer: bool = False
    next_peer: str = ""
    chunks: int = 1
    next_key: str = ""
    from_key: str = ""
    # Each part is a forward of its own (requests of a model taking one per forward, sent
    # together to save messages and hand-offs), not rows of one batch.
    separate: bool = False


@message("hop")
class Hop(Message):
    """One micro-batch of a direct run's activations, from a stage's worker to the next one's
    (never through the broker). Accepted only with the ticket of a Run the broker announced."""

    id: int
    ticket: int
    model: str
    stage: int
    chunk: int
    tensors: dict[str, Any] = field(default_factory=dict)


@message("cancel_run")
class CancelRun(Message):
    """The broker gave up a direct run: forget its state here (its Hops may still come)."""

    id: int


@message("run_result")
class RunResult(Message):
    id: int
    model: str
    stage: int
    tensors: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


@message("plan_job")
class PlanJob(Message):
    """The broker asks a partitioner to plan; same fields as PlanRequest."""

    id: int
    request: dict[str, Any]


# -- any socket


@message("bundle")
class Bundle(Message):
    """Several messages sent as one: under load, one send, one wake-up and one read stand for
    many (a client's calls of one event-loop turn, the answers of one grouped run).

    On the wire the header carries `counts`, the number of frames of each member, and the
    members' frames follow it, one member after the other. `decode` only splits them: each member
    is decoded and handled on its own, in order, as if it had come alone, so that a bad member is
    answered by its own error and the others go on. A bundle never holds a bundle.

    Only a peer known to take bundles is sent one: the broker bundles what it sends a client
    once that client has sent it a bundle, so that a client of its own that does not know them
    (one speaking the protocol over a plain socket) never gets one."""

    members: list[list[Any]] = field(default_factory=list)  # each member's frames


def message_types() -> dict[str, type[Message]]:
    return dict(_REGISTRY)


def bundled(
    encoded: list[list[Any]], limits: Limits = DEFAULT_LIMITS
) -> list[tuple[int, list[Any]]]:
    """Encoded messages (each its frames) as few sends as bundles allow, in order: a run of two
    or more becomes one bundle while it stays within BUNDLE_BYTES (or half the receiver's
    `limits.max_message_bytes`) and MAX_BUNDLE members; a message alone goes as it is. Each
    send is (how many of the messages it carries, its frames)."""
    cap = min(BUNDLE_BYTES, limits.max_message_bytes // 2)
    sends: list[tuple[int, list[Any]]] = []
    run: list[list[Any]] = []
    size = 0

    def close() -> None:
        if len(run) == 1:
            sends.append((1, run[0]))
        elif run:
            sends.append((len(run), encode(Bundle(members=list(run)))))

    for member in encoded:
        nbytes = sum(_frame_len(f) for f in member)
        if run and (size + nbytes > cap or len(run) >= MAX_BUNDLE):
            close()
            run, size = [], 0
        run.append(member)
        size += nbytes
    close()
    return sends


# --------------------------------------------------------------------------- validation


class _FieldError(Exception):
    """A value of the wrong type: `path` below the field ("[0]", " key", "['x']"), `what`."""

    def __init__(self, path: str, what: str) -> None:
        super().__init__(what)
        self.path, self.what = path, what


# A checker raises _FieldError for a value not of its type, or returns. Checkers are compiled
# once per field type (see `_compile`): decoding runs one per field of every message a process
# receives, so no typing introspection and no path strings unless a value is wrong.
Checker = typing.Callable[[Any], None]


def _got(value: Any) -> str:
    return type(value).__name__


def _compile(tp: Any) -> Checker | None:
    """The checker of values of type `tp` (None: anything goes)."""
    if tp is Any:
        return None
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        arms = [_compile(a) for a in typing.get_args(tp)]
        if any(a is None for a in arms):
            return None
        checks = [a for a in arms if a is not None]

        def check_union(v: Any) -> None:
            for arm in checks:
                try:
                    arm(v)
                    return
                except _FieldError:
                    continue
            raise _FieldError("", f"unexpected {_got(v)}")

        return check_union
    if tp is type(None):

        def check_none(v: Any) -> None:
            if v is not None:
                raise _FieldError("", f"expected nothing, got {_got(v)}")

        return check_none
    if tp is float:

        def check_number(v: Any) -> None:
            if v.__class__ is not float and (isinstance(v, bool) or not isinstance(v, int | float)):
                raise _FieldError("", f"expected a number, got {_got(v)}")

        return check_number
    if tp is int:

        def check_int(v: Any) -> None:
            if v.__class__ is not int and (isinstance(v, bool) or not isinstance(v, int)):
                raise _FieldError("", f"expected an integer, got {_got(v)}")

        return check_int
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        item = _compile(item_tp)

        def check_list(v: Any) -> None:
            if not isinstance(v, list):
                raise _FieldError("", f"expected a list, got {_got(v)}")
            if item is not None:
                for i, x in enumerate(v):
                    try:
                        item(x)
                    except _FieldError as exc:
                        raise _FieldError(f"[{i}]{exc.path}", exc.what) from None

        return check_list
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        key, val = _compile(key_tp), _compile(val_tp)

        def check_map(v: Any) -> None:
            if not isinstance(v, dict):
                raise _FieldError("", f"expected a map, got {_got(v)}")
            for k, x in v.items():
                if key is not None:
                    try:
                        key(k)
                    except _FieldError as exc:
                        raise _FieldError(f" key{exc.path}", exc.what) from None
                if val is not None:
                    try:
                        val(x)
                    except _FieldError as exc:
                        raise _FieldError(f"[{_short(k)}]{exc.path}", exc.what) from None

        return check_map
    if isinstance(tp, type):

        def check_instance(v: Any) -> None:
            if not isinstance(v, tp):
                raise _FieldError("", f"expected {tp.__name__}, got {_got(v)}")

        return check_instance
    raise TypeError(f"no checker for field type {tp!r}")


@dataclass(frozen=True)
class _Fields:
    """What decoding needs to know of a message type, worked out once."""

    hints: dict[str, Any]  # field -> type, "tensors" left out
    required: frozenset[str]
    checks: dict[str, Checker | None]


_FIELDS: dict[type, _Fields] = {}

# Fields that travel as frames after the header, described in it (`tensors` by their name, dtype
# and shape; a bundle's `members` by their frame counts), not as header values.
_FRAMED = ("tensors", "members")


def _fields(cls: type[Message]) -> _Fields:
    got = _FIELDS.get(cls)
    if got is None:
        all_hints = typing.get_type_hints(cls)
        hints = {
            f.name: all_hints[f.name] for f in dataclasses.fields(cls) if f.name not in _FRAMED
        }
        required = frozenset(
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
            and f.name not in _FRAMED
        )
        got = _FIELDS[cls] = _Fields(hints, required, {n: _compile(t) for n, t in hints.items()})
    return got


def _hints(cls: type[Message]) -> dict[str, Any]:
    return _fields(cls).hints


# --------------------------------------------------------------------------- codec


def encode(msg: Message) -> list[Any]:
    """Frames for `msg`: the msgpack header, then one buffer per tensor (not copied)."""
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "t": msg.TYPE}
    frames: list[Any] = [b""]
    for name in _hints(type(msg)):
        header[name] = getattr(msg, name)
    if msg.HAS_TENSORS:
        meta = []
        for name, t in msg.tensors.items():  # type: ignore[attr-defined]
            dtype, shape, buf = tensor_frame(t)
            meta.append([name, dtype, list(shape)])
            frames.append(buf)
        header["tensors"] = meta
    elif type(msg) is Bundle:
        header["counts"] = [len(m) for m in msg.members]
        for m in msg.members:
            frames.extend(m)
    # For these plain values msgspec writes msgpack.packb(use_bin_type=True)'s bytes, faster.
    frames[0] = msgspec.msgpack.encode(header)
    return frames


def _frame_len(frame: Any) -> int:
    if hasattr(frame, "buffer"):  # zmq.Frame: len() would copy nothing but be explicit
        return frame.buffer.nbytes
    return memoryview(frame).nbytes


def _frame_bytes(frame: Any) -> bytes | memoryview:
    if hasattr(frame, "buffer"):
        return frame.buffer
    return frame


def _is_int(value: Any) -> bool:
    # bool is an int subclass; a `true` id or dim must not pass as 1 (an error reply carrying
    # `id: true` cannot be decoded by the receiver).
    return isinstance(value, int) and not isinstance(value, bool)


_REPR = reprlib.Repr()  # keyword arguments only from Python 3.12
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 2, 40, 40, 6, 6


def _short(value: Any) -> str:
    """A bounded repr of a value read from a peer: reasons must stay small, whatever arrived."""
    return _REPR.repr(value)


def _unpack_header(frame: Any, limits: Limits) -> Any:
    return msgpack.unpackb(
        _frame_bytes(frame),
        raw=False,
        strict_map_key=True,
        max_str_len=limits.max_str_len,
        max_bin_len=limits.max_str_len,
        max_array_len=limits.max_container_len,
        max_map_len=limits.max_container_len,
        max_ext_len=0,
    )


def decode(frames: list[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Validate and decode the frames after the routing envelope. Raises DecodeError only:
    every value read from the header is type-checked before it is used.

    A well-formed message takes the fast path (`_decode_fast`); anything it does not accept
    whole goes through `_decode_checked`, which accepts exactly what the fast path accepts
    and more, and says precisely what is wrong with the rest."""
    msg = _decode_fast(frames, limits)
    if msg is not None:
        return msg
    return _decode_checked(frames, limits)


def _decode_checked(frames: list[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """`decode` field by field, in Python: each failure gets its code and a readable reason."""
    if not frames:
        raise DecodeError(Code.BAD_MESSAGE, "empty message")
    sizes = [_frame_len(f) for f in frames]
    if sizes[0] > limits.max_header_bytes:
        raise DecodeError(
            Code.TOO_LARGE, f"header is {sizes[0]} bytes, limit {limits.max_header_bytes}"
        )
    # The header is read before the total size is judged, so that a TOO_LARGE answer can carry
    # the request's id and the sender can match it to its call; the header itself is bounded.
    header: Any = None
    unpack_error = ""
    try:
        header = _unpack_header(frames[0], limits)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        unpack_error = f"{type(exc).__name__}: {_short(str(exc))}"
    ref = header.get("id") if isinstance(header, dict) else None
    ref = ref if _is_int(ref) else None
    total = sum(sizes)
    if total > limits.max_message_bytes:
        raise DecodeError(
            Code.TOO_LARGE, f"message is {total} bytes, limit {limits.max_message_bytes}", ref
        )
    if unpack_error:
        raise DecodeError(Code.BAD_MESSAGE, f"header is not a valid msgpack map: {unpack_error}")
    if not isinstance(header, dict):
        raise DecodeError(Code.BAD_MESSAGE, f"header is a {type(header).__name__}, not a map")
    version = header.pop("v", None)
    if not _is_int(version) or version != PROTOCOL_VERSION:
        raise DecodeError(
            Code.VERSION,
            f"protocol version {_short(version)}, this process speaks {PROTOCOL_VERSION}",
            ref,
        )
    type_name = header.pop("t", None)
    cls = _REGISTRY.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise DecodeError(Code.UNKNOWN_TYPE, f"unknown message type {_short(type_name)}", ref)
    if cls is Bundle:
        return Bundle(members=_split_members(header, frames[1:]))
    meta = header.pop("tensors", [])
    tensors = _decode_tensors(meta, frames[1:], sizes[1:], cls, limits, ref)
    fields = _fields(cls)
    checks = fields.checks
    if not checks.keys() >= header.keys():
        unknown = sorted(set(header) - set(checks), key=str)
        names = ", ".join(_short(k) for k in unknown[:5])
        raise DecodeError(Code.BAD_MESSAGE, f"{cls.TYPE}: unknown field(s) {names}", ref)
    if not fields.required <= header.keys():
        missing = sorted(fields.required - header.keys())
        raise DecodeError(
            Code.BAD_MESSAGE, f"{cls.TYPE}: missing field(s) {', '.join(missing)}", ref
        )
    for name, value in header.items():
        check = checks[name]
        if check is None:
            continue
        try:
            check(value)
        except _FieldError as exc:
            where = f"{cls.TYPE}.{name}{exc.path}"
            raise DecodeError(Code.BAD_MESSAGE, f"{where}: {exc.what}", ref) from None
    if cls.HAS_TENSORS:
        header["tensors"] = tensors
    return cls(**header)


# --------------------------------------------------------------------------- fast path
#
# Every message a mesh exchanges takes this path: msgspec decodes the header straight into a
# struct that mirrors the message type (one declaration: the dataclass above; its mirror is
# derived from it), checking every field's type in C. It accepts a subset of what
# `_decode_checked` accepts, never more (tests/test_protocol.py compares the two on hostile
# headers): whatever it refuses is decoded again by `_decode_checked`, which finds the precise
# error. On the development machine it decodes a small `infer` in about a third of the time
# and a `run` in about two thirds.


class _Refused(Exception):
    """The fast path does not take this message (`_decode_checked` will say why, if wrong)."""


def _no_ext(code: int, data: memoryview) -> Any:
    raise _Refused  # msgpack extension types never travel (max_ext_len=0 on the checked path)


# Plain msgpack values, as `msgpack.unpackb(strict_map_key=True)` gives them: maps keyed by str
# or bytes only. msgspec decodes an `Any` value more liberally (int keys, timestamps).
_PLAIN = (str, int, float, bool, bytes, type(None))


def _plain(value: Any) -> bool:
    kind = type(value)
    if kind is list:
        for v in value:  # noqa: SIM110 (a loop: no generator frame per value)
            if type(v) not in _PLAIN and not _plain(v):
                return False
        return True
    if kind is dict:
        for k, v in value.items():
            if (type(k) is not str and type(k) is not bytes) or (
                type(v) not in _PLAIN and not _plain(v)
            ):
                return False
        return True
    return kind in _PLAIN


@dataclass(frozen=True)
class _Wire:
    """A message type's fast-path decoding: its mirror struct and what the struct leaves to
    Python (the fields holding `Any` values, whose contents are checked by `_plain`)."""

    cls: type[Message]
    names: tuple[str, ...]  # the dataclass's fields, "tensors" included
    any_fields: tuple[str, ...]


def _holds_any(tp: Any) -> bool:
    return tp is Any or any(_holds_any(a) for a in typing.get_args(tp))


def _mirror(cls: type[Message]) -> type[msgspec.Struct]:
    hints = typing.get_type_hints(cls)
    fields: list[Any] = [("v", int)]
    for f in dataclasses.fields(cls):
        if f.name == "members":  # a bundle: how many frames each member has
            fields.append(("counts", list[int]))
            continue
        tp = list[tuple[str, str, list[int]]] if f.name == "tensors" else hints[f.name]
        if f.default is not dataclasses.MISSING:
            fields.append((f.name, tp, f.default))
        elif f.default_factory is not dataclasses.MISSING:
            fields.append((f.name, tp, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, tp))
    return msgspec.defstruct(
        f"{cls.__name__}Header",
        fields,
        tag_field="t",
        tag=cls.TYPE,
        forbid_unknown_fields=True,
        kw_only=True,
    )


@functools.cache
def _fast_decoder() -> tuple[msgspec.msgpack.Decoder[Any], dict[type, _Wire]]:
    wires: dict[type, _Wire] = {}
    for cls in _REGISTRY.values():
        hints = typing.get_type_hints(cls)
        names = tuple(f.name for f in dataclasses.fields(cls))
        any_fields = tuple(n for n in names if n not in _FRAMED and _holds_any(hints[n]))
        wires[_mirror(cls)] = _Wire(cls, names, any_fields)
    union = Union[tuple(wires)]  # noqa: UP007 (a tuple of types, built at run time)
    return msgspec.msgpack.Decoder(union, ext_hook=_no_ext), wires


def _decode_fast(frames: list[Any], limits: Limits) -> Message | None:
    """The message, or None when this path does not take it."""
    if not frames:
        return None
    sizes = [_frame_len(f) for f in frames]
    head = sizes[0]
    # Within these, no string or container in the header can exceed a limit (each element
    # takes a byte at least), so the checked path's unpack limits cannot be what refuses it.
    if (
        head > limits.max_header_bytes
        or head > limits.max_str_len
        or head > limits.max_container_len
        or sum(sizes) > limits.max_message_bytes
    ):
        return None
    decoder, wires = _fast_decoder()
    try:
        header = decoder.decode(_frame_bytes(frames[0]))
    except Exception:  # msgspec's errors, _Refused, RecursionError: the checked path decides
        return None
    if header.v != PROTOCOL_VERSION:
        return None
    wire = wires[type(header)]
    cls = wire.cls
    if cls is Bundle:
        counts = header.counts
        if len(counts) > MAX_BUNDLE or sum(counts) != len(frames) - 1 or min(counts, default=1) < 1:
            return None
        return Bundle(members=_cut(frames[1:], counts))
    for name in wire.any_fields:
        if not _plain(getattr(header, name)):
            return None
    values = {name: getattr(header, name) for name in wire.names}
    if cls.HAS_TENSORS:
        meta = values["tensors"]
        if len(meta) != len(frames) - 1 or len(meta) > limits.max_tensors:
            return None
        tensors: dict[str, TensorRef] = {}
        for i, (name, dtype, shape) in enumerate(meta):
            itemsize = ITEMSIZE.get(dtype)
            if itemsize is None or name in tensors or len(shape) > limits.max_dims:
                return None
            n = itemsize
            for d in shape:
                if d < 0:
                    return None
                n *= d
            if n != sizes[i + 1]:
                return None
            tensors[name] = TensorRef(dtype, tuple(shape), frames[i + 1])
        values["tensors"] = tensors
    elif len(frames) != 1:
        return None
    return cls(**values)


def _decode_tensors(
    meta: Any,
    frames: list[Any],
    sizes: list[int],
    cls: type[Message],
    limits: Limits,
    ref: int | None,
) -> dict[str, TensorRef]:
    if not isinstance(meta, list):
        raise DecodeError(Code.BAD_MESSAGE, "'tensors' must be a list", ref)
    if meta and not cls.HAS_TENSORS:
        raise DecodeError(Code.BAD_FRAMES, f"{cls.TYPE} carries no tensors", ref)
    if len(meta) > limits.max_tensors:
        raise DecodeError(Code.TOO_LARGE, f"{len(meta)} tensors, limit {limits.max_tensors}", ref)
    if len(meta) != len(frames):
        raise DecodeError(
            Code.BAD_FRAMES,
            f"header names {len(meta)} tensor(s) but {len(frames)} tensor frame(s) arrived",
            ref,
        )
    out: dict[str, TensorRef] = {}
    for i, item in enumerate(meta):
        if not (isinstance(item, list) and len(item) == 3):
            raise DecodeError(Code.BAD_TENSOR, f"tensor {i}: expected [name, dtype, shape]", ref)
        name, dtype, shape = item
        # Each check guards the next use: a list as a name or dtype is unhashable, and a
        # float or bool as a dim would make prod() lie about the bytes.
        if not isinstance(name, str) or name in out:
            raise DecodeError(
                Code.BAD_TENSOR, f"tensor {i}: bad or repeated name {_short(name)}", ref
            )
        if not isinstance(dtype, str) or dtype not in ITEMSIZE:
            raise DecodeError(
                Code.BAD_TENSOR, f"tensor {_short(name)}: unknown dtype {_short(dtype)}", ref
            )
        if (
            not isinstance(shape, list)
            or len(shape) > limits.max_dims
            or not all(_is_int(d) and d >= 0 for d in shape)
        ):
            raise DecodeError(
                Code.BAD_TENSOR, f"tensor {_short(name)}: bad shape {_short(shape)}", ref
            )
        want = prod(shape) * ITEMSIZE[dtype]
        if sizes[i] != want:
            raise DecodeError(
                Code.BAD_TENSOR,
                f"tensor {_short(name)}: {sizes[i]} bytes, but {dtype} x {_short(shape)} "
                f"needs {want}",
                ref,
            )
        out[name] = TensorRef(dtype, tuple(shape), frames[i])
    return out


def decode_member(frames: list[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """`decode` of one member of a bundle, which may not be a bundle itself."""
    msg = decode(frames, limits)
    if type(msg) is Bundle:
        raise DecodeError(Code.BAD_MESSAGE, "a bundle inside a bundle")
    return msg


def _split_members(header: dict[str, Any], frames: list[Any]) -> list[list[Any]]:
    counts = header.pop("counts", None)
    if header:
        names = ", ".join(_short(k) for k in sorted(header, key=str)[:5])
        raise DecodeError(Code.BAD_MESSAGE, f"bundle: unknown field(s) {names}")
    if not isinstance(counts, list) or not all(_is_int(c) and c >= 1 for c in counts):
        raise DecodeError(
            Code.BAD_MESSAGE, f"bundle.counts: expected a list of ints >= 1, got {_short(counts)}"
        )
    if len(counts) > MAX_BUNDLE:
        raise DecodeError(Code.TOO_LARGE, f"bundle of {len(counts)} messages, limit {MAX_BUNDLE}")
    if sum(counts) != len(frames):
        raise DecodeError(
            Code.BAD_FRAMES,
            f"bundle header counts {sum(counts)} frame(s) but {len(frames)} arrived",
        )
    return _cut(frames, counts)


def _cut(frames: list[Any], counts: list[int]) -> list[list[Any]]:
    """A bundle's frames (after its header), member by member."""
    members, at = [], 0
    for n in counts:
        members.append(frames[at : at + n])
        at += n
    return members


def error_for(exc: BaseException, ref: int | None = None) -> Error:
    """The Error reply for an exception: its code and reason when it has them."""
    if ref is None:
        ref = getattr(exc, "ref", None)
    if not _is_int(ref):  # an Error must always be decodable by the one it answers
        ref = None
    if isinstance(exc, FlowmeshError):
        return Error(id=ref, code=str(exc.code), reason=exc.reason)
    return Error(id=ref, code=str(Code.INTERNAL), reason=f"{type(exc).__name__}: {exc}"[:500])
