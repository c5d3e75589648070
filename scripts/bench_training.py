"""Training under memory pressure (issue 7 §5): memory flow against temporal sharing, the
transfer/compute bound and each job alone, all measured in the same run; and the largest batch a
job trains at under a budget. Figures are same-run ratios; machines are noisy.

**Throughput.** K MLP jobs (Adam), all of the same width or of widths spread 0.5x-1.5x, whose
combined training footprint (the arena bytes of each job as one whole task) is R times the
device budget. Samples/s of:

- **flow** (flowmesh memory flow): every job cut into sub-models under one chunk target (half
  the budget, what a worker uses unless a job asks otherwise; the whole budget where a block
  needs more), so sub-models of all jobs are of even size; every job's steps are submitted at
  once and the `TrainingExecutor` interleaves their tasks on one arena (each sub-model's
  forward graph kept or recomputed in the backward, as its activation policy chooses);
- **(a) turns** (temporal sharing): each job is one sub-model: its whole state is copied in, it
  takes a step, its state is copied out, one job step at a time with no prefetch (what a user
  does by hand today); only where every job fits the budget whole;
- **(b) bound**: max(total compute time, total bytes moved / copy bandwidth). Compute is the
  plain PyTorch time of (c); bytes are what memory flow moved (the executor's bytes_in +
  bytes_out: parameters, gradients, optimizer state, buffers; not the stashes, what a step's
  later tasks read, which on a GPU stay on the device while the resident room has space for
  them, `--train-resident-bytes`, else go to host memory and back: the table's "stashes" lines
  and the JSON's `stashes` say how much did which); the bandwidth is measured in the same run
  by replaying, host -> arena on the same device, the copies memory flow issued (their exact
  sizes, recorded on the copy lane);
- **(c) alone**: plain PyTorch, each job alone and whole on the device, all its steps, then the
  next job (nothing copied); a baseline only where every job fits the budget whole, and always
  the compute term of the bound.

Each figure is the best of `--repeats`, the modes interleaved; the same ratios are also given in
samples per process CPU second (every thread of the process: the work done, not the waiting),
which a shared CPU box disturbs less than wall time.

**Largest batch.** For the MLP, tiny GPT and small ResNet: the budget is what the whole model
needs to train at `--ref-batch` (parameters, gradients, Adam state and activations: the arena
bytes of its whole-job task). A binary search on the batch finds the largest batch the model
trains at alone, whole, in that budget (whole-job task <= budget) and the largest under flowmesh
(`open_job` cuts it with the budget as chunk target and refuses when one block's footprint at
that batch exceeds it), and with half the budget as chunk target (two tasks in memory at once,
so the next task's copy can run under the current compute). Both ends are then trained for one
step through the executor on an arena of exactly the budget (resident peak checked).

What the CPU stand-in cannot show: copies and compute share the machine's cores and memory
bandwidth, so a copy "under" a compute slows it down instead of hiding behind it, and the
measured copy bandwidth (taken while nothing else runs) is more than the copy lane gets during a
run: the bound is optimistic there, and flow pays for its recompute with nothing to gain from
overlap (use --threads 1 on a 2-core box: one core computes, one copies). On a GPU copies run on
the copy engine beside the SMs; the same script takes `--device cuda:0` (pinned host tier,
copies on the training copy lane's stream) and prints which device the figures come from; there
the CPU-second ratios mean little (host time only).

    python scripts/bench_training.py [--configs 2x2,2x4,4x2,4x4,8x2,8x4] [--sizes same,mixed]
        [--width 512] [--depth 6] [--batch 64] [--steps 4] [--repeats 3] [--threads 1]
        [--batch-models mlp,tiny_gpt,small_resnet] [--ref-batch 32] [--device cpu]
        [--out bench-out]

On a GPU, give the jobs some size, e.g. `--device cuda:0 --width 4096 --depth 8 --batch 256
--threads 0`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from flowmesh.errors import FlowmeshError
from flowmesh.modelio.build import build_seeded
from flowmesh.spec import ModelSpec
from flowmesh.units import parse_size
from gpu_worker.activation_keep import KEEP, NO_POLICY, SELECTIVE
from gpu_worker.device import CpuStandIn, Device, open_device
from gpu_worker.train_config import TrainConfig
from gpu_worker.train_executor import TrainingExecutor, open_job
from gpu_worker.train_job import TrainingJob

BIG = 1 << 50  # a chunk target no job reaches: the whole job is one sub-model
MIB = 1 << 20
PROBE = CpuStandIn(1)  # lays jobs out to read their footprints; never runs anything


# ----------------------------------------------------------------------------- jobs and data


def mlp_spec(i: int, width: int, depth: int) -> ModelSpec:
    return ModelSpec(
        name=f"job{i}",
        factory="flowmesh.examples:mlp",
        kwargs={"width": width, "depth": depth, "in_features": width, "out_features": 10},
        seed=i,
    )


# The jobs' activation policy (`--activations`): "auto" chooses per sub-model by measured cost.
POLICY = {"activations": "auto"}


def config(i: int) -> TrainConfig:
    return TrainConfig({"name": "adam", "lr": 1e-3}, seed=i, activations=POLICY["activations"])


def widths(k: int, width: int, sizes: str) -> list[int]:
    """Same: every job `width`; mixed: spread evenly over 0.5x-1.5x (multiples of 32)."""
    if sizes == "same" or k == 1:
        return [width] * k
    return [max(32, round(width * (0.5 + i / (k - 1)) / 32) * 32) for i in range(k)]


Batch = tuple[torch.Tensor, torch.Tensor]


def data(ws: list[int], batch: int, steps: int) -> list[list[Batch]]:
    """Per job, a batch of random inputs and labels for each of its `steps` timed steps and one
    for its warm-up step, the same in every mode. A fresh batch each step, as in real training:
    a job that steps on one batch again and again fits it within a few steps, and its
    gradients then underflow into subnormal floats, which a CPU computes with many times
    slower (BENCHMARKS.md, "subnormal floats")."""
    g = torch.Generator().manual_seed(0)
    return [
        [
            (torch.randn(batch, w, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(steps + 1)
        ]
        for w in ws
    ]


def sync(dev: Device) -> None:
    if dev.kind == "cuda":
        torch.cuda.synchronize()


def release() -> None:
    """Free dropped jobs and devices now (executors and jobs hold reference cycles): host
    tiers and arenas of one configuration must not pile up under the next."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def device_name(dev: Device) -> str:
    if dev.kind == "cuda":
        return f"{dev.name} ({torch.cuda.get_device_name(dev.torch_device)})"
    return f"cpu stand-in ({platform.machine()}, {os.cpu_count()} cores)"


class CopyLog:
    """Records the size of every host->arena copy the executor's copy lane issues."""

    def __init__(self, dev: Device) -> None:
        self.dev = dev
        self.sizes: list[int] = []
        self.lane: dict[str, Any] = {}  # the copy lane's arguments past the marker, to replay

    def __enter__(self) -> CopyLog:
        copy_in = self.dev.copy_in

        def logged(dst: torch.Tensor, src: torch.Tensor, *rest: Any, **kw: Any) -> None:
            self.sizes.append(src.numel() * src.element_size())
            self.lane = {"lane": rest[2]} if len(rest) > 2 else dict(kw)
            copy_in(dst, src, *rest, **kw)

        self.dev.copy_in = logged  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.dev.copy_in  # the class's method again


def copy_bandwidth(dev: Device, sizes: list[int], lane: dict[str, Any], repeats: int = 3) -> float:
    """Bytes/s of the copies `sizes`, replayed host -> arena as the copy lane does them (from
    the device's host buffers: pinned on CUDA), best of `repeats`."""
    src = dev.host_buffer(max(sizes))
    src.fill_(1)
    arena = dev.arena
    best = float("inf")
    for _ in range(repeats):
        sync(dev)
        t = time.perf_counter()
        for s in sizes:
            dev.copy_in(arena[:s], src[:s], [], dev.new_marker(), **lane)
        sync(dev)
        best = min(best, time.perf_counter() - t)
    return sum(sizes) / best


# ----------------------------------------------------------------------------- throughput


def run_flow(
    ex: TrainingExecutor, names: list[str], batches: list[list[Batch]], steps: int
) -> float:
    t = time.perf_counter()
    futures = [
        ex.submit(n, *batches[i][1 + s]) for s in range(steps) for i, n in enumerate(names)
    ]
    for f in futures:
        f.result(timeout=1200)
    return time.perf_counter() - t


def run_turns(
    ex: TrainingExecutor, names: list[str], batches: list[list[Batch]], steps: int
) -> float:
    t = time.perf_counter()
    for s in range(steps):
        for i, n in enumerate(names):
            ex.step(n, *batches[i][1 + s], timeout=1200)
    return time.perf_counter() - t


def run_alone(
    ws: list[int], depth: int, dev: Device, batches: list[list[Batch]], steps: int
) -> tuple[float, float]:
    """Plain PyTorch: each job alone and whole on the device, its steps back to back, then the
    next job. Returns the summed wall and process CPU seconds of the timed steps (each job
    warmed up by one step)."""
    device = dev.torch_device
    total = cpu = 0.0
    for i, (w, job_batches) in enumerate(zip(ws, batches, strict=True)):
        model = build_seeded(mlp_spec(i, w, depth)).to(device).train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        on_device = [(x.to(device), y.to(device)) for x, y in job_batches]

        def step(x: Any, y: Any, model: torch.nn.Module = model, opt: Any = opt) -> None:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

        step(*on_device[0])  # warm-up: kernels, optimizer state
        sync(dev)
        t, c = time.perf_counter(), time.process_time()
        for s in range(steps):
            step(*on_device[1 + s])
        sync(dev)
        total += time.perf_counter() - t
        cpu += time.process_time() - c
        del model, opt
    return total, cpu


def make_jobs(
    ws: list[int], args: argparse.Namespace, dev: Device, target: int
) -> list[TrainingJob]:
    return [
        open_job(
            f"job{i}",
            mlp_spec(i, w, args.depth),
            config(i),
            dev,
            batch=args.batch,
            target_bytes=target,
        )
        for i, w in enumerate(ws)
    ]


def flow_target(ws: list[int], args: argparse.Namespace, budget: int) -> int:
    """The chunk target of memory flow: half the budget, as a worker opens a job by default
    (`gpu_worker.core`: half its training bytes, so that one task computes while the next one
    copies in), else the whole budget where a block needs more."""
    for target in (budget // 2, budget):
        try:
            js = make_jobs(ws, args, PROBE, target)
        except FlowmeshError:
            continue
        if max(j.largest_task() for j in js) <= budget:
            return target
    raise SystemExit(f"widths {ws}: a block does not fit a budget of {budget / MIB:.1f} MiB")


def bench(k: int, pressure: float, sizes: str, args: argparse.Namespace) -> dict[str, Any]:
    ws = widths(k, args.width, sizes)
    whole = [j.largest_task() for j in make_jobs(ws, args, PROBE, BIG)]
    total = sum(whole)
    budget = int(total / pressure) + 4096
    fits = max(whole) <= budget
    target = flow_target(ws, args, budget)
    release()  # the probe layouts
    # The host tier holds every job's state once (jobs of one mode are dropped before the next
    # mode's are made), plus the replayed copies' source; CPU: plain memory, this is ignored.
    host_tier = int(1.5 * total) + 2 * budget + (64 << 20)
    dev = open_device(
        args.device, budget, host_tier_bytes=host_tier, resident_bytes=args.train_resident_bytes
    )
    batches = data(ws, args.batch, args.steps)
    names = [f"job{i}" for i in range(k)]

    best: dict[str, float] = {}
    cpu: dict[str, float] = {}  # process CPU seconds (all threads): the work, not the wait
    moved: dict[str, dict[str, int]] = {}
    parts: list[int] = []
    policies: list[list[str]] = []  # per flow job, each sub-model's (its last step's)
    task_compute_s = 0.0
    copies: list[int] = []
    lane: dict[str, Any] = {}
    modes = ["flow", "turns"] if fits else ["flow"]
    for _ in range(args.repeats):  # interleaved so that noise hits every figure alike
        for mode in modes:
            flow = mode == "flow"
            ex = TrainingExecutor(dev, prefetch=1 if flow else 0)
            try:
                js = make_jobs(ws, args, dev, target if flow else BIG)
                if flow:
                    parts = [j.parts for j in js]
                for j in js:
                    ex.open(j)
                for i, n in enumerate(names):  # warm-up step: optimizer state, kernels
                    ex.step(n, *batches[i][0], timeout=1200)
                before = {key: ex.counters[key] for key in ("bytes_in", "bytes_out", "compute_s")}
                c = time.process_time()
                if flow:
                    with CopyLog(dev) as log:
                        seconds = run_flow(ex, names, batches, args.steps)
                    copies, lane = log.sizes, log.lane
                    policies = [[j.activation_policy(i) for i in range(j.parts)] for j in js]
                else:
                    seconds = run_turns(ex, names, batches, args.steps)
                cpu[mode] = min(cpu.get(mode, float("inf")), time.process_time() - c)
                assert ex.stats()["resident_peak"] <= budget, "resident bytes over the budget"
                moved[mode] = {
                    key: int(ex.counters[key] - before[key]) for key in ("bytes_in", "bytes_out")
                }
                if flow and seconds < best.get("flow", float("inf")):
                    task_compute_s = ex.counters["compute_s"] - before["compute_s"]
            finally:
                ex.close()
                js, j = [], None  # no job of this mode may outlive it (host tier)
                del ex
                release()
            best[mode] = min(best.get(mode, float("inf")), seconds)
        alone, alone_cpu = run_alone(ws, args.depth, dev, batches, args.steps)
        best["alone"] = min(best.get("alone", float("inf")), alone)
        cpu["alone"] = min(cpu.get("alone", float("inf")), alone_cpu)

    bandwidth = copy_bandwidth(dev, copies, lane)
    bytes_flow = moved["flow"]["bytes_in"] + moved["flow"]["bytes_out"]
    transfer_s = bytes_flow / bandwidth
    bound_s = max(best["alone"], transfer_s)
    samples = k * args.steps * args.batch
    sps = {m: samples / s for m, s in best.items()}
    sps["bound"] = samples / bound_s
    row = {
        "jobs": k,
        "sizes": sizes,
        "widths": ws,
        "pressure": pressure,
        "device": device_name(dev),
        "budget_bytes": budget,
        "job_footprint_bytes": whole,
        "fits_whole": fits,
        "chunk_target_bytes": target,
        "sub_models_per_job": parts,
        "activation_policies": policies,
        "steps": args.steps,
        "batch": args.batch,
        "seconds": best,
        "samples_per_s": sps,
        "bytes_moved": moved,
        "copies_replayed": len(copies),
        "copy_bytes_replayed": sum(copies),
        "copy_gib_s": bandwidth / 2**30,
        "compute_s": best["alone"],
        "flow_task_compute_s": task_compute_s,
        "transfer_s": transfer_s,
        "bound_s": bound_s,
        "bound_term": "compute" if best["alone"] >= transfer_s else "transfer",
        "flow_vs_turns": best["turns"] / best["flow"] if fits else None,
        "flow_vs_bound": bound_s / best["flow"],
        "flow_vs_alone": best["alone"] / best["flow"] if fits else None,
        "turns_vs_bound": bound_s / best["turns"] if fits else None,
        "cpu_seconds": cpu,
        "cpu_flow_vs_turns": cpu["turns"] / cpu["flow"] if fits else None,
        "cpu_flow_vs_alone": cpu["alone"] / cpu["flow"],
        # Flow's stashes (taking turns keeps none): on the device beside the arena, and to the
        # host tier, all repeats told (a GPU's; none on the CPU stand-in, where they stay put).
        "stashes": dev.resident_room.stats() if dev.resident_room else None,
    }
    del dev
    release()
    return row


def kept(policies: list[list[str]]) -> str:
    """How many sub-models of the jobs keep their forward's graph (all of it, or selectively),
    of those that choose."""
    chose = [p for job in policies for p in job if p != NO_POLICY]
    return f"{sum(p in (KEEP, SELECTIVE) for p in chose)}/{len(chose)}"


# ----------------------------------------------------------------------------- largest batch


def batch_models(
    args: argparse.Namespace,
) -> dict[str, tuple[ModelSpec, int, Callable[[int], Any]]]:
    """name -> (spec, seq_len, batch of that size: (inputs, targets))."""
    g = torch.Generator().manual_seed(0)
    seq = 64
    return {
        "mlp": (
            ModelSpec(
                name="mlp",
                factory="flowmesh.examples:mlp",
                kwargs={"width": args.width, "depth": args.depth, "out_features": 10},
                seed=0,
            ),
            1,
            lambda b: (torch.randn(b, args.width, generator=g), torch.randint(0, 10, (b,))),
        ),
        "tiny_gpt": (
            ModelSpec(
                name="tiny_gpt",
                factory="flowmesh.examples:tiny_gpt",
                kwargs={"vocab": 512, "d_model": 128, "n_layers": 4, "max_len": seq},
                seed=0,
            ),
            seq,
            lambda b: (
                torch.randint(0, 512, (b, seq), generator=g),
                torch.randint(0, 512, (b, seq), generator=g),
            ),
        ),
        "small_resnet": (
            ModelSpec(name="small_resnet", factory="flowmesh.examples:small_resnet", seed=0),
            1,
            lambda b: (torch.randn(b, 3, 32, 32, generator=g), torch.randint(0, 10, (b,))),
        ),
    }


def task_bytes(spec: ModelSpec, seq: int, batch: int, target: int) -> int | None:
    """The arena bytes of the job's largest task at `batch` cut under `target`; None where
    `open_job` refuses (a block's footprint at that batch is over the target)."""
    try:
        job = open_job(
            "probe", spec, config(0), PROBE, batch=batch, target_bytes=target, seq_len=seq
        )
    except FlowmeshError:
        return None
    return job.largest_task()


def largest_batch(fits: Callable[[int], bool], cap: int = 1 << 20) -> int:
    """The largest batch b with fits(b) (0 if none), assuming fits is monotone."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    if hi > cap:
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def train_once(
    dev: Device, spec: ModelSpec, seq: int, batch: int, target: int, make: Callable[[int], Any]
) -> tuple[int, int, float]:
    """One step through the executor on `dev`: (sub-models, resident peak, loss)."""
    job = open_job("check", spec, config(0), dev, batch=batch, target_bytes=target, seq_len=seq)
    with TrainingExecutor(dev, prefetch=1) as ex:
        ex.open(job)  # refuses a task over the arena
        loss = ex.step("check", *make(batch), timeout=1200).loss
        peak = ex.stats()["resident_peak"]
    assert peak <= dev.budget_bytes, "resident bytes over the budget"
    return job.parts, peak, loss


def bench_batch(name: str, args: argparse.Namespace) -> dict[str, Any]:
    spec, seq, make = batch_models(args)[name]
    budget = task_bytes(spec, seq, args.ref_batch, BIG)
    assert budget is not None

    def under(target: int) -> Callable[[int], bool]:
        def fits(b: int) -> bool:
            need = task_bytes(spec, seq, b, target)
            return need is not None and need <= budget

        return fits

    t = time.perf_counter()
    whole = largest_batch(under(BIG))
    flow = largest_batch(under(budget))
    flow_half = largest_batch(under(budget // 2))
    search_s = time.perf_counter() - t
    state = task_bytes(spec, seq, 1, BIG)
    row: dict[str, Any] = {
        "model": name,
        "seq_len": seq,
        "budget_bytes": budget,
        "ref_batch": args.ref_batch,
        "state_bytes_at_batch_1": state,
        "whole_batch": whole,
        "flow_batch": flow,
        "flow_batch_half_target": flow_half,
        "flow_vs_whole": flow / whole if whole else None,
        "flow_half_vs_whole": flow_half / whole if whole else None,
        "search_s": search_s,
    }
    if args.batch_check:
        dev = open_device(args.device, budget, host_tier_bytes=4 * budget + (64 << 20))
        row["checked_on"] = device_name(dev)
        for key, batch, target in (("whole", whole, BIG), ("flow", flow, budget)):
            parts, peak, loss = train_once(dev, spec, seq, batch, target, make)
            row[f"{key}_check"] = {"sub_models": parts, "resident_peak": peak, "loss": loss}
        del dev
        release()
    return row


# ----------------------------------------------------------------------------- report


def fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--configs", default="2x2,2x4,4x2,4x4,8x2,8x4", help="K x pressure, comma-separated"
    )
    ap.add_argument("--sizes", default="same,mixed", help="same and/or mixed (widths 0.5x-1.5x)")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: keep)")
    ap.add_argument("--batch-models", default="mlp,tiny_gpt,small_resnet", help="'' to skip")
    ap.add_argument(
        "--ref-batch", type=int, default=32, help="the whole model fits the budget at this batch"
    )
    ap.add_argument(
        "--no-batch-check",
        dest="batch_check",
        action="store_false",
        help="skip training one step at each found batch",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--activations",
        default="auto",
        help="auto | recompute | keep | selective: the jobs' policy",
    )
    ap.add_argument(
        "--train-resident-bytes",
        type=parse_size,
        default=None,
        help="CUDA: device bytes beside the arena flow's stashes may stay in (the worker's "
        "--train-resident-bytes; default as a worker's, 0: every stash to the host tier)",
    )
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    POLICY["activations"] = args.activations
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: CUDA is not available on this machine")
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    load = [os.getloadavg()[0]]

    rows = []
    for sizes in [s for s in args.sizes.split(",") if s]:
        if sizes not in ("same", "mixed"):
            raise SystemExit(f"--sizes: {sizes!r} is neither same nor mixed")
        for item in [c for c in args.configs.split(",") if c]:
            k, pressure = item.lower().split("x")
            rows.append(bench(int(k), float(pressure), sizes, args))
            print(f"  {item} {sizes}: done ({time.perf_counter() - t0:.0f} s)", flush=True)
    batch_rows = []
    for name in [m for m in args.batch_models.split(",") if m]:
        batch_rows.append(bench_batch(name, args))
        print(f"  largest batch, {name}: done ({time.perf_counter() - t0:.0f} s)", flush=True)

    load.append(os.getloadavg()[0])
    where = rows[0]["device"] if rows else batch_rows[0].get("checked_on", args.device)
    print(
        f"\nfigures from device {where}; torch threads {torch.get_num_threads()}; "
        f"1-min load average {load[0]:.1f} at start, {load[1]:.1f} at end"
    )
    if rows:
        print(
            f"throughput: MLP jobs width {args.width} (mixed: 0.5x-1.5x), depth {args.depth}, "
            f"Adam, batch {args.batch}, {args.steps} timed steps per job, best of {args.repeats}; "
            "samples/s"
        )
        print(
            f"{'K':>2} {'sizes':>5} {'mem':>4} {'parts':>7} {'flow':>7} {'turns':>7} "
            f"{'alone':>7} {'bound':>7} {'bnd by':>8} {'fl/turns':>8} {'fl/bound':>8} "
            f"{'fl/alone':>8} {'cpu fl/t':>8} {'cpu fl/a':>8} {'moved MiB':>9} {'copy GiB/s':>10} "
            f"{'kept':>5}"
        )
        for r in rows:
            sps = r["samples_per_s"]
            p = r["sub_models_per_job"]
            parts = f"{min(p)}-{max(p)}" if min(p) != max(p) else str(p[0])
            mb = sum(r["bytes_moved"]["flow"].values()) / MIB
            print(
                f"{r['jobs']:>2} {r['sizes']:>5} {r['pressure']:>3.0f}x {parts:>7} "
                f"{sps['flow']:>7.0f} {fmt(sps.get('turns'), '7.0f'):>7} "
                f"{sps['alone']:>7.0f} {sps['bound']:>7.0f} {r['bound_term']:>8} "
                f"{fmt(r['flow_vs_turns'], '.2f'):>8} {r['flow_vs_bound']:>8.2f} "
                f"{fmt(r['flow_vs_alone'], '.2f'):>8} {fmt(r['cpu_flow_vs_turns'], '.2f'):>8} "
                f"{r['cpu_flow_vs_alone']:>8.2f} {mb:>9.0f} "
                f"{r['copy_gib_s']:>10.2f} {kept(r['activation_policies']):>5}"
            )
        print(
            "turns and fl/alone are n/a where a job does not fit the budget whole; 'alone' is "
            "still the compute term of the bound there. cpu fl/t, cpu fl/a: the same ratios in "
            "samples per process CPU second (all threads: the work done, not the waiting), "
            "steadier than wall time on a shared CPU box. kept: the sub-models whose forward's "
            "graph memory flow kept for the backward, whole or selectively (the rest recompute "
            "it), over those with "
            "a choice (a job's last sub-model runs both in one task); each sub-model's policy "
            "is in the JSON (activation_policies)"
        )
        for r in rows:
            st = r["stashes"]
            if st is not None:  # a device whose stashes move (CUDA)
                print(
                    f"stashes, {r['jobs']} jobs {r['sizes']} {r['pressure']:.0f}x: "
                    f"{st['stash_device_kept_bytes'] / MIB:.0f} MiB stayed on the device (at "
                    f"most {st['stash_device_peak'] / MIB:.0f} of "
                    f"{st['stash_device_limit'] / MIB:.0f} MiB at once), "
                    f"{st['stash_host_bytes'] / MIB:.0f} MiB went to the host tier"
                )
    if batch_rows:
        print(
            f"\nlargest batch under a budget (the whole model's footprint at batch "
            f"{args.ref_batch}):"
        )
        print(
            f"{'model':>13} {'budget MiB':>10} {'whole':>6} {'flow':>7} {'flow/whole':>10} "
            f"{'flow@1/2':>8} {'@1/2/whole':>10}"
        )
        for b in batch_rows:
            print(
                f"{b['model']:>13} {b['budget_bytes'] / MIB:>10.1f} {b['whole_batch']:>6} "
                f"{b['flow_batch']:>7} {fmt(b['flow_vs_whole'], '.1f'):>10} "
                f"{b['flow_batch_half_target']:>8} {fmt(b['flow_half_vs_whole'], '.1f'):>10}"
            )
    if args.device == "cpu":
        print(
            "\nCPU stand-in: copies and compute share the cores and memory bandwidth, so nothing "
            "overlaps and the bound (bandwidth measured with the machine otherwise idle) is "
            "optimistic; run with --device cuda:0 for the figures that matter."
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "training.json").write_text(
        json.dumps(
            {
                "args": vars(args),
                "load_average": load,
                "rows": rows,
                "largest_batch": batch_rows,
                "seconds": time.perf_counter() - t0,
            },
            indent=1,
        )
    )
    print(f"wrote {out / 'training.json'} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
