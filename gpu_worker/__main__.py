"""`python -m gpu_worker`: one worker process for one device."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

import torch

from flowmesh import logs, metrics
from flowmesh.affinity import pin_process
from flowmesh.auth import load_keys
from flowmesh.config import (
    CPUS,
    DATA_ROOT,
    FLOAT,
    INSECURE,
    INT,
    LOG_LEVEL_OPTION,
    METRICS_PORT,
    PEER_ALLOW,
    PEER_KEYS,
    SIZE,
    TEXT,
    Option,
    Options,
)
from flowmesh.exposure import check_keyless_bind
from flowmesh.lifecycle import run_process
from flowmesh.protocol import Limits
from flowmesh.roots import Roots
from flowmesh.units import parse_size
from gpu_worker.device import open_device
from gpu_worker.service import WorkerService

OPTIONS = Options(
    "worker",
    prog="python -m gpu_worker",
    description="flowmesh GPU worker",
    options=(
        Option("--broker", TEXT, "tcp://127.0.0.1:5556", "broker backend endpoint"),
        Option("--device", TEXT, "cuda:0", "cuda:N, or cpu for a stand-in device"),
        Option(
            "--memory-budget",
            SIZE,
            None,
            "device bytes for resident stages (e.g. 2GiB); required for cpu, "
            "default 80%% of free memory on CUDA",
        ),
        Option(
            "--train-bytes",
            SIZE,
            "0",
            "device bytes guaranteed to training jobs, besides --memory-budget: one arena of "
            "both holds serving stages and training tasks; training also borrows what serving "
            "leaves free and gives it back at once when serving needs it (0 = this worker takes "
            "no training jobs)",
        ),
        Option(
            "--name",
            TEXT,
            None,
            "worker name, unique in the mesh (default host-device, e.g. gpu7-cuda0; a CPU "
            "stand-in without --keys adds its pid)",
        ),
        Option("--compute-lanes", INT, 2, "concurrent runs", least=1, most=1024),
        Option("--threads", INT, None, "torch CPU threads", least=1),
        CPUS,
        PEER_ALLOW,
        PEER_KEYS,
        DATA_ROOT,
        Option(
            "--checkpoint-root",
            TEXT,
            None,
            "a directory under which clients' training checkpoints are saved (a new directory, "
            "or over a flowmesh checkpoint) and resumed from (repeatable; default: the working "
            "directory)",
            repeat=True,
        ),
        Option("--max-message", SIZE, "1GiB", "largest accepted message"),
        Option(
            "--switch-interval",
            FLOAT,
            2e-4,
            "seconds a thread may hold the GIL while others wait",
        ),
        Option(
            "--host-tier-bytes",
            SIZE,
            None,
            "pinned host memory for deployed stages on CUDA, reserved at start as one slab "
            "(default 2x --memory-budget, at least 256MiB, at most half the machine's memory); "
            "a deploy that does not fit fails with NO_SPACE",
        ),
        Option(
            "--train-resident-bytes",
            SIZE,
            None,
            "device memory beside the arena where training keeps what a step's later tasks read "
            "(activations, what a forward saved for its backward) instead of copying it to the "
            "host tier and back, on CUDA (default: a quarter of the GPU memory free once the "
            "arena is reserved; none with --train-bytes 0; 0: always the host tier)",
        ),
        Option(
            "--prefault",
            INT,
            1,
            "1: fault in (zero) the whole device arena at start, so that no first load pays for "
            "it; 0: leave it to first use (only to measure the difference)",
        ),
        Option(
            "--peer-endpoint",
            TEXT,
            "tcp://127.0.0.1:0",
            "where other workers send this worker a model's activations directly, stage to "
            "stage (port 0: any free port; on a mesh over several hosts, this host's address "
            "the others reach; CURVE with --keys, without them only with --insecure 1); empty: "
            "none, the broker relays them",
        ),
        Option(
            "--eviction",
            TEXT,
            "value",
            "which idle stages a load evicts first: value (rows run per second x seconds to "
            "copy back) or lru (least recently used alone: a benchmark's ablation)",
        ),
        Option(
            "--kv-preempt",
            TEXT,
            "auto",
            "what a preempted generation's KV cache becomes: auto (kept in host memory and "
            "copied back when that costs less than recomputing it from its tokens, by measured "
            "times), swap (always kept, host room allowing) or recompute (always dropped)",
        ),
        INSECURE,
        METRICS_PORT,
        LOG_LEVEL_OPTION,
    ),
)


def parser() -> argparse.ArgumentParser:
    return OPTIONS.parser()


def default_name(device: str, *, keyed: bool, host: str = "", pid: int = 0) -> str:
    """host-device: one worker per GPU. CPU stand-ins, of which a host may run several, add
    their pid (without keys: with them, the name is the key's, so stays host-device)."""
    name = f"{host or socket.gethostname()}-{device.replace(':', '')}"
    return name if keyed or device.startswith("cuda") else f"{name}-{pid or os.getpid()}"


def main(argv: list[str] | None = None) -> None:
    args = OPTIONS.parse(argv)
    if args.cpus:
        try:
            pin_process(args.cpus)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    logs.setup("worker", args.log_level)
    if args.peer_endpoint:
        check_keyless_bind(
            "--peer-endpoint",
            args.peer_endpoint,
            "send this worker activations to hold and compute (a run's ticket still checked)",
            keyed=bool(args.keys),
            insecure=bool(args.insecure),
            log=logging.getLogger("worker"),
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    # The event loop, the copy lane and the compute lanes share the GIL; with the default 5 ms
    # switch interval a lane finishing a torch op can wait that long to get it back.
    sys.setswitchinterval(args.switch_interval)
    budget = parse_size(args.memory_budget) if args.memory_budget else None
    train_bytes = parse_size(args.train_bytes)
    # One arena for serving and training (a CUDA budget left to its default is 80% of what is
    # free, and training's bytes come out of it).
    device = open_device(
        args.device,
        budget + train_bytes if budget is not None else None,
        host_tier_bytes=args.host_tier_bytes,
        prefault=bool(args.prefault),
        # A worker that takes no training jobs keeps no stashes.
        resident_bytes=args.train_resident_bytes if train_bytes else 0,
    )
    if device.budget_bytes < train_bytes:
        raise SystemExit(f"--train-bytes {args.train_bytes} leaves no device memory for serving")
    name = args.name or default_name(args.device, keyed=bool(args.keys))
    service = WorkerService(
        name,
        args.broker,
        device,
        compute_lanes=args.compute_lanes,
        allow=tuple(args.allow) if args.allow else None,  # None: the broker's list
        limits=Limits(max_message_bytes=parse_size(args.max_message)),
        threads=args.threads,
        train_bytes=train_bytes,
        peer_endpoint=args.peer_endpoint,
        eviction=args.eviction,
        kv_preempt=args.kv_preempt,
        roots=Roots.of(args.data_root, args.checkpoint_root, f"worker {name}"),
    )
    for warning in service.roots.warnings():
        logging.getLogger("worker").warning("%s", warning)
    if args.keys:
        service.curve = load_keys(args.keys, name)
    # exits non-zero when a task failed
    run_process(
        metrics.serve_with_metrics(
            service.serve(),
            args.metrics_port,
            lambda loop: metrics.worker_collector(service, loop),
        )
    )


if __name__ == "__main__":
    main()
