"""What handing a small run to a compute lane costs, against computing it on the calling thread.

A worker never computes on its event loop (the loop must stay free for its sockets): each run goes
to a compute lane (a thread) and its result comes back to the loop. For a model whose forward
takes tens of microseconds that hand-off is most of the cost. In one process, the same run of a
tiny model (`--width`, one Linear + GELU + Linear) is timed in the same run:

- **inline**: the forward called on the event loop's thread (the reference; not what a worker does);
- **bare pool**: `run_in_executor` on a one-thread pool (the hand-off alone, and the GIL: every
  torch op releases and takes it again, so the loop and the lane trade it at each op);
- **lanes**: `flowmesh.threads.TorchLanes.submit`, what the executor hands runs to (no
  concurrent.futures machinery between the lane and the loop);
- **executor**: `gpu_worker.executor.Executor.run` on a loaded stage (the hand-off plus the run's
  bookkeeping: markers, batching of parts, outputs split back).

Each one sequentially (one run at a time) and with `--concurrency` runs outstanding; printed: wall
and CPU microseconds per run and their ratios to inline.

    python scripts/bench_lanes.py [--runs 6000] [--concurrency 32] [--width 16] [--lanes 2]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch
import uvloop

from flowmesh.modelio.build import build_meta, build_seeded
from flowmesh.spec import ModelSpec
from flowmesh.threads import TorchLanes, torch_pool
from gpu_worker.device import CpuStandIn
from gpu_worker.executor import Executor
from gpu_worker.host_tier import HostStage


async def timed(one: Callable[[], Awaitable[Any]], runs: int, concurrency: int) -> dict[str, float]:
    for _ in range(200):
        await one()
    out = {}
    for label, width in (("seq", 1), ("conc", concurrency)):
        t, c = time.perf_counter(), time.process_time()
        for _ in range(runs // width):
            await asyncio.gather(*(one() for _ in range(width)))
        n = runs // width * width
        out[f"{label}_wall_us"] = (time.perf_counter() - t) / n * 1e6
        out[f"{label}_cpu_us"] = (time.process_time() - c) / n * 1e6
    return out


async def measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    spec = ModelSpec(
        name="tiny", factory="flowmesh.examples:mlp", kwargs={"width": args.width, "depth": 1}
    )
    model = build_seeded(spec).eval()
    x = torch.randn(1, args.width)

    def forward() -> torch.Tensor:
        with torch.inference_mode():
            return model(x)

    async def inline() -> torch.Tensor:
        return forward()

    loop = asyncio.get_running_loop()
    pool = torch_pool(args.lanes, "bare")

    async def bare() -> torch.Tensor:
        return await loop.run_in_executor(pool, forward)

    lanes = TorchLanes(args.lanes, "lanes")

    async def lane() -> torch.Tensor:
        return await lanes.submit(loop, forward)

    ex = Executor(CpuStandIn(64 << 20), compute_lanes=args.lanes)
    host = HostStage.build([dict(b.state_dict()) for b in model.children()])
    ex.add_stage(("tiny", 0), list(build_meta(spec).children()), host)
    await ex.load(("tiny", 0))

    async def executor() -> Any:
        return await ex.run(("tiny", 0), [{"": x}])

    results = {}
    for name, one in (
        ("inline", inline),
        ("bare pool", bare),
        ("lanes", lane),
        ("executor", executor),
    ):
        results[name] = await timed(one, args.runs, args.concurrency)
    ex.close()
    pool.shutdown()
    lanes.shutdown()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=6000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--lanes", type=int, default=2, help="compute lanes (a worker's default)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (as --threads 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = uvloop.run(measure(args))
    base = results["inline"]
    print(
        f"{'path':12} {'seq wall':>9} {'seq cpu':>8} {'x':>6} "
        f"{'conc wall':>10} {'conc cpu':>9} {'x':>6}"
    )
    for name, r in results.items():
        print(
            f"{name:12} {r['seq_wall_us']:9.0f} {r['seq_cpu_us']:8.0f} "
            f"{r['seq_cpu_us'] / base['seq_cpu_us']:6.2f} {r['conc_wall_us']:10.0f} "
            f"{r['conc_cpu_us']:9.0f} {r['conc_cpu_us'] / base['conc_cpu_us']:6.2f}"
        )
    print(f"(microseconds per run; x: CPU per run / inline; {args.concurrency} outstanding)")


if __name__ == "__main__":
    main()
