"""Swap-in: the executor's host->device load against a raw copy of the same bytes, same run; and a
cold request (load + run issued together, layer-pipelined) against transfer alone and against
transfer followed by compute. Then disk to host: a safetensors file of --disk-mib written by the
script (in a temporary directory) read into a stage's host buffer by the worker's direct reader
(modelio.weights.read_weights_into: each tensor's bytes from the file straight into its slot),
against safetensors.torch.load_file, the old path (load_file, then copied into the host buffer)
and a raw read of the whole file into a bytearray, same run, interleaved.

The page cache cannot be dropped without root, so the disk figures are warm-cache (the file was
just written and is read once before timing): they measure the copies out of the page cache and
the allocation, not the disk. O_DIRECT is not used: it needs aligned buffers and offsets that
safetensors' tensor offsets are not, and is not portable.

Runs on the first CUDA device when there is one (pinned host tier, copy stream), else on a CPU
stand-in device (real memcpy into the arena on the copy thread).

    python scripts/bench_swap.py [--mib 256] [--layers 16] [--repeats 5] [--disk-mib 512]
        [--out bench-out]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from flowmesh.modelio.weights import READ_CHUNK, read_weights_into
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


def direct_read_s(
    dev: Device, path: str, metas: list[dict[str, torch.Tensor]], into: HostStage | None = None
) -> float:
    """The worker's path: lay out, allocate the host buffer once, read each tensor into it.
    With `into`, the reads alone, into a stage whose buffer is already faulted in (a reserved
    slab's range, as on CUDA, where the pinned host tier is reserved when the worker starts)."""
    t = time.perf_counter()
    host = into or direct_layout(dev, metas)
    dests = {
        f"{b}.{n}": host.slot_view(b, k) for b, ts in enumerate(metas) for k, n in enumerate(ts)
    }
    read_weights_into(path, dests)
    return time.perf_counter() - t


def direct_layout(dev: Device, metas: list[dict[str, torch.Tensor]]) -> HostStage:
    return HostStage.allocate_for(
        [[(n, (b, n), m) for n, m in ts.items()] for b, ts in enumerate(metas)], dev.host_buffer
    )


def load_file_s(path: str, touch: bool = False) -> float:
    """safetensors.torch.load_file. On the CPU it maps the file (a private mmap) and returns
    views of it: no byte is read until used, so with `touch` one byte of every page of every
    tensor is read too, which is the least a consumer of the tensors pays."""
    from safetensors.torch import load_file

    t = time.perf_counter()
    tensors = load_file(path)
    if touch:
        for x in tensors.values():
            x.reshape(-1).view(torch.uint8)[::4096].sum()
    return time.perf_counter() - t


def old_path_s(dev: Device, path: str, metas: list[dict[str, torch.Tensor]]) -> float:
    """Before the direct read: the tensors on the CPU, then copied into the host buffer."""
    from safetensors.torch import load_file

    t = time.perf_counter()
    flat = load_file(path)
    blocks = [{n: flat[f"{b}.{n}"] for n in ts} for b, ts in enumerate(metas)]
    HostStage.build(blocks, allocate=dev.host_buffer)
    return time.perf_counter() - t


def raw_read_s(path: str, into: memoryview | None = None) -> float:
    """The whole file read into one buffer: a new bytearray, or `into` (already faulted in)."""
    t = time.perf_counter()
    view = into if into is not None else memoryview(bytearray(os.path.getsize(path)))
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < len(view):
            done += f.readinto(view[done : done + READ_CHUNK])  # the direct reader's chunks
    return time.perf_counter() - t


def disk_to_host(dev: Device, args: argparse.Namespace) -> dict[str, object]:
    from safetensors.torch import save_file

    width = int((args.disk_mib * 2**20 / 4 / args.layers) ** 0.5)
    _blocks, tensors = make_stage(args.layers, width)
    metas = [{n: t.to("meta") for n, t in ts.items()} for ts in tensors]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "stage.safetensors")
        save_file({f"{b}.{n}": t for b, ts in enumerate(tensors) for n, t in ts.items()}, path)
        del tensors
        size = os.path.getsize(path)
        raw_read_s(path)  # into the page cache (it is there already, having just been written)
        direct_read_s(dev, path, metas)  # and a first allocation of each kind
        reserved = direct_layout(dev, metas)  # faulted in once, reused
        reused = memoryview(bytearray(size))
        reused_torch = memoryview(torch.empty(size, dtype=torch.uint8).numpy())
        raw_read_s(path, reused)  # fault both in
        raw_read_s(path, reused_torch)
        runs: dict[str, list[float]] = {
            "direct_reserved": [],
            "raw_reused": [],
            "raw_reused_torch": [],
            "direct": [],
            "load_file": [],
            "load_file_touch": [],
            "old_path": [],
            "raw": [],
        }
        for _ in range(args.repeats):
            runs["direct_reserved"].append(direct_read_s(dev, path, metas, reserved))
            runs["raw_reused"].append(raw_read_s(path, reused))
            runs["raw_reused_torch"].append(raw_read_s(path, reused_torch))
            runs["direct"].append(direct_read_s(dev, path, metas))
            runs["load_file"].append(load_file_s(path))
            runs["load_file_touch"].append(load_file_s(path, touch=True))
            runs["old_path"].append(old_path_s(dev, path, metas))
            runs["raw"].append(raw_read_s(path))
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "file_bytes": size,
        "cache": "warm (page cache not dropped: needs root)",
        **{f"{k}_s": v for k, v in med.items()},
        **{f"{k}_gb_s": size / v / 1e9 for k, v in med.items()},
        "direct_vs_load_file": med["load_file"] / med["direct"],
        "direct_vs_load_file_touch": med["load_file_touch"] / med["direct"],
        "direct_vs_old_path": med["old_path"] / med["direct"],
        "direct_vs_raw": med["raw"] / med["direct"],
        "direct_reserved_vs_raw_reused": med["raw_reused"] / med["direct_reserved"],
        "direct_reserved_vs_raw_reused_torch": med["raw_reused_torch"] / med["direct_reserved"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, default=256)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--chunk-mib", type=float, default=0, help="largest single copy (default: the device's)"
    )
    ap.add_argument("--disk-mib", type=float, default=512, help="0: skip disk to host")
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
    if args.disk_mib:
        # On CUDA the host buffers are ranges of a pinned slab: room for two stages at once.
        tier = int(args.disk_mib * 2**20 * 2.5)
        dev = CudaDevice(0, 2**20, tier) if torch.cuda.is_available() else CpuStandIn(2**20)
        d = disk_to_host(dev, args)
        r["disk_to_host"] = d
        print(f"disk to host, {d['file_bytes'] / 2**20:.0f} MiB safetensors file, {d['cache']}:")
        for k, what in [
            ("direct_reserved", "direct read, buffer already faulted in"),
            ("raw_reused", "raw read, bytearray already faulted in"),
            ("raw_reused_torch", "raw read, torch buffer already faulted in"),
            ("direct", "direct read, allocating the host buffer"),
            ("load_file", "safetensors.torch.load_file (mmap, lazy)"),
            ("load_file_touch", "load_file + one byte of every page read"),
            ("old_path", "load_file + copy into the host buffer"),
            ("raw", "raw read, allocating a bytearray"),
        ]:
            print(f"  {what:40s} {d[k + '_s'] * 1e3:8.1f} ms  {d[k + '_gb_s']:6.2f} GB/s")
        print(
            f"  direct read = {d['direct_vs_load_file']:.2f}x load_file, "
            f"{d['direct_vs_load_file_touch']:.2f}x load_file + touch, "
            f"{d['direct_vs_old_path']:.2f}x the old path, {d['direct_vs_raw']:.2f}x a raw read "
            "(speed ratios: above 1 is faster)"
        )
        print(
            "  into memory already faulted in: direct read = "
            f"{d['direct_reserved_vs_raw_reused']:.2f}x a raw read into a bytearray, "
            f"{d['direct_reserved_vs_raw_reused_torch']:.2f}x a raw read into a torch buffer"
        )
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    (out / f"swap-{r['device']}.json").write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
