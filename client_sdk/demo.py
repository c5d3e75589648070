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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from client_sdk.client import AsyncClient
from client_sdk.loadgen import Tally, arrival_times, run_trace, zipf_choices
from client_sdk.mesh import LocalMesh
from flowmesh.build import build_seeded
from flowmesh.spec import ModelSpec
from flowmesh.testing import compare, forward_tolerance
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
class Checked:
    """How served outputs compared with a direct forward of the same model."""

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


def checker(
    refs: dict[str, torch.nn.Module], checked: dict[str, Checked]
) -> Callable[[str, torch.Tensor, torch.Tensor], None]:
    def check(model: str, x: torch.Tensor, out: torch.Tensor) -> None:
        with torch.inference_mode():
            want = refs[model](x)
        c = checked[model]
        got = compare(out, want)
        if got.verdict == "exact":
            c.exact += 1
        elif got.verdict == "close":
            c.close += 1  # the same forward in another order (batched with other requests)
        else:
            c.wrong += 1
        c.max_diff = max(c.max_diff, got.max_abs_diff)

    return check


def main(args: argparse.Namespace | None = None) -> int:
    if args is None:
        from client_sdk.cli import build_parser

        args = build_parser().parse_args(["demo", *sys.argv[1:]])
    # The reference forwards on one thread: the workers already keep the cores busy.
    torch.set_num_threads(1)
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
        rng = random.Random(args.seed)
        # Bursty (Gamma arrivals, CV 2) and skewed (Zipf 1.1): a few hot models, a long tail.
        times = arrival_times(args.requests, rate=80.0, cv=2.0, rng=rng)
        trace = list(zip(times, zipf_choices(list(specs), args.requests, 1.1, rng), strict=True))
        checked = {n: Checked() for n in specs}
        tallies, wall = asyncio.run(
            run_trace(
                mesh.frontend,
                trace,
                lambda m: make_input(specs[m], rng),
                clients=args.clients,
                timeout=120.0,
                check=checker(refs, checked),
            )
        )
        status = asyncio.run(fetch_status(mesh.frontend))
    return report(status, tallies, checked, wall)


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


async def fetch_status(address: str) -> dict[str, Any]:
    async with AsyncClient(address) as client:
        return await client.status()


def report(
    status: dict[str, Any], tallies: dict[str, Tally], checked: dict[str, Checked], wall: float
) -> int:
    from client_sdk.cli import table

    rows, done, bad = [], 0, 0
    for m in sorted(status["models"], key=lambda m: -m["requests"]):
        t, c = tallies.get(m["name"], Tally()), checked[m["name"]]
        r = t.row()
        n_err = sum(t.errors.values())
        done += r["ok"]
        bad += n_err + c.wrong
        rows.append(
            [
                m["name"],
                fmt_bytes(m["bytes"]),
                len(m["stages"]),
                r["ok"] + n_err,
                f"{r['mean_ms']:.1f}",
                f"{r['p99_ms']:.1f}",
                m["loads"],
                m["evictions"],
                m["batches"],
                f"{c.exact}/{c.close}/{c.wrong}",
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
    # The arena is the budget, so its peak cannot exceed it; the worker's high-water mark of the
    # stages it held (taken at every load) could, if its bookkeeping were wrong.
    over = [
        w for w in status["workers"] if w["stats"].get("stage_bytes_peak", 0) > w["budget_bytes"]
    ]
    rtol, atol = forward_tolerance(torch.float32)
    print(
        f"\n{done} requests answered in {wall:.1f} s ({done / wall:.0f}/s); outputs checked "
        "against a direct torch forward: 'exact' bit for bit; 'close' the same forward computed "
        "in another order (batched with other requests), within torch.testing.assert_close's "
        f"float32 tolerance (|diff| <= {atol:g} + {rtol:g} x |expected|); 'wrong' otherwise"
    )
    if bad or over:
        print(f"FAILED: {bad} wrong or failed requests, {len(over)} workers over budget")
        return 1
    print("OK: every output matches its reference and no device exceeded its budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())
