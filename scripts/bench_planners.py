"""Planner speed: the exact bisection balancer against a textbook exact dynamic program, same run.

Both return the optimal bottleneck (checked); the figure is how much faster flowmesh's planner is
on the same cost lists, and its absolute time on a 1,000-block model.

    python scripts/bench_planners.py [--blocks 1000] [--parts 2 4 8 16] [--out bench-out]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from flowmesh.modelio.costs import BlockProfile
from flowmesh.modelio.planners import balance, chunks, part_sums


def dp_bottleneck(costs: list[int], parts: int) -> int:
    """Reference: O(parts * n^2) dynamic program over prefix sums (exact, no tricks)."""
    n = len(costs)
    pre = [0]
    for c in costs:
        pre.append(pre[-1] + c)
    inf = float("inf")
    best = [0 if i == 0 else inf for i in range(n + 1)]  # best[i]: i blocks in k parts
    for k in range(1, parts + 1):
        nxt = [inf] * (n + 1)
        for i in range(k, n - (parts - k) + 1):
            cands = (max(best[j], pre[i] - pre[j]) for j in range(k - 1, i))
            nxt[i] = min(cands)
        best = nxt
    return int(best[n])


def timed(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=1000)
    ap.add_argument("--parts", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    # Transformer-like: a few large embedding/head blocks, many similar layers with jitter.
    costs = [rng.randint(900_000, 1_100_000) for _ in range(args.blocks)]
    costs[0] = costs[-1] = 25_000_000
    rows = []
    print(f"{'parts':>5} {'flowmesh ms':>12} {'DP ms':>10} {'speedup':>9}  bottleneck equal")
    for parts in args.parts:
        ours = timed(lambda p=parts: balance(costs, p), 20)
        ref = timed(lambda p=parts: dp_bottleneck(costs, p), 1)
        bounds = balance(costs, parts)
        same = max(part_sums(costs, bounds)) == dp_bottleneck(costs, parts)
        rows.append(
            {"parts": parts, "flowmesh_s": ours, "dp_s": ref, "speedup": ref / ours, "equal": same}
        )
        print(f"{parts:>5} {ours * 1e3:12.3f} {ref * 1e3:10.1f} {ref / ours:9.0f}  {same}")
    blocks = [
        BlockProfile(
            name=f"b{i}",
            param_bytes=c,
            buffer_bytes=0,
            shared_bytes=0,
            out_bytes_per_sample=4096,
            saved_bytes_per_sample=16384,
            out_shape=None,
            forward_s=None,
            forward_backward_s=None,
            tensors=(),
        )
        for i, c in enumerate(costs)
    ]
    target = 4 * sum(costs) // 10
    chunk_s = timed(lambda: chunks(target, blocks, "adam", 8), 20)
    print(
        f"\nchunks(target={target} bytes, adam, batch 8) on {args.blocks} blocks: "
        f"{chunk_s * 1e3:.3f} ms"
    )
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    (out / "planners.json").write_text(
        json.dumps({"blocks": args.blocks, "stages": rows, "chunks_s": chunk_s}, indent=2)
    )
    assert all(r["equal"] for r in rows), "planner disagrees with the exact DP"


if __name__ == "__main__":
    main()
