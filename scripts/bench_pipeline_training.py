"""One training job over two workers, pipelined (issue 23 §2), against the same job on one
worker by memory flow, through one mesh in the same run.

An MLP (Adam, `--accumulate` micro-batches per step) is opened twice on a mesh of two workers:
`pipeline=2` (each worker holds half the model resident, micro-batches' activations and
gradients going worker to worker) and `pipeline=0` (one worker, the model cut into sub-models
that flow through its training memory). The two train on the same batches in turns of
`--steps` steps (`--rounds` turns each, so that the machine's drift falls on both), every step
of a turn in flight at once; samples/s is each side's best turn, and the ratio pipeline / flow is
printed with both. The two jobs' losses are checked equal (the tolerance rule), since both are
held to plain PyTorch.

What the CPU stand-in shows: both workers share this machine's cores, so the two stages'
computes do not run beside each other as two devices' do; what a pipeline pays (a hop per
micro-batch and stage, both ways; stage 0 waits for the last stage's random state only for a
model that draws, and this MLP draws none) is measured, what it gains is not. On two GPUs, one
worker each: `python scripts/bench_pipeline_training.py --gpus 2 --width 4096 --depth 8 --batch
256 --accumulate 4 --threads 0`; with one GPU, `--gpus 1` puts both workers on it (a check, not
a figure).

    python scripts/bench_pipeline_training.py [--width 512] [--depth 8] [--batch 64]
        [--accumulate 4] [--steps 8] [--rounds 3] [--threads 1] [--out bench-out]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from client_sdk.mesh import LocalMesh

ADAM = {"name": "adam", "lr": 1e-3}


def batches(args: argparse.Namespace, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(args.batch, args.width, generator=g),
            torch.randint(0, 10, (args.batch,), generator=g),
        )
        for _ in range(n)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--accumulate", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=8, help="steps per turn")
    ap.add_argument("--rounds", type=int, default=3, help="turns of each side")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker (0: keep)")
    ap.add_argument("--gpus", type=int, default=0, help="CUDA workers (0: two CPU stand-ins)")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()

    kwargs = {"width": args.width, "depth": args.depth, "in_features": args.width,
              "out_features": 10}  # fmt: skip
    params = args.depth * (args.width * args.width + args.width)
    train_bytes = max(64 << 20, 8 * 4 * params)  # the whole job fits either way
    gpus = [i % max(1, torch.cuda.device_count()) for i in range(2)] if args.gpus else None
    data = batches(args, args.steps)
    times: dict[str, list[float]] = {"pipeline": [], "flow": []}
    losses: dict[str, list[float]] = {"pipeline": [], "flow": []}
    held = 0  # the most micro-batches whose activations the pipeline's stage 0 held at once
    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalMesh(
            cpu_workers=0 if gpus else 2,
            gpus=gpus,
            memory_budget="64MiB",
            gpu_budget="1GiB" if gpus else None,
            train_bytes=str(train_bytes),
            data_roots=[tmp],
            threads_per_worker=args.threads or None,
            heartbeat_s=0.5,
        ) as mesh,
        mesh.client(timeout=600) as c,
    ):
        jobs = {}
        for name, pipeline in (("pipeline", 2), ("flow", 0)):
            jobs[name] = c.train_open(
                f"bench-{name}", "flowmesh.examples:mlp", kwargs=kwargs, seed=1,
                optimizer=ADAM, batch_size=args.batch, accumulate=args.accumulate,
                pipeline=pipeline, timeout=600,
            )  # fmt: skip
            print(f"{name}: workers {jobs[name].info.pipeline or [jobs[name].info.worker]}, "
                  f"{len(jobs[name].info.sub_models)} parts", flush=True)  # fmt: skip
        for _ in range(args.rounds):
            for name, job in jobs.items():
                t0 = time.perf_counter()
                results = [f.result(600) for f in [job.step_async(x, y) for x, y in data]]
                times[name].append(time.perf_counter() - t0)
                losses[name] += [r.loss for r in results]
                if name == "pipeline":
                    held = max([held, *(int(r.metrics["held_micro_batches"]) for r in results)])
        for job in jobs.values():
            job.close()
    samples = args.steps * args.batch
    rate = {k: samples / min(v) for k, v in times.items()}
    try:
        torch.testing.assert_close(losses["pipeline"], losses["flow"], rtol=1e-5, atol=1e-6)
        same = "equal (rtol 1e-5, atol 1e-6)"
    except AssertionError as exc:
        same = f"DIFFER: {str(exc).splitlines()[0]}"
    device = f"{args.gpus} GPU(s): {torch.cuda.get_device_name(0)}" if gpus else "CPU stand-ins"
    result: dict[str, Any] = {
        "device": device,
        "args": vars(args),
        "samples_per_s": rate,
        "turns_s": times,
        "pipeline_vs_flow": rate["pipeline"] / rate["flow"],
        "held_micro_batches": held,
        "losses": same,
    }
    print(f"on {device}: MLP width {args.width} x depth {args.depth}, batch {args.batch} in "
          f"{args.accumulate} micro-batches, {args.steps} steps a turn, best of {args.rounds}")
    print(f"pipeline over 2 workers {rate['pipeline']:.1f} samples/s, memory flow on one "
          f"{rate['flow']:.1f} samples/s: pipeline / flow {result['pipeline_vs_flow']:.2f}x; "
          f"losses {same}; stage 0 held at most {held} of the step's {args.accumulate} "
          "micro-batches' activations at once")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline_training.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
