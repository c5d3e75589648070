"""`python -m partitioner`: the planning service."""

from __future__ import annotations

import argparse
import socket

from flowmesh import logs, metrics
from flowmesh.auth import load_keys
from flowmesh.config import (
    DATA_ROOT,
    INT,
    LOG_LEVEL_OPTION,
    METRICS_PORT,
    PEER_ALLOW,
    PEER_KEYS,
    TEXT,
    Option,
    Options,
)
from flowmesh.lifecycle import run_process
from partitioner.service import PartitionerService

OPTIONS = Options(
    "partitioner",
    prog="python -m partitioner",
    description="flowmesh partitioner",
    options=(
        Option("--broker", TEXT, "tcp://127.0.0.1:5556", "broker backend endpoint"),
        Option("--name", TEXT, None, "service name (default host-partitioner)"),
        Option("--threads", INT, 2, "plans computed at once", least=1),
        Option("--measure-device", TEXT, "cpu", "where to time blocks when asked"),
        PEER_ALLOW,
        PEER_KEYS,
        DATA_ROOT,
        METRICS_PORT,
        LOG_LEVEL_OPTION,
    ),
)


def parser() -> argparse.ArgumentParser:
    return OPTIONS.parser()


def main(argv: list[str] | None = None) -> None:
    args = OPTIONS.parse(argv)
    log = logs.setup("partitioner", args.log_level)
    name = args.name or f"{socket.gethostname()}-partitioner"
    service = PartitionerService(
        name,
        args.broker,
        allow=tuple(args.allow) if args.allow else None,  # None: the broker's list
        threads=args.threads,
        measure_device=args.measure_device,
        data_roots=args.data_root,
    )
    for warning in service.roots.warnings():
        log.warning("%s", warning)
    if args.keys:
        service.curve = load_keys(args.keys, name)
    # exits non-zero when a task failed
    run_process(
        metrics.serve_with_metrics(
            service.serve(),
            args.metrics_port,
            lambda loop: metrics.partitioner_collector(service, loop),
        )
    )


if __name__ == "__main__":
    main()
