"""The `flowmesh` command: run the mesh, look at it, deploy, infer, generate, plan, train, sweep
and list jobs."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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

from client_sdk import cli_args
from client_sdk.client import Client
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
from flowmesh.auth import (
    API_KEYS,
    KeyRing,
    add_api_key,
    add_key,
    init_keys,
    read_api_keys,
    remove_api_key,
    remove_key,
)
from flowmesh.errors import FlowmeshError
from flowmesh.reports import BrokerStatus
from flowmesh.units import parse_size
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


def gateway_table(args: argparse.Namespace) -> dict[str, Any] | None:
    """The config file's `[gateway]` table, read as the gateway reads it; None without one."""
    if not args.config:
        return None
    from flowmesh.config import load_section
    from gateway.__main__ import OPTIONS as GATEWAY

    return GATEWAY.read(args.config) if load_section(args.config, "gateway") else None


def gateway_host(args: argparse.Namespace) -> str:
    """The address the gateway `flowmesh up` runs binds: --http-host, else the config file's
    `[gateway]` host, else 127.0.0.1."""
    if args.http_host is not None:
        return str(args.http_host)
    return str((gateway_table(args) or {}).get("host", "127.0.0.1"))


def gateway_port(args: argparse.Namespace) -> int:
    """The port of the gateway `flowmesh up` runs: --http-port, else the config file's
    `[gateway]` port if it has that table (8000 if the table names none); 0: no gateway."""
    if args.http_port is not None:
        return args.http_port
    table = gateway_table(args)
    return 0 if table is None else int(table.get("port", 8000))


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
    if not (port or "5555").isdigit() or int(port or 5555) > 65534:
        raise SystemExit(
            f"flowmesh up: --listen {args.listen}: expected HOST:PORT (127.0.0.1:5555; port 0: "
            "free ports; workers join on PORT+1)"
        )
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


def refuse_open_binds(args: argparse.Namespace, host: str, http_host: str | None) -> None:
    """Stop `up` before anything starts when it would bind where other hosts reach it without
    keys and without --insecure: the broker and the gateway would refuse to start, in their
    logs, naming their own flags (`--insecure 1`, `--insecure-open`), not up's."""
    from flowmesh.exposure import reachable_from_other_hosts
    from gateway.guard import find_api_keys

    if args.insecure:
        return
    if not args.keys and reachable_from_other_hosts(f"tcp://{host}:0"):
        raise SystemExit(
            f"flowmesh up: --listen {args.listen} is not a loopback address, and no --keys: "
            "anyone who reaches it could deploy, train, register as a worker and read every "
            "answer. Give --keys DIR (flowmesh keys init), listen on 127.0.0.1, or pass "
            "--insecure to run without keys anyway"
        )
    if http_host is None or not reachable_from_other_hosts(f"tcp://{http_host}:0"):
        return
    table = gateway_table(args) or {}
    if table.get("insecure_open") or table.get("api_keys") or os.environ.get("FLOWMESH_API_KEYS"):
        return  # (a key file named that is not there: the gateway says so as it starts)
    try:
        api_keys = find_api_keys(None, args.keys)
    except FlowmeshError:
        return  # (the gateway says why as it starts)
    if api_keys is None:
        raise SystemExit(
            f"flowmesh up: the gateway's host {http_host} is not a loopback address, and there "
            "are no API keys: anyone who reaches it could call the mesh. Add one (flowmesh keys "
            "add NAME --role client --api --dir DIR, with --keys DIR), bind 127.0.0.1, or pass "
            "--insecure to serve every caller"
        )


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
    refuse_open_binds(args, host, http_host if http_port else None)
    if http_port and busy(http_host, http_port):
        raise SystemExit(
            f"flowmesh up: port {http_port} (--http-port) is already in use; choose another"
        )
    gpus = [g["index"] for g in discover_gpus()] if not args.cpu_workers else []
    mesh = up_mesh(args, gpus)
    for name, port in mesh.metrics_ports().items():
        if busy("0.0.0.0", port):  # (where each process serves /metrics)
            raise SystemExit(
                f"flowmesh up: port {port} (the {name}'s /metrics: --metrics-port "
                f"{args.metrics_port} and the ports after it, one per process) is already in "
                "use; choose another --metrics-port"
            )
    stop = threading.Event()

    def interrupt(*_: Any) -> None:
        raise KeyboardInterrupt

    # While the mesh starts, Ctrl-C or SIGTERM interrupts the start (which stops what it
    # started); once it runs, they stop it (`run_up`).
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
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
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
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
        if args.close:
            c.train_close(args.close, timeout=args.timeout)
            print(f"training job {args.close!r} closed")
            return 0
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
        timeout = args.timeout if args.drain is None else max(args.timeout, args.drain + 10)
        done = c.undeploy(args.name, timeout=timeout, drain=args.drain)
    said = f"undeployed {args.name}"
    if done.drained or done.cut:
        said += (
            f" after {done.waited_s:.1f} s: {done.drained} generation(s) ended meanwhile, "
            f"{done.cut} cut"
        )
    print(said)
    return 0


def cmd_infer(args: argparse.Namespace) -> int:
    import torch

    from flowmesh.modelio.dtypes import torch_dtype

    if args.output:
        # Checked before the request runs, not once its answer is in hand.
        out_dir = Path(args.output).resolve().parent
        if not out_dir.is_dir() or not os.access(out_dir, os.W_OK):
            raise SystemExit(f"flowmesh infer: --output {args.output}: no writable directory")
    inputs: Any = _read_inputs(args.input) if args.input else None
    with connect(args) as c:
        if inputs is None:
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


def _read_inputs(path: str) -> dict[str, Any]:
    """The named tensors of the safetensors file `path`; a file that does not read stops the
    command with one line."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (OSError, SafetensorError) as exc:
        raise SystemExit(f"flowmesh infer: --input {path}: {exc}") from None


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
    if (args.factory is None) == (args.hf is None):
        raise SystemExit("flowmesh train: give a factory module:callable, or --hf DIR")
    kwargs = _kwargs(args.kwargs)
    name = args.name or f"train-{os.getpid()}"
    if args.data:
        data = train_data.from_file(args.data)
    else:
        # The data's dtypes are the float32 parameters' whatever --dtype computes in.
        spec = ModelSpec(name=name, factory=args.factory, hf=args.hf, kwargs=kwargs)
        # The factory runs here only on the meta device, to shape the data: no weights, no
        # values. Its own module is what the user asked for, so it is the allow-list here; the
        # broker and the workers still check theirs.
        module = (args.factory or "").partition(":")[0]
        try:
            data = train_data.synthetic(
                spec,
                loss=args.loss,
                samples=args.samples,
                seq=args.seq,
                seed=args.data_seed,
                allow=(module,) if module else (),
            )
        except FlowmeshError as exc:
            if args.hf is not None:  # read here too, to shape the data: not only by workers
                raise SystemExit(
                    f"flowmesh train: {exc.reason} (here, in this command's own process: it "
                    f"reads {args.hf!r}'s config to shape synthetic data, so the directory must "
                    "be readable from this shell too; or give --data FILE)"
                ) from None
            if "could not import" not in exc.reason:
                raise
            raise SystemExit(
                f"flowmesh train: {exc.reason} (here, in this command's own process: it builds "
                f"the model on the meta device to shape synthetic data, so {module!r} must be "
                "importable from this shell too, e.g. on its PYTHONPATH; or give --data FILE)"
            ) from None
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
            hf=args.hf,
            kwargs=kwargs,
            # A directory or a weights file brings the weights: the seed is then the job's
            # random stream's alone.
            seed=None if args.hf or args.weights else args.seed,
            rng_seed=args.seed if args.hf or args.weights else None,
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
            pipeline=args.pipeline,
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
                    "pipeline": job.info.pipeline,  # its stages' workers, if pipelined
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
        where = " and ".join(job.info.pipeline) if job.info.pipeline else job.info.worker
        print(
            f"trained {name} on {where}: {len(losses)} steps of {args.batch} rows "
            f"from {data.source} in {seconds:.1f} s ({rate:.2f} steps/s); loss "
            f"{losses[0]:.4f} -> {losses[-1]:.4f}"
        )
        if saved is not None:
            print(f"saved to {saved['path']} at step {saved['step']}")
    return 0


SWEEP_KEYS = {
    "name", "factory", "trials", "steps", "eval_every", "concurrency", "pruner",
    "reduction_factor", "objective", "direction", "batch", "loss", "seed", "chunk_bytes", "out",
    "pipeline", "hf", "idle_close",
    "kwargs", "optimizer", "data", "space",
}  # fmt: skip
SWEEP_DATA_KEYS = {"file", "eval_file", "samples", "seq", "seed", "holdout"}


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
    missing = [k for k in ("trials", "steps", "eval_every", "space") if k not in cfg]
    if ("factory" in cfg) == ("hf" in cfg):
        missing.insert(0, "factory (or hf, a Hugging Face model directory; not both)")
    if missing:
        raise SystemExit(f"flowmesh sweep: {path}: missing keys {', '.join(missing)}")
    return cfg


def cmd_sweep(args: argparse.Namespace) -> int:
    from client_sdk import train_data
    from flowmesh.spec import ModelSpec

    cfg = load_sweep_config(args.config)
    base = Path(args.config).resolve().parent
    name = str(cfg.get("name", f"sweep-{os.getpid()}"))
    factory = str(cfg["factory"]) if "factory" in cfg else None
    # A directory named relative to the config file, as its data files are.
    hf = str(base / str(cfg["hf"])) if "hf" in cfg else None
    kwargs = dict(cfg.get("kwargs", {}))
    loss = str(cfg.get("loss", "cross_entropy"))
    d = cfg.get("data", {})
    eval_data = None
    if "file" in d:
        data = train_data.from_file(str(base / d["file"]))
        if "eval_file" in d:
            eval_data = train_data.from_file(str(base / d["eval_file"]))
    else:
        spec = ModelSpec(name=name, factory=factory, hf=hf, kwargs=kwargs)
        # As in `flowmesh train`: the factory runs here only on the meta device, to shape data.
        data = train_data.synthetic(
            spec,
            loss=loss,
            samples=int(d.get("samples", 512)),
            seq=int(d.get("seq", 16)),
            seed=int(d.get("seed", 0)),
            allow=(factory.partition(":")[0],) if factory else (),
        )
    out = Path(args.out) if args.out else base / str(cfg.get("out", f"sweep-{name}"))
    if args.quiet or args.json:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)  # its line per trial, on stderr
    chunk = cfg.get("chunk_bytes")
    try:
        pipeline = cli_args.pipeline_arg(cfg.get("pipeline", 0))
    except argparse.ArgumentTypeError as exc:
        raise SystemExit(f"flowmesh sweep: {args.config}: {exc}") from None
    with connect(args) as c:
        try:
            result = c.sweep(
                name=name,
                factory=factory,
                hf=hf,
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
                pipeline=pipeline,
                out_dir=out,
                show=not (args.quiet or args.json),
                timeout=args.timeout,
                storage=args.storage,
                heartbeat_interval=args.heartbeat,
                grace_period=args.grace,
                # 0: kept until closed
                idle_close=float(cfg.get("idle_close", 300.0)) or None,
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
    d = _key_dir(args, "add")
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
    d = Path(args.dir)
    rows = []
    if (d / "broker.key").exists():
        ring = KeyRing(args.dir)
        rows += [[i.name, i.role, "curve"] for i in ring.by_key.values()]
    if (d / API_KEYS).exists():
        rows += [[i.name, i.role, "api"] for i in read_api_keys(d / API_KEYS).values()]
    if not rows and not (d / "broker.key").exists():
        raise SystemExit(
            f"flowmesh keys list: {d} holds no keys (no broker.key, no {API_KEYS}): see "
            "'flowmesh keys init' and 'flowmesh keys add'"
        )
    print(table(sorted(rows), ["name", "role", "kind"]))
    return 0


def cmd_keys_remove(args: argparse.Namespace) -> int:
    d = _key_dir(args, "remove")
    if args.api:
        path = remove_api_key(d, args.name)
        print(f"API key {args.name!r} removed from {path}: gateways on it refuse it from now on")
    else:
        path = remove_key(d, args.name)
        print(f"key {args.name!r} removed ({path}): a broker on {d} refuses it from now on")
    return 0


def _key_dir(args: argparse.Namespace, cmd: str) -> str:
    d = args.dir or os.environ.get("FLOWMESH_KEY_DIR")
    if not d:
        raise SystemExit(
            f"flowmesh keys {cmd}: --dir DIR (or FLOWMESH_KEY_DIR) names the key directory"
        )
    return str(d)


def cmd_demo(args: argparse.Namespace) -> int:
    # Imported here, not above: the demo brings torch and the local mesh, which no other
    # command needs (`client_sdk.demo_options`).
    from client_sdk import demo

    return demo.main(args)


def cmd_gateway(args: argparse.Namespace) -> int:
    return gateway_serve(args)


COMMANDS: dict[str, cli_args.Command] = {
    "demo": cmd_demo,
    "deploy": cmd_deploy,
    "gateway": cmd_gateway,
    "generate": cmd_generate,
    "infer": cmd_infer,
    "jobs": cmd_jobs,
    "keys add": cmd_keys_add,
    "keys init": cmd_keys_init,
    "keys list": cmd_keys_list,
    "keys remove": cmd_keys_remove,
    "plan": cmd_plan,
    "status": cmd_status,
    "sweep": cmd_sweep,
    "train": cmd_train,
    "undeploy": cmd_undeploy,
    "up": cmd_up,
}


def build_parser() -> argparse.ArgumentParser:
    return cli_args.build_parser(COMMANDS, __doc__ or "")


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
    except KeyboardInterrupt:
        # Ctrl-C: the call in flight is given up (a generation's connection closes, and the
        # broker stops its sequences); a user pressing it wants no traceback.
        print(f"\nflowmesh {args.cmd}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
