"""A model cut into P stages over P workers against the same model whole on one worker.

Real broker, partitioner and worker processes on loopback. In the same run, one model (an MLP
of `--depth` layers of `--width`) is served three ways, each on a mesh of its own with the same
workers:

- **one stage**: the whole model on one worker (the reference);
- **P stages, direct**: cut over P workers, each batch announced to every stage at once and the
  activations sent worker to worker in micro-batches (`--micro-batches`, 0: one per stage);
- **P stages, relayed**: the same cut with `--direct 0`: every activation through the broker;
- the two again with CURVE keys on every socket (`--keys`): the workers' peer sockets are
  CURVE too, so activations travel encrypted, worker to worker or through the broker.

Closed loop: `--clients` clients each keep one request of `--rows` rows in flight for
`--seconds`. Printed: requests/s of each, their ratios to one stage, and the activation bytes
the broker forwarded. Every answer is checked against the model's own forward.

    python scripts/bench_pipeline.py [--stages 4] [--width 1024] [--depth 16] [--rows 32]
        [--clients 8] [--seconds 10] [--threads 1] [--keys]

On the CPU stand-in every worker shares the machine's cores (a 2-core machine cannot run four
stages at once), so the ratio shows the overhead of the hops and what overlap the cores allow;
on GPUs each stage has a device of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import torch

from client_sdk.client import AsyncClient
from client_sdk.mesh import LocalMesh
from flowmesh.modelio.build import build_seeded
from flowmesh.spec import ModelSpec
from flowmesh.testing import assert_forward_close


def spec_of(width: int, depth: int) -> ModelSpec:
    return ModelSpec(
        name="deep",
        factory="flowmesh.examples:mlp",
        kwargs={"width": width, "depth": depth, "in_features": width, "out_features": width},
        seed=5,
    )


async def closed_loop(
    frontend: str,
    clients: int,
    rows: int,
    width: int,
    seconds: float,
    ref: Any,
    keys: Any = None,
) -> tuple[int, float]:
    done = 0
    xs = [torch.randn(rows, width) for _ in range(4)]
    wants = [ref(x) for x in xs]

    async def client(k: int) -> None:
        nonlocal done
        async with AsyncClient(frontend, timeout=120, keys=keys) as c:
            i = k
            while time.perf_counter() < end:
                out = await c.infer("deep", xs[i % 4])
                assert_forward_close(out, wants[i % 4])
                done += 1
                i += 1

    async with AsyncClient(frontend, timeout=120, keys=keys) as warm:  # every stage loaded
        for x in xs:
            await warm.infer("deep", x)
    t0 = time.perf_counter()
    end = t0 + seconds
    await asyncio.gather(*(client(k) for k in range(clients)))
    return done, time.perf_counter() - t0


def run(
    args: argparse.Namespace, stages: int, direct: bool, ref: Any, keys: bool = False
) -> dict[str, Any]:
    spec = spec_of(args.width, args.depth)
    broker = ["--direct", "1" if direct else "0", "--micro-batches", str(args.micro_batches)]
    with LocalMesh(
        cpu_workers=args.stages,
        memory_budget=args.budget,
        threads_per_worker=args.threads,
        broker_args=broker,
        keys=keys or None,
    ) as mesh:
        with mesh.client() as c:
            c.deploy(
                spec.name,
                spec.factory,
                kwargs=spec.kwargs,
                seed=spec.seed,
                stages=stages,
                replicas=1,
                max_batch_size=args.rows,
            )
        n, secs = asyncio.run(
            closed_loop(
                mesh.frontend,
                args.clients,
                args.rows,
                args.width,
                args.seconds,
                ref,
                mesh.client_keys,
            )
        )
        with mesh.client() as c:
            st = c.status()
    return {
        "rps": n / secs,
        "requests": n,
        "relayed_mib": st.totals.activation_bytes_relayed / (1 << 20),
        "direct_batches": st.totals.direct_batches,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=0)
    ap.add_argument("--budget", default="256MiB")
    ap.add_argument(
        "--keys", action="store_true", help="also both cuts with CURVE keys on every socket"
    )
    args = ap.parse_args()
    model = build_seeded(spec_of(args.width, args.depth)).eval()

    def ref(x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return model(x)

    rows = []
    configs = [
        ("one stage, one worker", 1, True, False),
        (f"{args.stages} stages, direct", args.stages, True, False),
        (f"{args.stages} stages, relayed by the broker", args.stages, False, False),
    ]
    if args.keys:
        configs += [
            (f"{args.stages} stages, direct, CURVE", args.stages, True, True),
            (f"{args.stages} stages, relayed, CURVE", args.stages, False, True),
        ]
    for what, stages, direct, keys in configs:
        r = run(args, stages, direct, ref, keys)
        rows.append((what, r))
        print(f"  {what}: {r['rps']:.1f} requests/s ({r['requests']} requests)", flush=True)
    base = rows[0][1]["rps"]
    print(f"\n{'config':<40} {'req/s':>8} {'/ one stage':>12} {'relayed MiB':>12}")
    for what, r in rows:
        print(f"{what:<40} {r['rps']:8.1f} {r['rps'] / base:12.2f} {r['relayed_mib']:12.1f}")
    direct, relayed = rows[1][1]["rps"], rows[2][1]["rps"]
    print(f"\ndirect / relayed: {direct / relayed:.2f}")
    if args.keys:
        print(f"with CURVE keys, direct / relayed: {rows[3][1]['rps'] / rows[4][1]['rps']:.2f}")


if __name__ == "__main__":
    main()
