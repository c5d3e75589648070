"""`python -m partitioner`: the planning service."""

from __future__ import annotations

import argparse
import socket

from flowmesh import logs
from flowmesh.config import INT, LOG_LEVEL, TEXT, Option, Options
from flowmesh.lifecycle import run_process
from partitioner.service import PartitionerService

OPTIONS = Options(
    "partitioner",
    prog="python -m partitioner",
    description="flowmesh partitioner",
    options=(
        Option("--broker", TEXT, "tcp://127.0.0.1:5556", "broker backend endpoint"),
        Option("--name", TEXT, None, "service name (default host-partitioner)"),
        Option("--threads", INT, 2, "plans computed at once"),
        Option("--measure-device", TEXT, "cpu", "where to time blocks when asked"),
        Option("--allow", TEXT, None, "allowed factory modules (repeatable)", repeat=True),
        Option("--log-level", LOG_LEVEL, None, "debug, info, warning, error or critical"),
    ),
)


def parser() -> argparse.ArgumentParser:
    return OPTIONS.parser()


def main(argv: list[str] | None = None) -> None:
    args = OPTIONS.parse(argv)
    logs.setup("partitioner", args.log_level)
    service = PartitionerService(
        args.name or f"{socket.gethostname()}-partitioner",
        args.broker,
        allow=tuple(args.allow) if args.allow else None,  # None: the broker's list
        threads=args.threads,
        measure_device=args.measure_device,
    )
    run_process(service.serve())  # exits non-zero when a task failed


if __name__ == "__main__":
    main()
