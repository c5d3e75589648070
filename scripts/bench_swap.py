"""Swap-in: the executor's host->device load against a raw copy of the same bytes, same run; and a
cold request (load + run issued together, layer-pipelined) against transfer alone and against
transfer followed by compute.

Runs on the first CUDA device when there is one (pinned host tier, copy stream), else on a CPU
stand-in device (real memcpy into the arena on the copy thread).

    python scripts/bench_swap.py [--mib 256] [--layers 16] [--repeats 5] [--out bench-out]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from gpu_worker.device import CpuStandIn, CudaDevice, Device
from gpu_worker.executor import Executor
from gpu_worker.host_tier import HostStage


def make_stage(layers: int, width: int) -> tuple[list[nn.Module], list[dict[str, torch.Tensor]]]:
    real = [nn.Linear(width, width) for _ in range(layers)]
    tensors = [dict(m.state_dict()) for m in real]
    with torch.device("meta"):
        blocks: list[nn.Module] = [nn.Linear(width, width) for _ in range(layers)]
    return blocks, tensors


def sync(dev: Device) -> None:
    if dev.kind == "cuda":
        torch.cuda.synchronize()


def raw_copy_s(dev: Device, host: HostStage) -> float:
    dst = dev.arena[: host.buffer.numel()]
    sync(dev)
    t = time.perf_counter()
    if dev.kind == "cuda":
        with torch.cuda.stream(dev.copy_stream):  # type: ignore[attr-defined]
            dst.copy_(host.buffer, non_blocking=True)
        torch.cuda.synchronize()
    else:
        dst.copy_(host.buffer)
    return time.perf_counter() - t


async def load_s(ex: Executor, key: tuple[str, int]) -> float:
    ex.evict(key)
    sync(ex.device)
    t = time.perf_counter()
    await ex.load(key)
    return time.perf_counter() - t


async def cold_request_s(ex: Executor, key: tuple[str, int], x: torch.Tensor) -> float:
    ex.evict(key)
    sync(ex.device)
    t = time.perf_counter()
    loading = ex.load(key)
    await ex.run(key, [{"x": x}])  # issued at once: computes block i as soon as it has landed
    await loading
    return time.perf_counter() - t


async def run_s(ex: Executor, key: tuple[str, int], x: torch.Tensor) -> float:
    t = time.perf_counter()
    await ex.run(key, [{"x": x}])
    return time.perf_counter() - t


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    width = int((args.mib * 2**20 / 4 / args.layers) ** 0.5)
    if torch.cuda.is_available():
        dev: Device = CudaDevice(0, int(args.mib * 2**20 * 1.2))
    else:
        dev = CpuStandIn(int(args.mib * 2**20 * 1.2))
    blocks, tensors = make_stage(args.layers, width)
    host = HostStage.build(tensors, allocate=dev.host_buffer)
    ex = Executor(dev, compute_lanes=1, copy_chunk_bytes=int(args.chunk_mib * 2**20) or None)
    key = ("bench", 0)
    ex.add_stage(key, blocks, host)
    x = torch.randn(args.batch, width)
    await ex.load(key)
    await ex.run(key, [{"x": x}])  # warm up kernels and the arena's pages
    raw, load, cold, compute = [], [], [], []
    for _ in range(args.repeats):  # interleaved so noise hits every figure alike
        raw.append(raw_copy_s(dev, host))
        load.append(await load_s(ex, key))
        compute.append(await run_s(ex, key, x))
        cold.append(await cold_request_s(ex, key, x))
    ex.close()
    med = {
        k: statistics.median(v)
        for k, v in {
            "raw_copy_s": raw,
            "load_s": load,
            "run_s": compute,
            "cold_request_s": cold,
        }.items()
    }
    nbytes = host.nbytes
    result: dict[str, object] = {
        "device": dev.kind,
        "bytes": nbytes,
        "layers": args.layers,
        "batch": args.batch,
        **med,
        "load_vs_raw_copy": med["raw_copy_s"] / med["load_s"],
        "cold_vs_transfer_plus_compute": med["cold_request_s"] / (med["load_s"] + med["run_s"]),
        "cold_vs_max_transfer_compute": med["cold_request_s"] / max(med["load_s"], med["run_s"]),
        "load_gib_s": nbytes / med["load_s"] / 2**30,
        "raw_gib_s": nbytes / med["raw_copy_s"] / 2**30,
    }
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, default=256)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--chunk-mib", type=float, default=0, help="largest single copy (default: the device's)"
    )
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    r = asyncio.run(main_async(args))
    print(f"device {r['device']}: stage of {r['bytes'] / 2**20:.0f} MiB in {r['layers']} blocks")
    print(f"raw copy       {r['raw_copy_s'] * 1e3:8.1f} ms  {r['raw_gib_s']:6.1f} GiB/s")
    print(
        f"executor load  {r['load_s'] * 1e3:8.1f} ms  {r['load_gib_s']:6.1f} GiB/s  "
        f"= {r['load_vs_raw_copy']:.2f} of the raw copy"
    )
    print(f"warm run       {r['run_s'] * 1e3:8.1f} ms")
    print(
        f"cold request   {r['cold_request_s'] * 1e3:8.1f} ms  = "
        f"{r['cold_vs_transfer_plus_compute']:.2f} of load+run, "
        f"{r['cold_vs_max_transfer_compute']:.2f} of max(load, run)"
    )
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    (out / f"swap-{r['device']}.json").write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
