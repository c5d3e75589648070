"""Serving benchmark: a bursty trace over more models than fit, against Ray Serve multiplexing.

N models, each `Sequential(Linear(W, W), GELU) x depth`, seeded and written by this script as
safetensors files into a temporary directory, together with a factory module (`bench_zoo`) that
the mesh is allowed to run (`LocalMesh(allow=...)`). A seeded trace: Gamma inter-arrivals (mean
rate `--rate`, coefficient of variation `--cv`), Zipf popularity (`--zipf`, popularity order
shuffled), 1 to `--max-rows` rows per request. It is replayed open loop: each request is sent at
its trace time whatever the earlier ones are doing, and its latency counts from that time (so a
client that falls behind shows in the figures). Every answer is checked afterwards against a
direct torch forward of the same weights (`flowmesh.testing.assert_forward_close`).

Configurations, one after the other in the same run, same trace, same files:

1. `flowmesh`: as shipped. `LocalMesh`, one CPU worker whose budget holds `--fit` models (a
   quarter by default), models deployed with their default `max_batch_size` (8).
2. `no batching`: the same with `max_batch_size=1` at deploy.
3. `bound`: the same as 1 with a budget for every model (everything resident).
4. Ablations of the residency policy, otherwise as 1: `lru` (least recently used by bytes,
   on broker and worker: `--eviction lru`), `computron` (Computron's count-based LRU, all of a
   model's stages loading at once, no prefetch: broker `--eviction count --prefetch 0`, worker
   `--eviction lru`), `no-prefetch` (broker `--prefetch 0`).
5. `ray`: Ray Serve model multiplexing, `@serve.multiplexed(max_num_models_per_replica=fit)`,
   one replica, `max_ongoing_requests` raised (`--ray-max-ongoing`) so that its router does not
   stall; called through a `DeploymentHandle` (no HTTP), loading each model from its
   safetensors file on a miss. Ray runs in its own virtual environment (`--ray-venv`, made and
   filled by this script: `pip install "ray[serve]" torch==<this torch>`), as a subprocess of
   that venv's python that reads the trace and models from the temporary directory and writes
   its answers back; Ray is never imported in flowmesh's environment. If it cannot be installed
   or started, it is reported as skipped, with the reason, and the rest still runs.

Writes `serving.json` and `serving_cdf.png` (latency CDFs) under `--out`.

    python scripts/bench_serving.py [--models 8] [--depth 4] [--fit 2] [--requests 400] \
        [--rate 8] [--cv 4] [--zipf 1.1] [--seed 0] [--rounds 1] [--skip-ray] [--out bench-out]

Defaults (8 models of 64 MiB, 400 requests at 8/s) take about 5 minutes per round on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

# This file also runs inside the Ray venv (`--ray-runner`), where flowmesh is not installed:
# flowmesh imports stay inside the functions that run in flowmesh's environment.

ZOO = '''"""Factory module written by scripts/bench_serving.py."""
from torch import nn


def stack(width: int = 2048, depth: int = 4) -> nn.Module:
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())]
    model = nn.Sequential(*layers)
    model.flowmesh_inputs = {"x": {"dtype": "float32", "shape": [-1, width]}}
    return model
'''

# Ablations: (label, broker flags, worker flags), each otherwise as `flowmesh`.
ABLATIONS = {
    "lru": ("LRU by bytes", ["--eviction", "lru"], ["--eviction", "lru"]),
    "computron": (
        "count-based LRU, no prefetch (Computron)",
        ["--eviction", "count", "--prefetch", "0"],
        ["--eviction", "lru"],
    ),
    "no-prefetch": ("no prefetch", ["--prefetch", "0"], []),
}


def build(width: int, depth: int) -> nn.Sequential:
    """The same architecture as `bench_zoo.stack`."""
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())])


async def replay(trace: list[dict[str, Any]], one: Any) -> float:
    """Open loop: start `one(i, at)` at each request's trace time, whatever the earlier ones are
    doing; returns the seconds from the trace's start until every request is answered. (Used by
    flowmesh's side and by the Ray runner, which runs this file in its own venv.)"""
    tasks = []
    t0 = time.perf_counter() + 0.2
    for i, r in enumerate(trace):
        at = t0 + r["t"]
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, at)))
    await asyncio.gather(*tasks)
    return time.perf_counter() - t0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary(lat: list[float]) -> dict[str, float]:
    return {
        "mean_ms": sum(lat) / len(lat) if lat else float("nan"),
        "p50_ms": percentile(lat, 50),
        "p99_ms": percentile(lat, 99),
        "max_ms": max(lat) if lat else float("nan"),
    }


# --------------------------------------------------------------------------- the workload


def make_trace(args: argparse.Namespace, names: list[str]) -> list[dict[str, Any]]:
    """[{"t": seconds, "model": name, "rows": n}]: Gamma renewal arrivals, Zipf popularity."""
    rng = random.Random(args.seed)
    shape = 1.0 / (args.cv * args.cv)
    order = names[:]
    rng.shuffle(order)
    weights = [1.0 / (k + 1) ** args.zipf for k in range(len(order))]
    t, trace = 0.0, []
    for _ in range(args.requests):
        t += rng.gammavariate(shape, 1.0 / (args.rate * shape))
        model = rng.choices(order, weights)[0]
        trace.append({"t": t, "model": model, "rows": rng.randint(1, args.max_rows)})
    return trace


def write_workload(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Models, factory module, trace and inputs into `work`; returns the run's config."""
    names = [f"m{k}" for k in range(args.models)]
    (work / "models").mkdir(parents=True, exist_ok=True)
    (work / "bench_zoo.py").write_text(ZOO)
    paths = {}
    for k, name in enumerate(names):
        torch.manual_seed(args.seed * 1000 + k)
        model = build(args.width, args.depth)
        path = work / "models" / f"{name}.safetensors"
        save_file({n: t.contiguous() for n, t in model.state_dict().items()}, str(path))
        paths[name] = str(path)
    model_bytes = args.depth * (args.width * args.width + args.width) * 4
    trace = make_trace(args, names)
    gen = torch.Generator().manual_seed(args.seed + 1)
    inputs = {
        f"r{i}": torch.randn(r["rows"], args.width, generator=gen) for i, r in enumerate(trace)
    }
    save_file(inputs, str(work / "inputs.safetensors"))
    (work / "trace.json").write_text(json.dumps(trace))
    cfg = {
        "names": names,
        "paths": paths,
        "width": args.width,
        "depth": args.depth,
        "model_bytes": model_bytes,
        "fit": args.fit,
        "threads": args.threads,
        "timeout_s": args.timeout,
        "ray_max_ongoing": args.ray_max_ongoing,
    }
    (work / "config.json").write_text(json.dumps(cfg))
    return cfg


def expected_outputs(
    cfg: dict[str, Any], trace: list[dict[str, Any]], inputs: dict[str, torch.Tensor]
) -> dict[int, torch.Tensor]:
    """Each request's answer from a direct forward (one forward per model over all its
    requests' rows, then split: the same forward up to floating-point reordering)."""
    by_model: dict[str, list[int]] = {}
    for i, r in enumerate(trace):
        by_model.setdefault(r["model"], []).append(i)
    out: dict[int, torch.Tensor] = {}
    with torch.inference_mode():
        for name, idx in by_model.items():
            model = build(cfg["width"], cfg["depth"])
            model.load_state_dict(load_file(cfg["paths"][name]))
            xs = [inputs[f"r{i}"] for i in idx]
            ys = model(torch.cat(xs)).split([x.shape[0] for x in xs])
            out.update({i: y.clone() for i, y in zip(idx, ys, strict=True)})
            del model
    return out


def check_outputs(
    label: str, outputs: dict[int, torch.Tensor], expected: dict[int, torch.Tensor]
) -> tuple[int, list[str]]:
    from flowmesh.testing import assert_forward_close

    bad = []
    for i, y in outputs.items():
        try:
            assert_forward_close(y, expected[i], f"{label} request {i}")
        except AssertionError as exc:
            bad.append(str(exc).splitlines()[0])
    return len(outputs) - len(bad), bad


# --------------------------------------------------------------------------- flowmesh


def flowmesh_config(
    label: str,
    cfg: dict[str, Any],
    work: Path,
    trace: list[dict[str, Any]],
    inputs: dict[str, torch.Tensor],
    fit: int,
    max_batch_size: int,
    clients: int,
    broker_args: list[str] | None = None,
    worker_args: list[str] | None = None,
) -> dict[str, Any]:
    import uvloop

    from client_sdk.client import AsyncClient
    from client_sdk.errors import ClientError
    from client_sdk.mesh import LocalMesh

    budget = fit * cfg["model_bytes"] + (8 << 20)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(work), os.environ.get("PYTHONPATH")) if p)}
    mesh = LocalMesh(
        cpu_workers=1,
        memory_budget=str(budget),
        allow=["bench_zoo"],
        threads_per_worker=cfg["threads"],
        env=env,
        data_roots=[work / "models"],  # where the models' weights files are
        ready_timeout_s=120.0,
        broker_args=list(broker_args or []),
        worker_args=list(worker_args or []),
    )
    print(
        f"  [{label}] starting the mesh: 1 CPU worker, budget {budget / 2**20:.0f} MiB "
        f"({fit} of {len(cfg['names'])} models), max_batch_size {max_batch_size}",
        flush=True,
    )
    t_start = time.perf_counter()
    with mesh:
        start_s = time.perf_counter() - t_start

        async def run() -> dict[str, Any]:
            addr = mesh.frontend
            async with AsyncClient(addr, timeout=600, keys=mesh.client_keys or False) as admin:
                t = time.perf_counter()
                for name in cfg["names"]:
                    await admin.deploy(
                        name,
                        "bench_zoo:stack",
                        kwargs={"width": cfg["width"], "depth": cfg["depth"]},
                        weights=cfg["paths"][name],
                        max_batch_size=max_batch_size,
                    )
                deploy_s = time.perf_counter() - t
                await asyncio.sleep(1.5)  # let the worker's heartbeat settle the status
                before = await admin.status()
                conns = [
                    AsyncClient(addr, timeout=cfg["timeout_s"], keys=mesh.client_keys or False)
                    for _ in range(clients)
                ]
                for c in conns:
                    await c.status()  # connect before the clock starts
                lat: dict[int, float] = {}
                lag: list[float] = []
                outs: dict[int, torch.Tensor] = {}
                errors: Counter[str] = Counter()
                batches: list[int] = []

                async def one(i: int, at: float) -> None:
                    r = trace[i]
                    lag.append(time.perf_counter() - at)
                    try:
                        y, info = await conns[i % clients].infer_with_info(
                            r["model"], inputs[f"r{i}"], timeout=cfg["timeout_s"]
                        )
                    except ClientError as exc:
                        errors[str(exc.code)] += 1
                        return
                    lat[i] = (time.perf_counter() - at) * 1000
                    outs[i] = y.clone()
                    if isinstance(info.get("batch"), int):
                        batches.append(info["batch"])

                wall = await replay(trace, one)
                after = await admin.status()
                for c in conns:
                    await c.close()
            return {
                "lat": lat,
                "lag": lag,
                "outs": outs,
                "errors": dict(errors),
                "batches": batches,
                "before": before,
                "after": after,
                "wall_s": wall,
                "deploy_s": deploy_s,
            }

        got = uvloop.run(run())
    before = {m.name: m for m in got["before"].models}
    after = {m.name: m for m in got["after"].models}
    loads = {n: after[n].loads - before[n].loads for n in cfg["names"]}
    evictions = {n: after[n].evictions - before[n].evictions for n in cfg["names"]}
    workers = got["after"].workers
    lat = [got["lat"][i] for i in sorted(got["lat"])]
    return {
        "label": label,
        "budget_bytes": budget,
        "fit": fit,
        "max_batch_size": max_batch_size,
        "mesh_start_s": start_s,
        "deploy_s": got["deploy_s"],
        "wall_s": got["wall_s"],
        "latencies_ms": lat,
        "latency_by_request": got["lat"],
        "outputs": got["outs"],
        "errors": got["errors"],
        "send_lag_p99_ms": 1000 * percentile(got["lag"], 99),
        "loads": sum(loads.values()),
        "evictions": sum(evictions.values()),
        "loads_by_model": loads,
        "evictions_by_model": evictions,
        "stages": {n: len(after[n].stages) for n in cfg["names"]},
        # Requests in the batch each request ran in, averaged over requests.
        "mean_batch": sum(got["batches"]) / len(got["batches"]) if got["batches"] else None,
        "worker_mean_load_ms": [w.mean_load_ms for w in workers],
        **summary(lat),
    }


# --------------------------------------------------------------------------- Ray (its own venv)


def ray_venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


# Ray's own processes (GCS, raylet, Serve controller, replica, driver) take about 1 GiB here.
RAY_MIN_MEMORY = 2 << 30


def mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def ensure_ray_venv(venv: Path, timeout_s: float) -> tuple[bool, str]:
    """(ok, detail): a venv at `venv` with ray[serve] and this process's torch, installing them if
    missing. Never touches the current environment."""
    avail = mem_available()
    if avail is not None and avail < RAY_MIN_MEMORY:
        return False, (
            f"{avail / 2**30:.1f} GiB of memory available, Ray needs about "
            f"{RAY_MIN_MEMORY / 2**30:.0f} GiB beside the models"
        )
    py = ray_venv_python(venv)
    want_torch = torch.__version__.split("+")[0]
    probe = [
        str(py),
        "-c",
        "import ray, torch, safetensors; from ray import serve; "
        "print(ray.__version__, torch.__version__)",
    ]
    if py.exists():
        r = subprocess.run(probe, capture_output=True, text=True, timeout=120)
        if r.returncode == 0 and r.stdout.split()[1].split("+")[0] == want_torch:
            return True, f"ray {r.stdout.split()[0]}, torch {r.stdout.split()[1]} (venv reused)"
    t = time.perf_counter()
    try:
        if not py.exists():
            subprocess.run(
                [sys.executable, "-m", "venv", "--clear", str(venv)],
                check=True,
                capture_output=True,
                timeout=300,
            )
        r = subprocess.run(
            [
                str(py),
                "-m",
                "pip",
                "install",
                "-q",
                "ray[serve]",
                f"torch=={want_torch}",
                "safetensors",
                "numpy",
            ],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return False, f"pip install ray[serve] did not finish in {timeout_s:.0f} s"
    except subprocess.CalledProcessError as exc:
        return False, f"could not make the venv: {exc.stderr!r}"[:500]
    if r.returncode != 0:
        tail = [ln for ln in r.stderr.splitlines() if "is ignored" not in ln][-5:]
        return False, "pip install ray[serve] failed: " + " | ".join(tail)
    r = subprocess.run(probe, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        return False, "ray installed but does not import: " + r.stderr.strip()[-300:]
    took = time.perf_counter() - t
    ray_v, torch_v = r.stdout.split()[:2]
    return True, f"ray {ray_v}, torch {torch_v} (installed in {took:.0f} s)"


def ray_runner(work: Path) -> None:
    """Runs inside the Ray venv: serve every model through one multiplexed replica, replay the
    trace open loop, write latencies and answers into `work`."""
    import ray
    from ray import serve

    cfg = json.loads((work / "config.json").read_text())
    trace = json.loads((work / "trace.json").read_text())
    inputs = load_file(str(work / "inputs.safetensors"))

    # Stop by itself (Ray shut down properly) before the parent's deadline kills it.
    def overdue(*_: object) -> None:
        raise TimeoutError(f"the Ray run took more than {cfg['ray_deadline_s']:.0f} s")

    signal.signal(signal.SIGALRM, overdue)
    signal.alarm(int(cfg["ray_deadline_s"]))
    try:
        ray_serve_trace(work, cfg, trace, inputs)
    finally:
        signal.alarm(0)
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


def ray_serve_trace(
    work: Path, cfg: dict[str, Any], trace: list[dict[str, Any]], inputs: dict[str, torch.Tensor]
) -> None:
    import ray
    from ray import serve

    width, depth, fit, threads = cfg["width"], cfg["depth"], cfg["fit"], cfg["threads"]
    paths = cfg["paths"]
    t = time.perf_counter()
    ray.init(
        num_cpus=max(2, os.cpu_count() or 2),
        include_dashboard=False,
        object_store_memory=256 << 20,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        configure_logging=False,
        _temp_dir=str(work / "ray"),  # removed with the run's temporary directory
    )
    serve.start(http_options={"host": "127.0.0.1", "location": "NoServer"})

    @serve.deployment(
        num_replicas=1,
        max_ongoing_requests=cfg["ray_max_ongoing"],
        ray_actor_options={"num_cpus": 1},
    )
    class Multiplexed:
        def __init__(self) -> None:
            torch.set_num_threads(threads)
            self.loads: Counter[str] = Counter()
            self.load_s = 0.0

        @serve.multiplexed(max_num_models_per_replica=fit)
        async def get_model(self, model_id: str) -> nn.Module:
            self.loads[model_id] += 1
            t = time.perf_counter()
            model = await asyncio.to_thread(self._load, model_id)
            self.load_s += time.perf_counter() - t
            return model

        @staticmethod
        def _load(model_id: str) -> nn.Module:
            with torch.device("meta"):
                model = build(width, depth)
            model.load_state_dict(load_file(paths[model_id]), assign=True)
            return model.eval()

        @staticmethod
        def _run(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
            with torch.inference_mode():
                return model(x)

        async def __call__(self, x: torch.Tensor) -> torch.Tensor:
            model = await self.get_model(serve.get_multiplexed_model_id())
            return await asyncio.to_thread(self._run, model, x)

        def stats(self) -> dict[str, Any]:
            n = sum(self.loads.values())
            return {"loads": dict(self.loads), "mean_load_ms": 1000 * self.load_s / n if n else 0}

    handle = serve.run(Multiplexed.bind(), name="bench", route_prefix=None)
    start_s = time.perf_counter() - t

    async def drive() -> dict[str, Any]:
        await handle.stats.remote()  # the router is up before the clock starts
        lat: dict[int, float] = {}
        lag: list[float] = []
        outs: dict[str, torch.Tensor] = {}
        errors: Counter[str] = Counter()

        async def one(i: int, at: float) -> None:
            r = trace[i]
            lag.append(time.perf_counter() - at)
            try:
                resp = handle.options(multiplexed_model_id=r["model"]).remote(inputs[f"r{i}"])
                y = await asyncio.wait_for(resp, cfg["timeout_s"])
            except Exception as exc:  # any failure is counted, by type
                errors[type(exc).__name__] += 1
                return
            lat[i] = (time.perf_counter() - at) * 1000
            outs[f"r{i}"] = y.contiguous()

        wall = await replay(trace, one)
        stats = await handle.stats.remote()
        return {
            "lat": lat,
            "lag": lag,
            "outs": outs,
            "errors": dict(errors),
            "wall_s": wall,
            "stats": stats,
        }

    got = asyncio.run(drive())
    save_file(got.pop("outs"), str(work / "ray_out.safetensors"))
    got["start_s"] = start_s
    got["ray_version"] = ray.__version__
    got["torch_version"] = torch.__version__
    got["node_ip"] = ray.util.get_node_ip_address()
    (work / "ray_result.json").write_text(json.dumps(got))


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group that `proc` leads; SIGKILL what is left of it after 15 s."""
    deadline = time.monotonic() + 15.0
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        deadline = time.monotonic() + 5.0
    proc.poll()


def ray_config(
    args: argparse.Namespace, cfg: dict[str, Any], work: Path, venv_detail: str
) -> dict[str, Any]:
    py = ray_venv_python(Path(args.ray_venv).resolve())
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # Loopback only: without this Ray trades 127.0.0.1 for the machine's own address
    # (`resolve_ip_for_localhost`); this is Ray's switch for one-machine clusters.
    env.update(
        {
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "PYTHONUNBUFFERED": "1",
        }
    )
    log = Path(args.out) / "ray.log"
    for stale in ("ray_result.json", "ray_out.safetensors"):
        (work / stale).unlink(missing_ok=True)
    print(f"  [ray] {venv_detail}; starting Ray (log: {log})", flush=True)
    limit = args.ray_timeout or 300 + 4 * float(
        json.loads((work / "trace.json").read_text())[-1]["t"]
    )
    (work / "config.json").write_text(json.dumps({**cfg, "ray_deadline_s": max(1, limit - 30)}))
    with open(log, "a") as fh:
        try:
            # Its own process group: Ray's daemons (GCS, raylet, workers) are its children, and
            # a run that overstays is stopped with all of them.
            proc = subprocess.Popen(
                [str(py), str(Path(__file__).resolve()), "--ray-runner", str(work)],
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(work),
                start_new_session=True,
            )
        except OSError as exc:
            return {"label": "ray", "skipped": f"could not start Ray's python: {exc}"}
        try:
            rc = proc.wait(limit)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            return {"label": "ray", "skipped": f"the Ray run did not finish in {limit:.0f} s"}
        except BaseException:
            stop_group(proc)
            raise
    if rc != 0 or not (work / "ray_result.json").exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-1:]
        return {"label": "ray", "skipped": f"Ray exited with {rc}: " + " | ".join(tail)}
    got = json.loads((work / "ray_result.json").read_text())
    outs = load_file(str(work / "ray_out.safetensors"))
    lat_by = {int(i): v for i, v in got["lat"].items()}
    lat = [lat_by[i] for i in sorted(lat_by)]
    loads = got["stats"]["loads"]
    n_loads = sum(loads.values())
    return {
        "label": "ray",
        "versions": f"ray {got['ray_version']}, torch {got['torch_version']}",
        "node_ip": got.get("node_ip"),
        "fit": cfg["fit"],
        "max_batch_size": 1,
        "mesh_start_s": got["start_s"],
        "wall_s": got["wall_s"],
        "latencies_ms": lat,
        "latency_by_request": lat_by,
        "outputs": {int(k[1:]): v for k, v in outs.items()},
        "errors": got["errors"],
        "send_lag_p99_ms": 1000 * percentile(got["lag"], 99),
        "loads": n_loads,
        # An LRU of `fit` models: every load beyond the first `fit` evicted one.
        "evictions": max(0, n_loads - cfg["fit"]),
        "loads_by_model": loads,
        "mean_load_ms_ray": got["stats"]["mean_load_ms"],
        **summary(lat),
    }


# --------------------------------------------------------------------------- report


def pool(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """One config's rounds together: latencies pooled, loads per round."""
    if any("skipped" in r for r in rs):
        return next(r for r in rs if "skipped" in r)
    lat = [x for r in rs for x in r["latencies_ms"]]
    errors: Counter[str] = Counter()
    for r in rs:
        errors.update(r["errors"])
    batches = [r["mean_batch"] for r in rs if r.get("mean_batch")]
    keep = ("round", "loadavg_1m", "mean_ms", "p50_ms", "p99_ms", "loads", "evictions")
    return {
        "label": rs[0]["label"],
        "rounds": len(rs),
        "checked": sum(len(r["latencies_ms"]) + len(r["wrong"]) for r in rs),
        "checked_ok": sum(r["checked_ok"] for r in rs),
        "wrong": [w for r in rs for w in r["wrong"]],
        "errors": dict(errors),
        "loads": [r["loads"] for r in rs],
        "evictions": [r["evictions"] for r in rs],
        "mean_batch": sum(batches) / len(batches) if batches else 1.0,
        "latencies_ms": lat,
        **summary(lat),
        "per_round": [{k: r.get(k) for k in keep} for r in rs],
        "runs": [{k: v for k, v in r.items() if k not in ("latencies_ms",)} for r in rs],
    }


def fmt(x: float | None, digits: int = 1) -> str:
    if x is None or x != x:
        return "-"
    return f"{x:,.{digits}f}"


def report(results: list[dict[str, Any]], args: argparse.Namespace, n_req: int) -> str:
    ran = {r["label"]: r for r in results if "skipped" not in r}
    ray = ran.get("ray")
    bound = ran.get("bound")
    head = [
        "config",
        "ok/checked",
        "errors",
        "mean ms",
        "p50 ms",
        "p99 ms",
        "loads",
        "evictions",
        "mean batch",
        "mean/Ray",
        "p99/Ray",
        "mean/bound",
        "p99/bound",
    ]
    rows = []
    for r in results:
        if "skipped" in r:
            rows.append([r["label"], f"skipped: {r['skipped']}"] + [""] * (len(head) - 2))
            continue

        def ratio(ref: dict[str, Any] | None, key: str, r: dict[str, Any] = r) -> str:
            return fmt(r[key] / ref[key], 2) if ref else "-"

        ok = f"{r['checked_ok']}/{n_req * r['rounds']}"
        rows.append(
            [
                r["label"],
                ok,
                str(sum(r["errors"].values())),
                fmt(r["mean_ms"]),
                fmt(r["p50_ms"]),
                fmt(r["p99_ms"]),
                " / ".join(map(str, r["loads"])),
                " / ".join(map(str, r["evictions"])),
                fmt(r["mean_batch"], 2),
                ratio(ray, "mean_ms"),
                ratio(ray, "p99_ms"),
                ratio(bound, "mean_ms"),
                ratio(bound, "p99_ms"),
            ]
        )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def round_table(results: list[dict[str, Any]]) -> str:
    head = ["config", "round", "mean ms", "p50 ms", "p99 ms", "loads", "load average (1 min)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        for x in r.get("per_round", []):
            cells = [
                r["label"],
                str(x["round"] + 1),
                fmt(x["mean_ms"]),
                fmt(x["p50_ms"]),
                fmt(x["p99_ms"]),
                str(x["loads"]),
                f"{x['loadavg_1m'][0]:.1f} -> {x['loadavg_1m'][1]:.1f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        if "skipped" in r or not r["latencies_ms"]:
            continue
        s = sorted(r["latencies_ms"])
        ax.plot(s, [(k + 1) / len(s) for k in range(len(s))], label=r["label"])
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("latency from trace arrival (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", type=int, default=8)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=4, help="Linear+GELU pairs per model")
    ap.add_argument("--fit", type=int, default=None, help="models in memory (default N/4)")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rate", type=float, default=8.0, help="mean requests per second")
    ap.add_argument("--cv", type=float, default=4.0, help="inter-arrival CV (1 = Poisson)")
    ap.add_argument("--zipf", type=float, default=1.1, help="popularity skew")
    ap.add_argument("--max-rows", type=int, default=4, help="rows per request: 1..max")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch threads: worker, Ray replica")
    ap.add_argument("--clients", type=int, default=4, help="flowmesh client connections")
    ap.add_argument("--timeout", type=float, default=60.0, help="per request, seconds")
    ap.add_argument(
        "--configs",
        default="flowmesh,no-batching,lru,computron,no-prefetch,bound,ray",
        help="comma-separated subset of flowmesh,no-batching,lru,computron,no-prefetch,bound,ray",
    )
    ap.add_argument(
        "--rounds", type=int, default=1, help="run every config this many times, order alternating"
    )
    ap.add_argument("--skip-ray", action="store_true")
    ap.add_argument("--ray-venv", default="bench-out/ray-venv")
    ap.add_argument("--ray-max-ongoing", type=int, default=10_000)
    ap.add_argument("--ray-install-timeout", type=float, default=900.0)
    ap.add_argument(
        "--ray-timeout", type=float, default=None, help="seconds (default 300 + 4x the trace)"
    )
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--ray-runner", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ray_runner:
        ray_runner(Path(args.ray_runner))
        return
    args.fit = args.fit or max(1, args.models // 4)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.skip_ray and "ray" in configs:
        configs.remove("ray")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)

    print(
        f"trace: {args.requests} requests, Gamma inter-arrivals at {args.rate:g}/s mean with CV "
        f"{args.cv:g}, Zipf {args.zipf:g} over {args.models} models, 1-{args.max_rows} rows of "
        f"{args.width}, seed {args.seed}\nmodels: Sequential(Linear({args.width}), GELU) x "
        f"{args.depth}, {args.depth * (args.width**2 + args.width) * 4 / 2**20:.1f} MiB each; "
        f"memory for {args.fit} of {args.models}; torch threads {args.threads}",
        flush=True,
    )

    # Ray first: installing it (minutes) must not overlap a measurement.
    ray_status = None
    ray_skip = None
    if "ray" in configs:
        print(f"ray: checking its venv {args.ray_venv} ...", flush=True)
        ok, detail = ensure_ray_venv(Path(args.ray_venv), args.ray_install_timeout)
        ray_status = detail if ok else None
        if not ok:
            print(f"ray: skipped: {detail}", flush=True)
            configs.remove("ray")
            ray_skip = detail
    elif args.skip_ray:
        ray_skip = "--skip-ray"

    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        work = Path(tmp)
        t = time.perf_counter()
        cfg = write_workload(args, work)
        trace = json.loads((work / "trace.json").read_text())
        inputs = load_file(str(work / "inputs.safetensors"))
        expected = expected_outputs(cfg, trace, inputs)
        os.sync()  # the model files' writeback must not land inside a measurement
        gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(trace)]
        peak = max(sum(1 for r in trace if s["t"] <= r["t"] < s["t"] + 1.0) for s in trace)
        pop = Counter(r["model"] for r in trace)
        print(
            f"workload written in {time.perf_counter() - t:.1f} s: {trace[-1]['t']:.1f} s of "
            f"trace, measured CV {stdev(gaps) / (sum(gaps) / len(gaps)):.2f}, busiest second "
            f"{peak} requests; requests per model {dict(pop.most_common())}",
            flush=True,
        )
        plan = {
            "flowmesh": ("flowmesh", args.fit, 8),
            "no-batching": ("no batching", args.fit, 1),
            "bound": ("bound", args.models, 8),
        }
        for rnd in range(args.rounds):
            # Alternate the order, so that neither end of a run is always the same config.
            order = configs if rnd % 2 == 0 else configs[::-1]
            print(f"round {rnd + 1}/{args.rounds}: {', '.join(order)}", flush=True)
            for c in order:
                if runs.get(c) and "skipped" in runs[c][-1]:
                    continue
                t = time.perf_counter()
                load_before = os.getloadavg()[0]
                if c == "ray":
                    r = ray_config(args, cfg, work, ray_status or "")
                elif c in ABLATIONS:
                    label, b_args, w_args = ABLATIONS[c]
                    r = flowmesh_config(
                        label, cfg, work, trace, inputs, args.fit, 8, args.clients, b_args, w_args
                    )
                else:
                    label, fit, mbs = plan[c]
                    r = flowmesh_config(label, cfg, work, trace, inputs, fit, mbs, args.clients)
                r["round"] = rnd
                r["loadavg_1m"] = [load_before, os.getloadavg()[0]]
                if "skipped" not in r:
                    r["checked_ok"], r["wrong"] = check_outputs(
                        r["label"], r.pop("outputs"), expected
                    )
                    print(
                        f"  [{r['label']}] {len(r['latencies_ms'])} answered, {r['checked_ok']} "
                        f"checked equal, {len(r['wrong'])} wrong, errors {r['errors']}; mean "
                        f"{r['mean_ms']:.1f} ms, p50 {r['p50_ms']:.1f}, p99 {r['p99_ms']:.1f}, "
                        f"loads {r['loads']}; start {r['mesh_start_s']:.0f} s, deploy "
                        f"{r.get('deploy_s', 0):.0f} s, trace {r['wall_s']:.0f} s, "
                        f"{time.perf_counter() - t:.0f} s in all; load average "
                        f"{r['loadavg_1m'][0]:.1f} -> {r['loadavg_1m'][1]:.1f}",
                        flush=True,
                    )
                else:
                    print(f"  [ray] skipped: {r['skipped']}", flush=True)
                runs.setdefault(c, []).append(r)
    results = [pool(rs) for rs in runs.values()]
    if "ray" not in runs and ray_skip:
        results.append({"label": "ray", "skipped": ray_skip})

    table = report(results, args, len(trace))
    rounds = round_table(results)
    print("\n" + table + "\n\nper round (the machine is shared: see the load average):\n" + rounds)
    png = out / "serving_cdf.png"
    plot(
        results,
        png,
        f"{args.requests} requests x {args.rounds} round(s), {args.rate:g}/s, CV {args.cv:g}, "
        f"Zipf {args.zipf:g}, "
        f"{args.models} models x {cfg['model_bytes'] / 2**20:.0f} MiB, memory for {args.fit}",
    )
    for r in results:
        for run in r.get("runs", []):
            run.pop("latency_by_request", None)
    (out / "serving.json").write_text(
        json.dumps(
            {"args": vars(args), "results": results, "table": table, "rounds": rounds}, indent=1
        )
    )
    print(f"\nplot: {png}\njson: {out / 'serving.json'}\ncommand: {' '.join(sys.argv)}")
    wrong = sum(len(r.get("wrong", [])) for r in results)
    if wrong:
        for r in results:
            for w in r.get("wrong", [])[:3]:
                print("WRONG:", w)
        raise SystemExit(f"{wrong} answers differ from the direct forward")


def stdev(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return (sum((x - m) ** 2 for x in xs) / len(xs)) ** 0.5


if __name__ == "__main__":
    main()
