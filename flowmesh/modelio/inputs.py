"""A model's inputs: what it declares, example tensors of those shapes, and how it is called."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flowmesh.modelio.dtypes import FLOAT_DTYPES, torch_dtype
from flowmesh.spec import ModelSpec, TensorSpec, parse_inputs


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


def make_inputs(
    inputs: dict[str, TensorSpec],
    batch: int,
    seq_len: int,
    device: str | torch.device,
    random: bool = False,
) -> dict[str, torch.Tensor]:
    """Tensors of the declared shapes: dim 0 = batch, free dims = seq_len.

    Integer inputs are zeros (valid token ids for any vocabulary); floating ones are zeros or,
    with `random`, standard normal (what real data looks like to the kernels being timed).
    """
    out = {}
    for name, ts in inputs.items():
        shape = [batch] + [seq_len if d == -1 else d for d in ts.shape[1:]]
        dtype = torch_dtype(ts.dtype)
        if random and dtype.is_floating_point:
            out[name] = torch.randn(shape, device=device).to(dtype)
        else:
            out[name] = torch.zeros(shape, dtype=dtype, device=device)
    return out


def call_model(model: nn.Module, inputs: dict[str, torch.Tensor] | torch.Tensor) -> Any:
    """One tensor is passed positionally, whatever its name; several as keyword arguments."""
    if isinstance(inputs, torch.Tensor):
        return model(inputs)
    if len(inputs) == 1:
        return model(next(iter(inputs.values())))
    return model(**inputs)
