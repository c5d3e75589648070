"""Dtype names as specs and files write them, and the torch dtypes they stand for."""

from __future__ import annotations

import torch

from flowmesh.errors import Code, FlowmeshError

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
