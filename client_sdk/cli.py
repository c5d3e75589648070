"""The `flowmesh` command: run the mesh, look at it, deploy, infer, plan, train, sweep and list
jobs."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections import deque
from typing import Any

from client_sdk.client import DEFAULT_ADDRESS, Client
from client_sdk.errors import ClientError, Timeout
from flowmesh.auth import ROLES, KeyRing, add_key, init_keys
from flowmesh.errors import FlowmeshError
from flowmesh.units import fmt_bytes, parse_size


def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header, *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_status(st: dict[str, Any]) -> str:
    out = [
        f"broker up {st['uptime_s']:.0f} s  protocol v{st['protocol']}  "
        f"requests {st['requests']}  completed {st['completed']}  errors {st['errors']}  "
        f"queued {st['queued']}  running batches {st['inflight_batches']}",
        "",
    ]
    if st.get("direct_batches") or st.get("activation_bytes_relayed"):
        out.insert(
            1,
            f"stages over several workers: {st.get('direct_batches', 0)} batches direct, "
            f"{fmt_bytes(st.get('activation_bytes_relayed', 0))} of activations relayed",
        )
    rows = [
        [
            w["name"],
            w["device"],
            "ready" if w["ready"] else "joining",
            fmt_bytes(w["budget_bytes"]),
            fmt_bytes(w["resident_bytes"]),
            fmt_bytes(w["peak_bytes"]),
            fmt_bytes(w["host_bytes"]),
            w["loads"],
            fmt_bytes(w.get("load_bytes", 0)),
            f"{w.get('mean_load_ms', 0.0):.1f}",
            w["evictions"],
            w["inflight"],
            ", ".join(w["resident"]) or "-",
        ]
        for w in st["workers"]
    ]
    out.append(
        table(
            rows,
            [
                "worker",
                "device",
                "state",
                "budget",
                "resident",
                "peak",
                "host",
                "loads",
                "loaded",
                "load ms",
                "evictions",
                "running",
                "resident stages",
            ],
        )
    )
    parts = (
        ", ".join(
            f"{p['name']} ({'ready' if p['ready'] else 'joining'})" for p in st["partitioners"]
        )
        or "none"
    )
    for w in st["workers"]:
        t = w.get("stats", {})
        if t.get("train_budget_bytes"):
            out.append(
                f"{w['name']} training: resident {fmt_bytes(t.get('train_resident_bytes', 0))} "
                f"(peak {fmt_bytes(t.get('train_resident_peak', 0))}) of "
                f"{fmt_bytes(t['train_budget_bytes'])}, tasks {t.get('train_tasks', 0)}, "
                f"job switches {t.get('train_job_switches', 0)}"
            )
    out += ["", f"partitioners: {parts}", ""]
    rows = []
    for m in st["models"]:
        stages = " | ".join(
            f"{s['blocks'][0]}-{s['blocks'][1] - 1}:{fmt_bytes(s['bytes'])}" for s in m["stages"]
        )
        reps = "; ".join(
            "+".join(r["workers"]) + ("" if r["live"] else " (deploying)") for r in m["replicas"]
        )
        rows.append(
            [
                m["name"],
                m["state"],
                fmt_bytes(m["bytes"]),
                stages,
                reps,
                m["queue"],
                m["requests"],
                m["errors"],
                m["loads"],
                m["evictions"],
                f"{m['mean_ms']:.1f}",
                f"{m['p99_ms']:.1f}",
                f"{m.get('queue_wait_ms', 0.0):.1f}",
                f"{m.get('load_wait_ms', 0.0):.1f}",
                f"{m.get('run_ms', 0.0):.1f}",
                f"{m.get('mean_batch', 0.0):.1f}",
            ]
        )
    out.append(
        table(
            rows,
            [
                "model",
                "state",
                "bytes",
                "stages (blocks:bytes)",
                "replicas",
                "queue",
                "requests",
                "errors",
                "loads",
                "evictions",
                "mean ms",
                "p99 ms",
                "queue ms",
                "load wait ms",
                "run ms",
                "batch",
            ],
        )
    )
    if st.get("jobs"):
        out += ["", format_jobs(st["jobs"])]
    return "\n".join(out)


def format_jobs(jobs: list[dict[str, Any]]) -> str:
    """Training jobs as a table: worker, state, step, last loss, steps/s, sub-models."""
    rows = [
        [
            j["name"],
            j["worker"],
            j["state"],
            j["step"],
            "-" if j["last_loss"] is None else f"{j['last_loss']:.4g}",
            f"{j['steps_per_s']:.2f}",
            " | ".join(
                f"{m['blocks'][0]}-{m['blocks'][1] - 1}:{fmt_bytes(m.get('host_bytes', 0))}"
                f"/{fmt_bytes(m.get('task_bytes', 0))}"
                for m in j["sub_models"]
            )
            or "-",
            fmt_bytes(j["footprint"]),
            "-" if j["saved_step"] is None else j["saved_step"],
            j["pending"],
            j["errors"],
        ]
        for j in jobs
    ]
    header = [
        "job",
        "worker",
        "state",
        "step",
        "loss",
        "steps/s",
        "sub-models (blocks:host/task bytes)",
        "footprint",
        "saved",
        "pending",
        "errors",
    ]
    return table(rows, header)


def format_plan(plan: dict[str, Any]) -> str:
    from partitioner.plan import Plan

    return Plan.from_dict(plan).table()


def _kwargs(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--kwargs is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise SystemExit("--kwargs must be a JSON object")
    return value


def connect(args: argparse.Namespace) -> Client:
    """A client whose broker answered a status request: a wrong address fails in seconds,
    not after a long deploy timeout."""
    client = Client(args.broker, keys=getattr(args, "keys", None))
    try:
        client.status(timeout=min(5.0, args.timeout))
    except Timeout:
        client.close()
        raise SystemExit(
            f"flowmesh {args.cmd}: no broker answers at {args.broker} "
            "(is 'flowmesh up' running? see --broker / FLOWMESH_BROKER)"
        ) from None
    except BaseException:
        client.close()
        raise
    return client


def up_mesh(args: argparse.Namespace, gpus: list[int]) -> Any:
    """The LocalMesh `flowmesh up` runs (not started)."""
    from client_sdk.mesh import LocalMesh

    host, _, port = args.listen.rpartition(":")
    return LocalMesh(
        cpu_workers=args.cpu_workers or 2,
        memory_budget=args.memory_budget or "1GiB",
        gpus=gpus or None,
        gpu_budget=args.memory_budget if gpus else None,
        host=host or "127.0.0.1",
        frontend_port=int(port or 5555),
        backend_port=int(port or 5555) + 1,
        heartbeat_s=args.heartbeat,
        threads_per_worker=args.threads,
        train_bytes=args.train_bytes or 0,
        metrics_port=args.metrics_port,
        keys=args.keys,
        allow=args.allow,
        data_roots=args.data_root,
        checkpoint_roots=args.checkpoint_root,
        broker_args=[
            *(["--state-dir", args.state_dir] if args.state_dir else []),
            *(["--autoscale", "1"] if args.autoscale else []),
            *(["--insecure", "1"] if args.insecure else []),
        ],
    )


def cmd_up(args: argparse.Namespace) -> int:
    from gpu_worker.device import discover_gpus

    gpus = [g["index"] for g in discover_gpus()] if not args.cpu_workers else []
    mesh = up_mesh(args, gpus)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with mesh:
        kind = (
            f"{len(gpus)} GPU worker(s)"
            if gpus
            else f"{mesh.cpu_workers} CPU stand-in worker(s) of {mesh.memory_budget}"
        )
        print(
            f"flowmesh up: broker {mesh.frontend} (workers join at {mesh.backend}), {kind}, "
            f"partitioner; logs in {mesh.run_dir}. Ctrl-C stops everything.",
            flush=True,
        )
        if mesh.metrics_port:
            where = ", ".join(f"{n} :{port}" for n, port in mesh.metrics_ports().items())
            print(f"flowmesh up: Prometheus /metrics on {where}", flush=True)
        dead: list[str] = []
        while not dead and not stop.wait(0.5):
            dead = [c.name for c in mesh.children if c.proc.poll() is not None]
        if dead:
            print(f"stopping: {', '.join(dead)} exited", file=sys.stderr)
            mesh.keep_logs()  # stop says where they are
    print("flowmesh stopped")
    return 1 if dead else 0


def cmd_status(args: argparse.Namespace) -> int:
    if args.watch:
        return watch_status(args)
    with connect(args) as c:
        st = c.status(timeout=args.timeout)
    print(json.dumps(st, indent=2) if args.json else format_status(st))
    return 0


def status_view(st: dict[str, Any] | None, note: str = "") -> Any:
    """The live view of `status --watch` (rich): workers, models and jobs."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    if st is None:
        return Text(note or "waiting for the broker", style="yellow")
    head = Text(
        f"broker up {st['uptime_s']:.0f} s  requests {st['requests']}  completed "
        f"{st['completed']}  errors {st['errors']}  queued {st['queued']}  running batches "
        f"{st['inflight_batches']}  dropped sends {st.get('dropped_sends', 0)}"
    )
    if note:
        head.append(f"  ({note})", style="yellow")
    workers = Table(title="workers", title_justify="left")
    for col in (
        "worker",
        "state",
        "resident / budget",
        "host",
        "loads",
        "load ms",
        "evictions",
        "running",
        "seen s",
        "resident stages",
    ):
        workers.add_column(col, overflow="fold")
    for w in st["workers"]:
        full = w["budget_bytes"] and w["resident_bytes"] > 0.9 * w["budget_bytes"]
        workers.add_row(
            w["name"],
            Text("ready", "green") if w["ready"] else Text("joining", "yellow"),
            Text(
                f"{fmt_bytes(w['resident_bytes'])} / {fmt_bytes(w['budget_bytes'])}",
                "red" if full else "",
            ),
            fmt_bytes(w["host_bytes"]),
            str(w["loads"]),
            f"{w.get('mean_load_ms', 0.0):.1f}",
            str(w["evictions"]),
            str(w["inflight"]),
            Text(f"{w['last_seen_s']:.1f}", "red" if w.get("missed_heartbeats", 0) > 1 else ""),
            ", ".join(w["resident"]) or "-",
        )
    models = Table(title="models", title_justify="left")
    for col in (
        "model",
        "state",
        "bytes",
        "replicas",
        "queue",
        "requests",
        "errors",
        "loads",
        "mean ms",
        "p99 ms",
        "queue ms",
        "load wait ms",
        "run ms",
        "batch",
    ):
        models.add_column(col, overflow="fold")
    for m in st["models"]:
        models.add_row(
            m["name"],
            Text(m["state"], "green" if m["state"] == "ready" else "yellow"),
            fmt_bytes(m["bytes"]),
            "; ".join("+".join(r["workers"]) for r in m["replicas"]) or "-",
            str(m["queue"]),
            str(m["requests"]),
            Text(str(m["errors"]), "red" if m["errors"] else ""),
            str(m["loads"]),
            f"{m['mean_ms']:.1f}",
            f"{m['p99_ms']:.1f}",
            f"{m.get('queue_wait_ms', 0.0):.1f}",
            f"{m.get('load_wait_ms', 0.0):.1f}",
            f"{m.get('run_ms', 0.0):.1f}",
            f"{m.get('mean_batch', 0.0):.1f}",
        )
    parts: list[Any] = [head, workers, models]
    if st.get("jobs"):
        jobs = Table(title="training jobs", title_justify="left")
        for col in ("job", "worker", "state", "step", "loss", "steps/s", "pending", "errors"):
            jobs.add_column(col)
        for j in st["jobs"]:
            jobs.add_row(
                j["name"],
                j["worker"],
                j["state"],
                str(j["step"]),
                "-" if j["last_loss"] is None else f"{j['last_loss']:.4g}",
                f"{j['steps_per_s']:.2f}",
                str(j["pending"]),
                str(j["errors"]),
            )
        parts.append(jobs)
    return Group(*parts)


def watch_status(args: argparse.Namespace, rounds: int | None = None) -> int:
    """`status --watch N`: the live view, asked for every N seconds until Ctrl-C (or `rounds`
    refreshes, for tests). A broker that stops answering is shown, and asked again."""
    from rich.live import Live

    st: dict[str, Any] | None = None
    with connect(args) as c, Live(status_view(None), refresh_per_second=4) as live:
        done = 0
        try:
            while rounds is None or done < rounds:
                try:
                    st, note = c.status(timeout=min(args.timeout, max(2.0, args.watch))), ""
                except Timeout:
                    note = f"no answer from {args.broker}; showing the last status"
                live.update(status_view(st, note))
                done += 1
                if rounds is None or done < rounds:
                    time.sleep(args.watch)
        except KeyboardInterrupt:
            pass
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    with connect(args) as c:
        jobs = c.jobs(timeout=args.timeout)
    if args.json:
        print(json.dumps(jobs, indent=2))
    else:
        print(format_jobs(jobs) if jobs else "no training jobs")
    return 0


class DeployWatch:
    """How far a deploy's weights are read, from the workers' heartbeats in status (each
    reports `preparing`: "model/stage" -> [bytes read, bytes to read] while it reads)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stages: dict[tuple[str, str], list[int]] = {}  # (worker, stage) -> [read, total]

    def update(self, status: dict[str, Any]) -> tuple[int, int]:
        """(bytes read, bytes to read) so far; a stage no longer reported has been read."""
        now = set()
        for w in status.get("workers", []):
            preparing = (w.get("stats") or {}).get("preparing") or {}
            for key, value in preparing.items():
                model, _, stage = key.rpartition("/")
                if model == self.name and isinstance(value, list) and len(value) == 2:
                    self.stages[(w["name"], stage)] = [int(value[0]), int(value[1])]
                    now.add((w["name"], stage))
        for key, value in self.stages.items():
            if key not in now:
                value[0] = value[1]
        return sum(v[0] for v in self.stages.values()), sum(v[1] for v in self.stages.values())


def _deploy_with_progress(c: Client, args: argparse.Namespace, call: Any) -> Any:
    """Run `call` (the deploy) while a bar on stderr shows the weights read so far."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )

    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["info"] = call()
        except BaseException as exc:  # handed to the main thread
            done["error"] = exc

    thread = threading.Thread(target=run, name="deploy", daemon=True)
    watch = DeployWatch(args.name)
    bar = Progress(
        TextColumn(f"[bold]deploy {args.name}: reading weights"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),  # outside a terminal: the final state only
    )
    task = bar.add_task("read", total=None)
    t0 = time.perf_counter()
    thread.start()
    with bar:
        while thread.is_alive():
            thread.join(0.25)
            if not thread.is_alive():
                break
            try:
                read, total = watch.update(c.status(timeout=5))
            except ClientError:
                continue
            if total:
                bar.update(task, completed=read, total=total)
        if "info" in done:
            total = done["info"]["bytes"] * max(1, len(done["info"]["replicas"]))
            bar.update(task, completed=total, total=total)
    if "error" in done:
        raise done["error"]
    print(
        f"deploy {args.name}: weights read in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return done["info"]


def cmd_deploy(args: argparse.Namespace) -> int:
    with connect(args) as c:

        def call() -> Any:
            return c.deploy(
                args.name,
                args.factory,
                kwargs=_kwargs(args.kwargs),
                seed=args.seed,
                weights=args.weights,
                dtype=args.dtype,
                stages=args.stages,
                max_batch_size=args.max_batch,
                replicas=args.replicas,
                timeout=args.timeout,
            )

        show = args.progress or (args.progress is None and sys.stderr.isatty())
        info = _deploy_with_progress(c, args, call) if show else call()
    stages = ", ".join(
        f"stage {s['index']}: blocks {s['blocks'][0]}-{s['blocks'][1] - 1} "
        f"({fmt_bytes(s['bytes'])})"
        for s in info["stages"]
    )
    reps = "; ".join("+".join(r["workers"]) for r in info["replicas"])
    print(f"deployed {info['name']}: {fmt_bytes(info['bytes'])}, {stages}; replicas: {reps}")
    return 0


def cmd_undeploy(args: argparse.Namespace) -> int:
    with connect(args) as c:
        c.undeploy(args.name, timeout=args.timeout)
    print(f"undeployed {args.name}")
    return 0


def cmd_infer(args: argparse.Namespace) -> int:
    import torch

    from flowmesh.build import torch_dtype

    with connect(args) as c:
        if args.input:
            from safetensors.torch import load_file

            inputs: Any = load_file(args.input)
        else:
            st = c.status(timeout=args.timeout)
            model = next((m for m in st["models"] if m["name"] == args.name), None)
            if model is None:
                raise SystemExit(f"no model {args.name!r}")
            declared = model.get("inputs")
            if not declared:
                raise SystemExit(f"{args.name!r} declares no inputs: give --input file")
            inputs = {}
            for name, spec in declared.items():
                shape = [args.batch] + [args.seq if d == -1 else d for d in spec["shape"][1:]]
                dtype = torch_dtype(spec["dtype"])
                inputs[name] = (
                    torch.randn(shape).to(dtype)
                    if dtype.is_floating_point
                    else torch.randint(0, 2, shape).to(dtype)
                )
        out, info = c.infer_with_info(args.name, inputs, timeout=args.timeout)
    outs = out if isinstance(out, dict) else {"output": out}
    for name, t in outs.items():
        print(
            f"{name or 'output'}: {t.dtype} {list(t.shape)} mean {t.float().mean():.6f} "
            f"std {t.float().std():.6f}"
        )
    print(
        f"latency {info['latency_ms']:.1f} ms (queue {info['queue_ms']:.1f}, compute "
        f"{info['compute_ms']:.1f}, waiting for weights {info['load_wait_ms']:.1f}), batch "
        f"{info['batch']}, workers {', '.join(info['workers'])}"
    )
    if args.output:
        from safetensors.torch import save_file

        save_file({k or "output": v.contiguous() for k, v in outs.items()}, args.output)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    kind = "chunks" if args.target else "stages"
    with connect(args) as c:
        plan = c.plan(
            args.factory,
            kwargs=_kwargs(args.kwargs),
            dtype=args.dtype,
            kind=kind,
            stages=args.stages,
            mem_cap=parse_size(args.mem_cap) if args.mem_cap else None,
            target_bytes=parse_size(args.target) if args.target else None,
            optimizer=args.optimizer,
            batch=args.batch,
            measure=args.measure,
            timeout=args.timeout,
        )
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    return 0


class _Progress:
    """Steps done, steps/s and the last loss on stderr (stdout keeps the summary): a rich
    progress bar when rich is installed, else one line rewritten in place."""

    def __init__(self, total: int, name: str) -> None:
        self.total, self.name = total, name
        self.t0 = time.perf_counter()
        self._bar: Any = None
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )
        except ImportError:
            return
        self._bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]} steps/s  loss {task.fields[loss]}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
        )
        self._task = self._bar.add_task(name, total=total, rate="-", loss="-")
        self._bar.start()

    def update(self, done: int, loss: float) -> None:
        rate = f"{done / max(time.perf_counter() - self.t0, 1e-9):.2f}"
        if self._bar is not None:
            self._bar.update(self._task, completed=done, rate=rate, loss=f"{loss:.4f}")
        else:
            line = f"\r{self.name}: step {done}/{self.total}  {rate} steps/s  loss {loss:.4f}"
            print(line, end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.total < 0:
            return
        self.total = -1  # closed: a second close (the error path) prints nothing more
        if self._bar is not None:
            self._bar.stop()
        else:
            print(file=sys.stderr, flush=True)


def cmd_train(args: argparse.Namespace) -> int:
    from client_sdk import train_data
    from flowmesh.spec import ModelSpec

    if args.steps < 1 or args.inflight < 1:
        raise SystemExit("--steps and --inflight must be positive")
    kwargs = _kwargs(args.kwargs)
    name = args.name or f"train-{os.getpid()}"
    if args.data:
        data = train_data.from_file(args.data)
    else:
        spec = ModelSpec(name=name, factory=args.factory, kwargs=kwargs, dtype=args.dtype)
        # The factory runs here only on the meta device, to shape the data: no weights, no
        # values. Its own module is what the user asked for, so it is the allow-list here; the
        # broker and the workers still check theirs.
        module = args.factory.partition(":")[0]
        data = train_data.synthetic(
            spec,
            loss=args.loss,
            samples=args.samples,
            seq=args.seq,
            seed=args.data_seed,
            allow=(module,),
        )
    work = train_data.batches(data, args.batch, args.steps)
    optimizer: dict[str, Any] = {"name": args.optimizer, "lr": args.lr}
    if args.weight_decay is not None:
        optimizer["weight_decay"] = args.weight_decay
    if args.momentum is not None:
        optimizer["momentum"] = args.momentum
    losses: list[float] = []
    saved: dict[str, Any] | None = None
    with connect(args) as c:
        job = c.train_open(
            name,
            args.factory,
            kwargs=kwargs,
            seed=args.seed,
            weights=args.weights,
            resume=args.resume,
            optimizer=None if args.resume else optimizer,
            loss=args.loss,
            batch_size=args.batch,
            clip_grad_norm=args.clip_grad_norm,
            accumulate=args.accumulate,
            dtype=args.dtype,
            chunk_bytes=parse_size(args.chunk_bytes) if args.chunk_bytes else None,
            timeout=args.timeout,
        )
        progress = _Progress(len(work), name)
        t0, seconds = time.perf_counter(), 0.0
        try:
            # A few steps in flight: the worker starts the next one while this process waits.
            pending: deque[Any] = deque()
            for x, y in work:
                pending.append(job.step_async(x, y, timeout=args.timeout))
                if len(pending) >= args.inflight:
                    losses.append(pending.popleft().result(args.timeout + 5).loss)
                    progress.update(len(losses), losses[-1])
            while pending:
                losses.append(pending.popleft().result(args.timeout + 5).loss)
                progress.update(len(losses), losses[-1])
            seconds = time.perf_counter() - t0
            progress.close()
            if args.save:
                saved = job.save(args.save, timeout=args.timeout)
        finally:
            progress.close()
            job.close(timeout=args.timeout)
    rate = len(losses) / max(seconds, 1e-9)
    if args.json:
        print(
            json.dumps(
                {
                    "job": name,
                    "worker": job.info.get("worker"),
                    "data": data.source,
                    "steps": len(losses),
                    "losses": losses,
                    "seconds": seconds,
                    "steps_per_s": rate,
                    "saved": saved,
                }
            )
        )
    else:
        print(
            f"trained {name} on {job.info.get('worker')}: {len(losses)} steps of {args.batch} rows "
            f"from {data.source} in {seconds:.1f} s ({rate:.2f} steps/s); loss "
            f"{losses[0]:.4f} -> {losses[-1]:.4f}"
        )
        if saved is not None:
            print(f"saved to {saved['path']} at step {saved['step']}")
    return 0


SWEEP_KEYS = {
    "name", "factory", "trials", "steps", "eval_every", "concurrency", "pruner",
    "reduction_factor", "objective", "direction", "batch", "loss", "seed", "chunk_bytes", "out",
    "kwargs", "optimizer", "data", "space",
}  # fmt: skip
SWEEP_DATA_KEYS = {"file", "eval_file", "samples", "seq", "seed", "holdout"}
SWEEP_HELP = """Run a hyper-parameter sweep described by a TOML file (scripts/sweep_example.toml):
trials are training jobs on the mesh, driven by Optuna (ask-and-tell) and pruned early by its
successive-halving or Hyperband pruner; a live table on stderr, the results table on stdout, and
trials.json + curves.png in the output directory.

Top-level keys: name (study; jobs are <name>-t<N>), factory (module:callable), trials, steps,
eval_every (steps between held-out evaluations, each reported to the pruner), concurrency
(trials at once, default 2), pruner (successive_halving | hyperband | none), reduction_factor
(default 3), objective (loss | accuracy; default loss), direction (minimize | maximize; default
by objective), batch (rows per step, default 16), loss (cross_entropy | mse), seed (sampler and
initial weights, default 0), chunk_bytes (e.g. "32KiB"), out (output directory, default
sweep-<name>).
Tables: [kwargs] fixed factory keyword arguments; [optimizer] fixed optimizer (name, lr, ...;
default adamw, lr 1e-3); [data] file / eval_file (.safetensors with 'inputs' and 'targets'), or
the built-in synthetic dataset: samples (default 512), seq (16), seed (0); holdout (fraction of
the rows held out for evaluation when there is no eval_file, default 0.2); [space.<param>]
type = "float" | "int" | "categorical" with low, high, log, step or choices. A <param> named
optimizer, lr, weight_decay, momentum or optim.<key> sets the optimizer; any other name is a
factory keyword argument. Relative paths are relative to the TOML file's directory."""


def load_sweep_config(path: str) -> dict[str, Any]:
    """The TOML file of `flowmesh sweep`, checked for unknown keys (a typo would otherwise be
    silently ignored and the sweep run with a default)."""
    import tomllib

    try:
        with open(path, "rb") as f:
            cfg = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SystemExit(f"flowmesh sweep: {path}: {exc}") from None
    unknown = sorted(set(cfg) - SWEEP_KEYS) + [
        f"data.{k}" for k in sorted(set(cfg.get("data", {})) - SWEEP_DATA_KEYS)
    ]
    if unknown:
        raise SystemExit(f"flowmesh sweep: {path}: unknown keys {', '.join(unknown)}")
    missing = [k for k in ("factory", "trials", "steps", "eval_every", "space") if k not in cfg]
    if missing:
        raise SystemExit(f"flowmesh sweep: {path}: missing keys {', '.join(missing)}")
    return cfg


def cmd_sweep(args: argparse.Namespace) -> int:
    from pathlib import Path

    from client_sdk import train_data
    from flowmesh.spec import ModelSpec

    cfg = load_sweep_config(args.config)
    base = Path(args.config).resolve().parent
    name = str(cfg.get("name", f"sweep-{os.getpid()}"))
    factory = str(cfg["factory"])
    kwargs = dict(cfg.get("kwargs", {}))
    loss = str(cfg.get("loss", "cross_entropy"))
    d = cfg.get("data", {})
    eval_data = None
    if "file" in d:
        data = train_data.from_file(str(base / d["file"]))
        if "eval_file" in d:
            eval_data = train_data.from_file(str(base / d["eval_file"]))
    else:
        spec = ModelSpec(name=name, factory=factory, kwargs=kwargs)
        # As in `flowmesh train`: the factory runs here only on the meta device, to shape data.
        data = train_data.synthetic(
            spec,
            loss=loss,
            samples=int(d.get("samples", 512)),
            seq=int(d.get("seq", 16)),
            seed=int(d.get("seed", 0)),
            allow=(factory.partition(":")[0],),
        )
    out = Path(args.out) if args.out else base / str(cfg.get("out", f"sweep-{name}"))
    chunk = cfg.get("chunk_bytes")
    with connect(args) as c:
        try:
            result = c.sweep(
                name=name,
                factory=factory,
                space=cfg["space"],
                data=data,
                eval_data=eval_data,
                holdout_fraction=float(d.get("holdout", 0.2)),
                trials=int(cfg["trials"]),
                steps=int(cfg["steps"]),
                eval_every=int(cfg["eval_every"]),
                objective=str(cfg.get("objective", "loss")),
                direction=cfg.get("direction"),
                pruner=str(cfg.get("pruner", "successive_halving")),
                reduction_factor=int(cfg.get("reduction_factor", 3)),
                concurrency=int(cfg.get("concurrency", 2)),
                kwargs=kwargs,
                optimizer=cfg.get("optimizer"),
                loss=loss,
                batch=int(cfg.get("batch", 16)),
                seed=int(cfg.get("seed", 0)),
                chunk_bytes=parse_size(chunk) if chunk is not None else None,
                out_dir=out,
                show=not (args.quiet or args.json),
                timeout=args.timeout,
            )
        except ValueError as exc:
            raise SystemExit(f"flowmesh sweep: {args.config}: {exc}") from None
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    best = result.best
    states = [t.state for t in result.trials]
    counts = ", ".join(f"{states.count(s)} {s.lower()}" for s in sorted(set(states)))
    print(f"sweep {name}: {len(states)} trials ({counts}) on {data.source}")
    if best is not None:
        params = ", ".join(f"{k}={v!r}" for k, v in best.params.items())
        print(f"best: trial {best.number}, {result.objective} {best.value:.4f} ({params})")
    print(f"saved {result.json_path} and {result.png_path}")
    return 0 if best is not None else 1


def cmd_keys_init(args: argparse.Namespace) -> int:
    d = init_keys(args.dir)
    print(
        f"broker key pair in {d}: broker.key goes to every peer and client, "
        "broker.key_secret stays with the broker"
    )
    return 0


def cmd_keys_add(args: argparse.Namespace) -> int:
    d = args.dir or os.environ.get("FLOWMESH_KEY_DIR")
    if not d:
        raise SystemExit(
            "flowmesh keys add: --dir DIR (or FLOWMESH_KEY_DIR) names the key directory"
        )
    secret = add_key(d, args.name, args.role)
    print(
        f"{args.role} key {args.name!r}: {secret} (give it, with broker.key, to "
        f"{args.name} only); allowed by {secret.with_suffix('.key')}"
    )
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    ring = KeyRing(args.dir)
    rows = [[i.name, i.role] for i in sorted(ring.by_key.values(), key=lambda i: i.name)]
    print(table(rows, ["name", "role"]))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from client_sdk.demo import main as demo

    return demo(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="flowmesh", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def client_cmd(name: str, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        p.add_argument(
            "--broker", default=DEFAULT_ADDRESS, help="broker client endpoint (env FLOWMESH_BROKER)"
        )
        p.add_argument("--timeout", type=float, default=60.0, help="seconds")
        p.add_argument(
            "--keys",
            default=None,
            help="CURVE key of this client, a NAME.key_secret file with broker.key next to it "
            "(env FLOWMESH_KEYS)",
        )
        return p

    p = sub.add_parser("up", help="run broker, partitioner and workers on this machine")
    p.add_argument(
        "--cpu-workers",
        type=int,
        default=0,
        help="CPU stand-in workers instead of one worker per GPU",
    )
    p.add_argument(
        "--memory-budget",
        default=None,
        help="device budget per worker (CPU stand-ins: 1GiB; GPUs: 80%% of free)",
    )
    p.add_argument(
        "--listen", default="127.0.0.1:5555", help="host:port for clients; workers join on port+1"
    )
    p.add_argument("--heartbeat", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker")
    p.add_argument(
        "--train-bytes",
        default=None,
        help="device bytes per worker for training jobs, besides --memory-budget (default: none)",
    )
    p.add_argument(
        "--allow",
        action="append",
        default=None,
        metavar="MODULE",
        help="module allowed to provide model and loss factories, for the whole mesh "
        "(repeatable; default: flowmesh.examples and torch.nn)",
    )
    p.add_argument(
        "--keys",
        default=None,
        help="key directory (flowmesh keys init): CURVE everywhere; the keys of the processes "
        "'up' starts are added to it",
    )
    p.add_argument(
        "--data-root",
        action="append",
        default=None,
        metavar="DIR",
        help="a directory under which clients may name weights files, Hugging Face directories "
        "and checkpoints to resume (repeatable; default: the working directory)",
    )
    p.add_argument(
        "--checkpoint-root",
        action="append",
        default=None,
        metavar="DIR",
        help="a directory under which clients save training checkpoints and resume from them "
        "(repeatable; default: the working directory)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="without --keys, let --listen be a non-loopback address anyway: anyone who reaches "
        "it may deploy, train, register as a worker and read every answer (default: refused)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="Prometheus /metrics: the broker on this port, the partitioner on the next, "
        "worker i on port+2+i (default: off)",
    )
    p.add_argument(
        "--state-dir",
        default=None,
        help="the broker keeps its models, plans, jobs and allow-list here (SQLite), so that a "
        "restarted broker loses nothing (default: in memory only)",
    )
    p.add_argument(
        "--autoscale",
        action="store_true",
        help="add a replica of a model its replicas cannot keep up with, and remove it once the "
        "model cools (never below the deployed count; default: off)",
    )
    p.set_defaults(fn=cmd_up)

    p = sub.add_parser("keys", help="CURVE keys: a broker key pair, then one key per peer")
    keys_sub = p.add_subparsers(dest="keys_cmd", required=True)
    k = keys_sub.add_parser("init", help="create DIR and the broker's key pair in it")
    k.add_argument("dir")
    k.set_defaults(fn=cmd_keys_init)
    k = keys_sub.add_parser("add", help="create (and so allow) the key of a peer or client")
    k.add_argument("name", help="the name it is allowed (a worker's or partitioner's --name)")
    k.add_argument("--role", required=True, choices=ROLES)
    k.add_argument("--dir", default=None, help="the key directory (env FLOWMESH_KEY_DIR)")
    k.set_defaults(fn=cmd_keys_add)
    k = keys_sub.add_parser("list", help="the keys a key directory allows")
    k.add_argument("dir")
    k.set_defaults(fn=cmd_keys_list)

    p = client_cmd("jobs", "show training jobs")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_jobs)

    p = client_cmd("status", "show workers, models and queues")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="a live view, refreshed every SECONDS (default 2) until Ctrl-C",
    )
    p.set_defaults(fn=cmd_status)

    p = client_cmd("deploy", "deploy a model")
    p.add_argument("name")
    p.add_argument("factory", help="module:callable from the broker's allow-list")
    p.add_argument("--kwargs", help="factory keyword arguments as JSON")
    p.add_argument("--seed", type=int, default=None, help="seeded random weights")
    p.add_argument("--weights", default=None, help="safetensors file the workers can read")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--stages", type=int, default=None, help="pipeline stages (default: auto)")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--replicas", type=int, default=None)
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a bar of the weights read so far (default: when stderr is a terminal)",
    )
    p.set_defaults(fn=cmd_deploy, timeout=600.0)

    p = client_cmd("undeploy", "remove a model")
    p.add_argument("name")
    p.set_defaults(fn=cmd_undeploy)

    p = client_cmd("infer", "run one request (random inputs of the declared shape by default)")
    p.add_argument("name")
    p.add_argument("--input", help="safetensors file of named input tensors")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=16, help="size of free dimensions")
    p.add_argument("--output", help="write the outputs to this safetensors file")
    p.set_defaults(fn=cmd_infer)

    p = client_cmd("plan", "plan pipeline stages or training chunks for a model")
    p.add_argument("factory")
    p.add_argument("--kwargs")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--stages", type=int, default=None)
    p.add_argument("--mem-cap", default=None, help="bytes per stage (default: smallest worker)")
    p.add_argument("--target", default=None, help="training chunk target bytes (chunk plan)")
    p.add_argument("--optimizer", default="adam", help="sgd | momentum | adam | adamw")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--measure", action="store_true", help="time each block")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_plan, timeout=120.0)

    p = client_cmd("train", "train a model from a factory for N steps, with a progress bar")
    p.add_argument("factory", help="module:callable from the broker's allow-list")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--name", default=None, help="job name (default: train-<pid>)")
    p.add_argument("--kwargs", help="factory keyword arguments as JSON")
    p.add_argument("--seed", type=int, default=0, help="seeded initial weights and random stream")
    p.add_argument("--weights", default=None, help="safetensors file the workers can read")
    p.add_argument("--resume", default=None, help="checkpoint directory written by --save")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=8, help="rows per step")
    p.add_argument("--optimizer", default="adamw", help="sgd | adam | adamw")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=None)
    p.add_argument("--momentum", type=float, default=None, help="sgd only")
    p.add_argument("--loss", default="cross_entropy", help="cross_entropy | mse")
    p.add_argument("--clip-grad-norm", type=float, default=None)
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    p.add_argument("--chunk-bytes", default=None, help="sub-model target size (e.g. 4MiB)")
    p.add_argument(
        "--data",
        default=None,
        help="a .safetensors file with 'inputs' (or 'inputs/<name>') and 'targets' "
        "(default: the built-in synthetic dataset matched to the model's declared inputs)",
    )
    p.add_argument("--samples", type=int, default=256, help="rows of the synthetic dataset")
    p.add_argument("--seq", type=int, default=16, help="free input dimensions (synthetic)")
    p.add_argument("--data-seed", type=int, default=0, help="synthetic dataset seed")
    p.add_argument("--inflight", type=int, default=2, help="steps sent ahead of their answers")
    p.add_argument("--save", default=None, help="checkpoint directory at the end (on the worker)")
    p.add_argument("--json", action="store_true", help="print the per-step losses as JSON")
    p.set_defaults(fn=cmd_train, timeout=600.0)

    p = client_cmd("sweep", "hyper-parameter sweep from a TOML file (Optuna, with pruning)")
    p.description = SWEEP_HELP
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("config", help="the sweep's TOML file (keys: see above)")
    p.add_argument("--out", default=None, help="output directory (overrides 'out')")
    p.add_argument("--quiet", action="store_true", help="no live table, no results table")
    p.add_argument(
        "--json", action="store_true", help="print the trials as JSON on stdout (and no tables)"
    )
    p.set_defaults(fn=cmd_sweep, timeout=600.0)

    p = sub.add_parser("demo", help="the main job: embedded mesh serving and training")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--memory-budget", default="48MiB")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_demo)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except (ClientError, FlowmeshError) as exc:
        print(f"flowmesh {args.cmd}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
