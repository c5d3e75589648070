"""Training under memory pressure: memory flow against temporal sharing and the transfer/compute
bound, all measured in the same run (figures are ratios; machines are noisy).

K MLP jobs (Adam) whose combined training footprint is R times one device budget; each job alone
fits the budget, so temporal sharing can run too:

- **memory flow**: each job cut into sub-models of about a third of the budget; every job's steps
  are submitted at once and the executor interleaves their tasks (recompute included);
- **temporal sharing**: each job is one sub-model: its whole state is copied in, it takes a step,
  its state is copied out, one job step at a time with no prefetch (what a user does by hand);
- **resident**: plain PyTorch steps with every model and optimizer in place, nothing copied: the
  total compute, which is also "one job after another" where the jobs fit;
- **bound**: max(resident compute, bytes moved by memory flow / measured copy bandwidth).

On the CPU stand-in copies and compute share the machine's cores and memory bandwidth, so overlap
shows only as far as spare cores allow (use --threads 1 on a 2-core box: one core computes, one
copies); memory flow also pays one extra forward per sub-model (the recompute). The figures that
matter for GPUs come from the same script on a CUDA device (--device cuda:0).

    python scripts/bench_training.py [--configs 2x2,4x2,4x4] [--width 512] [--depth 6]
        [--batch 64] [--steps 4] [--repeats 2] [--threads 1] [--device cpu] [--out bench-out]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from flowmesh.build import build_seeded
from flowmesh.spec import ModelSpec
from gpu_worker.device import CpuStandIn, Device, open_device
from gpu_worker.train_job import TrainConfig, TrainingJob
from gpu_worker.training import TrainingExecutor, open_job

BIG = 1 << 40  # a chunk target no job reaches: the whole job is one sub-model


def spec(i: int, width: int, depth: int) -> ModelSpec:
    return ModelSpec(
        name=f"job{i}",
        factory="flowmesh.examples:mlp",
        kwargs={"width": width, "depth": depth, "in_features": width, "out_features": 10},
        seed=i,
    )


def config(i: int) -> TrainConfig:
    return TrainConfig({"name": "adam", "lr": 1e-3}, seed=i)


def jobs(k: int, args: argparse.Namespace, dev: Device, target: int) -> list[TrainingJob]:
    return [
        open_job(
            f"job{i}",
            spec(i, args.width, args.depth),
            config(i),
            dev,
            batch=args.batch,
            target_bytes=target,
        )
        for i in range(k)
    ]


def data(args: argparse.Namespace, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,)))
        for _ in range(k)
    ]


def sync(dev: Device) -> None:
    if dev.kind == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(dev: Device, nbytes: int) -> float:
    """Bytes/s of one host->device copy of `nbytes` (best of three), as the copy lane does it."""
    src = dev.host_buffer(nbytes)
    src.fill_(1)
    dst = dev.arena[:nbytes]
    best = float("inf")
    for _ in range(3):
        sync(dev)
        t = time.perf_counter()
        marker = dev.new_marker()
        dev.copy_in(dst, src, [], marker)
        marker.wait()
        sync(dev)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def run_flow(ex: TrainingExecutor, names: list[str], batches: list[Any], steps: int) -> float:
    t = time.perf_counter()
    futures = [ex.submit(n, *batches[i]) for _ in range(steps) for i, n in enumerate(names)]
    for f in futures:
        f.result(timeout=600)
    return time.perf_counter() - t


def run_turns(ex: TrainingExecutor, names: list[str], batches: list[Any], steps: int) -> float:
    t = time.perf_counter()
    for _ in range(steps):
        for i, n in enumerate(names):
            ex.step(n, *batches[i], timeout=600)
    return time.perf_counter() - t


def run_resident(k: int, args: argparse.Namespace, dev: Device, batches: list[Any]) -> float:
    device = dev.torch_device
    models = [build_seeded(spec(i, args.width, args.depth)).to(device).train() for i in range(k)]
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in models]
    on_dev = [(x.to(device), y.to(device)) for x, y in batches]

    def one_round() -> None:
        for m, opt, (x, y) in zip(models, opts, on_dev, strict=True):
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()

    one_round()  # warm-up: kernels, optimizer state
    sync(dev)
    t = time.perf_counter()
    for _ in range(args.steps):
        one_round()
    sync(dev)
    return time.perf_counter() - t


def bench(k: int, pressure: float, args: argparse.Namespace) -> dict[str, Any]:
    probe_dev = CpuStandIn(1)  # only to lay out a whole job and read its footprint
    whole = open_job(
        "probe",
        spec(0, args.width, args.depth),
        config(0),
        probe_dev,
        batch=args.batch,
        target_bytes=BIG,
    )
    footprint = whole.largest_task()
    budget = int(k * footprint / pressure) + 4096
    if budget < footprint:
        raise SystemExit(
            f"{k} jobs at {pressure}x: a job does not fit alone; use fewer x or more K"
        )
    dev = open_device(args.device, budget)
    batches = data(args, k)
    names = [f"job{i}" for i in range(k)]
    bandwidth = copy_bandwidth(dev, min(budget, 256 << 20))

    best: dict[str, float] = {}
    moved: dict[str, int] = {}
    parts = 0
    for _ in range(args.repeats):  # interleaved so that noise hits every figure alike
        for mode in ("flow", "turns"):
            target = budget // 3 if mode == "flow" else BIG
            ex = TrainingExecutor(dev, prefetch=1 if mode == "flow" else 0)
            try:
                js = jobs(k, args, dev, target)
                parts = js[0].parts if mode == "flow" else parts
                for j in js:
                    ex.open(j)
                for i, n in enumerate(names):  # warm-up step: optimizer state, kernels
                    ex.step(n, *batches[i], timeout=600)
                before = ex.counters["bytes_in"] + ex.counters["bytes_out"]
                run = run_flow if mode == "flow" else run_turns
                seconds = run(ex, names, batches, args.steps)
                assert ex.stats()["resident_peak"] <= budget
                moved[mode] = ex.counters["bytes_in"] + ex.counters["bytes_out"] - before
            finally:
                ex.close()
            best[mode] = min(best.get(mode, float("inf")), seconds)
        best["resident"] = min(
            best.get("resident", float("inf")), run_resident(k, args, dev, batches)
        )
    samples = k * args.steps * args.batch
    transfer_s = moved["flow"] / bandwidth
    bound_s = max(best["resident"], transfer_s)
    return {
        "jobs": k,
        "pressure": pressure,
        "device": dev.kind,
        "budget_bytes": budget,
        "job_footprint_bytes": footprint,
        "sub_models_per_job": parts,
        "steps": args.steps,
        "batch": args.batch,
        "seconds": best,
        "samples_per_s": {m: samples / s for m, s in best.items()},
        "bytes_moved": moved,
        "copy_gib_s": bandwidth / 2**30,
        "transfer_s": transfer_s,
        "bound_s": bound_s,
        "flow_vs_turns": best["turns"] / best["flow"],
        "flow_vs_bound": bound_s / best["flow"],
        "turns_vs_bound": bound_s / best["turns"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="2x2,4x2,4x4", help="K x pressure, comma-separated")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: keep)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for item in args.configs.split(","):
        k, pressure = item.lower().split("x")
        rows.append(bench(int(k), float(pressure), args))
    header = (
        f"{'K':>2} {'mem':>4} {'parts':>5} {'flow/s':>8} {'turns/s':>8} {'resid/s':>8} "
        f"{'flow/turns':>10} {'flow/bound':>10} {'turns/bound':>11} {'moved MiB':>9}"
    )
    print(f"device {rows[0]['device']}, torch threads {torch.get_num_threads()}, samples/s:")
    print(header)
    for r in rows:
        sps = r["samples_per_s"]
        print(
            f"{r['jobs']:>2} {r['pressure']:>3.0f}x {r['sub_models_per_job']:>5} "
            f"{sps['flow']:>8.0f} {sps['turns']:>8.0f} {sps['resident']:>8.0f} "
            f"{r['flow_vs_turns']:>10.2f} {r['flow_vs_bound']:>10.2f} {r['turns_vs_bound']:>11.2f} "
            f"{r['bytes_moved']['flow'] / 2**20:>9.0f}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "training.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"wrote {out / 'training.json'}")


if __name__ == "__main__":
    main()
