"""The wire protocol: exact frame layout, tensor round trips without copies, strict validation."""

from __future__ import annotations

import ctypes

import msgpack
import numpy as np
import pytest
import torch
import zmq

from flowmesh import protocol as p
from flowmesh.errors import Code


def roundtrip(msg: p.Message) -> p.Message:
    return p.decode(p.encode(msg))


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 5),
        torch.randn(4, 2).half(),
        torch.randn(2, 7).bfloat16(),
        torch.arange(12, dtype=torch.int64).reshape(3, 4),
        torch.rand(6) > 0.5,
        torch.randn(4, 6).t(),  # non-contiguous
        torch.randn(8, 8)[::2, 1::3],  # strided slice
        torch.empty(0, 3),
        torch.tensor(3.5),  # 0-d
        torch.randint(0, 100, (2, 3), dtype=torch.int32),
    ],
    ids=["f32", "f16", "bf16", "i64", "bool", "transposed", "strided", "empty", "0d", "i32"],
)
def test_tensor_roundtrip_is_exact(tensor: torch.Tensor) -> None:
    msg = roundtrip(p.Infer(id=1, model="m", tensors={"x": tensor}))
    out = msg.tensors["x"].tensor()  # type: ignore[attr-defined]
    assert out.dtype == tensor.dtype and out.shape == tensor.shape
    assert torch.equal(out, tensor)


def test_frame_layout_is_one_header_plus_one_frame_per_tensor() -> None:
    frames = p.encode(p.Infer(id=9, model="m", tensors={"a": torch.ones(2), "b": torch.ones(3)}))
    assert len(frames) == 3
    header = msgpack.unpackb(frames[0])
    assert header["v"] == p.PROTOCOL_VERSION and header["t"] == "infer" and header["id"] == 9
    assert header["tensors"] == [["a", "float32", [2]], ["b", "float32", [3]]]
    assert len(p.encode(p.Status(id=1))) == 1


def test_contiguous_cpu_tensor_is_sent_without_a_copy() -> None:
    t = torch.randn(64, 64)
    _header, buf = p.encode(p.Infer(id=1, model="m", tensors={"x": t}))
    assert np.asarray(buf).ctypes.data == t.data_ptr()


def test_256_mib_tensor_over_a_real_socket_is_not_copied_on_receipt() -> None:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        port = a.bind_to_random_port("tcp://127.0.0.1")
        b.connect(f"tcp://127.0.0.1:{port}")
        big = torch.arange(64 * 1024 * 1024, dtype=torch.float32)  # 256 MiB
        a.send_multipart(p.encode(p.Infer(id=1, model="m", tensors={"x": big})), copy=False)
        frames = b.recv_multipart(copy=False)
        msg = p.decode(frames)
        out = msg.tensors["x"].tensor()  # type: ignore[attr-defined]
        frame_addr = ctypes.addressof(ctypes.c_char.from_buffer(frames[1].buffer))
        assert out.data_ptr() == frame_addr, "decoded tensor must share the frame's memory"
        assert out.shape == big.shape and torch.equal(out[-5:], big[-5:])
        assert torch.equal(out, big)
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


def test_tensor_refs_pass_through_without_decoding() -> None:
    frames = p.encode(p.Infer(id=1, model="m", tensors={"x": torch.randn(3)}))
    ref = p.decode(frames).tensors["x"]  # type: ignore[attr-defined]
    forwarded = p.encode(p.Result(id=2, tensors={"y": ref}))
    assert forwarded[1] is frames[1]
    out = p.decode(forwarded).tensors["y"].tensor()  # type: ignore[attr-defined]
    assert torch.equal(out, p.decode(frames).tensors["x"].tensor())  # type: ignore[attr-defined]


def header(**fields: object) -> bytes:
    return msgpack.packb({"v": p.PROTOCOL_VERSION, **fields})


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([b"\xc1\xff garbage"], Code.BAD_MESSAGE),
        ([msgpack.packb({"v": 1, "t": "status", "id": 1})[:-2]], Code.BAD_MESSAGE),
        ([msgpack.packb([1, 2, 3])], Code.BAD_MESSAGE),
        ([header(t="warp_drive", id=1)], Code.UNKNOWN_TYPE),
        ([msgpack.packb({"v": 99, "t": "status", "id": 1})], Code.VERSION),
        ([header(t="status")], Code.BAD_MESSAGE),  # missing id
        ([header(t="status", id="one")], Code.BAD_MESSAGE),  # wrong type
        ([header(t="status", id=1, evil=True)], Code.BAD_MESSAGE),  # unknown field
        ([header(t="infer", id=1, model="m", tensors=[["x", "float32", [2]]])], Code.BAD_FRAMES),
        ([header(t="infer", id=1, model="m", tensors=[]), b"1234"], Code.BAD_FRAMES),
        (
            [header(t="infer", id=1, model="m", tensors=[["x", "float32", [2]]]), b"123"],
            Code.BAD_TENSOR,
        ),
        (
            [header(t="infer", id=1, model="m", tensors=[["x", "complex", [1]]]), b"12345678"],
            Code.BAD_TENSOR,
        ),
        (
            [header(t="infer", id=1, model="m", tensors=[["x", "float32", [-1]]]), b""],
            Code.BAD_TENSOR,
        ),
        ([header(t="status", id=1, tensors=[["x", "float32", [1]]]), b"1234"], Code.BAD_FRAMES),
        ([], Code.BAD_MESSAGE),
    ],
    ids=[
        "garbage",
        "truncated",
        "not-a-map",
        "unknown-type",
        "version",
        "missing-field",
        "wrong-type",
        "unknown-field",
        "missing-frame",
        "extra-frame",
        "short-bytes",
        "bad-dtype",
        "negative-dim",
        "tensors-on-status",
        "empty",
    ],
)
def test_malformed_messages_raise_decode_errors_with_codes(frames: list[bytes], code: Code) -> None:
    with pytest.raises(p.DecodeError) as info:
        p.decode(frames)
    assert info.value.code is code
    assert info.value.reason


def test_decode_error_keeps_the_request_id_for_the_reply() -> None:
    with pytest.raises(p.DecodeError) as info:
        p.decode([header(t="status", id=41, extra=1)])
    reply = p.error_for(info.value)
    assert reply.id == 41 and reply.code == "bad_message"


def test_size_limits_are_enforced() -> None:
    limits = p.Limits(max_message_bytes=1024, max_header_bytes=128)
    big = p.encode(p.Infer(id=1, model="m", tensors={"x": torch.zeros(300)}))
    with pytest.raises(p.DecodeError) as info:
        p.decode(big, limits)
    assert info.value.code is Code.TOO_LARGE
    with pytest.raises(p.DecodeError) as info:
        p.decode([header(t="status", id=1, pad="x" * 200)], limits)
    assert info.value.code is Code.TOO_LARGE
    with pytest.raises(p.DecodeError) as info:
        p.decode([header(t="status", id=1, pad="x" * 200)], p.Limits(max_str_len=100))
    assert info.value.code is Code.BAD_MESSAGE


def test_every_message_type_roundtrips() -> None:
    for name, cls in p.message_types().items():
        import dataclasses
        import typing

        hints = typing.get_type_hints(cls)
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                continue
            tp = hints[f.name]
            sample = {int: 3, str: "s", float: 1.5, bool: True}.get(tp)
            if sample is None:
                origin = typing.get_origin(tp)
                sample = {} if origin is dict else [] if origin is list else None
            kwargs[f.name] = sample
        msg = cls(**kwargs)
        assert roundtrip(msg) == msg, name
