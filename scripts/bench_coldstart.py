"""Cold start: the first load of each stage into a fresh arena against a later reload of the same
stage (after an eviction), with the arena faulted in at start (prefault) and without, same run.

One worker executor in-process. N stages of about S MiB each are deployed, then loaded one after
the other into a fresh device arena (the first load of each), then each is evicted and loaded
again, `--rounds` times (the later loads land in the range the stage just left, whose pages are
already in use). Without prefault a first load pays the page faults of its range on the copy lane;
with prefault the device paid them once, when it opened (`prefault_s`).

Runs on the first CUDA device when there is one (pinned host tier), else on a CPU stand-in.

    python scripts/bench_coldstart.py [--stages 8] [--mib 64] [--blocks 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import resource
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from gpu_worker.device import CpuStandIn, CudaDevice, Device
from gpu_worker.executor import Executor
from gpu_worker.host_tier import HostStage


def open_dev(budget: int, prefault: bool, cpu: bool) -> Device:
    if torch.cuda.is_available() and not cpu:
        return CudaDevice(0, budget, prefault=prefault)
    return CpuStandIn(budget, prefault=prefault)


def make_stage(
    dev: Device, blocks: int, width: int, fill: float
) -> tuple[list[nn.Module], HostStage]:
    tensors = [
        {"weight": torch.full((width, width), fill), "bias": torch.full((width,), fill)}
        for _ in range(blocks)
    ]
    with torch.device("meta"):
        mods: list[nn.Module] = [nn.Linear(width, width) for _ in range(blocks)]
    return mods, HostStage.build(tensors, allocate=dev.host_buffer)


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


async def timed_load(ex: Executor, key: tuple[str, int], faults: list[int]) -> float:
    """Seconds to load `key`; appends the page faults the process took meanwhile to `faults`."""
    f = minor_faults()
    t = time.perf_counter()
    await ex.load(key)
    dt = time.perf_counter() - t
    faults.append(minor_faults() - f)
    return dt


async def one_config(args: argparse.Namespace, prefault: bool) -> dict[str, object]:
    width = int((args.mib * 2**20 / 4 / args.blocks) ** 0.5)
    stage_bytes = args.blocks * (width * width + width) * 4
    budget = int(args.stages * stage_bytes * 1.02) + (1 << 20)
    t = time.perf_counter()
    dev = open_dev(budget, prefault, args.cpu)
    open_s = time.perf_counter() - t
    ex = Executor(dev, compute_lanes=1)
    keys = [(f"m{i}", 0) for i in range(args.stages)]
    for i, key in enumerate(keys):
        ex.add_stage(key, *make_stage(dev, args.blocks, width, float(i)))
    first_faults: list[int] = []
    later_faults: list[int] = []
    first = [await timed_load(ex, key, first_faults) for key in keys]  # into untouched ranges
    later: list[float] = []
    for _ in range(args.rounds):
        for key in keys:
            ex.evict(key)
            later.append(await timed_load(ex, key, later_faults))  # the range it just left
    x = torch.ones(1, width, device=dev.torch_device)
    out = await ex.run(keys[-1], [{"x": x.cpu()}])  # the bytes landed where the blocks read them
    assert out.parts[0][""].shape == (1, width)
    ex.close()
    result: dict[str, object] = {
        "prefault": prefault,
        "device": dev.kind,
        "budget_bytes": budget,
        "stage_bytes": stage_bytes,
        "open_s": open_s,
        "prefault_s": dev.prefault_s,
        "first_s": first,
        "later_s": later,
        "first_median_s": statistics.median(first),
        "later_median_s": statistics.median(later),
        "first_max_s": max(first),
        "first_faults_median": statistics.median(first_faults),
        "later_faults_median": statistics.median(later_faults),
    }
    result["first_vs_later"] = result["first_median_s"] / result["later_median_s"]  # type: ignore[operator]
    result["worst_first_vs_later"] = max(first) / result["later_median_s"]  # type: ignore[operator]
    del ex, dev, x, out
    gc.collect()  # the arena and the host tier go back before the next configuration
    return result


async def main_async(args: argparse.Namespace) -> list[dict[str, object]]:
    """Both configurations `--repeats` times, in alternating order (the machine is shared and
    noisy); the samples of each configuration are pooled."""
    runs: dict[bool, list[dict[str, object]]] = {False: [], True: []}
    for r in range(args.repeats):
        for prefault in (False, True) if r % 2 == 0 else (True, False):
            runs[prefault].append(await one_config(args, prefault))
    out = []
    for rs in runs.values():
        first = [t for r in rs for t in r["first_s"]]  # type: ignore[attr-defined]
        later = [t for r in rs for t in r["later_s"]]  # type: ignore[attr-defined]
        pf = [r["prefault_s"] for r in rs if r["prefault_s"] is not None]
        med_first, med_later = statistics.median(first), statistics.median(later)
        out.append(
            {
                **{k: rs[0][k] for k in ("prefault", "device", "budget_bytes", "stage_bytes")},
                "runs": rs,
                "open_s": statistics.median(r["open_s"] for r in rs),  # type: ignore[misc]
                "prefault_s": statistics.median(pf) if pf else None,  # type: ignore[type-var]
                "first_median_s": med_first,
                "later_median_s": med_later,
                "first_max_s": max(first),
                "first_faults_median": statistics.median(r["first_faults_median"] for r in rs),  # type: ignore[misc]
                "later_faults_median": statistics.median(r["later_faults_median"] for r in rs),  # type: ignore[misc]
                "first_vs_later": med_first / med_later,
                "worst_first_vs_later": max(first) / med_later,
                "per_run_first_vs_later": [r["first_vs_later"] for r in rs],
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--mib", type=float, default=64, help="size of each stage")
    ap.add_argument("--blocks", type=int, default=4, help="blocks per stage")
    ap.add_argument("--rounds", type=int, default=3, help="reloads of each stage")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each configuration")
    ap.add_argument("--cpu", action="store_true", help="a CPU stand-in even with CUDA")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    results = asyncio.run(main_async(args))
    r0 = results[0]
    print(
        f"device {r0['device']}: {args.stages} stages of {r0['stage_bytes'] / 2**20:.0f} MiB "  # type: ignore[operator]
        f"({args.blocks} blocks), arena {r0['budget_bytes'] / 2**20:.0f} MiB"  # type: ignore[operator]
    )
    print(
        "prefault | open (prefault) | first load (median / max) | later load | page faults "
        "first / later | first/later"
    )
    for r in results:
        pf = "-" if r["prefault_s"] is None else f"{r['prefault_s'] * 1e3:.0f} ms"  # type: ignore[operator]
        print(
            f"{'on ' if r['prefault'] else 'off'}      | "
            f"{r['open_s'] * 1e3:6.0f} ms ({pf}) | "  # type: ignore[operator]
            f"{r['first_median_s'] * 1e3:7.1f} / {r['first_max_s'] * 1e3:7.1f} ms | "  # type: ignore[operator]
            f"{r['later_median_s'] * 1e3:7.1f} ms | "  # type: ignore[operator]
            f"{r['first_faults_median']:6.0f} / {r['later_faults_median']:4.0f} | "
            f"{r['first_vs_later']:.2f} (worst {r['worst_first_vs_later']:.2f}; per run "
            + ", ".join(f"{x:.2f}" for x in r["per_run_first_vs_later"])  # type: ignore[attr-defined]
            + ")"
        )
    on = results[1]["first_vs_later"]
    print(
        f"target: first <= 1.2x later with prefault: {'met' if on <= 1.2 else 'NOT met'} ({on:.2f})"
    )  # type: ignore[operator]
    Path(args.out).mkdir(exist_ok=True)
    path = Path(args.out) / "coldstart.json"
    path.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
