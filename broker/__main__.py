"""`python -m broker`: run the broker."""

from __future__ import annotations

import argparse
import sqlite3

from broker.core import BrokerConfig
from broker.service import BrokerService
from flowmesh import logs, metrics
from flowmesh.affinity import pin_process
from flowmesh.config import (
    CPUS,
    FLOAT,
    INSECURE,
    INT,
    LOG_LEVEL_OPTION,
    METRICS_PORT,
    SIZE,
    TEXT,
    Option,
    Options,
)
from flowmesh.exposure import check_keyless_bind
from flowmesh.lifecycle import run_process
from flowmesh.protocol import Limits
from flowmesh.spec import DEFAULT_ALLOW
from flowmesh.units import parse_size

OPTIONS = Options(
    "broker",
    prog="python -m broker",
    description="flowmesh broker",
    options=(
        Option("--frontend", TEXT, "tcp://127.0.0.1:5555", "client endpoint"),
        Option("--backend", TEXT, "tcp://127.0.0.1:5556", "worker endpoint"),
        Option("--heartbeat", FLOAT, 1.0, "seconds between heartbeats", above=0),
        Option("--liveness", INT, 3, "missed heartbeats before death", least=1),
        Option(
            "--allow",
            TEXT,
            None,
            "module allowed to provide model factories (repeatable; default: "
            + ", ".join(DEFAULT_ALLOW)
            + ")",
            repeat=True,
        ),
        Option("--max-queue", INT, 4096, "queued requests per model", least=1),
        Option(
            "--max-client-inflight",
            INT,
            1024,
            "requests one client may have queued or running at once (beyond: OVERLOADED)",
        ),
        Option(
            "--autoscale",
            INT,
            0,
            "1: add a replica of a model its replicas cannot keep up with, and remove it once "
            "the model cools (never below the deployed count)",
        ),
        Option("--scale-up-after", FLOAT, 5.0, "seconds a model must stay hot to gain a replica"),
        Option(
            "--scale-down-after", FLOAT, 60.0, "seconds a model must stay cool to lose a replica"
        ),
        Option("--scale-cooldown", FLOAT, 30.0, "seconds between two changes of one model"),
        Option(
            "--rate-window",
            FLOAT,
            30.0,
            "seconds a model's arrival rate is averaged over (autoscaling, prefetch, eviction)",
        ),
        Option(
            "--eviction",
            TEXT,
            "value",
            "which stages a load expects to evict: value (arrival rate x seconds to copy back), "
            "lru (least recently used, by bytes), count (Computron's: a stage count per worker, "
            "least recently used); the last two for benchmarks",
        ),
        Option(
            "--prefetch",
            INT,
            1,
            "1: load models asked for before into free device bytes ahead of their next request",
        ),
        Option(
            "--direct",
            INT,
            1,
            "1: a model cut over several workers passes activations worker to worker (when they "
            "all have a peer endpoint); 0: through the broker",
        ),
        Option(
            "--micro-batches",
            INT,
            0,
            "micro-batches a direct run's batch is cut into, so that stages overlap "
            "(0: one per stage, each of at least --micro-batch-rows rows)",
        ),
        Option(
            "--micro-batch-rows",
            INT,
            64,
            "with --micro-batches 0, the fewest rows a micro-batch has (smaller batches go whole)",
        ),
        Option(
            "--group-runs",
            INT,
            8,
            "most queued requests of a model taking one request per forward (max_batch_size 1) "
            "sent in one run, each computed on its own (1: a run each)",
        ),
        Option(
            "--gen-groups",
            INT,
            1,
            "generation iterations in flight per replica of a language model, each at its own "
            "stage (0: one per stage)",
        ),
        Option(
            "--gen-overlap",
            INT,
            1,
            "1: a language model of one stage has its next iteration queued on its worker while "
            "one runs (no round trip between two tokens); 0: sent once the last one answered",
        ),
        Option(
            "--undeploy-drain",
            FLOAT,
            30.0,
            "seconds an undeploy waits for the model's running generations to end before it "
            "goes (new calls refused meanwhile; 0: at once)",
        ),
        Option("--max-message", SIZE, "1GiB", "largest accepted message"),
        Option("--replicas", INT, 2, "default replicas per model", least=1),
        Option(
            "--starvation",
            FLOAT,
            2.0,
            "seconds a request waits before it may evict busy models",
        ),
        Option("--ready-file", TEXT, None, "write the bound endpoints here (JSON) once serving"),
        Option(
            "--keys",
            TEXT,
            None,
            "key directory (flowmesh keys init): CURVE on both sockets, only its keys let in",
        ),
        INSECURE,
        CPUS,
        METRICS_PORT,
        Option(
            "--state-dir",
            TEXT,
            None,
            "keep deployed models, training jobs and the allow-list here (SQLite), so that a "
            "restarted broker takes them up again (default: off)",
        ),
        LOG_LEVEL_OPTION,
    ),
)


def parser() -> argparse.ArgumentParser:
    return OPTIONS.parser()


def main(argv: list[str] | None = None) -> None:
    args = OPTIONS.parse(argv)
    if args.cpus:
        try:
            pin_process(args.cpus)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    log = logs.setup("broker", args.log_level)
    for flag, endpoint, lets in (
        ("--frontend", args.frontend, "deploy, undeploy and train models and read every answer"),
        ("--backend", args.backend, "register as a worker and answer the runs sent to it"),
    ):
        check_keyless_bind(
            flag, endpoint, lets, keyed=bool(args.keys), insecure=bool(args.insecure), log=log
        )
    if args.eviction not in ("value", "lru", "count"):
        raise SystemExit(f"--eviction {args.eviction!r}: expected value, lru or count")
    cfg = BrokerConfig(
        heartbeat_s=args.heartbeat,
        liveness=args.liveness,
        allow=tuple(args.allow) if args.allow else DEFAULT_ALLOW,
        max_queue=args.max_queue,
        max_client_inflight=args.max_client_inflight,
        autoscale=bool(args.autoscale),
        scale_up_after_s=args.scale_up_after,
        scale_down_after_s=args.scale_down_after,
        scale_cooldown_s=args.scale_cooldown,
        rate_window_s=args.rate_window,
        eviction=args.eviction,
        prefetch=bool(args.prefetch),
        direct=bool(args.direct),
        micro_batches=args.micro_batches,
        micro_batch_rows=args.micro_batch_rows,
        group_runs=args.group_runs,
        gen_groups=args.gen_groups,
        gen_overlap=bool(args.gen_overlap),
        undeploy_drain_s=args.undeploy_drain,
        default_replicas=args.replicas,
        starvation_s=args.starvation,
        state_dir=args.state_dir,
    )
    limits = Limits(max_message_bytes=parse_size(args.max_message))
    try:
        service = BrokerService(
            cfg,
            args.frontend,
            args.backend,
            limits=limits,
            ready_file=args.ready_file,
            keys=args.keys,
        )
    except (OSError, sqlite3.Error) as exc:
        # The state directory: not one (a file), not writable, or another broker's.
        where = f"--state-dir {args.state_dir}: " if args.state_dir else ""
        raise SystemExit(f"python -m broker: {where}{exc}") from None
    # exits non-zero when a task failed
    run_process(
        metrics.serve_with_metrics(
            service.serve(),
            args.metrics_port,
            lambda loop: metrics.broker_collector(service, loop),
        )
    )


if __name__ == "__main__":
    main()
