"""Serving and training on one worker, through the mesh: what each costs the other.

One worker (real broker, partitioner and worker processes on loopback) serves one model while K
training jobs whose footprints add up to R times the worker's training bytes train beside it, in
one arena (serving first: training borrows what serving leaves free and gives it back at once,
and on the CPU stand-in starts no compute while serving has a load or a run in flight). In the
same run, in `--rounds` interleaved rounds (on a host shared with other work its load drifts
within a run; each figure is measured across all the rounds, so a drift falls on both sides of a
ratio alike):

- **inference alone**: closed-loop requests (one in flight), latency p50 / p99;
- **together**: training started, the same number of requests beside it, training stopped;
  training is driven by a client process of its own, so that the inference client's event loop
  measures serving, not its own handling of training's answers;
- **training alone**: every job keeps `--inflight` steps queued, for as long as the round's
  together phase lasted; steps/s over the rounds' windows.

Printed: latency with training / alone, training steps/s with serving / alone, and the worker's
memory counters (claims by serving, bytes training gave back, most it borrowed). Every answer is
checked against the model's own forward.

    python scripts/bench_colocated.py [--jobs 4] [--ratio 3] [--requests 1000] [--rounds 8]
        [--width 512] [--train-width 96] [--gpu N] [--out bench-out]

`--gpu N` puts the worker on CUDA device N (its arena and training bytes on the GPU) in place of
a CPU stand-in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from client_sdk.client import AsyncClient
from client_sdk.mesh import LocalMesh
from flowmesh.modelio.build import build_seeded
from flowmesh.spec import ModelSpec
from flowmesh.testing import assert_forward_close

KIB = 1 << 10


def served_spec(width: int) -> ModelSpec:
    return ModelSpec(
        name="served",
        factory="flowmesh.examples:mlp",
        kwargs={"width": width, "depth": 4, "in_features": width, "out_features": 10},
        seed=7,
    )


def train_spec(i: int, width: int) -> ModelSpec:
    return ModelSpec(
        name=f"job{i}",
        factory="flowmesh.examples:mlp",
        kwargs={"width": width, "depth": 6, "in_features": width, "out_features": 10},
        seed=100 + i,
    )


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def infer_loop(
    ac: AsyncClient, n: int, width: int, ref: torch.nn.Module, seed: int
) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    lat = []
    for _ in range(n):
        x = torch.randn(4, width, generator=g)
        t0 = time.perf_counter()
        out = await ac.infer("served", x)
        lat.append(time.perf_counter() - t0)
        with torch.inference_mode():
            assert_forward_close(out, ref(x))
    return lat


def train_batches(width: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A fresh batch of random inputs and labels for every step, as real training sees: a
    job stepping on one batch again and again fits it within a few steps, and its gradients
    then underflow into subnormal floats, which a CPU computes with many times slower
    (BENCHMARKS.md, "subnormal floats")."""
    g = torch.Generator().manual_seed(1)
    while True:
        yield torch.randn(32, width, generator=g), torch.randint(0, 10, (32,), generator=g)


async def train_loop(jobs: list[Any], width: int, stop: asyncio.Event, inflight: int) -> int:
    """Keep `inflight` steps queued per job until `stop`; returns the steps completed."""
    batches = train_batches(width)
    done = 0

    async def one(job: Any) -> None:
        nonlocal done
        pending: list[asyncio.Future[Any]] = []
        while not stop.is_set() or pending:
            while not stop.is_set() and len(pending) < inflight:
                pending.append(asyncio.ensure_future(job.step_async(*next(batches))))
            await pending.pop(0)
            done += 1

    await asyncio.gather(*(one(j) for j in jobs))
    return done


def trainer_main(frontend: str, args: argparse.Namespace, conn: Connection) -> None:
    """The training client, a process of its own (as a user's would be): the inference
    client's event loop then measures serving, not its own handling of training's answers."""
    asyncio.run(trainer(frontend, args, conn))


async def trainer(frontend: str, args: argparse.Namespace, conn: Connection) -> None:
    """Open the jobs and send their footprint; then, per "run", train until "stop" and send
    (steps, seconds); on "close", close the jobs and send "closed"."""
    loop = asyncio.get_running_loop()
    async with AsyncClient(frontend, timeout=300) as ac:
        jobs = []
        for i in range(args.jobs):
            s = train_spec(i, args.train_width)
            jobs.append(
                await ac.train_open(
                    s.name,
                    s.factory,
                    kwargs=s.kwargs,
                    seed=s.seed,
                    optimizer={"name": "adam", "lr": 1e-3},
                    batch_size=32,
                    timeout=300,
                )
            )
        for j in jobs:  # warm: each job's first step builds its optimizers and code paths
            await j.step_async(*next(train_batches(args.train_width)))
        conn.send(sum(j.info.footprint for j in jobs))
        while await loop.run_in_executor(None, conn.recv) == "run":
            stop = asyncio.Event()
            t0 = time.perf_counter()
            training = asyncio.ensure_future(
                train_loop(jobs, args.train_width, stop, args.inflight)
            )
            await loop.run_in_executor(None, conn.recv)  # "stop"
            stop.set()
            steps = await training
            conn.send((steps, time.perf_counter() - t0))
        for j in jobs:
            await j.close()
    conn.send("closed")


async def measure(mesh: LocalMesh, args: argparse.Namespace) -> dict[str, Any]:
    serve = served_spec(args.width)
    ref = build_seeded(serve).eval()
    loop = asyncio.get_running_loop()
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=trainer_main, args=(mesh.frontend, args, child), daemon=True)

    async def recv() -> Any:
        return await loop.run_in_executor(None, conn.recv)

    async with AsyncClient(mesh.frontend, timeout=300) as ac:
        await ac.deploy("served", serve.factory, kwargs=serve.kwargs, seed=serve.seed, stages=1)
        await infer_loop(ac, 5, args.width, ref, 0)  # warm: loaded, code paths hot
        proc.start()
        footprint = await recv()

        alone: list[float] = []
        together: list[float] = []
        steps_together = steps_alone = 0
        together_s = alone_s = 0.0
        per_round = max(1, args.requests // args.rounds)
        for r in range(args.rounds):
            alone += await infer_loop(ac, per_round, args.width, ref, 1 + 2 * r)

            conn.send("run")
            t0 = time.perf_counter()
            together += await infer_loop(ac, per_round, args.width, ref, 2 + 2 * r)
            window = time.perf_counter() - t0
            conn.send("stop")
            steps, seconds = await recv()
            steps_together += steps
            together_s += seconds

            conn.send("run")
            await asyncio.sleep(window)
            conn.send("stop")
            steps, seconds = await recv()
            steps_alone += steps
            alone_s += seconds
        conn.send("close")
        assert await recv() == "closed"
        proc.join(60)
        st = await ac.status()
    (w,) = st.workers
    return {
        "alone": alone,
        "together": together,
        "steps_alone_per_s": steps_alone / alone_s,
        "steps_together_per_s": steps_together / together_s,
        "footprint": footprint,
        "stats": w.stats,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--ratio", type=float, default=3.0, help="jobs' footprint / training bytes")
    # 1000: a p99 read from 200 requests is about the second-slowest of them, and one run's
    # varied from 1.3x to 3x (BENCHMARKS.md, "serving beside training after these changes").
    ap.add_argument("--requests", type=int, default=1000, help="requests per phase, all rounds")
    ap.add_argument("--rounds", type=int, default=8, help="alone / together rounds, interleaved")
    ap.add_argument("--width", type=int, default=512, help="served model width")
    ap.add_argument("--train-width", type=int, default=96)
    ap.add_argument("--inflight", type=int, default=2, help="steps queued per job")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument(
        "--gpu", type=int, default=None, help="the worker on this CUDA device (default: CPU)"
    )
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    if args.gpu is not None and not torch.cuda.is_available():
        ap.error("--gpu: this torch sees no CUDA device")

    serve_bytes = sum(p.numel() * 4 for p in build_seeded(served_spec(args.width)).parameters())
    # One job's footprint, measured the way a worker reports it, sets the training bytes.
    probe = train_spec(0, args.train_width)
    per_job = sum(p.numel() * 4 for p in build_seeded(probe).parameters()) * 4  # p, g, Adam m, v
    train_bytes = max(64 * KIB, int(args.jobs * per_job / args.ratio))
    mesh = LocalMesh(
        cpu_workers=1,
        memory_budget=f"{2 * serve_bytes}B",
        gpus=None if args.gpu is None else [args.gpu],
        gpu_budget=f"{2 * serve_bytes}B",
        train_bytes=train_bytes,
        heartbeat_s=0.5,
        threads_per_worker=args.threads,
    )
    with mesh:
        r = asyncio.run(measure(mesh, args))
    a, t = r["alone"], r["together"]
    st = r["stats"]
    rows = {
        "inference p50 ms (alone / with training)": (
            1e3 * statistics.median(a),
            1e3 * statistics.median(t),
        ),
        "inference p99 ms (alone / with training)": (1e3 * pct(a, 0.99), 1e3 * pct(t, 0.99)),
        "training steps/s (alone / with serving)": (
            r["steps_alone_per_s"],
            r["steps_together_per_s"],
        ),
    }
    print(
        f"{args.jobs} jobs, footprint {r['footprint'] / KIB:.0f} KiB = "
        f"{r['footprint'] / train_bytes:.1f}x the {train_bytes / KIB:.0f} KiB of training bytes; "
        f"served model {serve_bytes / KIB:.0f} KiB; {args.requests} requests per phase in "
        f"{args.rounds} rounds"
    )
    for name, (x, y) in rows.items():
        print(f"  {name:44s} {x:9.2f} {y:9.2f}   ratio {y / x:5.2f}x")
    print(
        f"  memory: serving claims {st.memory_claims}, training gave back "
        f"{st.train_reclaimed_bytes / KIB:.0f} KiB, borrowed at most "
        f"{st.train_borrowed_peak / KIB:.0f} KiB, arena peak "
        f"{st.arena_peak / KIB:.0f} of {st.arena_bytes / KIB:.0f} KiB"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_colocated.json").write_text(
        json.dumps({"args": vars(args), **{k: v for k, v in r.items() if k != "stats"}}, indent=1)
    )


if __name__ == "__main__":
    main()
