"""Turning a ModelSpec into torch modules: on the meta device, seeded on the CPU, or from weights.

Every process that needs a module (partitioner, worker, tests, the demo's reference forward) builds
it here, so "the same model" means the same code path everywhere.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from flowmesh.errors import Code, FlowmeshError
from flowmesh.roots import io_error, not_safetensors
from flowmesh.spec import DEFAULT_ALLOW, ModelSpec, TensorSpec, check_factory, parse_inputs

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")


def torch_dtype(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise FlowmeshError(Code.BAD_REQUEST, f"unknown dtype {name!r}") from None


def resolve_factory(factory: str, allow: Iterable[str] = DEFAULT_ALLOW) -> Callable[..., Any]:
    check_factory(factory, tuple(allow))
    module_name, attr = factory.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise FlowmeshError(Code.BAD_REQUEST, f"factory module {module_name!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise FlowmeshError(Code.BAD_REQUEST, f"factory {factory!r} is not a callable")
    return fn


def _call_factory(spec: ModelSpec, allow: Iterable[str]) -> nn.Module:
    fn = resolve_factory(spec.factory, allow)
    try:
        model = fn(**spec.kwargs)
    except FlowmeshError:
        raise
    except Exception as exc:
        raise FlowmeshError(
            Code.BAD_REQUEST, f"factory {spec.factory} failed: {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(model, nn.Module):
        raise FlowmeshError(
            Code.BAD_REQUEST,
            f"factory {spec.factory} returned {type(model).__name__}, not a Module",
        )
    return model


def _cast(model: nn.Module, dtype: str) -> nn.Module:
    # Only floating tensors take the model dtype; integer buffers (positions, masks) keep theirs.
    return model.to(torch_dtype(dtype)).eval()


def build_meta(spec: ModelSpec, allow: Iterable[str] = DEFAULT_ALLOW) -> nn.Module:
    """The model's structure with no memory behind it."""
    if spec.hf is not None:
        from flowmesh import hf_dir

        return _cast(hf_dir.build_meta(spec.hf), spec.dtype)
    with torch.device("meta"):
        model = _call_factory(spec, allow)
    return _cast(model, spec.dtype)


def build_seeded(spec: ModelSpec, allow: Iterable[str] = DEFAULT_ALLOW) -> nn.Module:
    """The whole model on the CPU with the factory's own initialisation under `spec.init_seed`.

    This is the reference for seeded deployments: a worker holding any stage of the model has
    exactly the tensors this returns, so tests compare served outputs with its forward.
    A Hugging Face directory (`spec.hf`) has no seed: its model comes with its weights.
    """
    if spec.hf is not None:
        return build_reference(spec, allow)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.init_seed)
        with torch.device("cpu"):
            model = _call_factory(spec, allow)
    return _cast(model, spec.dtype)


def build_reference(spec: ModelSpec, allow: Iterable[str] = DEFAULT_ALLOW) -> nn.Module:
    """The whole model on the CPU as deployed: seeded, or with its weights file (or Hugging
    Face directory) loaded."""
    if spec.hf is not None:
        from flowmesh import hf_dir

        return hf_dir.load_whole(build_meta(spec, allow), spec.hf)
    if spec.weights is None:
        return build_seeded(spec, allow)
    model = build_meta(spec, allow)
    names = {n: n for n in model.state_dict(keep_vars=True)}
    tensors = read_weights(spec.weights, names, expected=model.state_dict(keep_vars=True))
    model.load_state_dict(tensors, assign=True, strict=True)
    return model.eval()


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
    from safetensors import safe_open

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


# safetensors' dtype names (little-endian in the file, as on every host flowmesh runs on).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

READ_CHUNK = 64 * 2**20  # largest single read; preadv may also return less


def read_header(path: str) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (name -> dtype, shape, data_offsets) and where its data
    starts; a missing or corrupt file is a clear deploy error."""
    import json
    import struct

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


def declared_inputs(spec: ModelSpec, model: nn.Module) -> dict[str, TensorSpec] | None:
    """The spec's inputs, else what the module declares in `flowmesh_inputs`.

    A module declares its floating inputs for float32; deployed in another dtype, it takes
    them in that dtype (integer inputs such as token ids keep theirs).
    """
    if spec.inputs is not None:
        return spec.inputs
    raw = getattr(model, "flowmesh_inputs", None)
    if raw is None:
        return None
    return {
        name: TensorSpec(spec.dtype, t.shape) if t.dtype in FLOAT_DTYPES else t
        for name, t in parse_inputs(raw).items()
    }


def example_inputs(
    inputs: dict[str, TensorSpec], batch: int, device: str | torch.device = "meta"
) -> dict[str, torch.Tensor]:
    """Tensors of the declared shapes (free dims = 1, dim 0 = batch) for shape propagation."""
    out = {}
    for name, ts in inputs.items():
        shape = [batch] + [1 if d == -1 else d for d in ts.shape[1:]]
        out[name] = torch.zeros(shape, dtype=torch_dtype(ts.dtype), device=device)
    return out


def call_model(model: nn.Module, inputs: dict[str, torch.Tensor] | torch.Tensor) -> Any:
    """One tensor is passed positionally, whatever its name; several as keyword arguments."""
    if isinstance(inputs, torch.Tensor):
        return model(inputs)
    if len(inputs) == 1:
        return model(next(iter(inputs.values())))
    return model(**inputs)
