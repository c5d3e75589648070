"""Fuzz a running broker at both ports while a healthy client checks every answer it gets.

Each fuzz message is one of several kinds — garbage bytes, a non-map header, a truncated or
bit-flipped valid message, an oversized one, a field of the wrong type (anywhere, down to a
tensor's dtype or one dim of its shape), a missing or unknown field, a missing or extra tensor
frame — sent from a raw DEALER to the frontend or the backend. Every message is decoded here
first with the broker's limits, which predicts the answer: an `error` with that code and that id
for a malformed one, exactly one answer of any type for the rare mutation that stays valid
(only harmless types are kept: a valid `register`, `deploy` or `error` is drawn again). The
generator is seeded, so a failure replays.

    python scripts/fuzz.py --count 100000 [--seed 0] [--max-message 64KiB]

starts a mesh (broker, partitioner, one CPU worker), deploys a small model, fuzzes, and prints
the counts per kind and per answer, wrong or missing answers, children that exited, the
healthy client's calls, and the broker's RSS before and after. tests/mesh/test_fuzz.py runs the
same `fuzz()` with a few thousand messages.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from flowmesh import protocol as p

# A mutation that stays valid is sent only if it is one of these: anything else (a register
# could take over a real worker's name, a deploy would start loading a model, an error is
# never answered) is drawn again.
SAFE_VALID = {
    "frontend": (p.Status, p.Infer, p.Undeploy, p.Heartbeat, p.RunResult, p.Loaded),
    "backend": (p.Heartbeat, p.RunResult, p.Loaded, p.StageReady, p.PlanReply, p.Status),
}
# The model that the healthy client uses: fuzz traffic never names it.
HEALTHY_MODEL = "steady"
KINDS = (
    "garbage",
    "not_a_map",
    "truncated",
    "bitflip",
    "oversized",
    "wrong_type",
    "fields",
    "frames",
)

WRONG_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    2**63,
    -(2**63),
    1.5,
    float("nan"),
    "",
    "x" * 300,
    "float32",
    b"\x00\x01",
    [],
    ["float32"],
    [1, 2],
    [[1]],
    {},
    {"a": 1},
    {"id": 1},
    [[["deep"]]],
]


def _tensor_header(rng: random.Random, n: int) -> tuple[list[Any], list[bytes]]:
    meta, frames = [], []
    for i in range(n):
        dtype = rng.choice(list(p.ITEMSIZE))
        shape = [rng.randint(0, 4) for _ in range(rng.randint(0, 3))]
        nbytes = p.ITEMSIZE[dtype]
        for d in shape:
            nbytes *= d
        meta.append([f"t{i}", dtype, shape])
        frames.append(bytes(rng.getrandbits(8) for _ in range(nbytes)))
    return meta, frames


def base_message(rng: random.Random) -> tuple[dict[str, Any], list[bytes]]:
    """A valid header (as a dict) and its tensor frames, of a random type."""
    mid = rng.randint(1, 2**31)
    model = rng.choice(["fuzz-nope", "m", "a" * 20])
    choices: list[Callable[[], tuple[dict[str, Any], list[bytes]]]] = []

    def tensors(kind: str, **fields: Any) -> tuple[dict[str, Any], list[bytes]]:
        meta, frames = _tensor_header(rng, rng.randint(0, 3))
        return {"t": kind, **fields, "tensors": meta}, frames

    choices += [
        lambda: ({"t": "status", "id": mid}, []),
        lambda: tensors("infer", id=mid, model=model, timeout_ms=rng.choice([None, 1000])),
        lambda: ({"t": "undeploy", "id": mid, "model": model}, []),
        lambda: (
            {
                "t": "deploy",
                "id": mid,
                "spec": {"name": model, "factory": "flowmesh.examples:mlp", "kwargs": {}},
            },
            [],
        ),
        lambda: (
            {
                "t": "register",
                "id": mid,
                "role": "worker",
                "name": f"fuzz-{mid}",
                "pid": mid,
                "budget_bytes": 1 << 20,
            },
            [],
        ),
        lambda: (
            {"t": "heartbeat", "stats": {"role": "worker", "inflight": rng.randint(0, 3)}},
            [],
        ),
        lambda: tensors("run_result", id=mid, model=model, stage=0, info={}),
        lambda: (
            {"t": "loaded", "id": mid, "model": model, "stage": 0, "nbytes": 1, "seconds": 0.1},
            [],
        ),
        lambda: ({"t": "error", "id": mid, "code": "internal", "reason": "fuzz"}, []),
        lambda: ({"t": "plan_reply", "id": mid, "plan": {}, "inputs": None}, []),
    ]
    header, frames = rng.choice(choices)()
    return {"v": p.PROTOCOL_VERSION, **header}, frames


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a header where a value could be swapped (map values, list items)."""
    out = []
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    )
    for key, value in items:
        out.append((*prefix, key))
        out.extend(_paths(value, (*prefix, key)))
    return out


def _set(obj: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


def mutate(rng: random.Random, kind: str, port: str, limit: int) -> list[bytes]:
    """The frames of one fuzz message of `kind` (after the routing envelope)."""
    header, frames = base_message(rng)
    if kind == "garbage":
        return [rng.randbytes(rng.randint(0, 200)) for _ in range(rng.randint(1, 3))]
    if kind == "not_a_map":
        return [msgpack.packb(rng.choice([[1, 2], "status", 7, None, 1.5, b"xx", [header]]))]
    if kind == "oversized":
        header = {"v": p.PROTOCOL_VERSION, "t": "infer", "id": rng.randint(1, 2**31)}
        header["model"] = "fuzz-nope"
        # Past the soft limit (answered TOO_LARGE, with the id) but each frame below the
        # socket's hard cap of twice the limit (beyond it the connection is dropped unanswered).
        sizes = [rng.randint(limit // 2 + 1, limit)] * 2 if rng.random() < 0.5 else [limit + 1]
        header["tensors"] = [[f"t{i}", "uint8", [n]] for i, n in enumerate(sizes)]
        if rng.random() < 0.2:
            return [b"\xc1" + msgpack.packb(header), *(bytes(n) for n in sizes)]
        return [msgpack.packb(header), *(bytes(n) for n in sizes)]
    if kind == "wrong_type":
        paths = [pt for pt in _paths(header) if pt != ("v",) or rng.random() < 0.3]
        _set(header, rng.choice(paths), rng.choice(WRONG_VALUES))
    elif kind == "fields":
        keys = [k for k in header if k not in ("v", "t")]
        if keys and rng.random() < 0.5:
            del header[rng.choice(keys)]
        else:
            header[rng.choice(["evil", "ID", "tensor", "x" * 50])] = rng.choice(WRONG_VALUES)
    elif kind == "frames":
        if frames and rng.random() < 0.5:
            frames.pop(rng.randrange(len(frames)))
        else:
            frames.insert(rng.randint(0, len(frames)), rng.randbytes(rng.randint(0, 16)))
    raw = [msgpack.packb(header), *frames]
    if kind == "truncated":
        i = rng.randrange(len(raw))
        if raw[i]:
            raw[i] = raw[i][: rng.randrange(len(raw[i]))]
        else:
            raw = raw[:i] or [b""]
    elif kind == "bitflip":
        head = bytearray(raw[0])
        for _ in range(rng.randint(1, 3)):
            head[rng.randrange(len(head))] ^= 1 << rng.randrange(8)
        raw[0] = bytes(head)
    return raw


@dataclass
class Expect:
    """What the broker must answer: an Error with `code` and `ref`; any one Error (`code` is
    ANY_ERROR: our own decoder failed on it, a bug that `crash` describes); or, for a valid
    message (`code` None), any one answer."""

    code: str | None
    ref: int | None
    crash: str = ""


ANY_ERROR = "*"


def predict(frames: list[bytes], limits: p.Limits, port: str) -> Expect | None:
    """The expected answer, or None when the message must not be sent (see SAFE_VALID)."""
    try:
        msg = p.decode(frames, limits)
    except p.DecodeError as exc:
        return Expect(str(exc.code), exc.ref)
    except Exception as exc:  # a decoder bug: still sent, to see what the broker makes of it
        return Expect(ANY_ERROR, None, crash=f"{type(exc).__name__}: {exc}")
    if not isinstance(msg, SAFE_VALID[port]):
        return None
    if getattr(msg, "model", None) == HEALTHY_MODEL:
        return None
    return Expect(None, None)


def draw(rng: random.Random, port: str, limits: p.Limits) -> tuple[str, list[bytes], Expect]:
    while True:
        kind = rng.choices(KINDS, weights=[1, 1, 2, 2, 0.3, 4, 2, 2])[0]
        frames = mutate(rng, kind, port, limits.max_message_bytes)
        expect = predict(frames, limits, port)
        if expect is not None:
            return kind, frames, expect


@dataclass
class Report:
    sent: Counter[str] = field(default_factory=Counter)
    answers: Counter[str] = field(default_factory=Counter)
    wrong: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    decoder_crashes: list[str] = field(default_factory=list)
    healthy_ok: int = 0
    healthy_errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.sent.values())


def _check(what: str, reply: list[bytes], expect: Expect, port: str, report: Report) -> None:
    try:
        answer = p.decode(reply)
    except p.DecodeError as exc:
        report.wrong.append(f"{what}: undecodable answer ({exc})")
        return
    code = answer.code if isinstance(answer, p.Error) else answer.TYPE
    report.answers[f"{port}/{code}"] += 1
    if expect.code is None:
        return
    if expect.crash:
        report.decoder_crashes.append(f"{what}: {expect.crash}")
    if not isinstance(answer, p.Error):
        report.wrong.append(f"{what}: expected error {expect.code}, got {answer}")
    elif expect.code == ANY_ERROR:
        return
    elif (answer.code, answer.id) != (expect.code, expect.ref) or not answer.reason:
        report.wrong.append(
            f"{what}: expected {expect.code} id={expect.ref}, got {answer.code} "
            f"id={answer.id} {answer.reason!r}"
        )


async def attack(
    endpoint: str,
    port: str,
    count: int,
    seed: int,
    limits: p.Limits,
    report: Report,
    window: int = 16,
    answer_timeout: float = 10.0,
) -> None:
    """Send `count` fuzz messages to `endpoint`, at most `window` unanswered at a time, and
    check each answer. One socket's messages are answered in the order sent (one reader
    handles them one by one, and every kind sent here is answered at once), so the next
    answer is always the oldest outstanding message's."""
    rng = random.Random(f"{seed}-{port}")
    ctx = zmq.asyncio.Context.instance()

    def connect() -> zmq.asyncio.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        return sock

    sock = connect()
    outstanding: deque[tuple[str, Expect]] = deque()
    i = 0
    try:
        while i < count or outstanding:
            while i < count and len(outstanding) < window:
                kind, frames, expect = draw(rng, port, limits)
                report.sent[f"{port}/{kind}"] += 1
                await sock.send_multipart(frames)
                outstanding.append((f"{port} #{i} {kind} {frames[0][:60]!r}", expect))
                i += 1
            try:
                reply = await asyncio.wait_for(sock.recv_multipart(), answer_timeout)
            except TimeoutError:
                # Which message went unanswered is unknown past the first: count them all, and
                # start a fresh socket so that a late answer is not taken for a later message's.
                report.missing.extend(what for what, _ in outstanding)
                outstanding.clear()
                if len(report.missing) > 4 * window:
                    return  # the broker is gone or stuck: the report says so already
                sock.close(0)
                sock = connect()
                continue
            what, expect = outstanding.popleft()
            _check(what, reply, expect, port, report)
    finally:
        sock.close(0)


async def healthy(frontend: str, stop: asyncio.Event, report: Report, width: int) -> None:
    """A well-behaved client: every answer must be the right one, however busy the broker."""
    import torch

    from client_sdk.client import AsyncClient
    from flowmesh.modelio.build import build_seeded

    ref = build_seeded(healthy_spec(width))
    async with AsyncClient(frontend, timeout=10) as client:
        while not stop.is_set() or (report.healthy_ok < 5 and not report.healthy_errors):
            x = torch.randn(1, width)
            try:
                out = await client.infer(HEALTHY_MODEL, x)
                torch.testing.assert_close(out, ref(x))
                report.healthy_ok += 1
            except Exception as exc:  # recorded, not raised: the fuzzers keep going
                report.healthy_errors.append(f"{type(exc).__name__}: {exc}")
                if len(report.healthy_errors) > 20:
                    return


def healthy_spec(width: int) -> Any:
    from flowmesh.spec import ModelSpec

    return ModelSpec(
        name=HEALTHY_MODEL,
        factory="flowmesh.examples:mlp",
        kwargs={"width": width, "depth": 2},
        seed=9,
    )


async def fuzz(
    frontend: str,
    backend: str,
    count: int,
    seed: int = 0,
    limits: p.Limits = p.DEFAULT_LIMITS,
    width: int = 64,
) -> Report:
    """`count` fuzz messages split between both ports, sent while a healthy client runs."""
    report = Report()
    stop = asyncio.Event()
    t0 = time.monotonic()

    async def attacks() -> None:
        try:
            await asyncio.gather(
                attack(frontend, "frontend", count // 2, seed, limits, report),
                attack(backend, "backend", count - count // 2, seed, limits, report),
            )
        finally:
            stop.set()

    await asyncio.gather(attacks(), healthy(frontend, stop, report, width))
    report.seconds = time.monotonic() - t0
    return report


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--count", type=int, default=100_000, help="fuzz messages in all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-message", default="64KiB", help="the broker's --max-message")
    args = ap.parse_args()

    import torch

    from client_sdk.mesh import LocalMesh
    from flowmesh.units import parse_size

    torch.set_num_threads(1)
    limits = p.Limits(max_message_bytes=parse_size(args.max_message))
    mesh = LocalMesh(
        cpu_workers=1,
        memory_budget="8MiB",
        heartbeat_s=0.2,
        threads_per_worker=1,
        broker_args=["--max-message", args.max_message],
    )
    with mesh:
        with mesh.client() as c:
            spec = healthy_spec(64)
            c.deploy(spec.name, spec.factory, kwargs=spec.kwargs, seed=spec.seed)
        broker = mesh.child("broker")
        rss0 = rss_bytes(broker.proc.pid)
        report = asyncio.run(fuzz(mesh.frontend, mesh.backend, args.count, args.seed, limits))
        rss1 = rss_bytes(broker.proc.pid)
        exited = {c.name: c.proc.poll() for c in mesh.children if c.proc.poll() is not None}
        tracebacks = broker.log.read_text(errors="replace").count("Traceback")
        with contextlib.suppress(Exception), mesh.client() as c:
            st = c.status(timeout=5)
            print("workers after:", [(w.name, w.pid, w.ready) for w in st.workers])
    print(f"sent {report.total} fuzz messages in {report.seconds:.1f} s (seed {args.seed})")
    for key, n in sorted(report.sent.items()):
        print(f"  sent    {key:<24} {n}")
    for key, n in sorted(report.answers.items()):
        print(f"  answer  {key:<24} {n}")
    print(
        f"wrong answers: {len(report.wrong)}; missing answers: {len(report.missing)}; "
        f"messages our own decoder failed on: {len(report.decoder_crashes)}"
    )
    for line in (report.wrong + report.missing + report.decoder_crashes)[:20]:
        print("  ", line)
    print(f"healthy client: {report.healthy_ok} right answers, {len(report.healthy_errors)} errors")
    for line in report.healthy_errors[:5]:
        print("  ", line)
    print(f"children exited (crashes): {exited or 'none'}; tracebacks in broker log: {tracebacks}")
    print(f"broker RSS: {rss0 / 2**20:.1f} MiB before, {rss1 / 2**20:.1f} MiB after")
    bad = (
        report.wrong
        or report.missing
        or report.decoder_crashes
        or report.healthy_errors
        or exited
        or tracebacks
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
