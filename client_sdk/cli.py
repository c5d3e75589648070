"""The `flowmesh` command: run the mesh, look at it, deploy, infer, generate, plan, train, sweep
and list jobs."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import os
import signal
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgspec

from client_sdk import demo_options
from client_sdk.client import DEFAULT_ADDRESS, Client
from client_sdk.errors import ClientError, Timeout, Unavailable
from client_sdk.views import (
    DeployWatch,
    TrainProgress,
    deploy_bar,
    format_deployed,
    format_infer,
    format_jobs,
    format_plan,
    format_status,
    status_view,
    table,
    watch_text,
)
from flowmesh.auth import ROLES, KeyRing, add_api_key, add_key, init_keys
from flowmesh.errors import FlowmeshError
from flowmesh.reports import BrokerStatus
from flowmesh.units import parse_size
from gateway.__main__ import add_options as gateway_options
from gateway.__main__ import serve as gateway_serve


def _json_object(flag: str, text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"{flag} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise SystemExit(f"{flag} must be a JSON object")
    return value


def _kwargs(text: str | None) -> dict[str, Any]:
    return _json_object("--kwargs", text)


def connect(args: argparse.Namespace) -> Client:
    """A client whose broker answered a status request: a wrong address fails in seconds,
    not after a long deploy timeout."""
    client = Client(args.broker, keys=getattr(args, "keys", None))
    try:
        client.status(timeout=min(5.0, args.timeout))
    except (Timeout, Unavailable):  # Unavailable: nothing answered the first contact
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

    host, ports = listen_ports(args)
    config = ["--config", str(Path(args.config).resolve())] if args.config else []
    return LocalMesh(
        cpu_workers=args.cpu_workers or 2,
        memory_budget=args.memory_budget or "1GiB",
        gpus=gpus or None,
        gpu_budget=args.memory_budget if gpus else None,
        host=host,
        frontend_port=ports[0] if ports else 0,
        backend_port=ports[1] if ports else 0,  # port 0: both free ports, chosen at bind
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
            *config,
        ],
        partitioner_args=config,
        worker_args=config,
        http_port=gateway_port(args),
        http_host=gateway_host(args),
        # Open to every caller, as --insecure opens the broker's ports without keys.
        gateway_args=[*config, *(["--insecure-open"] if args.insecure else [])],
        run_dir=Path(args.log_dir).resolve() if args.log_dir else None,
    )


def gateway_host(args: argparse.Namespace) -> str:
    """The address the gateway `flowmesh up` runs binds: --http-host, else the config file's
    `[gateway]` host, else 127.0.0.1."""
    if args.http_host is not None:
        return str(args.http_host)
    if args.config:
        from flowmesh.config import load_section
        from gateway.__main__ import OPTIONS as GATEWAY

        if load_section(args.config, "gateway"):
            return str(GATEWAY.read(args.config).get("host", "127.0.0.1"))
    return "127.0.0.1"


def gateway_port(args: argparse.Namespace) -> int:
    """The port of the gateway `flowmesh up` runs: --http-port, else the config file's
    `[gateway]` port if it has that table (8000 if the table names none); 0: no gateway."""
    if args.http_port is not None:
        return args.http_port
    if not args.config:
        return 0
    from flowmesh.config import load_section
    from gateway.__main__ import OPTIONS as GATEWAY

    if not load_section(args.config, "gateway"):
        return 0
    return int(GATEWAY.read(args.config).get("port", 8000))


def check_config(path: str) -> None:
    """Read each service's table of `flowmesh up --config FILE` as that process will, so that a
    wrong key stops `up` with one line before anything starts."""
    from broker.__main__ import OPTIONS as BROKER
    from flowmesh.config import ConfigError
    from gateway.__main__ import OPTIONS as GATEWAY
    from gpu_worker.__main__ import OPTIONS as WORKER
    from partitioner.__main__ import OPTIONS as PARTITIONER

    for options in (BROKER, PARTITIONER, WORKER, GATEWAY):
        try:
            options.read(path)
        except ConfigError as exc:
            raise SystemExit(f"flowmesh up: {exc}") from None


def listen_ports(args: argparse.Namespace) -> tuple[str, list[int]]:
    """The host and the ports `flowmesh up` binds: clients' on --listen, workers' the next
    (none for port 0: the broker binds free ports, and `up` prints them)."""
    host, _, port = args.listen.rpartition(":")
    first = int(port or 5555)
    return host or "127.0.0.1", [first, first + 1] if first else []


def busy(host: str, port: int) -> bool:
    """Whether something listens on host:port already. SO_REUSEADDR as ZeroMQ binds, so that a
    socket of a stopped mesh still in TIME_WAIT does not count, a listening one does."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host.strip("[]"), port))
        except OSError:
            return True
    return False


def port_in_use(host: str, port: int) -> str:
    return (
        f"flowmesh up: {host}:{port} is already in use: another 'flowmesh up' or broker is "
        f"listening there; stop it, or choose another port with --listen {host}:PORT"
    )


def cmd_up(args: argparse.Namespace) -> int:
    from gpu_worker.device import discover_gpus

    host, ports = listen_ports(args)
    for port in ports:
        if busy(host, port):
            raise SystemExit(port_in_use(host, port))
    if args.config:
        check_config(args.config)
    http_port, http_host = gateway_port(args), gateway_host(args)
    if http_port and busy(http_host, http_port):
        raise SystemExit(
            f"flowmesh up: port {http_port} (--http-port) is already in use; choose another"
        )
    gpus = [g["index"] for g in discover_gpus()] if not args.cpu_workers else []
    mesh = up_mesh(args, gpus)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        dead = run_up(mesh, gpus, stop)
    except FlowmeshError as exc:
        if "Address already in use" in str(exc):  # bound by another between check and start
            raise SystemExit(port_in_use(host, ports[0] if ports else 0)) from None
        raise
    if dead or args.log_dir:
        print("flowmesh stopped")
    else:
        print("flowmesh stopped (its logs are removed: --log-dir DIR keeps them)")
    return 1 if dead else 0


def run_up(mesh: Any, gpus: list[int], stop: threading.Event) -> list[str]:
    """Run the mesh until `stop` is set or one of its processes exits; the names of those that
    exited. Their logs are kept then (the mesh says where)."""
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
        if mesh.http_url:
            print(
                f"flowmesh up: HTTP gateway on port {mesh.http_port} ({mesh.http_url}/v1/models, "
                f"{mesh.http_url}/v2/health/ready)",
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
    return dead


def cmd_status(args: argparse.Namespace) -> int:
    if args.count is not None and not args.watch:
        raise SystemExit("flowmesh status: --count N counts the snapshots of --watch")
    if args.watch:
        return watch_status(args)
    with connect(args) as c:
        st = c.status(timeout=args.timeout)
    print(json.dumps(msgspec.to_builtins(st), indent=2) if args.json else format_status(st))
    return 0


def watch_status(args: argparse.Namespace, rounds: int | None = None) -> int:
    """`status --watch N`: the status asked for every N seconds until Ctrl-C, or `rounds`
    (`--count`) snapshots. On a terminal a live view redrawn in place; elsewhere (a pipe, a file)
    each snapshot as plain text, one after the other. A broker that stops answering is shown,
    and asked again."""
    rounds = rounds if rounds is not None else args.count
    live_view = sys.stdout.isatty()
    st: BrokerStatus | None = None
    with contextlib.ExitStack() as stack:
        c = stack.enter_context(connect(args))
        if live_view:
            from rich.live import Live

            live = stack.enter_context(Live(status_view(None), refresh_per_second=4))
        done = 0
        try:
            while rounds is None or done < rounds:
                try:
                    st, note = c.status(timeout=min(args.timeout, max(2.0, args.watch))), ""
                except Timeout:
                    note = f"no answer from {args.broker}; showing the last status"
                if live_view:
                    live.update(status_view(st, note))
                else:
                    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                    print(f"-- {stamp}\n{watch_text(st, note)}\n", flush=True)
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
        print(json.dumps(msgspec.to_builtins(jobs), indent=2))
    else:
        print(format_jobs(jobs) if jobs else "no training jobs")
    return 0


def _deploy_with_progress(c: Client, args: argparse.Namespace, call: Any) -> Any:
    """Run `call` (the deploy) while a bar on stderr shows the weights read so far."""
    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["info"] = call()
        except BaseException as exc:  # handed to the main thread
            done["error"] = exc

    thread = threading.Thread(target=run, name="deploy", daemon=True)
    watch = DeployWatch(args.name)
    bar = deploy_bar(args.name)
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
            total = done["info"].bytes * max(1, len(done["info"].replicas))
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
    if (args.factory is None) == (args.hf is None):
        raise SystemExit(
            "flowmesh deploy: give the model as a factory (module:callable) or as --hf DIR, "
            "one of the two"
        )
    with connect(args) as c:

        def call() -> Any:
            return c.deploy(
                args.name,
                args.factory,
                hf=args.hf,
                kwargs=_kwargs(args.kwargs),
                seed=args.seed,
                weights=args.weights,
                dtype=args.dtype,
                stages=args.stages,
                max_batch_size=args.max_batch,
                replicas=args.replicas,
                inputs=_json_object("--inputs", args.inputs),
                slo_ms=args.slo_ms,
                max_context=args.max_context,
                max_seqs=args.max_seqs,
                kv_share=args.kv_share,
                timeout=args.timeout,
            )

        show = args.progress or (args.progress is None and sys.stderr.isatty())
        info = _deploy_with_progress(c, args, call) if show else call()
    print(format_deployed(info))
    if args.hf is None and args.weights is None:
        # Said, not left implicit: a model deployed without weights is random, from this seed.
        seed = 0 if args.seed is None else args.seed
        print(f"{args.name}: no weights given: initialised from seed {seed}")
    return 0


def cmd_undeploy(args: argparse.Namespace) -> int:
    with connect(args) as c:
        c.undeploy(args.name, timeout=args.timeout)
    print(f"undeployed {args.name}")
    return 0


def cmd_infer(args: argparse.Namespace) -> int:
    import torch

    from flowmesh.modelio.dtypes import torch_dtype

    with connect(args) as c:
        if args.input:
            from safetensors.torch import load_file

            inputs: Any = load_file(args.input)
        else:
            st = c.status(timeout=args.timeout)
            model = next((m for m in st.models if m.name == args.name), None)
            if model is None:
                raise SystemExit(f"no model {args.name!r}")
            declared = model.inputs
            if not declared:
                raise SystemExit(f"{args.name!r} declares no inputs: give --input file")
            inputs = {}
            for name, spec in declared.items():
                shape = [args.batch] + [args.seq if d == -1 else d for d in spec.shape[1:]]
                dtype = torch_dtype(spec.dtype)
                inputs[name] = (
                    torch.randn(shape).to(dtype)
                    if dtype.is_floating_point
                    else torch.randint(0, 2, shape).to(dtype)
                )
        out, info = c.infer_with_info(args.name, inputs, timeout=args.timeout)
    outs = out if isinstance(out, dict) else {"output": out}
    rows = next(iter(inputs.values())).shape[0] if inputs else 0
    print(format_infer(outs, info, rows))
    if args.output:
        from safetensors.torch import save_file

        save_file({k or "output": v.contiguous() for k, v in outs.items()}, args.output)
    return 0


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise SystemExit(
            f"flowmesh generate: --ids takes integers separated by commas: {text!r}"
        ) from None


def _gen_prompt(args: argparse.Namespace) -> dict[str, Any]:
    """The prompt argument of `generate`: text, --ids, or (--chat) one user message."""
    if (args.prompt is None) == (args.ids is None):
        raise SystemExit("flowmesh generate: give the prompt as text or as --ids, one of the two")
    if args.ids is not None:
        if args.chat:
            raise SystemExit("flowmesh generate: --chat takes a text prompt, not --ids")
        return {"ids": _token_ids(args.ids)}
    if args.chat:
        return {"messages": [{"role": "user", "content": args.prompt}]}
    return {"prompt": args.prompt}


def gen_summary(gen: Any) -> str:
    """The line `flowmesh generate` prints on stderr: how the sequence ended and how fast, by the
    broker's clock (from its receipt of the call to the first token, then token to token)."""
    line = (
        f"finish: {gen.finish_reason}, {gen.completion_tokens} token(s) after a prompt of "
        f"{gen.prompt_tokens}, first token {gen.ttft_ms:.1f} ms"
    )
    between = sum(gen.token_ms)
    if gen.token_ms and between > 0:
        line += f", {len(gen.token_ms) / between * 1000:.1f} tokens/s after it"
    return line


def cmd_generate(args: argparse.Namespace) -> int:
    ask: dict[str, Any] = {
        **_gen_prompt(args),
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
        "ignore_eos": args.ignore_eos,
        "timeout": args.timeout,
    }
    with connect(args) as c:
        if args.json:
            gen = c.generate(args.name, **ask)
            print(json.dumps(dataclasses.asdict(gen)))
            return 0
        with c.generate_stream(args.name, **ask) as stream:
            for chunk in stream:
                # Text as it comes; a model without a tokenizer (--ids) streams its ids.
                piece = (
                    chunk.text if chunk.text is not None else "".join(f"{i} " for i in chunk.ids)
                )
                if piece:  # "" while a character or a possible stop string is incomplete
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            gens = stream.generations
    print()
    assert gens is not None  # the stream ran to its end
    print(gen_summary(gens[0]), file=sys.stderr)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    kind = "chunks" if args.target else "stages"
    optimizer = args.optimizer
    if args.momentum:
        if optimizer != "sgd":
            raise SystemExit("flowmesh plan: --momentum is for --optimizer sgd only")
        optimizer = "sgd_momentum"  # one more state per parameter (flowmesh/modelio/planners.py)
    with connect(args) as c:
        plan = c.plan(
            args.factory,
            kwargs=_kwargs(args.kwargs),
            dtype=args.dtype,
            kind=kind,
            stages=args.stages,
            mem_cap=parse_size(args.mem_cap) if args.mem_cap else None,
            target_bytes=parse_size(args.target) if args.target else None,
            optimizer=optimizer,
            batch=args.batch,
            measure=args.measure,
            timeout=args.timeout,
        )
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from client_sdk import train_data
    from flowmesh.spec import ModelSpec

    if args.steps < 1 or args.inflight < 1:
        raise SystemExit("--steps and --inflight must be positive")
    if args.resume and (args.dtype or args.activations):
        raise SystemExit(
            "--dtype or --activations with --resume: the job continues with the checkpoint's "
            "configuration"
        )
    kwargs = _kwargs(args.kwargs)
    name = args.name or f"train-{os.getpid()}"
    if args.data:
        data = train_data.from_file(args.data)
    else:
        # The data's dtypes are the float32 parameters' whatever --dtype computes in.
        spec = ModelSpec(name=name, factory=args.factory, kwargs=kwargs)
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
            activations=args.activations,
            chunk_bytes=parse_size(args.chunk_bytes) if args.chunk_bytes else None,
            timeout=args.timeout,
        )
        progress = TrainProgress(len(work), name)
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
                    "worker": job.info.worker,
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
            f"trained {name} on {job.info.worker}: {len(losses)} steps of {args.batch} rows "
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
default adamw, lr 1e-3); [data] file / eval_file (a .safetensors file with 'inputs' and
'targets'; any other file is a text corpus for next-byte prediction, in windows of 32 bytes), or
the built-in synthetic dataset: samples (default 512), seq (16), seed (0); holdout (fraction of
the rows held out for evaluation when there is no eval_file, default 0.2); [space.<param>]
type = "float" | "int" | "categorical" with low, high, log, step or choices. A <param> named
optimizer, lr, weight_decay, momentum or optim.<key> sets the optimizer; any other name is a
factory keyword argument. Relative paths are relative to the TOML file's directory.
With --storage, several drivers (on one mesh or several) given the same name share one study:
trials counts its finished trials, whoever ran them, and a dead driver's running trials are
failed and retried by the others (heartbeats every --heartbeat s, --grace s of silence)."""


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
    if args.quiet or args.json:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)  # its line per trial, on stderr
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
                storage=args.storage,
                heartbeat_interval=args.heartbeat,
                grace_period=args.grace,
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
    elif (shared := result.study_best) is not None:  # run by another driver of the study
        params = ", ".join(f"{k}={v!r}" for k, v in shared.params.items())
        print(f"best: trial {shared.number}, {result.objective} {shared.value:.4f} ({params})")
    else:  # say why, also under --quiet (which hides the trials' table)
        failed = [t for t in result.trials if t.state == "FAIL" and t.reason]
        for reason in dict.fromkeys(t.reason for t in failed):
            print(f"flowmesh sweep: a trial failed: {reason}", file=sys.stderr)
    print(f"saved {result.json_path} and {result.png_path}")
    return 0 if best is not None or result.study_best is not None else 1


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
    if args.api:
        path, api_key = add_api_key(d, args.name, args.role)
        # The key is shown this once: only its hash is kept.
        print(api_key)
        print(
            f"{args.role} API key {args.name!r} added to {path} (shown once: only its hash is "
            "kept); send it as 'Authorization: Bearer KEY' to a gateway given that file",
            file=sys.stderr,
        )
        return 0
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
    # Imported here, not above: the demo brings torch and the local mesh, which no other
    # command needs (`client_sdk.demo_options`).
    from client_sdk import demo

    return demo.main(args)


def cmd_gateway(args: argparse.Namespace) -> int:
    return gateway_serve(args)


class Parser(argparse.ArgumentParser):
    """argparse, stricter: no abbreviated flags (`--batc` is not `--batch`; a flag added later
    must not change what an old command line means), and an unknown argument is refused by the
    (sub)command it was given to, with that command's usage and the closest flag it has."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Any = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        ns, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(self.unknown(extra))
        return ns, extra

    def unknown(self, extra: list[str]) -> str:
        msg = f"unrecognized arguments: {' '.join(extra)}"
        flags = [f for a in self._actions for f in a.option_strings if f.startswith("--")]
        for arg in extra:
            if arg.startswith("--"):
                close = difflib.get_close_matches(arg.partition("=")[0], flags, n=1)
                if close:
                    return f"{msg} (did you mean {close[0]}?)"
        return msg


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("flowmesh")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="flowmesh", description=__doc__, allow_abbrev=False)
    ap.add_argument("--version", action="version", version=f"flowmesh {version()}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def add(subs: Any, name: str, help_: str) -> argparse.ArgumentParser:
        # add_parser does not pass the parent's allow_abbrev on: say it for each one.
        p: argparse.ArgumentParser = subs.add_parser(name, help=help_, allow_abbrev=False)
        return p

    def client_cmd(name: str, help_: str) -> argparse.ArgumentParser:
        p = add(sub, name, help_)
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

    p = add(sub, "up", "run broker, partitioner and workers on this machine")
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
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        metavar="PORT",
        help="also run the HTTP gateway (OpenAI and KServe v2 routes) on this port, bound on "
        "127.0.0.1 unless the config's [gateway] table says host = ...; a config file with a "
        "[gateway] table starts it on that table's port (default 8000) without this flag",
    )
    p.add_argument(
        "--http-host",
        default=None,
        metavar="ADDRESS",
        help="the address the gateway binds (default: the config's [gateway] host, else "
        "127.0.0.1); any other than loopback needs API keys (flowmesh keys add NAME --role "
        "client --api, in the --keys directory) or --insecure",
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="TOML file with [broker], [partitioner] and [worker] tables, read by each process "
        "'up' starts as by 'python -m broker --config FILE'; what 'up' sets itself (addresses, "
        "budgets, heartbeat, names, roots, keys) wins over the file",
    )
    p.add_argument(
        "--log-dir",
        default=None,
        metavar="DIR",
        help="the processes' logs go here, and stay (default: a temporary directory, removed "
        "when 'up' stops unless something failed)",
    )
    p.set_defaults(fn=cmd_up)

    p = add(sub, "keys", "CURVE keys: a broker key pair, then one key per peer")
    keys_sub = p.add_subparsers(dest="keys_cmd", required=True)
    k = add(keys_sub, "init", "create DIR and the broker's key pair in it")
    k.add_argument("dir")
    k.set_defaults(fn=cmd_keys_init)
    k = add(keys_sub, "add", "create (and so allow) the key of a peer or client")
    k.add_argument("name", help="the name it is allowed (a worker's or partitioner's --name)")
    k.add_argument("--role", required=True, choices=ROLES)
    k.add_argument("--dir", default=None, help="the key directory (env FLOWMESH_KEY_DIR)")
    k.add_argument(
        "--api",
        action="store_true",
        help="an API key for the HTTP gateway (role client or operator) in DIR/api_keys.json, "
        "printed once on stdout, instead of a CURVE key pair",
    )
    k.set_defaults(fn=cmd_keys_add)
    k = add(keys_sub, "list", "the keys a key directory allows")
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
        help="a live view, refreshed every SECONDS (default 2) until Ctrl-C; when stdout is not "
        "a terminal, one plain-text snapshot every SECONDS",
    )
    p.add_argument(
        "--count", type=int, default=None, metavar="N", help="with --watch: stop after N snapshots"
    )
    p.set_defaults(fn=cmd_status)

    p = client_cmd("deploy", "deploy a model: a factory, or a Hugging Face directory (--hf)")
    p.add_argument("name")
    p.add_argument(
        "factory", nargs="?", default=None, help="module:callable from the broker's allow-list"
    )
    p.add_argument(
        "--hf",
        default=None,
        metavar="DIR",
        help="a local Hugging Face model directory (config.json and safetensors) under the "
        "workers' data roots, instead of a factory",
    )
    p.add_argument("--kwargs", help="factory keyword arguments as JSON")
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="without --weights (or --hf), the model is initialised from this seed (default 0)",
    )
    p.add_argument("--weights", default=None, help="safetensors file the workers can read")
    p.add_argument("--dtype", default="float32", help="float32 | float16 | bfloat16")
    p.add_argument("--stages", type=int, default=None, help="pipeline stages (default: auto)")
    p.add_argument("--max-batch", type=int, default=8, help="most rows batched into a forward")
    p.add_argument("--replicas", type=int, default=None, help="copies of the pipeline")
    p.add_argument(
        "--inputs",
        default=None,
        metavar="JSON",
        help='the inputs when the model declares none: {"x": {"dtype": "float32", "shape": '
        "[-1, 784]}} (-1: a free dimension)",
    )
    p.add_argument("--slo-ms", type=float, default=None, help="latency objective, milliseconds")
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        metavar="N",
        help="language models: the longest sequence, prompt + new tokens (default: the model's "
        "own positions)",
    )
    p.add_argument(
        "--max-seqs",
        type=int,
        default=None,
        metavar="N",
        help="language models: sequences each replica runs at once (default 16)",
    )
    p.add_argument(
        "--kv-share",
        type=float,
        default=None,
        metavar="F",
        help="language models: the share (0, 1] of each worker's serving memory the KV cache of "
        "its stage may take (default 0.5)",
    )
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

    p = client_cmd("generate", "generate text with a language model, printed as it comes")
    p.add_argument("name", help="a model deployed from a Hugging Face directory")
    p.add_argument("prompt", nargs="?", default=None, help="the prompt's text (or --ids)")
    p.add_argument(
        "--ids", default=None, metavar="1,2,3", help="the prompt as token ids, instead of text"
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is one user message, written with the model's chat template",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="the most new tokens (default 16)")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0: the most likely token (greedy)"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1: no cut)")
    p.add_argument("--top-k", type=int, default=0, help="the k most likely tokens (0: no cut)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: unseeded)")
    p.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TEXT",
        help="a stop string: the text ends before it (repeatable)",
    )
    p.add_argument(
        "--ignore-eos", action="store_true", help="go on past the model's end-of-sequence token"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the result (text, ids, finish_reason, counts, timings) as JSON, once done",
    )
    p.set_defaults(fn=cmd_generate)

    # Any torch.optim optimizer by name: the worker (or partitioner) resolves it, and refuses
    # what it cannot run, saying why (flowmesh.optimizers); the CLI does not import torch.
    optimizer_help = "a torch.optim optimizer by name, any case (adam, sgd, rmsprop, nadam, ...)"
    p = client_cmd("plan", "plan pipeline stages or training chunks for a model")
    p.add_argument("factory")
    p.add_argument("--kwargs")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--stages", type=int, default=None)
    p.add_argument("--mem-cap", default=None, help="bytes per stage (default: smallest worker)")
    p.add_argument("--target", default=None, help="training chunk target bytes (chunk plan)")
    p.add_argument("--optimizer", default="adam", help=optimizer_help)
    p.add_argument(
        "--momentum", type=float, default=None, help="sgd only: plan its momentum buffer too"
    )
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
    p.add_argument(
        "--dtype",
        default=None,
        help="what the forward and the loss compute in: float32 (default), or bfloat16, mixed "
        "precision (autocast; the weights, gradients and optimizer state stay float32); "
        "with --resume, the checkpoint's",
    )
    p.add_argument("--batch", type=int, default=8, help="rows per step")
    p.add_argument("--optimizer", default="adamw", help=optimizer_help)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=None)
    p.add_argument("--momentum", type=float, default=None, help="sgd only")
    p.add_argument("--loss", default="cross_entropy", help="cross_entropy | mse")
    p.add_argument("--clip-grad-norm", type=float, default=None)
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    p.add_argument(
        "--activations",
        default=None,
        help="what each sub-model's backward does for its forward's activations: recompute, "
        "keep, or auto (default: whichever the worker measured cheaper)",
    )
    p.add_argument("--chunk-bytes", default=None, help="sub-model target size (e.g. 4MiB)")
    p.add_argument(
        "--data",
        default=None,
        help="a .safetensors file with 'inputs' (or 'inputs/<name>') and 'targets', or any other "
        "file as a text corpus for next-byte prediction in windows of 32 bytes (default: the "
        "built-in synthetic dataset matched to the model's declared inputs)",
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
    p.add_argument(
        "--storage",
        default=None,
        help="Optuna storage shared by every driver of the study 'name': sqlite:///PATH, "
        "postgresql+psycopg://USER@HOST/DB or journal:PATH (default: in memory, this driver only)",
    )
    p.add_argument(
        "--heartbeat", type=int, default=5, help="seconds between a driver's heartbeats (RDB)"
    )
    p.add_argument(
        "--grace",
        type=int,
        default=None,
        help="seconds without a heartbeat before a trial is failed and retried (default 2x)",
    )
    p.set_defaults(fn=cmd_sweep, timeout=600.0)

    p = add(sub, "demo", "the main job: embedded mesh serving, generating and training")
    demo_options.add_options(p)
    p.set_defaults(fn=cmd_demo)

    p = add(sub, "gateway", "HTTP gateway: OpenAI-compatible and KServe v2 routes to the mesh")
    gateway_options(p)
    p.set_defaults(fn=cmd_gateway)
    return ap


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return run(argv)
        finally:
            sys.stdout.flush()  # a reader gone away shows here, not at the interpreter's exit
    except BrokenPipeError:
        # `flowmesh status | head`: the reader has what it wanted. Exit quietly, with stdout on
        # /dev/null so that Python's own flush at exit does not fail once more (the recipe of
        # https://docs.python.org/3/library/signal.html#note-on-sigpipe).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except (ClientError, FlowmeshError) as exc:
        print(f"flowmesh {args.cmd}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
