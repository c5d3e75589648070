"""Broker overhead: flowmesh round trips against raw ZeroMQ round trips, measured in the same run.

A request through flowmesh travels client -> broker -> worker -> broker -> client: two hops each
way, validation at every hop, a (tiny) model run on the worker. The references, in separate
processes like the mesh's, are (1) a raw DEALER->ROUTER echo and (2) a raw relay in front of an
echo, i.e. the same four hops with no flowmesh logic. Sequential latency (one request at a time)
and pipelined throughput (many outstanding) are both reported, as ratios.

`--idle-models N` deploys N more models that nobody asks for: a catalogue's size must not
cost a request anything (the broker once walked every model twice per request).

Under the bursts, it also reports the CPU time each process of the flowmesh path takes per
request (the client, this process; the broker; the worker), from /proc (Linux only).

`--pin A,B` runs the broker on CPU A and the worker on CPU B (`--cpus`), and the references
alike: the relay on A, the echo servers on B; the client (this process) is not pinned. Without
it every process runs anywhere, as the kernel places it.

The three paths take turns within each round: `--chunk` sequential requests each, over and
over, then bursts of outstanding requests each, so that a slow spell of a shared machine (from
milliseconds to minutes; one path measured alone for a few seconds could see its p50 move by
several times) falls on all of them alike. Each round (after a warm-up round) gives its own
ratios; the summary is their median over the rounds.

    python scripts/bench_broker.py [--requests 2000] [--concurrency 32] [--rounds 5]
        [--chunk 25] [--idle-models 0] [--pin 0,1] [--out bench-out]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
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


ECHO = "raw echo (1 hop each way)"
RELAY = "raw relay + echo (2 hops each way)"
MESH = "flowmesh infer"


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) each process has used so far, from /proc; this process is
    "client". Empty where there is no /proc."""
    if not os.path.isdir("/proc/self"):
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    out = {"client": sum(os.times()[:2])}
    for name, pid in pids.items():
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[name] = (int(fields[11]) + int(fields[12])) / tick
    return out


class RawPath:
    """A raw DEALER talking to an echo server, directly or through the relay."""

    def __init__(self, endpoint: str, x: torch.Tensor) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(endpoint)
        self.x = x
        self.waiting: dict[int, asyncio.Future[None]] = {}
        self.ids = iter(range(1, 10**9))
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            msg = p.decode(frames)
            self.waiting.pop(msg.id).set_result(None)  # type: ignore[attr-defined]

    async def one(self) -> None:
        i = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        self.waiting[i] = fut
        msg = p.Infer(id=i, model="m", tensors={"": self.x})
        await self.sock.send_multipart(p.encode(msg), copy=False)
        await fut

    async def close(self) -> None:
        self.reader.cancel()
        self.sock.close(0)
        self.ctx.term()


class MeshPath:
    def __init__(self, endpoint: str, x: torch.Tensor) -> None:
        self.client = AsyncClient(endpoint)
        self.x = x

    async def one(self) -> None:
        await self.client.infer("tiny", self.x)

    async def close(self) -> None:
        await self.client.close()


async def measure_round(
    endpoints: dict[str, str],
    n: int,
    concurrency: int,
    chunk: int,
    x: torch.Tensor,
    mesh_pids: dict[str, int] | None = None,
) -> dict[str, dict[str, float]]:
    """One round: the paths take turns, `chunk` sequential requests each, then bursts of
    `concurrency` x 8 outstanding each, so that a slow spell of the machine (they last from
    milliseconds to minutes here) falls on every path alike. `mesh_pids`: the processes whose
    CPU per request is measured over the flowmesh path's bursts (`cpu_us_<process>`)."""
    paths = {
        name: MeshPath(ep, x) if name == MESH else RawPath(ep, x) for name, ep in endpoints.items()
    }
    try:
        for path in paths.values():
            for _ in range(50):  # warm up connections and code paths
                await path.one()
        lat: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(max(1, n // 4 // chunk)):
            for name, path in paths.items():
                for _ in range(chunk):
                    t = time.perf_counter()
                    await path.one()
                    lat[name].append((time.perf_counter() - t) * 1e6)
        burst = concurrency * 8
        wall = dict.fromkeys(paths, 0.0)
        sent = dict.fromkeys(paths, 0)
        cpu: dict[str, float] = {}
        for _ in range(max(1, n // burst)):
            for name, path in paths.items():
                sem = asyncio.Semaphore(concurrency)

                async def bounded(path: Any = path, sem: asyncio.Semaphore = sem) -> None:
                    async with sem:
                        await path.one()

                before = cpu_seconds(mesh_pids or {}) if name == MESH else {}
                t = time.perf_counter()
                await asyncio.gather(*(bounded() for _ in range(burst)))
                wall[name] += time.perf_counter() - t
                sent[name] += burst
                for proc, secs in cpu_seconds(mesh_pids or {}).items() if before else ():
                    cpu[proc] = cpu.get(proc, 0.0) + secs - before[proc]
        out = {
            name: {
                "p50_us": statistics.median(lat[name]),
                "mean_us": statistics.fmean(lat[name]),
                "msgs_per_s": sent[name] / wall[name],
            }
            for name in paths
        }
        for proc, secs in cpu.items():
            out[MESH][f"cpu_us_{proc}"] = secs / sent[MESH] * 1e6
        return out
    finally:
        for path in paths.values():
            await path.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--width", type=int, default=16, help="tiny model width (payload floats)")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds (after a warm-up)")
    ap.add_argument(
        "--chunk", type=int, default=25, help="sequential requests per turn of each path"
    )
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
        pids = {c.name.removesuffix("-0"): c.proc.pid for c in mesh.children}
        pids = {k: v for k, v in pids.items() if k in ("broker", "worker")}
        for rnd in range(args.rounds + 1):  # round 0 warms up
            endpoints = {ECHO: echo_ep, RELAY: relay_ep, MESH: mesh.frontend}
            results = uvloop.run(
                measure_round(endpoints, args.requests, args.concurrency, args.chunk, x, pids)
            )
            if rnd:
                rounds.append(results)
    for proc in procs:
        proc.kill()

    def ratios(r: dict[str, dict[str, float]]) -> dict[str, float]:
        m, rel, base = r[MESH], r[RELAY], r[ECHO]
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
    cpu_keys = [k for k in rounds[0][MESH] if k.startswith("cpu_us_")]
    for key in cpu_keys:
        summary[key] = statistics.median(r[MESH][key] for r in rounds)
    if cpu_keys:
        print(
            "CPU per request over the flowmesh bursts (median over the rounds): "
            + ", ".join(f"{k.removeprefix('cpu_us_')} {summary[k]:.0f} us" for k in cpu_keys)
        )
    summary.update(
        rounds=rounds,
        per_round=per_round,
        requests=args.requests,
        concurrency=args.concurrency,
        width=args.width,
        idle_models=args.idle_models,
        chunk=args.chunk,
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
