"""The main job: an embedded mesh serving a catalogue larger than all device memory, generating
text with a language model, and training several models at the same time.

Starts broker, partitioner and CPU stand-in workers (or GPUs when present), deploys example
models whose total size is several times the combined budget — one of them larger than any single
device, so it runs as pipeline stages on two workers — then sends skewed (Zipf), bursty traffic
from concurrent clients twice: alone, then beside training (below), and prints per model both
runs' latencies side by side, so that what training costs serving (inference comes first) shows.
Every output of both runs is checked against a direct torch forward of the same model once the
traffic is over, so that no reference computation takes a core from the mesh while it serves.

With the second run's traffic it opens three training jobs (two MLPs, AdamW and SGD with
momentum, and a small GPT, AdamW) whose footprints add up to more than a worker's training
bytes, so a worker runs them by memory flow, sub-model by sub-model. All three learn next-byte
prediction on the source code of a few standard-library modules (`inspect.getsource`): real
text, on every machine with Python, no download, and the same bytes on each run of one Python.
Every job's steps are sent at once from one async client; afterwards (with the serving checks)
the demo trains the same models in a plain PyTorch loop on the same seeds and batches, and
compares the per-step losses (`flowmesh.testing.compare`).

Alongside both, a small hyper-parameter sweep (`AsyncClient.sweep`: Optuna ask-and-tell with its
successive-halving pruner) tunes an MLP's learning rate and width on the same kind of real text
(next-byte prediction on standard-library source): its trials are training jobs on the same
workers, a pruned trial's job closes at once; the demo prints the sweep's table and saves
`trials.json` and `curves.png` (every trial's loss curve) in `demo-sweep/` of the working
directory.

Then a language model deployed from a Hugging Face directory in two pipeline stages generates
for concurrent calls (a batch, single prompts, a chat, a stream), its tokens checked against
Hugging Face's own `generate` (`client_sdk.demo_generation`).

When anything fails (a wrong output, a job that failed, timed out or differs from PyTorch), the
mesh's logs, one per process, are kept and their directory printed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from client_sdk import demo_generation
from client_sdk.client import AsyncClient
from client_sdk.demo_options import add_options
from client_sdk.errors import Timeout
from client_sdk.jobs import StepResult
from client_sdk.loadgen import Tally, arrival_times, run_trace, zipf_choices
from client_sdk.mesh import LocalMesh
from client_sdk.sweep import SweepResult
from client_sdk.train_data import next_byte_rows, stdlib_corpus
from client_sdk.views import table
from flowmesh.modelio.build import build_seeded
from flowmesh.reference import train
from flowmesh.reports import BrokerStatus, ModelRow
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


# Training: each worker's training bytes (besides its serving budget), the jobs, and their data.
TRAIN_BYTES = "12MiB"
CONTEXT = 32  # bytes of context per example: an MLP's input width, the GPT's sequence length
TRAIN_BATCH = 16
TRAIN_STEPS = 60
CORPUS_MODULES = ("textwrap", "heapq", "bisect", "fnmatch", "shlex", "difflib")
# name, factory, kwargs, optimizer. Opened in this order: each goes to the worker with the most
# free training bytes, so the first (over 12 MiB) has one worker, the other two share the other.
TRAIN_JOBS: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    (
        "mlp-wide",
        "flowmesh.examples:mlp",
        {"width": 512, "depth": 4, "in_features": CONTEXT, "out_features": 256},
        {"name": "adamw", "lr": 1e-3, "weight_decay": 0.01},
    ),
    (
        "gpt-bytes",
        "flowmesh.examples:tiny_gpt",
        {"vocab": 256, "d_model": 128, "n_layers": 4, "n_heads": 4, "max_len": CONTEXT},
        {"name": "adamw", "lr": 3e-3},
    ),
    (
        "mlp-narrow",
        "flowmesh.examples:mlp",
        {"width": 384, "depth": 4, "in_features": CONTEXT, "out_features": 256},
        {"name": "sgd", "lr": 0.1, "momentum": 0.9},
    ),
]
Batches = list[tuple[torch.Tensor, torch.Tensor]]

# The sweep: an MLP reading CONTEXT bytes predicts the next one; Optuna picks lr and width,
# successive halving (every SWEEP_EVAL_EVERY steps a held-out evaluation, reported to the
# pruner) stops the worse trials early.
SWEEP_NAME = "demo-sweep"
SWEEP_TRIALS = 6
SWEEP_STEPS = 12
SWEEP_EVAL_EVERY = 3
SWEEP_SAMPLES = 640  # windows drawn from the corpus; the last fifth is held out
SWEEP_SPACE: dict[str, dict[str, Any]] = {
    "lr": {"type": "float", "low": 1e-4, "high": 0.3, "log": True},
    "width": {"type": "int", "low": 32, "high": 128, "step": 32},
}
SWEEP_KWARGS = {"depth": 2, "in_features": CONTEXT, "out_features": 256}

# Where the generation part writes its language model's directory (under the working directory,
# which the mesh's processes read from).
LM_DIR = "demo-lm"


def corpus() -> torch.Tensor:
    """The bytes of a few standard-library modules' source: real text, offline, deterministic."""
    return stdlib_corpus(CORPUS_MODULES)


async def run_sweep(
    address: str,
    text: torch.Tensor,
    out_dir: Path,
    *,
    trials: int = SWEEP_TRIALS,
    steps: int = SWEEP_STEPS,
    eval_every: int = SWEEP_EVAL_EVERY,
    seed: int = 0,
) -> SweepResult:
    """The demo's sweep (see the module docstring); trials.json and curves.png go to out_dir."""
    data = next_byte_rows(text, CONTEXT, SWEEP_SAMPLES, seed + 300, "stdlib source")
    async with AsyncClient(address, timeout=300.0) as client:
        return await client.sweep(
            name=SWEEP_NAME,
            factory="flowmesh.examples:mlp",
            space=SWEEP_SPACE,
            data=data,
            trials=trials,
            steps=steps,
            eval_every=eval_every,
            pruner="successive_halving",
            reduction_factor=2,
            concurrency=2,
            kwargs=SWEEP_KWARGS,
            optimizer={"name": "adamw", "lr": 1e-3},
            loss="cross_entropy",
            batch=TRAIN_BATCH,
            seed=seed,
            out_dir=out_dir,
            show=False,  # the demo prints its table at the end, not a live one among its own
            timeout=300.0,
        )


async def sweep_after(opened: asyncio.Event, sweep: Awaitable[SweepResult]) -> SweepResult:
    """The sweep, started once the training jobs are open, so that the jobs the demo checks
    against plain PyTorch get their workers first. (Opening a job while others train is safe:
    building and tracing a model and computing a task exclude each other on a worker, see
    MODEL_CODE_LOCK in gpu_worker.model_code.)"""
    await opened.wait()
    return await sweep


def pruner_consulted(result: SweepResult, steps: int = SWEEP_STEPS) -> int:
    """Evaluations reported to the pruner before a trial's last step: each one was a
    `should_prune` decision."""
    return sum(1 for t in result.trials for step, _ in t.evals if step < steps)


def report_sweep(result: SweepResult, steps: int = SWEEP_STEPS) -> int:
    states = [t.state for t in result.trials]
    counts = ", ".join(f"{states.count(s)} {s.lower()}" for s in sorted(set(states)))
    print(
        f"\nsweep {result.name} ({len(states)} trials: {counts}; successive halving consulted "
        f"at {pruner_consulted(result, steps)} evaluations), next-byte prediction on stdlib "
        "source, alongside the serving and the training jobs above:"
    )
    print(result.table())
    best = result.best
    if best is not None:
        params = ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in best.params.items()
        )
        print(f"best: trial {best.number}, held-out loss {best.value:.4f} ({params})")
    print(f"saved {result.json_path} and {result.png_path}")
    failed = states.count("FAIL")
    if best is None or failed:
        reasons = "; ".join(t.reason for t in result.trials if t.state == "FAIL")[:300]
        print(f"FAILED: the sweep completed no trial or had {failed} failed trials ({reasons})")
        return 1
    print("OK: the sweep ran its trials through the mesh and saved its table and plot")
    return 0


def train_batches(
    spec: ModelSpec, text: torch.Tensor, seed: int, steps: int = TRAIN_STEPS
) -> Batches:
    """Next-byte prediction. The GPT reads CONTEXT bytes and predicts each one's successor; an
    MLP reads CONTEXT bytes as numbers in [-1, 3) and predicts the byte after them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(text) - CONTEXT - 1, (TRAIN_BATCH,), generator=g)
        windows = torch.stack([text[i : i + CONTEXT + 1] for i in starts.tolist()])
        if spec.factory.endswith("tiny_gpt"):
            out.append((windows[:, :-1].contiguous(), windows[:, 1:].contiguous()))
        else:
            out.append((windows[:, :-1].float() / 64 - 1, windows[:, -1].contiguous()))
    return out


def plain_losses(spec: ModelSpec, optimizer: dict[str, Any], batches: Batches) -> list[float]:
    """What a PyTorch user writes: the same model, seed, optimizer and batches, in this process."""
    return train(build_seeded(spec), optimizer, batches)


@dataclass
class Trained:
    """What a training job reported: where it ran, its losses, and how fast its steps came."""

    worker: str
    sub_models: int
    footprint: int
    losses: list[float]
    steps: list[int]
    seconds: float
    errors: list[str] = field(default_factory=list)
    timed_out: int = 0  # steps with no answer in time (among `errors`)
    # Its last step's activation policy per sub-model ("auto" measures each, then takes the
    # cheapest: gpu_worker/activation_keep.py).
    activations: list[str] = field(default_factory=list)


async def train_all(
    address: str,
    specs: dict[str, ModelSpec],
    optimizers: dict[str, Any],
    data: dict[str, Batches],
    opened: asyncio.Event | None = None,
) -> dict[str, Trained]:
    """Open the jobs (then set `opened`), send every step at once, close them."""
    async with AsyncClient(address, timeout=300.0) as client:
        jobs = {}
        for name, s in specs.items():  # one at a time: placement sees the footprints so far
            jobs[name] = await client.train_open(
                name,
                s.factory,
                kwargs=s.kwargs,
                seed=s.seed,
                optimizer=optimizers[name],
                loss="cross_entropy",
                batch_size=TRAIN_BATCH,
            )
        if opened is not None:
            opened.set()

        async def run(name: str) -> Trained:
            job = jobs[name]
            t0 = time.perf_counter()
            # Every step in flight at once: the broker and the worker keep them in order.
            steps = [asyncio.ensure_future(job.step_async(x, y)) for x, y in data[name]]
            done = await asyncio.gather(*steps, return_exceptions=True)
            seconds = time.perf_counter() - t0
            await job.close()
            results = [r for r in done if isinstance(r, StepResult)]
            errors = [f"{type(r).__name__}: {r}" for r in done if isinstance(r, BaseException)]
            timed_out = sum(isinstance(r, (Timeout, TimeoutError)) for r in done)
            return Trained(
                worker=job.info.worker,
                sub_models=len(job.info.sub_models),
                footprint=job.info.footprint,
                losses=[r.loss for r in results],
                steps=[r.step for r in results],
                seconds=seconds,
                errors=errors,
                timed_out=timed_out,
                activations=results[-1].activations if results else [],
            )

        done = await asyncio.gather(*(run(n) for n in jobs))
    return dict(zip(jobs, done, strict=True))


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


Answer = tuple[str, torch.Tensor, torch.Tensor]  # model, input, output


@dataclass
class Served:
    """One replay of the trace: a tally per model, the wall time, and every answer with its
    input, kept to be checked once the traffic is over (no reference forward takes a core
    from the mesh while it serves)."""

    tallies: dict[str, Tally]
    wall: float
    answers: list[Answer]

    def overall(self) -> dict[str, Any]:
        """Answers, mean and p99 latency over every model."""
        return Tally([ms for t in self.tallies.values() for ms in t.latencies_ms]).row()


async def serve(
    address: str,
    trace: list[tuple[float, str]],
    specs: dict[str, ModelSpec],
    seed: int,
    clients: int,
) -> Served:
    """Replay `trace` (open loop, from `clients` connections), keeping every answer."""
    rng = random.Random(seed)
    answers: list[Answer] = []
    tallies, wall = await run_trace(
        address,
        trace,
        lambda m: make_input(specs[m], rng),
        clients=clients,
        timeout=120.0,
        check=lambda m, x, y: answers.append((m, x, y)),
    )
    return Served(tallies, wall, answers)


def references(
    specs: dict[str, ModelSpec],
    answers: list[Answer],
    train_specs: dict[str, ModelSpec],
    optimizers: dict[str, Any],
    data: dict[str, Batches],
) -> tuple[dict[str, Checked], dict[str, list[float]]]:
    """After the traffic: every answer against a direct forward of its model, and each job's
    losses in a plain PyTorch loop (`plain_losses`). One task per model and per job, on a
    thread per core: each torch op still runs on one thread (`torch.set_num_threads(1)`, as on
    the workers), so the figures are those of computing them one after the other. The models
    are built first, here: a seeded build sets torch's global generator."""
    checked = {n: Checked() for n in specs}
    by_model: dict[str, list[Answer]] = {n: [] for n in specs}
    for answer in answers:
        by_model[answer[0]].append(answer)
    check = checker({n: build_seeded(specs[n]) for n in specs if by_model[n]}, checked)
    models = {n: build_seeded(s) for n, s in train_specs.items()}

    def check_model(name: str) -> None:  # the only task touching checked[name]
        for model, x, y in by_model[name]:
            check(model, x, y)

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        losses = {n: pool.submit(train, m, optimizers[n], data[n]) for n, m in models.items()}
        checks = [pool.submit(check_model, n) for n in specs if by_model[n]]
        for done in checks:
            done.result()
        expected = {n: f.result() for n, f in losses.items()}
    return checked, expected


def main(args: argparse.Namespace | None = None) -> int:
    if args is None:
        ap = argparse.ArgumentParser(prog="python -m client_sdk.demo", allow_abbrev=False)
        add_options(ap)
        args = ap.parse_args()
    # The reference forwards on one thread: the workers already keep the cores busy.
    torch.set_num_threads(1)
    budget = parse_size(args.memory_budget)
    specs = {
        name: ModelSpec(name=name, factory=f, kwargs=kw, seed=args.seed + i, max_batch_size=8)
        for i, (name, f, kw) in enumerate(CATALOGUE)
    }
    train_specs = {
        name: ModelSpec(name=name, factory=f, kwargs=kw, seed=args.seed + 100 + i)
        for i, (name, f, kw, _) in enumerate(TRAIN_JOBS)
    }
    optimizers = {name: opt for name, _, _, opt in TRAIN_JOBS}
    text = corpus()
    data = {
        n: train_batches(s, text, args.seed + 200 + i)
        for i, (n, s) in enumerate(train_specs.items())
    }
    print(
        f"flowmesh demo: {args.workers} CPU stand-in workers of {fmt_bytes(budget)} each "
        f"(+ {fmt_bytes(parse_size(TRAIN_BYTES))} for training), {len(specs)} models served, "
        f"{args.requests} requests from {args.clients} clients; {len(train_specs)} training jobs "
        f"of {TRAIN_STEPS} steps and a sweep of {SWEEP_TRIALS} trials at the same time\n",
        flush=True,
    )
    lm_dir = None
    if skip := demo_generation.available():
        print(f"(generation skipped: {skip})\n")
    else:
        lm_dir = demo_generation.prepare(Path.cwd() / LM_DIR, seed=args.seed)
    t_start = time.perf_counter()
    with LocalMesh(
        cpu_workers=args.workers,
        memory_budget=args.memory_budget,
        train_bytes=TRAIN_BYTES,
        heartbeat_s=0.5,
        threads_per_worker=1,
    ) as mesh:
        print(
            f"mesh up in {time.perf_counter() - t_start:.1f} s: broker {mesh.frontend}", flush=True
        )
        deployed = asyncio.run(deploy_all(mesh.frontend, specs))
        total = sum(m.bytes for m in deployed.values())
        print(
            f"deployed {len(deployed)} models, {fmt_bytes(total)} in all = "
            f"{total / (budget * args.workers):.1f}x the combined device budget",
            flush=True,
        )
        for name, m in deployed.items():
            if len(m.stages) > 1:
                print(
                    f"  {name} ({fmt_bytes(m.bytes)}) is larger than one device: "
                    f"{len(m.stages)} pipeline stages on {' + '.join(m.replicas[0].workers)}"
                )
        rng = random.Random(args.seed)
        # Bursty (Gamma arrivals, CV 2) and skewed (Zipf 1.1): a few hot models, a long tail.
        times = arrival_times(args.requests, rate=80.0, cv=2.0, rng=rng)
        trace = list(zip(times, zipf_choices(list(specs), args.requests, 1.1, rng), strict=True))
        # The same trace twice, to see what training costs serving: alone, then beside the
        # training jobs and the sweep. Its checks wait until the traffic is over.
        print(f"serving {len(trace)} requests alone...", flush=True)
        alone = asyncio.run(serve(mesh.frontend, trace, specs, args.seed, args.clients))
        print(
            f"serving them again beside training on {len(text):,} bytes of Python source "
            f"({', '.join(CORPUS_MODULES)}): next-byte prediction...",
            flush=True,
        )
        sweep_dir = Path.cwd() / SWEEP_NAME

        async def serve_and_train() -> tuple[Served, dict[str, Trained], SweepResult]:
            serving = serve(mesh.frontend, trace, specs, args.seed, args.clients)
            opened = asyncio.Event()
            training = train_all(mesh.frontend, train_specs, optimizers, data, opened)
            sweep = run_sweep(mesh.frontend, text, sweep_dir, seed=args.seed)
            sweeping = sweep_after(opened, sweep)
            return await asyncio.gather(serving, training, sweeping)

        beside, trained, swept = asyncio.run(serve_and_train())
        generated = generate_text(mesh.frontend, lm_dir)
        status = asyncio.run(fetch_status(mesh.frontend, after_s=3 * 0.5))
        t_ref = time.perf_counter()
        checked, expected = references(
            specs, alone.answers + beside.answers, train_specs, optimizers, data
        )
        lm_reference = (
            demo_generation.expected(lm_dir)
            if generated is not None and not generated.error
            else None
        )
        ref_s = time.perf_counter() - t_ref
        # Judged before the mesh stops: what failed keeps the workers' logs to say why.
        code = report(status, alone, beside, checked, ref_s)
        code = max(code, report_training(status, train_specs, optimizers, trained, expected, ref_s))
        code = max(code, report_sweep(swept))
        if generated is not None:
            code = max(code, demo_generation.report(generated, lm_reference))
        if code:
            mesh.keep_logs()  # the mesh says where when it stops
    print(f"\ndemo done in {time.perf_counter() - t_start:.0f} s")
    return code


def generate_text(address: str, lm_dir: Path | None) -> demo_generation.Generated | None:
    """The generation part (`client_sdk.demo_generation`); None when skipped. A failure is
    reported with the rest, not raised: the other parts' results still print."""
    if lm_dir is None:
        return None
    print(f"generating text with {demo_generation.LM_NAME} in two pipeline stages...", flush=True)
    try:
        return asyncio.run(demo_generation.run(address, lm_dir))
    except Exception as exc:
        return demo_generation.Generated(error=f"{type(exc).__name__}: {exc}")


async def deploy_all(address: str, specs: dict[str, ModelSpec]) -> dict[str, ModelRow]:
    async with AsyncClient(address, timeout=300.0) as client:
        infos = await asyncio.gather(
            *(
                client.deploy(
                    s.name, s.factory, kwargs=s.kwargs, seed=s.seed, max_batch_size=s.max_batch_size
                )
                for s in specs.values()
            )
        )
    return {i.name: i for i in infos}


async def fetch_status(address: str, after_s: float = 0.0) -> BrokerStatus:
    await asyncio.sleep(after_s)  # workers' figures come with their heartbeats
    async with AsyncClient(address) as client:
        return await client.status()


def latency_cell(t: Tally) -> str:
    r = t.row()
    return f"{r['mean_ms']:.1f} / {r['p99_ms']:.1f}"


def report(
    status: BrokerStatus,
    alone: Served,
    beside: Served,
    checked: dict[str, Checked],
    ref_s: float,
) -> int:
    """Serving: per model both runs' latencies side by side, then both runs overall."""
    rows, bad = [], 0
    served = [m for m in status.models if m.name in checked]  # not the language model
    for m in sorted(served, key=lambda m: -m.requests):
        ta, tb = alone.tallies.get(m.name, Tally()), beside.tallies.get(m.name, Tally())
        c = checked[m.name]
        errors: dict[str, int] = {}
        for t in (ta, tb):
            for k, v in t.errors.items():
                errors[k] = errors.get(k, 0) + v
        bad += sum(errors.values()) + c.wrong
        rows.append(
            [
                m.name,
                fmt_bytes(m.bytes),
                len(m.stages),
                len(ta.latencies_ms) + sum(ta.errors.values()),
                latency_cell(ta),
                latency_cell(tb),
                m.loads,
                m.evictions,
                m.batches,
                f"{c.exact}/{c.close}/{c.wrong}",
                ", ".join(f"{k}:{v}" for k, v in errors.items()) or "-",
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
                "alone: mean / p99 ms",
                "beside training",
                "loads",
                "evictions",
                "batches",
                "exact/close/wrong",
                "errors",
            ],
        )
    )
    print()
    a, b = alone.overall(), beside.overall()
    for what, run, r in (("alone", alone, a), ("beside training", beside, b)):
        print(
            f"serving {what + ':':<16} {r['ok']} answers in {run.wall:.1f} s, "
            f"mean {r['mean_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms"
        )
    print(
        f"the same trace twice on the same workers, alone and then beside {len(TRAIN_JOBS)} "
        f"training jobs and a sweep (mean x{b['mean_ms'] / max(a['mean_ms'], 1e-9):.1f}, "
        f"p99 x{b['p99_ms'] / max(a['p99_ms'], 1e-9):.1f}): inference comes first, a worker "
        "starts no training compute while serving has a load or a run in flight and takes "
        "back at once the memory training borrowed"
    )
    print()
    for w in status.workers:
        print(
            f"{w.name}: peak {fmt_bytes(w.peak_bytes)} of {fmt_bytes(w.budget_bytes)} "
            f"budget, {w.loads} loads, {w.evictions} evictions, host tier "
            f"{fmt_bytes(w.host_bytes)}"
        )
    print(
        f"models over several workers: {status.totals.direct_batches} batches passed their "
        "activations worker to worker, "
        f"{fmt_bytes(status.totals.activation_bytes_relayed)} went through the broker"
    )
    # The arena is the budget, so its peak cannot exceed it; the worker's high-water mark of the
    # stages it held (taken at every load) could, if its bookkeeping were wrong.
    over = [w for w in status.workers if w.stats.stage_bytes_peak > w.budget_bytes]
    rtol, atol = forward_tolerance(torch.float32)
    print(
        f"\nevery output of both runs checked after the traffic ({ref_s:.1f} s, with the "
        "training references) against a direct torch forward: 'exact' bit for bit; 'close' "
        "the same forward computed in another order (batched with other requests), within "
        f"torch.testing.assert_close's float32 tolerance (|diff| <= {atol:g} + {rtol:g} x "
        "|expected|); 'wrong' otherwise; loads, evictions and batches count both runs"
    )
    if bad or over:
        print(f"FAILED: {bad} wrong or failed requests, {len(over)} workers over budget")
        return 1
    print("OK: every output matches its reference and no device exceeded its budget")
    return 0


def policies(activations: list[str]) -> str:
    """A step's activation policies, counted ("2 keep, 1 recompute"; the last sub-model, whose
    forward and backward are one task, has none)."""
    counts = collections.Counter(p for p in activations if p != "none")
    return ", ".join(f"{n} {p}" for p, n in sorted(counts.items())) or "-"


def describe_optimizer(opt: dict[str, Any]) -> str:
    extra = "+momentum" if opt.get("momentum") else ""
    return f"{opt['name']}{extra} lr {opt['lr']:g}"


def report_training(
    status: BrokerStatus,
    specs: dict[str, ModelSpec],
    optimizers: dict[str, Any],
    trained: dict[str, Trained],
    expected: dict[str, list[float]],
    ref_s: float,
) -> int:
    rows, verdicts = [], []
    for name, t in trained.items():
        verdict, shown = training_verdict(t, expected[name])
        verdicts.append(verdict)
        rows.append(
            [
                name,
                specs[name].factory.rpartition(":")[2],
                describe_optimizer(optimizers[name]),
                t.worker,
                t.sub_models,
                policies(t.activations),
                fmt_bytes(t.footprint),
                len(t.losses),
                f"{t.losses[0]:.4f}" if t.losses else "-",
                f"{t.losses[-1]:.4f}" if t.losses else "-",
                f"{len(t.losses) / t.seconds:.1f}",
                shown,
                "; ".join(t.errors[:2]) or "-",
            ]
        )
    print()
    print(
        table(
            rows,
            [
                "job",
                "model",
                "optimizer",
                "worker",
                "sub-models",
                "activations",
                "footprint",
                "steps",
                "first loss",
                "last loss",
                "steps/s",
                "vs plain PyTorch",
                "errors",
            ],
        )
    )
    print()
    over = []
    for w in status.workers:
        st = w.stats  # its heartbeat figures
        held = [n for n, t in trained.items() if t.worker == w.name]
        footprint = sum(trained[n].footprint for n in held)
        budget = st.train_budget_bytes
        # Training is guaranteed its bytes and may borrow what serving leaves free of the one
        # arena the worker owns (when the worker reports one): the arena is the hard limit.
        limit = st.arena_bytes or budget
        if st.train_resident_peak > limit:
            over.append(w.name)
        borrowed = st.train_borrowed_peak
        print(
            f"{w.name}: jobs {', '.join(held) or '-'} ({fmt_bytes(footprint)} of footprints) "
            f"in {fmt_bytes(budget)} of training bytes: peak resident "
            f"{fmt_bytes(st.train_resident_peak)}"
            + (f" (borrowed up to {fmt_bytes(borrowed)} from serving)" if borrowed else "")
            + f", {fmt_bytes(st.train_bytes_in)} moved in, "
            f"{st.train_steps} steps"
        )
    rtol, atol = forward_tolerance(torch.float32)
    print(
        f"\nper-step losses compared with a plain PyTorch loop in this process, run after the "
        f"traffic (same seeds, batches and optimizers; {ref_s:.1f} s with the serving checks): "
        "'exact' every loss bit for bit; 'close' within "
        f"float32 tolerance (|diff| <= {atol:g} + {rtol:g} x |expected|, max |diff| shown); "
        "'wrong' otherwise; steps/s while serving and the other jobs share the 2 workers"
    )
    bad = [v for v in verdicts if v not in ("exact", "close")]
    if bad or over:
        counts = ", ".join(f"{bad.count(v)} {v}" for v in sorted(set(bad))) or "none"
        print(f"FAILED: training jobs {counts}; {len(over)} workers over their memory")
        return 1
    print("OK: every job's losses match plain PyTorch and no worker exceeded its memory")
    return 0


def training_verdict(t: Trained, want: list[float]) -> tuple[str, str]:
    """A job's verdict against plain PyTorch, and how its table cell shows it: a job whose
    steps went unanswered timed out (it has no losses to be wrong with), one whose steps failed
    failed; only a job that answered every step in order is compared."""
    if t.timed_out:
        return "timed out", f"timed out ({t.timed_out} of {len(want)} steps)"
    if t.errors:
        return "failed", f"failed ({len(t.errors)} of {len(want)} steps)"
    if t.steps != list(range(1, len(want) + 1)):
        return "wrong", "wrong (steps answered out of order)"
    got = compare(
        torch.tensor(t.losses, dtype=torch.float32), torch.tensor(want, dtype=torch.float32)
    )
    if got.verdict == "exact":
        return "exact", "exact"
    return got.verdict, f"{got.verdict} ({got.max_abs_diff:.1e})"


if __name__ == "__main__":
    sys.exit(main())
