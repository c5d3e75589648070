"""KServe v2 tensors to torch and back: datatypes mapped both ways, JSON data and the binary
tensor data extension, shapes and sizes checked before anything is forwarded."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError

# v2 datatype -> torch dtype: those flowmesh's tensors carry (`flowmesh.spec.TENSOR_DTYPES`).
TORCH_BY_V2: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "UINT8": torch.uint8,
    "INT8": torch.int8,
    "INT16": torch.int16,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "FP16": torch.float16,
    "BF16": torch.bfloat16,
    "FP32": torch.float32,
    "FP64": torch.float64,
}
V2_BY_TORCH = {t: name for name, t in TORCH_BY_V2.items()}
# A declared input's dtype (flowmesh's name) -> its v2 datatype, for a model's metadata.
V2_BY_NAME = {str(t).removeprefix("torch."): name for name, t in TORCH_BY_V2.items()}

# JSON numbers each datatype takes (numpy's kinds of the parsed list): a float given for an
# integer tensor, or a number for a bool one, is refused rather than silently cast.
_KINDS = {torch.bool: "b", **{t: "iu" for t in (torch.uint8, torch.int8, torch.int16)}}
_KINDS |= {torch.int32: "iu", torch.int64: "iu"}
_FLOAT_KINDS = "iuf"
_NUMPY = {
    t: torch.empty(0, dtype=t).numpy().dtype
    for t in TORCH_BY_V2.values()
    if t is not torch.bfloat16
}


# The most dimensions a tensor may have: what the mesh's codec takes (`flowmesh.codec.Limits`),
# so that a shape it would refuse is refused here, before anything is forwarded.
MAX_DIMS = p.DEFAULT_LIMITS.max_dims
# The most bytes a shape may span, its dimensions of size 0 counted as 1: no tensor the mesh
# carries is larger (a message is at most this), and a tensor with no element still has
# strides, which past this would overflow torch's int64 (and numpy's) offsets.
MAX_EXTENT = p.DEFAULT_LIMITS.max_message_bytes


def bad(reason: str) -> FlowmeshError:
    return FlowmeshError(Code.BAD_REQUEST, reason)


def _header(item: Any, where: str) -> tuple[str, torch.dtype, tuple[int, ...]]:
    if not isinstance(item, Mapping):
        raise bad(f"{where}: an object with name, shape, datatype and data expected")
    name, datatype, shape = item.get("name"), item.get("datatype"), item.get("shape")
    if not isinstance(name, str) or not name:
        raise bad(f"{where}: name must be a non-empty string")
    if datatype not in TORCH_BY_V2:
        raise bad(f"input {name!r}: datatype {datatype!r} not one of {', '.join(TORCH_BY_V2)}")
    if (
        not isinstance(shape, list)
        or not shape
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise bad(f"input {name!r}: shape must be a list of sizes >= 0")
    if len(shape) > MAX_DIMS:
        raise bad(f"input {name!r}: shape of {len(shape)} dimensions, at most {MAX_DIMS}")
    dtype = TORCH_BY_V2[datatype]
    # Checked one dimension at a time, so that a huge one is never multiplied further.
    extent = dtype.itemsize
    for d in shape:
        extent *= max(d, 1)
        if extent > MAX_EXTENT:
            raise bad(f"input {name!r}: shape {list(shape)} spans over {MAX_EXTENT} bytes")
    return name, dtype, tuple(shape)


def binary_size(item: Mapping[str, Any]) -> int | None:
    """The byte count of an input sent in the binary extension (None: its data is JSON)."""
    params = item.get("parameters")
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise bad(f"input {item.get('name')!r}: parameters must be an object")
    size = params.get("binary_data_size")
    if size is None:
        return None
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise bad(f"input {item.get('name')!r}: binary_data_size must be a size >= 0")
    return size


def from_json(item: Any, where: str) -> tuple[str, torch.Tensor]:
    """One request input with its data in JSON (flat, or nested as the shape)."""
    name, dtype, shape = _header(item, where)
    count = math.prod(shape)
    try:
        raw = np.asarray(item.get("data"))
    except (ValueError, TypeError):
        raise bad(f"input {name!r}: data must be a list of numbers") from None
    if raw.size != count or (count and raw.dtype.kind not in _KINDS.get(dtype, _FLOAT_KINDS)):
        got = f"{raw.size} {raw.dtype.kind!r}-kind values"
        raise bad(
            f"input {name!r}: shape {list(shape)} takes {count} {V2_BY_TORCH[dtype]}, got {got}"
        )
    if count and raw.dtype.kind in "iuf" and _holds_bool(item["data"], raw.ndim):
        # numpy reads true as 1 beside other numbers; a bool is not a number to v2.
        raise bad(f"input {name!r}: {V2_BY_TORCH[dtype]} data holds true or false")
    if raw.dtype.kind in "iu" and dtype in _KINDS and dtype is not torch.bool:
        info = torch.iinfo(dtype)
        if count and (raw.min() < info.min or raw.max() > info.max):
            raise bad(f"input {name!r}: a value out of {V2_BY_TORCH[dtype]}'s range")
    raw = raw.reshape(shape)
    numpy_dtype = _NUMPY.get(dtype)
    if numpy_dtype is None:  # bfloat16 has no numpy dtype: cast by torch
        tensor = torch.from_numpy(raw.copy()).to(dtype)
        if count and dtype.is_floating_point and bool(torch.isinf(tensor).any()):
            raise bad(f"input {name!r}: a value out of {V2_BY_TORCH[dtype]}'s range")
        return name, tensor
    # One numpy cast (a copy, so that the tensor owns its memory), not torch's copy and cast:
    # each torch op costs microseconds of dispatch, more than a small tensor's whole data.
    with np.errstate(over="ignore"):  # an overflow is refused just below, not warned of
        cast = raw.astype(numpy_dtype)
    # JSON has no infinity, so an infinite value is a finite one the datatype cannot hold.
    if count and cast.dtype.kind == "f" and not np.isfinite(cast).all():
        raise bad(f"input {name!r}: a value out of {V2_BY_TORCH[dtype]}'s range")
    return name, torch.from_numpy(cast)


def _holds_bool(data: Any, depth: int) -> bool:
    """Whether JSON `data`, lists nested `depth` deep (0: one value), holds a bool."""
    if depth == 0:
        return isinstance(data, bool)
    items = data
    for _ in range(depth - 1):
        items = itertools.chain.from_iterable(items)
    return bool in map(type, items)


def from_bytes(
    item: Mapping[str, Any], data: bytes | memoryview, where: str
) -> tuple[str, torch.Tensor]:
    """One request input sent in the binary extension: `data` its raw little-endian bytes."""
    name, dtype, shape = _header(item, where)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if len(data) != math.prod(shape) * itemsize:
        raise bad(
            f"input {name!r}: shape {list(shape)} of {V2_BY_TORCH[dtype]} takes "
            f"{math.prod(shape) * itemsize} bytes, got {len(data)}"
        )
    if not data:
        return name, torch.empty(shape, dtype=dtype)
    # A copy: the request's buffer is read-only, and a tensor on it would be too.
    return name, torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


def to_json(name: str, tensor: torch.Tensor) -> dict[str, Any]:
    """One response output with its data in JSON (flat, row-major)."""
    flat = tensor.detach().cpu().reshape(-1)
    if flat.dtype is torch.bfloat16:
        flat = flat.float()
    return {"name": name, **_meta(tensor), "data": flat.tolist()}


def to_bytes(name: str, tensor: torch.Tensor) -> tuple[dict[str, Any], bytes]:
    """One response output in the binary extension: its JSON header and its raw bytes."""
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"name": name, **_meta(tensor), "parameters": {"binary_data_size": len(raw)}}, raw


def _meta(tensor: torch.Tensor) -> dict[str, Any]:
    if tensor.dtype not in V2_BY_TORCH:
        raise FlowmeshError(Code.INTERNAL, f"an output of dtype {tensor.dtype} has no v2 datatype")
    return {"datatype": V2_BY_TORCH[tensor.dtype], "shape": list(tensor.shape)}
