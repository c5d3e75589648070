"""The same requests through the HTTP gateway and through the SDK directly, in one run.

One mesh on loopback (real broker, partitioner, 2 CPU workers and the gateway as `flowmesh up
--http-port` starts it: `LocalMesh(http_port=...)`), serving a small MLP and a tiny causal LM
(`flowmesh.lm_examples.tiny_lm_dir`):

- **infer**: `--requests` small-tensor infers (`--rows` x `--width` FP32) from `--clients`
  concurrent clients, through one `AsyncClient` (the SDK over ZeroMQ), then the same as KServe
  v2 JSON `POST /v2/models/mlp/infer` through one pool of `--clients` keep-alive connections, as
  a service in front of the gateway would hold; `--rounds` such turns, each side's figures over
  all of its rounds (turns, so that a shared machine's drifting load falls on both alike).
  Latency p50/p99 and requests/s, and the ratios gateway / SDK (issue 25's targets: p50 within
  1.3x, throughput at least 0.7x). Every gateway answer is checked against the SDK's for the
  same input (the first `--clients` of them, before the timed rounds).
  The HTTP client (`--http-client`) is `aiohttp` by default: the bench's client shares the
  machine's cores with the gateway and the mesh, and `httpx` spends several times aiohttp's CPU
  per request (pure-Python h11 parsing, its pool's bookkeeping), so that on a small machine it
  measures the client as much as the gateway. The SDK side pays only for its own lean client;
  `--http-client httpx` is there to see the difference, and `--http-client pycurl` (libcurl's
  multi interface on a thread, as a native client or a load balancer sends) to see how much of
  the gap is the Python HTTP client's. Each side encodes its request inside
  the timed call, as a real caller does (the SDK its frames, the HTTP side its JSON body).
  Beside the times, each side's CPU per request in every process of the mesh and in the
  bench's own ("client"): on a machine whose cores they all share, the ratio of requests/s
  follows the ratio of these sums.
- **one at a time**: in each round, after those, `--solo-requests` infers per side from one
  caller that sends the next only once the last answered: the latency the gateway adds to a
  request, with no queue. Under the closed loop above both sides keep the cores busy, so their
  latencies are mostly queueing and their ratio follows that of requests/s.
- **stream**: `--prompts` greedy completions of `--max-tokens` tokens, one after the other,
  through the SDK's `generate_stream` and through the gateway's `/v1/completions` with
  `stream=True` (the official `openai` client). Greedy, so both make the same tokens (checked):
  tokens/s of each, and the ratio, and the time to the first chunk.

    python scripts/bench_gateway.py [--requests 400] [--rounds 5] [--clients 8]
        [--solo-requests 100] [--rows 1]
        [--width 64] [--prompts 8] [--max-tokens 32] [--http-client aiohttp|httpx|pycurl]
        [--out bench-out]

Writes `gateway.json` under `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import openai
import torch

from client_sdk.client import AsyncClient
from client_sdk.mesh import LocalMesh
from flowmesh.lm_examples import tiny_lm_dir

PROMPTS = ["The quick brown fox", "Once upon a time", "In a distant land", "Hello there"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def closed_loop(n: int, clients: int, one: Any) -> tuple[list[float], float]:
    """`n` calls of `one(k)` from `clients` concurrent loops: (latencies in s, wall seconds)."""
    latencies: list[float] = []
    counter = iter(range(n))

    async def loop() -> None:
        for k in counter:
            start = time.perf_counter()
            await one(k)
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(clients)))
    return latencies, time.perf_counter() - start


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds process `pid` has spent (Linux's /proc; 0.0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summary(latencies: list[float], wall: float) -> dict[str, float]:
    return {
        "p50_ms": pct(latencies, 0.50) * 1e3,
        "p99_ms": pct(latencies, 0.99) * 1e3,
        "mean_ms": statistics.fmean(latencies) * 1e3,
        "requests_per_s": len(latencies) / wall,
    }


Post = Callable[[str, bytes], Awaitable[bytes]]


def curl_closed_loop(
    url: str, body: Callable[[int], bytes], n: int, clients: int
) -> tuple[list[float], float]:
    """`closed_loop` with libcurl's multi interface (pycurl) on this thread: `clients` handles
    on keep-alive connections, each posting `body(k)` for the next k as soon as its last
    answer came, the body encoded inside the timed call; a status other than 200 raises."""
    import pycurl

    multi = pycurl.CurlMulti()
    counter = iter(range(n))
    latencies: list[float] = []
    started: dict[Any, float] = {}

    def start(h: Any) -> None:
        k = next(counter, None)
        if k is None:
            return
        started[h] = time.perf_counter()
        h.setopt(pycurl.POSTFIELDS, body(k))
        multi.add_handle(h)

    handles = []
    for _ in range(clients):
        h = pycurl.Curl()
        h.setopt(pycurl.URL, url)
        h.setopt(pycurl.HTTPHEADER, ["Content-Type: application/json", "Expect:"])
        h.setopt(pycurl.WRITEFUNCTION, len)  # the body is read and dropped (checked apart)
        h.setopt(pycurl.TIMEOUT, 60)  # as the other clients' (a stalled gateway fails it)
        handles.append(h)
    t0 = time.perf_counter()
    for h in handles:
        start(h)
    while started:
        # Drive the transfers first (a request just added goes out now), then wait for a
        # socket only when nothing has finished.
        while multi.perform()[0] == pycurl.E_CALL_MULTI_PERFORM:
            pass
        _, ok, failed = multi.info_read()
        if failed:
            raise RuntimeError(f"curl: {failed[0][2]}")
        for h in ok:
            latencies.append(time.perf_counter() - started.pop(h))
            multi.remove_handle(h)
            if h.getinfo(pycurl.RESPONSE_CODE) != 200:
                raise RuntimeError(f"HTTP {h.getinfo(pycurl.RESPONSE_CODE)}")
            start(h)
        if not ok and started:
            multi.select(1.0)
    wall = time.perf_counter() - t0
    for h in handles:
        h.close()
    multi.close()
    return latencies, wall


def curl_post(url: str, data: bytes) -> bytes:
    """One POST with pycurl (blocking): the answer's body."""
    import io

    import pycurl

    out = io.BytesIO()
    h = pycurl.Curl()
    h.setopt(pycurl.URL, url)
    h.setopt(pycurl.HTTPHEADER, ["Content-Type: application/json", "Expect:"])
    h.setopt(pycurl.POSTFIELDS, data)
    h.setopt(pycurl.WRITEDATA, out)
    h.setopt(pycurl.TIMEOUT, 60)
    h.perform()
    code = h.getinfo(pycurl.RESPONSE_CODE)
    h.close()
    if code != 200:
        raise RuntimeError(f"HTTP {code}")
    return out.getvalue()


@asynccontextmanager
async def _http_client(kind: str, connections: int) -> AsyncIterator[Post]:
    """`post(url, body)`: the answer's body (an error status raises), over a pool of
    `connections` keep-alive connections of client `kind`."""
    headers = {"Content-Type": "application/json"}
    if kind == "pycurl":  # (its timed rounds run `curl_closed_loop`)

        async def post_curl(url: str, data: bytes) -> bytes:
            return await asyncio.to_thread(curl_post, url, data)

        yield post_curl
        return
    if kind == "httpx":
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        async with httpx.AsyncClient(limits=limits, timeout=60.0) as http:

            async def post_httpx(url: str, data: bytes) -> bytes:
                answer = await http.post(url, content=data, headers=headers)
                answer.raise_for_status()
                return answer.content

            yield post_httpx
        return
    connector = aiohttp.TCPConnector(limit=connections)
    timeout = aiohttp.ClientTimeout(total=60.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def post_aiohttp(url: str, data: bytes) -> bytes:
            async with session.post(url, data=data, headers=headers) as answer:
                answer.raise_for_status()
                return await answer.read()

        yield post_aiohttp


async def bench_infer(mesh: LocalMesh, args: argparse.Namespace) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(args.rows, args.width, generator=gen) for _ in range(args.requests)]
    url = f"{mesh.http_url}/v2/models/mlp/infer"

    def body(x: torch.Tensor) -> bytes:
        flat = x.flatten().tolist()
        item = {"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": flat}
        return json.dumps({"inputs": [item]}).encode()

    sdk_lat: list[float] = []
    gw_lat: list[float] = []
    solo: dict[str, list[float]] = {"sdk": [], "gateway": []}
    sdk_wall = gw_wall = gw_cpu = sdk_cpu = 0.0
    gw_pid = mesh.child("gateway").proc.pid
    # Every process's CPU on each side, the bench's own included ("client"): where the
    # gateway side's extra CPU goes, on a machine whose cores all of them share.
    pids = {c.name: c.proc.pid for c in mesh.children} | {"client": os.getpid()}
    side_cpu: dict[str, dict[str, float]] = {"sdk": dict.fromkeys(pids, 0.0)}
    side_cpu["gateway"] = dict.fromkeys(pids, 0.0)

    def charge(side: str, before: dict[str, float]) -> None:
        for name, pid in pids.items():
            side_cpu[side][name] += cpu_seconds(pid) - before[name]
    async with (
        AsyncClient(mesh.frontend, timeout=60.0) as c,
        _http_client(args.http_client, args.clients) as post,
    ):
        expected = [await c.infer("mlp", x) for x in xs[: args.clients]]  # and warm up
        for x, want in zip(xs[: args.clients], expected, strict=True):  # checked, and warm up
            got = json.loads(await post(url, body(x)))["outputs"][0]
            out = torch.tensor(got["data"]).reshape(got["shape"])
            assert isinstance(want, torch.Tensor)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)

        async def sdk(k: int) -> None:
            await c.infer("mlp", xs[k % len(xs)])

        async def gateway(k: int) -> None:
            await post(url, body(xs[k % len(xs)]))

        # The two sides in turns, not one after the other: on a shared machine the load of
        # other work drifts, and turns spread it over both alike.
        for _ in range(args.rounds):
            cpu = time.process_time()
            before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            lat, wall = await closed_loop(args.requests, args.clients, sdk)
            sdk_cpu += time.process_time() - cpu
            charge("sdk", before)
            before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            sdk_lat += lat
            sdk_wall += wall
            cpu = cpu_seconds(gw_pid)
            if args.http_client == "pycurl":
                lat, wall = await asyncio.to_thread(
                    curl_closed_loop, url, lambda k: body(xs[k]), args.requests, args.clients
                )
            else:
                lat, wall = await closed_loop(args.requests, args.clients, gateway)
            gw_cpu += cpu_seconds(gw_pid) - cpu
            charge("gateway", before)
            gw_lat += lat
            gw_wall += wall
            # One caller, one request at a time: the latency each side adds, with no queue.
            solo["sdk"] += (await closed_loop(args.solo_requests, 1, sdk))[0]
            if args.http_client == "pycurl":
                lat, _ = await asyncio.to_thread(
                    curl_closed_loop, url, lambda k: body(xs[k % len(xs)]), args.solo_requests, 1
                )
            else:
                lat, _ = await closed_loop(args.solo_requests, 1, gateway)
            solo["gateway"] += lat
    sdk_s, gw_s = summary(sdk_lat, sdk_wall), summary(gw_lat, gw_wall)
    # The gateway process's own CPU (all its threads) per request: unlike the times, it hardly
    # moves with the machine's other load.
    gw_s["cpu_us_per_request"] = gw_cpu / len(gw_lat) * 1e6
    # And, beside it, the bench's own process on the SDK side: the SDK client's CPU, which the
    # gateway's includes (it is one more SDK client, with an HTTP server in front).
    sdk_s["client_cpu_us_per_request"] = sdk_cpu / len(sdk_lat) * 1e6
    for side, figures in (("sdk", sdk_s), ("gateway", gw_s)):
        n = len(sdk_lat if side == "sdk" else gw_lat)
        figures["process_cpu_us_per_request"] = {k: v / n * 1e6 for k, v in side_cpu[side].items()}
    ratios = {
        "p50": gw_s["p50_ms"] / sdk_s["p50_ms"],
        "p99": gw_s["p99_ms"] / sdk_s["p99_ms"],
        "requests_per_s": gw_s["requests_per_s"] / sdk_s["requests_per_s"],
    }
    one = {side: {"p50_ms": pct(lat, 0.5) * 1e3, "p99_ms": pct(lat, 0.99) * 1e3}
           for side, lat in solo.items()}  # fmt: skip
    one["ratio_gateway_over_sdk"] = {
        q: one["gateway"][f"{q}_ms"] / one["sdk"][f"{q}_ms"] for q in ("p50", "p99")
    }
    return {"sdk": sdk_s, "gateway": gw_s, "ratio_gateway_over_sdk": ratios, "one_at_a_time": one}


async def bench_stream(mesh: LocalMesh, args: argparse.Namespace) -> dict[str, Any]:
    prompts = [PROMPTS[k % len(PROMPTS)] for k in range(args.prompts)]
    ask = {"max_tokens": args.max_tokens, "temperature": 0.0}
    sdk_text: list[str] = []
    tokens = 0
    sdk_first: list[float] = []
    async with AsyncClient(mesh.frontend, timeout=120.0) as c:
        await c.generate("lm", prompts[0], **ask)  # warm up
        start = time.perf_counter()
        for prompt in prompts:
            began = time.perf_counter()
            parts: list[str] = []
            async with c.generate_stream("lm", prompt, **ask) as stream:
                async for chunk in stream:
                    if not parts:
                        sdk_first.append(time.perf_counter() - began)
                    parts.append(chunk.text)
                    tokens += len(chunk.ids)
            sdk_text.append("".join(parts))
        sdk_wall = time.perf_counter() - start
    api = openai.AsyncOpenAI(base_url=f"{mesh.http_url}/v1", api_key="unused", max_retries=0)
    gw_text: list[str] = []
    gw_first: list[float] = []
    await api.completions.create(model="lm", prompt=prompts[0], **ask)  # warm up
    start = time.perf_counter()
    for prompt in prompts:
        began = time.perf_counter()
        parts = []
        stream = await api.completions.create(model="lm", prompt=prompt, stream=True, **ask)
        async for event in stream:
            if not parts:
                gw_first.append(time.perf_counter() - began)
            parts.append("".join(choice.text for choice in event.choices))
        gw_text.append("".join(parts))
    gw_wall = time.perf_counter() - start
    await api.close()
    assert gw_text == sdk_text, (gw_text, sdk_text)  # greedy: the same tokens both ways
    return {
        "tokens": tokens,
        "sdk": {"tokens_per_s": tokens / sdk_wall, "first_chunk_p50_ms": pct(sdk_first, 0.5) * 1e3},
        "gateway": {
            "tokens_per_s": tokens / gw_wall,
            "first_chunk_p50_ms": pct(gw_first, 0.5) * 1e3,
        },
        "ratio_gateway_over_sdk": {"tokens_per_s": sdk_wall / gw_wall},
    }


async def bench(mesh: LocalMesh, args: argparse.Namespace) -> dict[str, Any]:
    return {"infer": await bench_infer(mesh, args), "stream": await bench_stream(mesh, args)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=400, help="infers per side in each round")
    ap.add_argument("--rounds", type=int, default=5, help="turns of SDK then gateway infers")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument(
        "--solo-requests",
        type=int,
        default=100,
        help="infers per side in each round from one caller, one at a time (added latency)",
    )
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--http-client",
        choices=["aiohttp", "httpx", "pycurl"],
        default="aiohttp",
        help="the infer bench's HTTP client (aiohttp: see above)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    if min(args.requests, args.solo_requests, args.rounds, args.clients) < 1:
        raise SystemExit("--requests, --solo-requests, --rounds and --clients need at least 1")
    with tempfile.TemporaryDirectory(prefix="bench-gw-") as tmp:
        model_dir = tiny_lm_dir(Path(tmp) / "tiny-llama", "llama", seed=5, max_positions=256)
        mesh = LocalMesh(
            cpu_workers=2,
            memory_budget="64MiB",
            threads_per_worker=args.threads,
            data_roots=[tmp],
            http_port=free_port(),
        )
        with mesh:
            with mesh.client(timeout=300) as c:
                c.deploy("mlp", "flowmesh.examples:mlp", kwargs={"width": args.width, "depth": 2})
                c.deploy("lm", hf=str(model_dir), stages=1, replicas=1, max_seqs=4)
            result = asyncio.run(bench(mesh, args))
    result["args"] = vars(args)
    infer, stream = result["infer"], result["stream"]
    r = infer["ratio_gateway_over_sdk"]
    sdk, gw = infer["sdk"], infer["gateway"]
    print(
        f"infer ({args.rounds} x {args.requests} requests, {args.clients} clients, "
        f"{args.rows}x{args.width} FP32, {args.http_client}): "
        f"SDK p50 {sdk['p50_ms']:.2f} ms p99 {sdk['p99_ms']:.2f} ms "
        f"{sdk['requests_per_s']:.0f} req/s, its client's CPU "
        f"{sdk['client_cpu_us_per_request']:.0f} us/request; "
        f"gateway p50 {gw['p50_ms']:.2f} ms p99 {gw['p99_ms']:.2f} ms "
        f"{gw['requests_per_s']:.0f} req/s, its process's CPU "
        f"{gw['cpu_us_per_request']:.0f} us/request"
    )
    print(
        f"infer gateway/SDK: p50 {r['p50']:.2f}x  p99 {r['p99']:.2f}x  "
        f"requests/s {r['requests_per_s']:.2f}x"
    )
    one = infer["one_at_a_time"]
    print(
        f"infer one at a time ({args.rounds} x {args.solo_requests} requests, one caller): "
        f"SDK p50 {one['sdk']['p50_ms']:.2f} ms p99 {one['sdk']['p99_ms']:.2f} ms; gateway "
        f"p50 {one['gateway']['p50_ms']:.2f} ms p99 {one['gateway']['p99_ms']:.2f} ms: "
        f"gateway/SDK p50 {one['ratio_gateway_over_sdk']['p50']:.2f}x "
        f"p99 {one['ratio_gateway_over_sdk']['p99']:.2f}x"
    )
    for side, figures in (("SDK", sdk), ("gateway", gw)):
        per = figures["process_cpu_us_per_request"]
        print(
            f"CPU per request, {side} side: {sum(per.values()):.0f} us ("
            + ", ".join(f"{name} {us:.0f}" for name, us in per.items())
            + ")"
        )
    print(
        f"stream ({args.prompts} prompts x {args.max_tokens} tokens): SDK "
        f"{stream['sdk']['tokens_per_s']:.0f} tokens/s, gateway "
        f"{stream['gateway']['tokens_per_s']:.0f} tokens/s: gateway/SDK "
        f"{stream['ratio_gateway_over_sdk']['tokens_per_s']:.2f}x"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gateway.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
