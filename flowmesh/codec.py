"""The codec for every message of `flowmesh.messages`: frames out, frames in, checked on receipt.

A message is a multipart ZeroMQ message: routing frames (added and removed by the sockets), one
msgpack header, then one raw frame per tensor. The header is the message's struct (its type `t`,
its fields, the protocol version `v`) with `tensors` as `[name, dtype, shape]` per tensor frame,
in frame order (a list of such lists, one per part, for a batch's parted tensors). Tensor bytes
are never copied into the header; they are sent with `copy=False` and read back with
`torch.frombuffer`, so a decoded tensor shares the received frame's memory.
Processes that only forward tensors (the broker) never build tensors at all: they pass the
received frames on as `TensorRef`s.

Decoding is one typed pass: msgspec reads the header straight into the union of all message
types, checking every field's type and constraint, and each declared payload (a model spec, a
plan, a training configuration) checks the rest of itself as it is built; then the sizes and
frames are checked. Any failure raises `DecodeError` with a code and a reason naming the field;
the receiver answers with `Error` and keeps running. A refusal inside a payload is BAD_REQUEST,
as the same payload refused by its receiver was before it was declared. No pickle anywhere.

This module does not import torch at import time, so the broker can stay free of it.
"""

from __future__ import annotations

import functools
import reprlib
import typing
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from math import prod
from typing import Any, Union

import msgpack
import msgspec
import numpy

from flowmesh.errors import Code, FlowmeshError
from flowmesh.messages import (
    ITEMSIZE,
    PAYLOADS,
    PROTOCOL_VERSION,
    Bundle,
    Error,
    Message,
    message_types,
)

# Members of one bundle at most: a bound on the work one received message makes.
MAX_BUNDLE = 256
# Bundles are for small messages, whose sends cost more than their bytes: a sender bundles no
# more than this many bytes together, and sends a larger message alone.
BUNDLE_BYTES = 1 << 20

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
    """A received message that cannot be accepted; `ref` is its id and `type` its message type
    when the header carried them (read from the header alone: nothing else of it is trusted),
    so that the receiver can fail the call a refused answer was meant to answer."""

    def __init__(
        self, code: Code, reason: str, ref: int | None = None, type: str | None = None
    ) -> None:
        super().__init__(code, reason)
        self.ref = ref
        self.type = type


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

    from flowmesh.modelio.dtypes import torch_dtype

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


def _frame_len(frame: Any) -> int:
    if hasattr(frame, "buffer"):  # zmq.Frame: len() would copy nothing but be explicit
        return frame.buffer.nbytes
    return memoryview(frame).nbytes


def _frame_bytes(frame: Any) -> Any:
    if hasattr(frame, "buffer"):
        return frame.buffer
    return frame


# --------------------------------------------------------------------------- encoding

_ENCODER = msgspec.msgpack.Encoder()


def encode(msg: Message) -> list[Any]:
    """Frames for `msg`: the msgpack header, then one buffer per tensor (not copied)."""
    if msg.HAS_TENSORS:
        frames: list[Any] = [b""]
        tensors = msg.tensors  # type: ignore[attr-defined]
        if msg.PARTED:
            meta: list[Any] = [_listed(part, frames) for part in tensors]
        else:
            meta = _listed(tensors, frames)
        frames[0] = _ENCODER.encode(msgspec.structs.replace(msg, tensors=meta))  # type: ignore[type-var]
        return frames
    if type(msg) is Bundle:
        members = msg.members
        frames = [_ENCODER.encode(Bundle(members=[len(m) for m in members]))]
        for m in members:
            frames.extend(m)
        return frames
    return [_ENCODER.encode(msg)]


# --------------------------------------------------------------------------- decoding


def _refuse_ext(code: int, data: memoryview) -> Any:
    raise ValueError(f"msgpack extension type {code} does not travel")


_TYPES = message_types()
_DECODER = msgspec.msgpack.Decoder(
    Union[tuple(_TYPES.values())],  # noqa: UP007 (a tuple of types, built at run time)
    ext_hook=_refuse_ext,
)


class _Envelope(msgspec.Struct):
    """What a refused header's version, type and id were, when they can be read (other
    fields are skipped): to choose the error's code and let the reply name the request."""

    v: msgspec.Raw = msgspec.Raw()  # empty: missing
    t: msgspec.Raw = msgspec.Raw()
    id: msgspec.Raw = msgspec.Raw()


_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)


def _envelope(buf: Any) -> _Envelope | None:
    try:
        return _ENVELOPE.decode(buf)
    except Exception:  # not a map, truncated, nested past the stack: nothing can be read
        return None


def _read(raw: msgspec.Raw, tp: Any) -> Any:
    """`raw` as a `tp`, or None when it is missing or not one."""
    if not raw:
        return None
    try:
        return msgspec.msgpack.decode(raw, type=tp)
    except Exception:
        return None


_REPR = reprlib.Repr()  # keyword arguments only from Python 3.12
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 2, 40, 40, 6, 6


def _short(value: Any) -> str:
    """A bounded repr of a value read from a peer: reasons must stay small, whatever arrived."""
    return _REPR.repr(value)


def _cut_text(text: str, limit: int = 200) -> str:
    # msgspec's messages quote what arrived (an unknown field's name, say) and end with the path.
    return text if len(text) <= limit else f"{text[: limit - 80]}...{text[-60:]}"


def _ref_of(env: _Envelope | None) -> int | None:
    ref = _read(env.id, int) if env is not None else None
    return ref if ref is not None and ref >= 0 else None


def _type_of(env: _Envelope | None) -> str | None:
    name = _read(env.t, str) if env is not None else None
    return name if name in _TYPES else None


def _refused(buf: Any, why: str, cause: BaseException | None = None) -> DecodeError:
    """The error for a header msgspec refused (`why`; `cause`: what a payload's own check
    raised): VERSION and UNKNOWN_TYPE come first, as the version and the type decide how the
    rest reads; then BAD_TENSOR for a wrong tensor listing, BAD_FRAMES for tensors on a type
    without any, BAD_REQUEST inside a payload, BAD_MESSAGE for any other field."""
    env = _envelope(buf)
    if env is None:
        return DecodeError(Code.BAD_MESSAGE, f"header is not a valid map: {_cut_text(why)}")
    ref = _ref_of(env)
    version = _read(env.v, int)
    if version != PROTOCOL_VERSION:
        shown = _short(_read(env.v, Any)) if env.v else "missing"
        return DecodeError(
            Code.VERSION, f"protocol version {shown}, this process speaks {PROTOCOL_VERSION}", ref
        )
    name = _type_of(env)
    if name is None:
        shown = _short(_read(env.t, Any)) if env.t else "missing"
        return DecodeError(Code.UNKNOWN_TYPE, f"unknown message type {shown}", ref)
    code = Code.BAD_MESSAGE
    _, at, path = why.rpartition(" - at `$.")
    if "- at `$.tensors[" in why:
        code = Code.BAD_TENSOR
    elif why.startswith("Object contains unknown field `tensors`"):
        code = Code.BAD_FRAMES
    elif at and path.split(".", 1)[0].split("[", 1)[0].rstrip("`") in _payload_fields(_TYPES[name]):
        code = Code.BAD_REQUEST
        if isinstance(cause, FlowmeshError):  # its reason, without the code msgspec quoted
            why = f"{cause.reason} - at `$.{path}"
    return DecodeError(code, f"{name}: {_cut_text(why)}", ref, name)


def _check_bounds(buf: Any, limits: Limits) -> None:
    """The string and container limits, which msgspec does not apply; only a header longer
    than one of them can exceed it (each element takes a byte at least)."""
    try:
        msgpack.unpackb(
            buf,
            raw=False,
            strict_map_key=False,
            max_str_len=limits.max_str_len,
            max_bin_len=limits.max_str_len,
            max_array_len=limits.max_container_len,
            max_map_len=limits.max_container_len,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise DecodeError(
            Code.BAD_MESSAGE, f"header is not a valid msgpack map: {type(exc).__name__}"
        ) from None


# The version's key and value as msgspec writes them (last: `Message.v` is its last field) and
# as msgpack.packb writes a dict that starts with it.
_VERSION_BYTES = msgspec.msgpack.encode("v") + msgspec.msgpack.encode(PROTOCOL_VERSION)


def _has_version(buf: Any) -> bool:
    """Whether the header had its `v` (msgspec fills in a missing one with the default). Read
    from where encoders put it, last (msgspec) or first (a dict that starts with it), else from
    the header; a header that ends in those bytes without the key passes as version 1, which
    is harmless: such a sender could as well have written `v`."""
    n = len(_VERSION_BYTES)
    if buf[-n:] == _VERSION_BYTES:
        return True
    first = buf[0]
    start = 1 if 0x80 <= first <= 0x8F else 3 if first == 0xDE else 5
    if buf[start : start + n] == _VERSION_BYTES:
        return True
    env = _envelope(buf)  # another encoder's order: read it
    return env is not None and bool(env.v)


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


def _holds_any(tp: Any) -> bool:
    return tp is Any or any(_holds_any(a) for a in typing.get_args(tp))


def _mentions(tp: Any, kinds: tuple[type, ...]) -> bool:
    return (isinstance(tp, type) and issubclass(tp, kinds)) or any(
        _mentions(a, kinds) for a in typing.get_args(tp)
    )


@functools.cache
def _payload_fields(cls: type[Message]) -> frozenset[str]:
    """The fields of `cls` that hold a declared payload (`messages.PAYLOADS`)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return frozenset(n for n in cls.__struct_fields__ if _mentions(hints[n], PAYLOADS))


def _any_paths(tp: Any, at: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The paths to the values of type `tp` (at `at`) that are `Any` somewhere, through the
    structs, lists ("[]") and maps ("{}") that hold them: their contents are checked by
    `_plain`."""
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    if not _mentions(tp, (msgspec.Struct,)):
        return [at] if _holds_any(tp) else []
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        hints = typing.get_type_hints(tp, include_extras=True)
        out = []
        for name in tp.__struct_fields__:
            if not (name == "tensors" and issubclass(tp, Message)):  # read by the codec itself
                out += _any_paths(hints[name], (*at, name))
        return out
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (list, tuple):
        return [p for a in args if a is not Ellipsis for p in _any_paths(a, (*at, "[]"))]
    if origin is dict:
        return _any_paths(args[1], (*at, "{}"))
    return list(dict.fromkeys(p for a in args for p in _any_paths(a, at)))  # a union


@functools.cache
def _any_fields(cls: type[Message]) -> tuple[tuple[str, ...], ...]:
    return tuple(_any_paths(cls, ()))


def _values_at(value: Any, path: tuple[str, ...]) -> Iterator[Any]:
    """The values at `path` (see `_any_paths`) in `value`; a None or a value of another
    member of a union on the way ends that branch."""
    if not path:
        yield value
        return
    step, rest = path[0], path[1:]
    if step == "[]":
        if type(value) is list or type(value) is tuple:
            for v in value:
                yield from _values_at(v, rest)
    elif step == "{}":
        if type(value) is dict:
            for v in value.values():
                yield from _values_at(v, rest)
    elif isinstance(value, msgspec.Struct) and step in value.__struct_fields__:
        yield from _values_at(getattr(value, step), rest)


def decode(frames: list[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Validate and decode the frames after the routing envelope. Raises DecodeError only."""
    if not frames:
        raise DecodeError(Code.BAD_MESSAGE, "empty message")
    sizes = [_frame_len(f) for f in frames]
    head = sizes[0]
    if head > limits.max_header_bytes:
        raise DecodeError(
            Code.TOO_LARGE, f"header is {head} bytes, limit {limits.max_header_bytes}"
        )
    buf = _frame_bytes(frames[0])
    total = sum(sizes)
    if total > limits.max_message_bytes:
        # With the request's id when the header can be read, so that the sender can match
        # the answer to its call; the header itself is bounded.
        raise DecodeError(
            Code.TOO_LARGE,
            f"message is {total} bytes, limit {limits.max_message_bytes}",
            _ref_of(env := _envelope(buf)),
            _type_of(env),
        )
    if head > limits.max_str_len or head > limits.max_container_len:
        _check_bounds(buf, limits)
    try:
        msg = _DECODER.decode(buf)
    except msgspec.ValidationError as exc:
        raise _refused(buf, str(exc), exc.__cause__) from None
    except Exception as exc:  # msgspec.DecodeError, an extension type, RecursionError
        raise DecodeError(
            Code.BAD_MESSAGE, f"header is not a valid msgpack map: {_cut_text(str(exc))}"
        ) from None
    try:
        return _checked(msg, buf, frames, sizes, limits)
    except DecodeError as exc:  # the header decoded: its type is known
        exc.type = msg.TYPE
        raise


def _checked(
    msg: Message, buf: Any, frames: list[Any], sizes: list[int], limits: Limits
) -> Message:
    """`decode`'s checks of a header msgspec took: the version, the values, the frames."""
    cls = type(msg)
    ref = getattr(msg, "id", None)
    if not _has_version(buf):
        raise DecodeError(
            Code.VERSION, f"protocol version missing, this process speaks {PROTOCOL_VERSION}", ref
        )
    for path in _any_fields(cls):
        if len(path) == 1:  # a field of the message itself (run info, say): on the hot path
            ok = _plain(getattr(msg, path[0]))
        else:
            ok = all(_plain(v) for v in _values_at(msg, path))
        if not ok:
            raise DecodeError(
                Code.BAD_MESSAGE,
                f"{cls.TYPE}: a value that cannot travel (only maps keyed by strings, lists and "
                f"plain scalars) - at `$.{'.'.join(path)}`",
                ref,
            )
    if cls.HAS_TENSORS:
        msg.tensors = _tensors(msg, frames, sizes, limits, ref)  # type: ignore[attr-defined]
    elif cls is Bundle:
        msg.members = _members(msg.members, frames[1:])  # type: ignore[attr-defined]
    elif len(frames) != 1:
        raise DecodeError(Code.BAD_FRAMES, f"{cls.TYPE} carries no tensors", ref)
    return msg


def _listed(tensors: Any, frames: list[Any]) -> list[Any]:
    """The header's listing of `tensors` (a name -> tensor map), their frames appended."""
    meta = []
    for name, t in tensors.items():
        dtype, shape, buf = tensor_frame(t)
        meta.append((name, dtype, shape))
        frames.append(buf)
    return meta


def _tensors(
    msg: Message, frames: list[Any], sizes: list[int], limits: Limits, ref: int | None
) -> dict[str, TensorRef] | list[dict[str, TensorRef]]:
    """The tensors the header lists, over the frames that follow it: one name -> `TensorRef`
    map, or one per part for a `PARTED` type."""
    meta = msg.tensors  # type: ignore[attr-defined]
    if msg.PARTED:
        groups = meta
        if any(type(g) is not list for g in groups):
            raise DecodeError(Code.BAD_MESSAGE, f"{msg.TYPE}.tensors: expected lists", ref)
    elif type(meta) is not list:
        if meta:
            raise DecodeError(Code.BAD_MESSAGE, f"{msg.TYPE}.tensors: expected a list", ref)
        groups = [[]]  # not on the wire: the default
    else:
        groups = [meta]
    count = sum(len(g) for g in groups)
    if count > limits.max_tensors:
        raise DecodeError(Code.TOO_LARGE, f"{count} tensors, limit {limits.max_tensors}", ref)
    if count != len(frames) - 1:
        raise DecodeError(
            Code.BAD_FRAMES,
            f"header names {count} tensor(s) but {len(frames) - 1} tensor frame(s) arrived",
            ref,
        )
    parts: list[dict[str, TensorRef]] = []
    i = 0
    for group in groups:
        out: dict[str, TensorRef] = {}
        for name, dtype, shape in group:
            if name in out:
                raise DecodeError(Code.BAD_TENSOR, f"tensor {i}: repeated name {_short(name)}", ref)
            if len(shape) > limits.max_dims:
                raise DecodeError(
                    Code.BAD_TENSOR,
                    f"tensor {_short(name)}: {len(shape)} dims, limit {limits.max_dims}",
                    ref,
                )
            want = ITEMSIZE[dtype]
            for d in shape:
                want *= d
            if sizes[i + 1] != want:
                raise DecodeError(
                    Code.BAD_TENSOR,
                    f"tensor {_short(name)}: {sizes[i + 1]} bytes, but {dtype} x "
                    f"{_short(shape)} needs {want}",
                    ref,
                )
            out[name] = TensorRef(dtype, tuple(shape), frames[i + 1])
            i += 1
        parts.append(out)
    return parts if msg.PARTED else parts[0]


def _members(counts: list[int], frames: list[Any]) -> list[list[Any]]:
    """A bundle's frames (after its header), member by member."""
    if len(counts) > MAX_BUNDLE:
        raise DecodeError(Code.TOO_LARGE, f"bundle of {len(counts)} messages, limit {MAX_BUNDLE}")
    if sum(counts) != len(frames):
        raise DecodeError(
            Code.BAD_FRAMES,
            f"bundle header counts {sum(counts)} frame(s) but {len(frames)} arrived",
        )
    members, at = [], 0
    for n in counts:
        members.append(frames[at : at + n])
        at += n
    return members


def decode_member(frames: list[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """`decode` of one member of a bundle, which may not be a bundle itself."""
    msg = decode(frames, limits)
    if type(msg) is Bundle:
        raise DecodeError(Code.BAD_MESSAGE, "a bundle inside a bundle")
    return msg


# --------------------------------------------------------------------------- bundles and errors


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


def error_for(exc: BaseException, ref: int | None = None) -> Error:
    """The Error reply for an exception: its code and reason when it has them."""
    if ref is None:
        ref = getattr(exc, "ref", None)
    # An Error must always be decodable by the one it answers: an id is an int >= 0, never a
    # bool (a `true` id must not pass as 1).
    if isinstance(ref, bool) or not isinstance(ref, int) or ref < 0:
        ref = None
    if isinstance(exc, FlowmeshError):
        return Error(id=ref, code=str(exc.code), reason=exc.reason)
    return Error(id=ref, code=str(Code.INTERNAL), reason=f"{type(exc).__name__}: {exc}"[:500])
