"""`python -m gpu_worker`: one worker process for one device."""

from __future__ import annotations

import argparse
import socket
import sys

import torch

from flowmesh import logs
from flowmesh.config import apply_config
from flowmesh.lifecycle import run_process
from flowmesh.protocol import Limits
from flowmesh.spec import DEFAULT_ALLOW
from flowmesh.units import parse_size
from gpu_worker.device import open_device
from gpu_worker.service import WorkerService


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m gpu_worker", description="flowmesh GPU worker")
    ap.add_argument("--broker", default="tcp://127.0.0.1:5556", help="broker backend endpoint")
    ap.add_argument("--device", default="cuda:0", help="cuda:N, or cpu for a stand-in device")
    ap.add_argument(
        "--memory-budget",
        default=None,
        help="device bytes for resident stages (e.g. 2GiB); required for cpu, "
        "default 80%% of free memory on CUDA",
    )
    ap.add_argument(
        "--train-bytes",
        default="0",
        help="device bytes for training jobs, besides --memory-budget (interim static split of "
        "device memory; 0 = this worker takes no training jobs)",
    )
    ap.add_argument("--name", default=None, help="worker name (default host-device)")
    ap.add_argument("--compute-lanes", type=int, default=2, help="concurrent runs")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--allow", action="append", default=None, help="allowed factory modules")
    ap.add_argument("--max-message", default="1GiB", help="largest accepted message")
    ap.add_argument(
        "--switch-interval",
        type=float,
        default=2e-4,
        help="seconds a thread may hold the GIL while others wait",
    )
    ap.add_argument("--log-level", default=None)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = apply_config(parser(), argv, "worker")
    logs.setup("worker", args.log_level)
    if args.threads:
        torch.set_num_threads(args.threads)
    # The event loop, the copy lane and the compute lanes share the GIL; with the default 5 ms
    # switch interval a lane finishing a torch op can wait that long to get it back.
    sys.setswitchinterval(args.switch_interval)
    budget = parse_size(args.memory_budget) if args.memory_budget else None
    train_bytes = parse_size(args.train_bytes)
    # The training arena first: a CUDA serving budget left to its default takes 80% of what is
    # free after it.
    train_device = open_device(args.device, train_bytes) if train_bytes > 0 else None
    device = open_device(args.device, budget)
    name = args.name or f"{socket.gethostname()}-{args.device.replace(':', '')}"
    service = WorkerService(
        name,
        args.broker,
        device,
        compute_lanes=args.compute_lanes,
        allow=tuple(args.allow) if args.allow else DEFAULT_ALLOW,
        limits=Limits(max_message_bytes=parse_size(args.max_message)),
        threads=args.threads,
        train_device=train_device,
    )
    run_process(service.serve())  # exits non-zero when a task failed


if __name__ == "__main__":
    main()
