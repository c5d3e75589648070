"""The main job: an embedded mesh serving a catalogue larger than all device memory.

Starts broker, partitioner and CPU stand-in workers (or GPUs when present), deploys example
models whose total size is several times the combined budget — one of them larger than any single
device, so it runs as pipeline stages on two workers — then sends skewed (Zipf), bursty traffic
from concurrent clients, checks every output against a direct torch forward of the same model, and
prints what happened per model.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from broker.policy import percentile
from client_sdk.client import AsyncClient
from client_sdk.errors import ClientError
from client_sdk.mesh import LocalMesh
from flowmesh.build import build_seeded
from flowmesh.spec import ModelSpec
from flowmesh.units import fmt_bytes, parse_size

CATALOGUE: list[tuple[str, str, dict[str, Any]]] = [
    (
        "chat-large",
        "flowmesh.examples:tiny_gpt",
        {"vocab": 4096, "d_model": 512, "n_layers": 5, "n_heads": 8, "max_len": 64},
    ),
    (
        "chat-small",
        "flowmesh.examples:tiny_gpt",
        {"vocab": 4096, "d_model": 384, "n_layers": 4, "n_heads": 6, "max_len": 64},
    ),
    ("ranker", "flowmesh.examples:mlp", {"width": 1024, "depth": 6}),
    ("embedder", "flowmesh.examples:mlp", {"width": 1280, "depth": 3}),
    ("scorer", "flowmesh.examples:mlp", {"width": 768, "depth": 8}),
    ("classifier", "flowmesh.examples:mlp", {"width": 512, "depth": 4}),
    ("tagger", "flowmesh.examples:mlp", {"width": 896, "depth": 5}),
]


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    exact: int = 0
    close: int = 0
    wrong: int = 0
    max_diff: float = 0.0


def make_input(spec: ModelSpec, rng: random.Random) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    rows = rng.choice((1, 1, 1, 2))
    if spec.factory.endswith("tiny_gpt"):
        return torch.randint(0, spec.kwargs["vocab"], (rows, rng.choice((8, 16, 32))), generator=g)
    return torch.randn(rows, spec.kwargs["width"], generator=g)


async def client_loop(
    i: int,
    address: str,
    plan: list[tuple[float, str]],
    specs: dict[str, ModelSpec],
    refs: dict[str, torch.nn.Module],
    tallies: dict[str, Tally],
    seed: int,
) -> None:
    rng = random.Random(seed * 1000 + i)
    t0 = time.perf_counter()
    async with AsyncClient(address, timeout=120.0) as client:
        pending = []
        for at, name in plan:
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            x = make_input(specs[name], rng)
            pending.append(asyncio.create_task(one(client, name, x, refs[name], tallies[name])))
        await asyncio.gather(*pending)


async def one(
    client: AsyncClient, name: str, x: torch.Tensor, ref: torch.nn.Module, tally: Tally
) -> None:
    t = time.perf_counter()
    try:
        out = await client.infer(name, x)
    except ClientError as exc:
        tally.errors[str(exc.code)] = tally.errors.get(str(exc.code), 0) + 1
        return
    tally.latencies.append((time.perf_counter() - t) * 1000)
    # The reference runs in a worker thread so it never stalls the clients' event loop.
    want = await asyncio.to_thread(_forward, ref, x)
    assert isinstance(out, torch.Tensor)
    if torch.equal(out, want):
        tally.exact += 1
    elif torch.allclose(out, want, rtol=1e-4, atol=1e-5):
        tally.close += 1  # batched with other requests: matmul blocking differs in the last bits
    else:
        tally.wrong += 1
    tally.max_diff = max(tally.max_diff, float((out - want).abs().max()))


def _forward(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(x)


def traffic(models: list[str], n: int, clients: int, seed: int) -> list[list[tuple[float, str]]]:
    """Zipf popularity (a few hot models, a long tail) with Gamma inter-arrivals of CV 2."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** 1.1 for k in range(len(models))]
    order = models[:]
    rng.shuffle(order)
    per_client: list[list[tuple[float, str]]] = [[] for _ in range(clients)]
    t = 0.0
    shape = 0.25  # CV = 1/sqrt(shape) = 2: bursty
    for k in range(n):
        t += rng.gammavariate(shape, 0.012 / shape)
        per_client[k % clients].append((t, rng.choices(order, weights)[0]))
    return per_client


def main(args: argparse.Namespace | None = None) -> int:
    if args is None:
        from client_sdk.cli import build_parser

        args = build_parser().parse_args(["demo", *sys.argv[1:]])
    torch.set_num_threads(1)  # the reference forward, like each worker, on one thread
    budget = parse_size(args.memory_budget)
    specs = {
        name: ModelSpec(name=name, factory=f, kwargs=kw, seed=args.seed + i, max_batch_size=8)
        for i, (name, f, kw) in enumerate(CATALOGUE)
    }
    print(
        f"flowmesh demo: {args.workers} CPU stand-in workers of {fmt_bytes(budget)} each, "
        f"{len(specs)} models, {args.requests} requests from {args.clients} clients\n",
        flush=True,
    )
    t_start = time.perf_counter()
    with LocalMesh(
        cpu_workers=args.workers,
        memory_budget=args.memory_budget,
        heartbeat_s=0.5,
        threads_per_worker=1,
    ) as mesh:
        print(
            f"mesh up in {time.perf_counter() - t_start:.1f} s: broker {mesh.frontend}", flush=True
        )
        refs = {n: build_seeded(s) for n, s in specs.items()}
        deployed = asyncio.run(deploy_all(mesh.frontend, specs))
        total = sum(m["bytes"] for m in deployed.values())
        print(
            f"deployed {len(deployed)} models, {fmt_bytes(total)} in all = "
            f"{total / (budget * args.workers):.1f}x the combined device budget",
            flush=True,
        )
        for name, m in deployed.items():
            if len(m["stages"]) > 1:
                print(
                    f"  {name} ({fmt_bytes(m['bytes'])}) is larger than one device: "
                    f"{len(m['stages'])} pipeline stages on "
                    f"{' + '.join(m['replicas'][0]['workers'])}"
                )
        plan = traffic(list(specs), args.requests, args.clients, args.seed)
        tallies = {n: Tally() for n in specs}
        t0 = time.perf_counter()
        asyncio.run(run_clients(mesh.frontend, plan, specs, refs, tallies, args.seed))
        wall = time.perf_counter() - t0
        status = asyncio.run(fetch_status(mesh.frontend))
    return report(status, tallies, wall, budget, args.workers)


async def deploy_all(address: str, specs: dict[str, ModelSpec]) -> dict[str, dict[str, Any]]:
    async with AsyncClient(address, timeout=300.0) as client:
        infos = await asyncio.gather(
            *(
                client.deploy(
                    s.name, s.factory, kwargs=s.kwargs, seed=s.seed, max_batch_size=s.max_batch_size
                )
                for s in specs.values()
            )
        )
    return {i["name"]: i for i in infos}


async def run_clients(
    address: str,
    plan: list[list[tuple[float, str]]],
    specs: dict[str, ModelSpec],
    refs: dict[str, torch.nn.Module],
    tallies: dict[str, Tally],
    seed: int,
) -> None:
    await asyncio.gather(
        *(client_loop(i, address, p, specs, refs, tallies, seed) for i, p in enumerate(plan))
    )


async def fetch_status(address: str) -> dict[str, Any]:
    async with AsyncClient(address) as client:
        return await client.status()


def report(
    status: dict[str, Any], tallies: dict[str, Tally], wall: float, budget: int, workers: int
) -> int:
    from client_sdk.cli import table

    by_name = {m["name"]: m for m in status["models"]}
    rows, done, bad = [], 0, 0
    for name, t in sorted(tallies.items(), key=lambda kv: -len(kv[1].latencies)):
        m = by_name[name]
        n_err = sum(t.errors.values())
        done += len(t.latencies)
        bad += n_err + t.wrong
        rows.append(
            [
                name,
                fmt_bytes(m["bytes"]),
                len(m["stages"]),
                len(t.latencies) + n_err,
                f"{sum(t.latencies) / max(1, len(t.latencies)):.1f}",
                f"{percentile(t.latencies, 99):.1f}",
                m["loads"],
                m["evictions"],
                m["batches"],
                f"{t.exact}/{t.close}/{t.wrong}",
                ", ".join(f"{k}:{v}" for k, v in t.errors.items()) or "-",
            ]
        )
    print()
    print(
        table(
            rows,
            [
                "model",
                "bytes",
                "stages",
                "requests",
                "mean ms",
                "p99 ms",
                "loads",
                "evictions",
                "batches",
                "exact/close/wrong",
                "errors",
            ],
        )
    )
    print()
    for w in status["workers"]:
        print(
            f"{w['name']}: peak {fmt_bytes(w['peak_bytes'])} of {fmt_bytes(w['budget_bytes'])} "
            f"budget, {w['loads']} loads, {w['evictions']} evictions, host tier "
            f"{fmt_bytes(w['host_bytes'])}"
        )
    over = [w for w in status["workers"] if w["peak_bytes"] > w["budget_bytes"]]
    print(
        f"\n{done} requests answered in {wall:.1f} s ({done / wall:.0f}/s); outputs checked "
        "against a direct torch forward: 'exact' bit for bit, 'close' within 1e-4 (batched "
        "with others), 'wrong' otherwise"
    )
    if bad or over:
        print(f"FAILED: {bad} wrong or failed requests, {len(over)} workers over budget")
        return 1
    print("OK: every output matches its reference and no device exceeded its budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())
