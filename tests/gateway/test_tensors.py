"""KServe v2 tensors to torch and back (`gateway.tensors`), in process: every datatype both ways
through JSON and through the binary extension, and the refusals before anything is forwarded."""

from __future__ import annotations

import pytest
import torch

from flowmesh.errors import Code, FlowmeshError
from gateway.tensors import TORCH_BY_V2, binary_size, from_bytes, from_json, to_bytes, to_json


def sample(dtype: torch.dtype) -> torch.Tensor:
    if dtype is torch.bool:
        return torch.tensor([[True, False, True], [False, False, True]])
    if dtype.is_floating_point:
        return torch.tensor([[0.5, -1.25, 3.0], [1e-3, 2.0, -0.0]]).to(dtype)
    info = torch.iinfo(dtype)
    return torch.tensor([[info.min, 0, info.max], [1, 2, 3]], dtype=dtype)


@pytest.mark.parametrize("datatype", list(TORCH_BY_V2))
def test_every_datatype_goes_both_ways_in_json_and_in_bytes(datatype: str) -> None:
    t = sample(TORCH_BY_V2[datatype])
    out = to_json("y", t)
    assert (out["datatype"], out["shape"]) == (datatype, [2, 3])
    name, back = from_json({**out, "name": "x"}, "inputs[0]")
    # bit-exact: tensors converted to v2 JSON and back, pure data movement
    assert name == "x" and back.dtype == t.dtype and torch.equal(back, t)
    meta, raw = to_bytes("y", t)
    assert meta["parameters"]["binary_data_size"] == len(raw) == t.numel() * t.element_size()
    _, back = from_bytes(meta, raw, "inputs[0]")
    # bit-exact: tensors to the binary extension's bytes and back, pure data movement
    assert back.dtype == t.dtype and torch.equal(back, t)


def test_nested_json_data_takes_the_shape_too() -> None:
    item = {"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [[1, 2], [3, 4]]}
    # bit-exact: JSON numbers parsed, pure data movement
    assert torch.equal(from_json(item, "inputs[0]")[1], torch.tensor([[1.0, 2], [3, 4]]))


@pytest.mark.parametrize(
    ("item", "match"),
    [
        ({"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [1.0] * 3}, "takes 4"),
        ({"name": "x", "datatype": "INT32", "shape": [1], "data": [1.5]}, "takes 1 INT32"),
        ({"name": "x", "datatype": "BOOL", "shape": [1], "data": [1]}, "takes 1 BOOL"),
        ({"name": "x", "datatype": "INT8", "shape": [1], "data": [300]}, "range"),
        # true beside numbers, which numpy would read as 1, flat, nested and alone
        ({"name": "x", "datatype": "FP32", "shape": [2], "data": [0.5, True]}, "true or false"),
        ({"name": "x", "datatype": "INT64", "shape": [1, 2], "data": [[1, False]]}, "or false"),
        # finite numbers a float datatype cannot hold (they would be cast to infinity)
        ({"name": "x", "datatype": "FP16", "shape": [2], "data": [1.0, 70000.0]}, "range"),
        ({"name": "x", "datatype": "BF16", "shape": [1], "data": [1e39]}, "range"),
        ({"name": "x", "datatype": "FP32", "shape": [1], "data": [-1e39]}, "range"),
        ({"name": "x", "datatype": "FP32", "shape": [1], "data": ["a"]}, "takes 1 FP32"),
        ({"name": "x", "datatype": "BYTES", "shape": [1], "data": ["a"]}, "datatype 'BYTES'"),
        ({"name": "x", "datatype": "FP32", "shape": [-1], "data": [1.0]}, "shape"),
        ({"name": "", "datatype": "FP32", "shape": [1], "data": [1.0]}, "name"),
        ("x", "an object"),
    ],
)
def test_json_refusals_are_bad_requests(item: object, match: str) -> None:
    with pytest.raises(FlowmeshError, match=match) as refused:
        from_json(item, "inputs[0]")
    assert refused.value.code == Code.BAD_REQUEST


def test_json_numbers_at_a_datatypes_edges_are_taken() -> None:
    fp16 = {"name": "x", "datatype": "FP16", "shape": [1, 3], "data": [[65504.0, -65504, 1]]}
    # bit-exact: JSON numbers parsed, pure data movement
    assert torch.equal(from_json(fp16, "inputs[0]")[1], torch.tensor([[65504.0, -65504, 1]]).half())
    one = {"name": "x", "datatype": "FP32", "shape": [1], "data": 2}  # a lone number: shape [1]
    # bit-exact: a JSON number parsed, pure data movement
    assert torch.equal(from_json(one, "inputs[0]")[1], torch.tensor([2.0]))


def test_binary_data_of_the_wrong_size_is_refused() -> None:
    item = {"name": "x", "datatype": "FP32", "shape": [2]}
    with pytest.raises(FlowmeshError, match="takes 8 bytes, got 7") as refused:
        from_bytes(item, b"\0" * 7, "inputs[0]")
    assert refused.value.code == Code.BAD_REQUEST


@pytest.mark.parametrize(
    ("shape", "match"),
    [
        ([1] * 17, "17 dimensions, at most 16"),  # past what the mesh's codec takes
        ([0, 2**64], "spans over"),  # past int64: numpy and torch raised their own errors
        ([0, 2**62], "spans over"),  # no element, but strides past int64 offsets
        ([2**31, 2**31, 0], "spans over"),
    ],
)
def test_shapes_past_what_the_mesh_carries_are_bad_requests(shape: list[int], match: str) -> None:
    # Both ways in: binary tensors used to be made (torch.empty) and forwarded as they were.
    item = {"name": "x", "datatype": "FP32", "shape": shape}
    with pytest.raises(FlowmeshError, match=match) as refused:
        from_json({**item, "data": [1.0] if 0 not in shape else []}, "inputs[0]")
    assert refused.value.code == Code.BAD_REQUEST
    with pytest.raises(FlowmeshError, match=match) as refused:
        from_bytes(item, b"\0\0\0\0" if 0 not in shape else b"", "inputs[0]")
    assert refused.value.code == Code.BAD_REQUEST


def test_the_widest_shape_the_mesh_carries_is_taken() -> None:
    # No element, each row a whole message's worth of bytes: a shape a tensor may have.
    widest = 1 << 28  # FP32: 4 bytes each, 1 GiB in all
    item = {"name": "x", "datatype": "FP32", "shape": [0, widest]}
    assert from_bytes(item, b"", "inputs[0]")[1].shape == (0, widest)
    assert from_json({**item, "data": []}, "inputs[0]")[1].shape == (0, widest)
    ranked = {"name": "x", "datatype": "FP32", "shape": [1] * 16, "data": [2.0]}
    assert from_json(ranked, "inputs[0]")[1].shape == (1,) * 16


@pytest.mark.parametrize("parameters", [[1], "binary", 3])
def test_parameters_that_are_not_an_object_are_bad_requests(parameters: object) -> None:
    item = {"name": "x", "datatype": "FP32", "shape": [1], "parameters": parameters}
    with pytest.raises(FlowmeshError, match="parameters must be an object") as refused:
        binary_size(item)
    assert refused.value.code == Code.BAD_REQUEST
