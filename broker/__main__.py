"""`python -m broker`: run the broker."""

from __future__ import annotations

import argparse

from broker.core import BrokerConfig
from broker.service import BrokerService
from flowmesh import logs
from flowmesh.config import apply_config
from flowmesh.lifecycle import run_process
from flowmesh.protocol import Limits
from flowmesh.spec import DEFAULT_ALLOW
from flowmesh.units import parse_size


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m broker", description="flowmesh broker")
    ap.add_argument("--frontend", default="tcp://127.0.0.1:5555", help="client endpoint")
    ap.add_argument("--backend", default="tcp://127.0.0.1:5556", help="worker endpoint")
    ap.add_argument("--heartbeat", type=float, default=1.0, help="seconds between heartbeats")
    ap.add_argument("--liveness", type=int, default=3, help="missed heartbeats before death")
    ap.add_argument(
        "--allow",
        action="append",
        default=None,
        help="module allowed to provide model factories (repeatable; default: "
        + ", ".join(DEFAULT_ALLOW)
        + ")",
    )
    ap.add_argument("--max-queue", type=int, default=4096, help="queued requests per model")
    ap.add_argument("--max-message", default="1GiB", help="largest accepted message")
    ap.add_argument("--replicas", type=int, default=2, help="default replicas per model")
    ap.add_argument(
        "--starvation",
        type=float,
        default=2.0,
        help="seconds a request waits before it may evict busy models",
    )
    ap.add_argument("--ready-file", help="write the bound endpoints here (JSON) once serving")
    ap.add_argument("--log-level", default=None)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = apply_config(parser(), argv, "broker")
    logs.setup("broker", args.log_level)
    cfg = BrokerConfig(
        heartbeat_s=args.heartbeat,
        liveness=args.liveness,
        allow=tuple(args.allow) if args.allow else DEFAULT_ALLOW,
        max_queue=args.max_queue,
        default_replicas=args.replicas,
        starvation_s=args.starvation,
    )
    limits = Limits(max_message_bytes=parse_size(args.max_message))
    service = BrokerService(
        cfg, args.frontend, args.backend, limits=limits, ready_file=args.ready_file
    )
    run_process(service.serve())  # exits non-zero when a task failed


if __name__ == "__main__":
    main()
