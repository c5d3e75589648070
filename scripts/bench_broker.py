"""Broker overhead: flowmesh round trips against raw ZeroMQ round trips, measured in the same run.

A request through flowmesh travels client -> broker -> worker -> broker -> client: two hops each
way, validation at every hop, a (tiny) model run on the worker. The references, in separate
processes like the mesh's, are (1) a raw DEALER->ROUTER echo and (2) a raw relay in front of an
echo, i.e. the same four hops with no flowmesh logic. Sequential latency (one request at a time)
and pipelined throughput (many outstanding) are both reported, as ratios.

`--idle-models N` deploys N more models that nobody asks for: a catalogue's size must not
cost a request anything (the broker once walked every model twice per request).

`--pin A,B` runs the broker on CPU A and the worker on CPU B (`--cpus`), and the references
alike: the relay on A, the echo servers on B; the client (this process) is not pinned. Without
it every process runs anywhere, as the kernel places it.

The three are interleaved in rounds (after one warm-up round), so that machine noise hits them
alike; each round gives its own ratios, and the summary is their median over the rounds (on a
shared machine one round's raw relay p50 can move by several times).

    python scripts/bench_broker.py [--requests 2000] [--concurrency 32] [--rounds 5]
        [--idle-models 0] [--pin 0,1] [--out bench-out]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import uvloop
import zmq
import zmq.asyncio

from client_sdk.client import AsyncClient
from client_sdk.mesh import LocalMesh
from flowmesh import protocol as p
from flowmesh.affinity import pin_process


def pin(cpu: int | None) -> None:
    if cpu is not None:
        pin_process(str(cpu))  # as --cpus does for the broker and the worker


def echo_server(endpoint: str, envelope: int, cpu: int | None, ready: Any) -> None:
    """ROUTER that decodes each message and answers with its tensors (like a worker would).
    `envelope` routing frames precede the message (2 behind a relay: relay's and client's)."""
    pin(cpu)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port(endpoint)
    ready.put(port)
    while True:
        frames = sock.recv_multipart(copy=False)
        msg = p.decode(frames[envelope:])
        reply = p.Result(id=msg.id, tensors=msg.tensors)  # type: ignore[attr-defined]
        sock.send_multipart([*frames[:envelope], *p.encode(reply)], copy=False)


def relay_server(endpoint: str, upstream: str, cpu: int | None, ready: Any) -> None:
    """ROUTER in front, DEALER behind: forwards frames both ways without decoding (zmq.proxy)."""
    pin(cpu)
    ctx = zmq.Context()
    front = ctx.socket(zmq.ROUTER)
    port = front.bind_to_random_port(endpoint)
    back = ctx.socket(zmq.DEALER)
    back.connect(upstream)
    ready.put(port)
    zmq.proxy(front, back)


async def run_raw(endpoint: str, n: int, concurrency: int, x: torch.Tensor) -> dict[str, float]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    waiting: dict[int, asyncio.Future[None]] = {}

    async def reader() -> None:
        while True:
            frames = await sock.recv_multipart(copy=False)
            msg = p.decode(frames)
            waiting.pop(msg.id).set_result(None)  # type: ignore[attr-defined]

    task = asyncio.create_task(reader())
    ids = iter(range(1, 10**9))

    async def one() -> None:
        i = next(ids)
        fut = asyncio.get_running_loop().create_future()
        waiting[i] = fut
        await sock.send_multipart(p.encode(p.Infer(id=i, model="m", tensors={"": x})), copy=False)
        await fut

    out = await measure(one, n, concurrency)
    task.cancel()
    sock.close(0)
    ctx.term()
    return out


async def run_mesh(endpoint: str, n: int, concurrency: int, x: torch.Tensor) -> dict[str, float]:
    async with AsyncClient(endpoint) as client:

        async def one() -> None:
            await client.infer("tiny", x)

        return await measure(one, n, concurrency)


async def measure(one: Any, n: int, concurrency: int) -> dict[str, float]:
    for _ in range(50):  # warm up connections and code paths
        await one()
    lat = []
    for _ in range(n // 4):
        t = time.perf_counter()
        await one()
        lat.append((time.perf_counter() - t) * 1e6)
    t = time.perf_counter()
    sem = asyncio.Semaphore(concurrency)

    async def bounded() -> None:
        async with sem:
            await one()

    await asyncio.gather(*(bounded() for _ in range(n)))
    wall = time.perf_counter() - t
    return {
        "p50_us": statistics.median(lat),
        "mean_us": statistics.fmean(lat),
        "msgs_per_s": n / wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--width", type=int, default=16, help="tiny model width (payload floats)")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds (after a warm-up)")
    ap.add_argument(
        "--idle-models", type=int, default=0, help="models deployed beside it, never asked for"
    )
    ap.add_argument(
        "--pin",
        default="",
        help="A,B: broker and relay on CPU A, worker and echo servers on CPU B (default: off)",
    )
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    front_cpu = back_cpu = None
    if args.pin:
        front_cpu, back_cpu = (int(c) for c in args.pin.split(","))
    ctx = mp.get_context("spawn")
    q: Any = ctx.Queue()
    procs = []

    def start(target: Any, *a: Any) -> str:
        proc = ctx.Process(target=target, args=(*a, q), daemon=True)
        proc.start()
        procs.append(proc)
        return f"tcp://127.0.0.1:{q.get(timeout=30)}"

    echo_ep = start(echo_server, "tcp://127.0.0.1", 1, back_cpu)
    relay_ep = start(
        relay_server,
        "tcp://127.0.0.1",
        start(echo_server, "tcp://127.0.0.1", 2, back_cpu),
        front_cpu,
    )
    x = torch.randn(1, args.width)
    paths = (
        ("raw echo (1 hop each way)", run_raw, echo_ep),
        ("raw relay + echo (2 hops each way)", run_raw, relay_ep),
        ("flowmesh infer", run_mesh, ""),
    )
    rounds: list[dict[str, dict[str, float]]] = []
    with LocalMesh(
        cpu_workers=1,
        memory_budget="64MiB",
        partitioner=True,
        threads_per_worker=1,
        broker_args=["--cpus", str(front_cpu)] if args.pin else [],
        worker_args=["--cpus", str(back_cpu)] if args.pin else [],
    ) as mesh:
        with mesh.client() as c:
            c.deploy(
                "tiny",
                "flowmesh.examples:mlp",
                kwargs={"width": args.width, "depth": 1},
                seed=0,
                max_batch_size=1,
            )
            for i in range(args.idle_models):
                c.deploy(f"idle-{i}", "flowmesh.examples:mlp", kwargs={"width": 4, "depth": 1})
        for rnd in range(args.rounds + 1):  # round 0 warms up
            results: dict[str, dict[str, float]] = {}
            for name, fn, ep in paths:
                results[name] = uvloop.run(
                    fn(ep or mesh.frontend, args.requests, args.concurrency, x)
                )
            if rnd:
                rounds.append(results)
    for proc in procs:
        proc.kill()
    echo, relay, mesh_name = (name for name, _, _ in paths)

    def ratios(r: dict[str, dict[str, float]]) -> dict[str, float]:
        m, rel, base = r[mesh_name], r[relay], r[echo]
        return {
            "latency_vs_raw_echo": m["p50_us"] / base["p50_us"],
            "latency_vs_raw_relay": m["p50_us"] / rel["p50_us"],
            "throughput_vs_raw_echo": m["msgs_per_s"] / base["msgs_per_s"],
            "throughput_vs_raw_relay": m["msgs_per_s"] / rel["msgs_per_s"],
        }

    per_round = [ratios(r) for r in rounds]
    print(f"{'round':>5} {'path':38} {'p50 us':>8} {'msgs/s':>9}")
    for k, r in enumerate(rounds, 1):
        for name, v in r.items():
            print(f"{k:>5} {name:38} {v['p50_us']:8.0f} {v['msgs_per_s']:9.0f}")
        q = per_round[k - 1]
        print(
            f"{k:>5} {'flowmesh / raw relay':38} {q['latency_vs_raw_relay']:7.2f}x "
            f"{q['throughput_vs_raw_relay']:8.2f}x"
        )
    summary: dict[str, Any] = {
        key: statistics.median(q[key] for q in per_round) for key in per_round[0]
    }
    summary.update(
        rounds=rounds,
        per_round=per_round,
        requests=args.requests,
        concurrency=args.concurrency,
        width=args.width,
        idle_models=args.idle_models,
        pin=args.pin or None,
    )
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    (out / "broker.json").write_text(json.dumps(summary, indent=2))
    print(
        f"\nmedian over {len(rounds)} rounds: flowmesh p50 latency = "
        f"{summary['latency_vs_raw_relay']:.2f}x a raw 2-hop relay, throughput = "
        f"{summary['throughput_vs_raw_relay']:.2f}x; written {out / 'broker.json'}"
    )


if __name__ == "__main__":
    main()
