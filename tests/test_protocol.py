"""The wire protocol: exact frame layout, tensor round trips without copies, strict validation."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import typing

import msgpack
import msgspec
import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowmesh import protocol as p
from flowmesh import transport
from flowmesh.errors import Code
from flowmesh.modelio.plan import Plan
from flowmesh.spec import ModelSpec
from flowmesh.train_spec import TrainConfig


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


def test_a_runs_tensors_travel_part_by_part_with_names_repeated_across_parts() -> None:
    a, b, c = torch.ones(2, 3), torch.zeros(1, 3), torch.arange(4)
    frames = p.encode(
        p.Run(
            id=2, model="m", stage=0, parts=[[1, 2], [2, 1]], tensors=[{"x": a, "n": c}, {"x": b}]
        )
    )
    header = msgpack.unpackb(frames[0])
    assert header["tensors"] == [
        [["x", "float32", [2, 3]], ["n", "int64", [4]]],
        [["x", "float32", [1, 3]]],
    ]
    assert len(frames) == 4
    msg = p.decode(frames)
    assert isinstance(msg, p.Run) and [list(part) for part in msg.tensors] == [["x", "n"], ["x"]]
    assert torch.equal(msg.tensors[0]["x"].tensor(), a)  # bit for bit: data movement
    assert torch.equal(msg.tensors[0]["n"].tensor(), c)
    assert torch.equal(msg.tensors[1]["x"].tensor(), b)
    run = dict(header, tensors=[[["x", "float32", [1]], ["x", "float32", [1]]]])
    refused = {
        "repeated in a part": ([msgpack.packb(run), b"1234", b"1234"], Code.BAD_TENSOR),
        "a map for a part": (
            [msgpack.packb(dict(header, tensors=[{"x": 1}])), b"1234"],
            Code.BAD_MESSAGE,
        ),
        "one frame short": (frames[:-1], Code.BAD_FRAMES),
        "flat": (
            [msgpack.packb(dict(header, tensors=[["x", "float32", [1]]])), b"1234"],
            Code.BAD_TENSOR,
        ),
    }
    for why, (bad, code) in refused.items():
        with pytest.raises(p.DecodeError) as info:
            p.decode(bad)
        assert info.value.code is code, (why, info.value)


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
        ([msgpack.packb({"t": "status", "id": 1})], Code.VERSION),  # no version at all
        ([msgpack.packb({"t": "status", "id": 1, "x": "v"})], Code.VERSION),
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
        ([header(t="train_step", id=1, job="j", seq=1, inputs=["x", "targets"])], Code.BAD_MESSAGE),
        ([header(t="train_eval", id=1, job="j", inputs=[])], Code.BAD_MESSAGE),
        ([], Code.BAD_MESSAGE),
    ],
    ids=[
        "garbage",
        "truncated",
        "not-a-map",
        "unknown-type",
        "version",
        "no-version",
        "no-version-and-an-unknown-field",
        "missing-field",
        "wrong-type",
        "unknown-field",
        "missing-frame",
        "extra-frame",
        "short-bytes",
        "bad-dtype",
        "negative-dim",
        "tensors-on-status",
        "an-input-named-targets",
        "no-keyword-inputs",
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


SPEC = ModelSpec(name="m", factory="flowmesh.examples:mlp")
# A sample of each payload that checks itself (a sample built from its fields alone would not).
PAYLOAD_SAMPLES: dict[type, object] = {
    ModelSpec: SPEC,
    Plan: Plan(
        kind="stages",
        spec_digest="d",
        block_names=("a", "b"),
        block_bytes=(1, 2),
        ranges=((0, 1), (1, 2)),
        range_bytes=(1, 2),
        objective="bytes",
    ),
    TrainConfig: TrainConfig(optimizer={"name": "adam"}),
}


def _required(cls: type[msgspec.Struct]) -> dict[str, object]:
    """A sample value of each required field of `cls` (a nested part: a sample of its own)."""
    kwargs: dict[str, object] = {}
    for f in msgspec.structs.fields(cls):
        if f.required:
            tp = f.type
            while typing.get_origin(tp) is typing.Annotated:
                tp = typing.get_args(tp)[0]
            origin = typing.get_origin(tp)
            if tp in PAYLOAD_SAMPLES:
                kwargs[f.name] = PAYLOAD_SAMPLES[tp]
                continue
            if origin is typing.Literal:
                kwargs[f.name] = typing.get_args(tp)[0]
                continue
            if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
                kwargs[f.name] = tp(**_required(tp))
                continue
            kwargs[f.name] = {int: 3, str: "s", float: 1.5, bool: True}.get(
                tp, {} if origin is dict else [] if origin is list else None
            )
    return kwargs


def test_every_message_type_roundtrips() -> None:
    for name, cls in p.message_types().items():
        msg = cls(**_required(cls))
        assert roundtrip(msg) == msg, name


# --------------------------------------------------------------------------- hostile input

# The reproduction from issue 6: a list where the dtype should be. It used to raise TypeError
# (unhashable list) past the transport's `except DecodeError`, which ended the broker.
ISSUE_6_FRAMES = [
    msgpack.packb(
        {"v": 1, "t": "infer", "id": 1, "model": "m", "tensors": [["x", ["float32"], [4]]]}
    ),
    b"\0" * 16,
]


def test_a_list_as_dtype_is_a_decode_error_not_a_crash() -> None:
    with pytest.raises(p.DecodeError) as info:
        p.decode(ISSUE_6_FRAMES)
    assert info.value.code is Code.BAD_TENSOR and info.value.ref == 1
    reply = p.decode(p.encode(p.error_for(info.value)))
    assert isinstance(reply, p.Error) and reply.id == 1 and reply.code == "bad_tensor"


def infer_header(tensors: object, **fields: object) -> bytes:
    return header(t="infer", id=3, model="m", tensors=tensors, **fields)


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        (ISSUE_6_FRAMES, Code.BAD_TENSOR),
        ([infer_header([[["x"], "float32", [4]]]), b"\0" * 16], Code.BAD_TENSOR),
        ([infer_header([["x", {"a": 1}, [4]]]), b"\0" * 16], Code.BAD_TENSOR),
        ([infer_header([["x", None, [4]]]), b"\0" * 16], Code.BAD_TENSOR),
        ([infer_header([["x", "float32", [4.0]]]), b"\0" * 16], Code.BAD_TENSOR),
        ([infer_header([["x", "float32", [True, 4]]]), b"\0" * 16], Code.BAD_TENSOR),
        ([infer_header([["x", "float32", [[4]]]]), b"\0" * 16], Code.BAD_TENSOR),
        ([infer_header([["x", "float32", {"0": 4}]]), b"\0" * 16], Code.BAD_TENSOR),
        ([infer_header([["x", "float32", "4"]]), b"\0" * 16], Code.BAD_TENSOR),
        ([infer_header([["x", "float32"]]), b"\0" * 16], Code.BAD_TENSOR),
        ([infer_header(["x"]), b"\0" * 16], Code.BAD_TENSOR),
        ([infer_header({"x": 1}), b"\0" * 16], Code.BAD_MESSAGE),
        ([infer_header([["x", "float32", [2**62, 2**62]]]), b"\0" * 16], Code.BAD_TENSOR),
        ([header(t=["infer"], id=1)], Code.UNKNOWN_TYPE),
        ([header(t={"x": 1}, id=1)], Code.UNKNOWN_TYPE),
        ([header(t=None, id=1)], Code.UNKNOWN_TYPE),
        ([header(t="status", id={"a": 1})], Code.BAD_MESSAGE),
        ([header(t="status", id=[1])], Code.BAD_MESSAGE),
        ([header(t="status", id=True)], Code.BAD_MESSAGE),
        ([header(t="status", id=1.0)], Code.BAD_MESSAGE),
        ([msgpack.packb({"v": [1], "t": "status", "id": 1})], Code.VERSION),
        ([msgpack.packb({"v": True, "t": "status", "id": 1})], Code.VERSION),
        ([msgpack.packb({"v": 1.0, "t": "status", "id": 1})], Code.VERSION),
        ([msgpack.packb({"v": 1, "t": "status", "id": 1, b"id": 2})], Code.BAD_MESSAGE),
        ([msgpack.packb({"v": 1, "t": "status", "id": 1, "x" * 5000: 1})], Code.BAD_MESSAGE),
        ([header(t="run", id=1, model="m", stage=0, parts=[[1, True]])], Code.BAD_MESSAGE),
        ([header(t="run", id=1, model="m", stage=0, parts=[1])], Code.BAD_MESSAGE),
        ([header(t="heartbeat", stats={1: 2})], Code.BAD_MESSAGE),
        ([header(t="heartbeat", stats={b"k": 2})], Code.BAD_MESSAGE),
        ([header(t="register_ack", id=1, heartbeat_s=True, liveness=3)], Code.BAD_MESSAGE),
        ([header(t="error", id=None, code=["x"], reason="r")], Code.BAD_MESSAGE),
        ([b"\x91" * 100_000 + b"\x01"], Code.BAD_MESSAGE),  # nested past msgpack's stack
        ([b""], Code.BAD_MESSAGE),
    ],
)
def test_every_wrong_type_is_a_decode_error(frames: list[bytes], code: Code) -> None:
    with pytest.raises(p.DecodeError) as info:
        p.decode(frames)
    assert info.value.code is code
    assert 0 < len(info.value.reason) < 300  # a bounded reason, whatever arrived
    p.decode(p.encode(p.error_for(info.value)))  # the answer itself always decodes


def test_a_boolean_id_is_never_echoed_in_an_error() -> None:
    with pytest.raises(p.DecodeError) as info:
        p.decode([header(t="status", id=True)])
    assert info.value.ref is None
    with pytest.raises(p.DecodeError) as info:
        p.decode([header(t="warp_drive", id=True)])
    assert info.value.ref is None
    reply = p.error_for(p.DecodeError(Code.BAD_MESSAGE, "r", ref=True))  # type: ignore[arg-type]
    assert reply.id is None
    assert p.decode(p.encode(reply)) == reply


def test_too_large_carries_the_id_when_the_header_can_be_read() -> None:
    limits = p.Limits(max_message_bytes=1024)
    frames = [infer_header([["x", "uint8", [2000]]]), bytes(2000)]
    with pytest.raises(p.DecodeError) as info:
        p.decode(frames, limits)
    assert info.value.code is Code.TOO_LARGE and info.value.ref == 3
    with pytest.raises(p.DecodeError) as info:  # unreadable header: the size still decides
        p.decode([b"\xc1" + frames[0], frames[1]], limits)
    assert info.value.code is Code.TOO_LARGE and info.value.ref is None
    with pytest.raises(p.DecodeError) as info:  # a header over its own limit is not read
        p.decode([header(t="status", id=5, pad="x" * 200)], p.Limits(max_header_bytes=128))
    assert info.value.code is Code.TOO_LARGE and info.value.ref is None


WRONG = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.integers(-2, 2) | st.text(max_size=3) | st.booleans(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-(2**63), 2**63), max_size=2),
)


def _slots(obj: object, path: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    )
    out: list[tuple[object, ...]] = []
    for key, value in items:
        out += [(*path, key), *_slots(value, (*path, key))]
    return out


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_value_anywhere_in_a_header_is_a_decode_error_or_valid(data: st.DataObject) -> None:
    base = data.draw(
        st.sampled_from(
            [
                p.Infer(id=1, model="m", tensors={"x": torch.ones(2, 3), "y": torch.ones(0)}),
                p.Run(id=2, model="m", stage=0, parts=[[1, 2]], tensors=[{"x": torch.ones(2)}]),
                p.Register(id=3, role="worker", name="w", pid=4, info=p.PeerInfo(compute_lanes=3)),
                p.Error(id=None, code="internal", reason="r"),
                p.PlanRequest(id=5, spec=SPEC, stages=2),
            ]
        )
    )
    frames = p.encode(base)
    head = msgpack.unpackb(frames[0])
    slot = data.draw(st.sampled_from(_slots(head)))
    target = head
    for key in slot[:-1]:
        target = target[key]  # type: ignore[index]
    target[slot[-1]] = data.draw(WRONG)  # type: ignore[index]
    try:
        p.decode([msgpack.packb(head), *frames[1:]])
    except p.DecodeError as exc:
        assert exc.ref is None or type(exc.ref) is int


# --------------------------------------------------------------------------- liberal values

# Values msgspec reads into an `Any` field more liberally than msgpack.unpackb(strict_map_key=
# True) does: maps keyed by ints, timestamps, extension types.
LIBERAL = st.one_of(
    WRONG,
    st.dictionaries(st.integers(-3, 3), st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=2),
    st.builds(lambda: {"k": {1: "v"}}),  # fresh each draw: the test mutates what it draws
    st.builds(lambda: [{b"k": 1}]),
    st.builds(msgpack.Timestamp, st.integers(0, 2**32 - 1)),
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=4)),
)

HOT = [
    p.Infer(id=1, model="m", tensors={"x": torch.ones(2, 3), "y": torch.ones(0)}),
    p.Run(id=2, model="m", stage=0, parts=[[1, 2]], tensors=[{"x": torch.ones(2)}]),
    p.RunResult(id=2, model="m", stage=0, tensors=[{"": torch.ones(2)}], info={"compute_s": 1}),
    p.Result(id=1, tensors={"": torch.ones(1)}, info={"batch": 1, "workers": ["w"]}),
    p.Heartbeat(stats=p.WorkerStats(runs=3, stages={"m/0": "resident"}, prefault_s=1.5)),
    p.Register(id=3, role="worker", name="w", pid=4, info=p.PeerInfo(compute_lanes=3)),
    p.Error(id=None, code="internal", reason="r"),
    p.PlanRequest(id=5, spec=SPEC, stages=2),
]


def _same(a: p.Message, b: p.Message) -> bool:
    if type(a) is not type(b):
        return False
    for f in msgspec.structs.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "tensors":
            xs, ys = (v if a.PARTED else [v] for v in (x, y))
            if [[(k, t.dtype, t.shape, t.frame) for k, t in part.items()] for part in xs] != [
                [(k, t.dtype, t.shape, t.frame) for k, t in part.items()] for part in ys
            ]:
                return False
        # Compared as msgpack bytes: NaN equals itself there, and 1, 1.0 and True differ.
        elif msgspec.msgpack.encode(x) != msgspec.msgpack.encode(y):
            return False
    return True


def _strict(head: bytes) -> None:
    """Raises unless `msgpack.unpackb(strict_map_key=True)` reads the header as plain values:
    maps keyed by str or bytes only, no timestamps, no extension types."""
    value = msgpack.unpackb(head, strict_map_key=True, timestamp=0, ext_hook=_no_ext)
    todo = [value]
    while todo:
        v = todo.pop()
        assert not isinstance(v, msgpack.Timestamp), v
        todo += v.values() if isinstance(v, dict) else v if isinstance(v, list) else []


def _no_ext(code: int, data: bytes) -> object:
    raise AssertionError(f"extension type {code}")


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_decoder_accepts_nothing_liberal(data: st.DataObject) -> None:
    """What decodes is plain msgpack (no int keys, timestamps or extension types), and a
    decoded message encodes to one that decodes the same."""
    base = data.draw(st.sampled_from(HOT))
    frames = p.encode(base)
    head = msgpack.unpackb(frames[0])
    for _ in range(data.draw(st.integers(1, 2))):
        slots = _slots(head)
        if not slots:
            break
        slot = data.draw(st.sampled_from(slots))
        target = head
        for key in slot[:-1]:
            target = target[key]  # type: ignore[index]
        if isinstance(target, dict | list):
            target[slot[-1]] = data.draw(LIBERAL)  # type: ignore[index]
    if data.draw(st.booleans()):
        head[data.draw(st.sampled_from(["extra", "tensors", "v", "t", "id"]))] = data.draw(LIBERAL)
    frames = [msgpack.packb(head), *frames[1:]]
    try:
        msg: p.Message | None = p.decode(frames)
    except p.DecodeError:
        msg = None
    if msg is not None:
        _strict(frames[0])  # raises if the decoder took something liberal
        assert _same(p.decode(p.encode(msg)), msg), msg


# --------------------------------------------------------------------------- the reader


async def _reader_pair(handle: object, **kw: object) -> tuple[object, ...]:
    ctx = zmq.asyncio.Context()
    router, endpoint = transport.bind_router(ctx, f"inproc://reader-{id(handle)}", hwm=100_000)
    dealer = transport.connect_dealer(ctx, endpoint, hwm=100_000)
    log = logging.getLogger("test.reader")
    task = asyncio.create_task(transport.pump(router, handle, routed=True, log=log, **kw))  # type: ignore[arg-type]
    return ctx, router, dealer, task


async def _close(ctx: object, *socks: object, task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    for s in socks:
        s.close(0)  # type: ignore[attr-defined]
    ctx.term()  # type: ignore[attr-defined]


async def _answer(dealer: zmq.asyncio.Socket) -> p.Message:
    frames = await asyncio.wait_for(dealer.recv_multipart(), 5)
    return p.decode(frames)


async def test_the_reader_answers_every_failure_and_keeps_reading(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[p.Message] = []

    def handle(_peer: bytes | None, msg: p.Message) -> None:
        seen.append(msg)
        if isinstance(msg, p.Undeploy):
            raise KeyError("a bug in a handler")
        if isinstance(msg, p.Error):
            raise ValueError("cannot handle this error")

    ctx, router, dealer, task = await _reader_pair(handle)
    try:
        dealer.send_multipart(ISSUE_6_FRAMES)
        reply = await _answer(dealer)
        assert isinstance(reply, p.Error) and (reply.id, reply.code) == (1, "bad_tensor")

        transport.send(dealer, p.Undeploy(id=7, model="m"))
        reply = await _answer(dealer)
        assert isinstance(reply, p.Error) and (reply.id, reply.code) == (7, "internal")
        assert "a bug in a handler" in reply.reason

        # A decoder bug (any exception, not only DecodeError) is answered too.
        real_decode = transport.decode

        def broken(frames: list[object], limits: p.Limits = p.DEFAULT_LIMITS) -> p.Message:
            if len(frames) == 2:
                raise TypeError("unhashable type: 'list'")
            return real_decode(frames, limits)

        monkeypatch.setattr(transport, "decode", broken)
        dealer.send_multipart([header(t="status", id=8), b"x"])
        reply = await _answer(dealer)
        assert isinstance(reply, p.Error) and reply.code == "bad_message"

        # An error that its handler cannot take is logged, never answered with another error
        # (two peers would bounce it forever): the next answer is the status's.
        transport.send(dealer, p.Error(id=9, code="internal", reason="x"))
        transport.send(dealer, p.Undeploy(id=10, model="m"))
        reply = await _answer(dealer)
        assert isinstance(reply, p.Error) and reply.id == 10
        assert not task.done()
        assert [m.TYPE for m in seen] == ["undeploy", "error", "undeploy"]
    finally:
        await _close(ctx, router, dealer, task=task)


async def test_the_reader_lets_other_tasks_run_while_messages_are_queued() -> None:
    handled = 0
    gaps: list[int] = []

    def handle(_peer: bytes | None, _msg: p.Message) -> None:
        nonlocal handled
        handled += 1

    n = 5000
    ctx, router, dealer, task = await _reader_pair(handle)
    try:
        # Everything is queued before the reader first runs: each recv then completes at once.
        frames = p.encode(p.Status(id=1))
        for _ in range(n):
            dealer.send_multipart(frames)
        last = 0

        async def ticker() -> None:
            nonlocal last
            while handled < n:
                gaps.append(handled - last)
                last = handled
                await asyncio.sleep(0)

        await asyncio.wait_for(ticker(), 30)
        # Without the reader's yield, the ticker would first run again after all n messages.
        assert max(gaps) <= 2 * transport.YIELD_EVERY, max(gaps)
    finally:
        await _close(ctx, router, dealer, task=task)


# --------------------------------------------------------------------------- bundles


def _bits(frames: list[object]) -> list[bytes]:
    return [bytes(memoryview(f)) for f in frames]  # type: ignore[arg-type]


def test_a_bundle_carries_its_members_frames_unchanged_and_in_order() -> None:
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    msgs: list[p.Message] = [
        p.Infer(id=1, model="m", tensors={"": x}),
        p.Status(id=2),
        p.Infer(id=3, model="m", tensors={"a": x, "b": x[:1]}),
    ]
    members = [p.encode(m) for m in msgs]
    frames = p.encode(p.Bundle(members=members))
    assert len(frames) == 1 + sum(len(m) for m in members)
    for got in [p.decode(frames)]:
        assert isinstance(got, p.Bundle)
        # Pure data movement: every frame bit for bit.
        assert [_bits(m) for m in got.members] == [_bits(m) for m in members]
        back = [p.decode_member(m) for m in got.members]
        assert [type(m) for m in back] == [type(m) for m in msgs]
        assert [m.id for m in back] == [1, 2, 3]  # type: ignore[attr-defined]
        assert torch.equal(back[2].tensors["b"].tensor(), x[:1])  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("counts", "code"),
    [
        ([1, 3], Code.BAD_FRAMES),  # four frames announced, three sent
        ([1, 1], Code.BAD_FRAMES),  # two announced, three sent
        ([0, 3], Code.BAD_MESSAGE),  # a member has at least its header
        ([1.0, 2], Code.BAD_MESSAGE),
        ([True, 2], Code.BAD_MESSAGE),
        ("12", Code.BAD_MESSAGE),
        ([1] * (p.MAX_BUNDLE + 1), Code.TOO_LARGE),
    ],
)
def test_a_bundle_whose_counts_do_not_fit_its_frames_is_refused(counts: object, code: Code) -> None:
    x = torch.ones(1, 2)
    body = [*p.encode(p.Status(id=1)), *p.encode(p.Infer(id=2, model="m", tensors={"": x}))]
    with pytest.raises(p.DecodeError) as info:
        p.decode([header(t="bundle", counts=counts), *body])
    assert info.value.code is code, info.value


def test_a_bundle_with_an_unknown_field_is_refused() -> None:
    with pytest.raises(p.DecodeError) as info:
        p.decode([header(t="bundle", counts=[1], extra=1), *p.encode(p.Status(id=1))])
    assert info.value.code is Code.BAD_MESSAGE and "extra" in info.value.reason


def test_a_bundle_inside_a_bundle_is_refused_as_a_member() -> None:
    inner = p.encode(p.Bundle(members=[p.encode(p.Status(id=1))]))
    outer = p.decode(p.encode(p.Bundle(members=[inner])))
    assert isinstance(outer, p.Bundle)
    with pytest.raises(p.DecodeError) as info:
        p.decode_member(outer.members[0])
    assert info.value.code is Code.BAD_MESSAGE and "bundle inside a bundle" in info.value.reason


def test_bundled_keeps_order_and_bounds_each_send() -> None:
    small = [p.encode(p.Status(id=i)) for i in range(p.MAX_BUNDLE + 3)]
    sends = p.bundled(small)
    assert [n for n, _ in sends] == [p.MAX_BUNDLE, 3]
    ids = []
    for _, frames in sends:
        msg = p.decode(frames)
        assert isinstance(msg, p.Bundle)
        ids += [p.decode_member(m).id for m in msg.members]  # type: ignore[attr-defined]
    assert ids == list(range(p.MAX_BUNDLE + 3))
    # Alone, a message goes as it is; past the byte bound, a message starts a new send.
    assert p.bundled(small[:1]) == [(1, small[0])]
    big = p.encode(p.Infer(id=9, model="m", tensors={"": torch.zeros(p.BUNDLE_BYTES // 4)}))
    sends = p.bundled([small[0], small[1], big, small[2]])
    assert [n for n, _ in sends] == [2, 1, 1]
    assert sends[1][1] is big
    # The receiver's limit bounds a bundle too: half its largest message.
    tight = p.Limits(max_message_bytes=4 * len(small[0][0]))
    assert [n for n, _ in p.bundled(small[:5], tight)] == [2, 2, 1]
