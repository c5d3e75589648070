"""`python -m partitioner`: the planning service."""

from __future__ import annotations

import argparse
import socket

from flowmesh import logs
from flowmesh.config import apply_config
from flowmesh.lifecycle import run_process
from flowmesh.spec import DEFAULT_ALLOW
from partitioner.service import PartitionerService


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m partitioner", description="flowmesh partitioner")
    ap.add_argument("--broker", default="tcp://127.0.0.1:5556", help="broker backend endpoint")
    ap.add_argument("--name", default=None, help="service name (default host-partitioner)")
    ap.add_argument("--threads", type=int, default=2, help="plans computed at once")
    ap.add_argument("--measure-device", default="cpu", help="where to time blocks when asked")
    ap.add_argument("--allow", action="append", default=None, help="allowed factory modules")
    ap.add_argument("--log-level", default=None)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = apply_config(parser(), argv, "partitioner")
    logs.setup("partitioner", args.log_level)
    service = PartitionerService(
        args.name or f"{socket.gethostname()}-partitioner",
        args.broker,
        allow=tuple(args.allow) if args.allow else DEFAULT_ALLOW,
        threads=args.threads,
        measure_device=args.measure_device,
    )
    run_process(service.serve())  # exits non-zero when a task failed


if __name__ == "__main__":
    main()
