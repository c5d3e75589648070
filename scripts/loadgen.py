"""Load generator: bursty, skewed traffic against a running broker.

Inputs are random tensors of each model's declared dtype and shape (see `flowmesh status`).
Prints, per model, requests, errors and latency percentiles; writes the same as JSON.

    python scripts/loadgen.py --broker tcp://127.0.0.1:5555 --requests 2000 --rate 200 \
        --cv 4 --zipf 1.1 --clients 8 [--models a b c] [--out bench-out/loadgen.json]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import msgspec
import torch
import uvloop

from client_sdk.cli import table
from client_sdk.client import DEFAULT_ADDRESS, Client
from client_sdk.loadgen import arrival_times, random_inputs, run_trace, zipf_choices


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--broker", default=DEFAULT_ADDRESS)
    ap.add_argument("--models", nargs="*", help="default: every ready model with inputs")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=100.0, help="mean requests per second")
    ap.add_argument("--cv", type=float, default=1.0, help="inter-arrival CV (1 = Poisson)")
    ap.add_argument("--zipf", type=float, default=1.1, help="popularity skew")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rows", type=int, default=1, help="batch rows per request")
    ap.add_argument("--seq", type=int, default=16, help="size of free dimensions")
    ap.add_argument("--vocab", type=int, default=256, help="range of integer inputs")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write results as JSON here")
    args = ap.parse_args()

    with Client(args.broker) as c:
        status = c.status()
    declared = {
        m.name: msgspec.to_builtins(m.inputs)
        for m in status.models
        if m.state == "ready" and m.inputs
    }
    models = args.models or sorted(declared)
    missing = [m for m in models if m not in declared]
    if missing or not models:
        raise SystemExit(
            f"no ready model with declared inputs among {missing or 'the mesh'}; "
            f"ready: {sorted(declared)}"
        )
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    trace = list(
        zip(
            arrival_times(args.requests, args.rate, args.cv, rng),
            zipf_choices(models, args.requests, args.zipf, rng),
            strict=True,
        )
    )
    tallies, wall = uvloop.run(
        run_trace(
            args.broker,
            trace,
            lambda m: random_inputs(declared[m], args.rows, args.seq, gen, args.vocab),
            clients=args.clients,
            timeout=args.timeout,
        )
    )
    rows = []
    for name, t in sorted(tallies.items(), key=lambda kv: -len(kv[1].latencies_ms)):
        r = t.row()
        rows.append(
            [
                name,
                r["ok"],
                sum(r["errors"].values()),
                f"{r['mean_ms']:.1f}",
                f"{r['p50_ms']:.1f}",
                f"{r['p99_ms']:.1f}",
            ]
        )
    print(table(rows, ["model", "ok", "errors", "mean ms", "p50 ms", "p99 ms"]))
    done = sum(len(t.latencies_ms) for t in tallies.values())
    print(
        f"\n{done}/{args.requests} answered in {wall:.1f} s ({done / wall:.0f}/s) at offered "
        f"{args.rate:.0f}/s, CV {args.cv}, Zipf {args.zipf}"
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "wall_s": wall,
                    "models": {n: t.row() for n, t in tallies.items()},
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
