"""Reading tensors from a safetensors weights file: only the ones asked for, each checked against
the model's shape and cast to its dtype, or read straight into its place in a host buffer."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from typing import Any

import torch
from safetensors import safe_open

from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.dtypes import SAFETENSORS_DTYPES
from flowmesh.roots import io_error, not_safetensors


def conform(tensor: torch.Tensor, want: torch.Tensor, where: str) -> torch.Tensor:
    """`tensor` checked against `want`'s shape and cast to `want`'s dtype (the deployment's,
    for floating tensors); `where` names the tensor in the error."""
    if tuple(tensor.shape) != tuple(want.shape):
        raise FlowmeshError(
            Code.BAD_REQUEST,
            f"{where} has shape {tuple(tensor.shape)}, the model expects {tuple(want.shape)}",
        )
    return tensor if tensor.dtype == want.dtype else tensor.to(want.dtype)


def read_weights(
    path: str, names: dict[str, str], expected: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Read only the tensors named in `names` (local name -> name in the file), each conformed
    to `expected` (meta tensors of the model's shapes and dtypes).

    A missing tensor or a shape that does not match is a clear deploy error.
    """
    out: dict[str, torch.Tensor] = {}
    try:
        handle = safe_open(path, framework="pt", device="cpu")
    except OSError as exc:
        raise io_error(exc, f"weights {path!r}") from None
    except Exception:  # safetensors' own error types, whose text may quote the file
        raise not_safetensors(f"weights {path!r}") from None
    with handle as f:
        available = set(f.keys())
        for local, stored in names.items():
            if stored not in available:
                raise FlowmeshError(
                    Code.BAD_REQUEST, f"weights {path!r}: tensor {stored!r} is missing"
                )
            out[local] = conform(
                f.get_tensor(stored), expected[local], f"weights {path!r}: tensor {stored!r}"
            )
    return out


READ_CHUNK = 64 * 2**20  # largest single read; preadv may also return less


def read_header(path: str) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (name -> dtype, shape, data_offsets) and where its data
    starts; a missing or corrupt file is a clear deploy error."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            (n,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
            raw = f.read(n) if 0 <= n <= 100 * 2**20 else b""
    except OSError as exc:
        raise io_error(exc, f"weights {path!r}") from None
    try:
        if len(raw) != n:
            raise ValueError
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError
    except ValueError:  # UnicodeDecodeError's text would quote a byte of the file
        raise not_safetensors(f"weights {path!r}") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def _pread_into(
    fd: int,
    dst: memoryview,
    offset: int,
    path: str,
    progress: Callable[[int], None] | None = None,
) -> None:
    done = 0
    while done < len(dst):
        chunk = dst[done : done + READ_CHUNK]
        try:
            got = os.preadv(fd, [chunk], offset + done)
        except OSError as exc:
            raise io_error(exc, f"weights {path!r}") from None
        if got <= 0:
            raise FlowmeshError(
                Code.BAD_REQUEST, f"weights {path!r}: the file ends inside a tensor's data"
            )
        done += got
        if progress is not None:
            progress(got)


def _writable(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes as a writable memoryview (no copy)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def read_weights_into(
    path: str, dests: dict[str, torch.Tensor], progress: Callable[[int], None] | None = None
) -> None:
    """Read each tensor named in `dests` (name in the file -> a contiguous CPU tensor of the
    model's shape and dtype, typically a view of a stage's host buffer) from the safetensors
    file at `path` straight into its destination: one copy, from the file to its place.

    A tensor stored in another dtype than its destination's is read into a temporary of the
    file's dtype and cast on the way in (as `read_weights` does); a missing tensor or a shape
    that does not match is a clear deploy error. `progress(n)` is told of every n destination
    bytes filled (at most READ_CHUNK at a time).
    """
    header, data_start = read_header(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise io_error(exc, f"weights {path!r}") from None
    try:
        for stored, dst in dests.items():
            where = f"weights {path!r}: tensor {stored!r}"
            entry = header.get(stored)
            if entry is None:
                raise FlowmeshError(
                    Code.BAD_REQUEST, f"weights {path!r}: tensor {stored!r} is missing"
                )
            if not isinstance(entry, dict):
                raise FlowmeshError(Code.BAD_REQUEST, f"{where}: bad header entry")
            if entry.get("dtype") not in SAFETENSORS_DTYPES:
                # A dtype this reader does not know (float8 ...): safetensors' own reader.
                dst.copy_(read_weights(path, {stored: stored}, {stored: dst})[stored])
                if progress is not None:
                    progress(dst.nbytes)
                continue
            file_dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            try:
                shape = tuple(int(d) for d in entry["shape"])
                begin, end = (int(o) for o in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise FlowmeshError(Code.BAD_REQUEST, f"{where}: bad header entry") from None
            if shape != tuple(dst.shape):
                raise FlowmeshError(
                    Code.BAD_REQUEST,
                    f"{where} has shape {shape}, the model expects {tuple(dst.shape)}",
                )
            nbytes = dst.numel() * file_dtype.itemsize
            if end - begin != nbytes:
                raise FlowmeshError(
                    Code.BAD_REQUEST, f"{where}: {end - begin} bytes for {nbytes} expected"
                )
            if nbytes == 0:
                continue
            if file_dtype == dst.dtype and dst.is_contiguous():
                _pread_into(fd, _writable(dst), data_start + begin, path, progress)
            else:
                tmp = torch.empty(shape, dtype=file_dtype)
                _pread_into(fd, _writable(tmp), data_start + begin, path)
                dst.copy_(conform(tmp, dst, where))
                if progress is not None:
                    progress(dst.nbytes)
    finally:
        os.close(fd)
