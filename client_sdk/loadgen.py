"""Synthetic traffic: bursty arrivals, skewed popularity, inputs of each model's declared shape.

Arrivals are a Gamma renewal process: the coefficient of variation (CV) sets the burstiness
(1 is Poisson, 4 is very bursty). Popularity is Zipf: model k of n gets weight 1/k^s.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from broker.policy import percentile
from client_sdk.client import AsyncClient
from client_sdk.errors import ClientError
from flowmesh.modelio.dtypes import torch_dtype


def arrival_times(n: int, rate: float, cv: float, rng: random.Random) -> list[float]:
    """`n` arrival times (seconds from 0) at `rate` per second with inter-arrival CV `cv`."""
    shape = 1.0 / (cv * cv)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(shape, 1.0 / (rate * shape))
        out.append(t)
    return out


def zipf_choices(models: list[str], n: int, s: float, rng: random.Random) -> list[str]:
    """`n` model names; the popularity order itself is shuffled so no name is always hot."""
    order = models[:]
    rng.shuffle(order)
    weights = [1.0 / (k + 1) ** s for k in range(len(order))]
    return rng.choices(order, weights, k=n)


def random_inputs(
    declared: Mapping[str, Mapping[str, Any]],
    rows: int,
    free: int,
    gen: torch.Generator,
    vocab: int = 2,
) -> dict[str, torch.Tensor]:
    """Tensors of the declared dtypes and shapes: dim 0 = rows, other free dims = `free`.
    Integer inputs (token ids) are drawn in [0, vocab)."""
    out = {}
    for name, spec in declared.items():
        shape = [rows] + [free if d == -1 else d for d in spec["shape"][1:]]
        dtype = torch_dtype(spec["dtype"])
        if dtype.is_floating_point:
            out[name] = torch.randn(shape, generator=gen).to(dtype)
        else:
            out[name] = torch.randint(0, vocab, shape, generator=gen).to(dtype)
    return out


@dataclass
class Tally:
    latencies_ms: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        lat = self.latencies_ms
        return {
            "ok": len(lat),
            "errors": dict(self.errors),
            "mean_ms": sum(lat) / len(lat) if lat else 0.0,
            "p50_ms": percentile(lat, 50),
            "p99_ms": percentile(lat, 99),
        }


async def run_trace(
    address: str,
    trace: list[tuple[float, str]],
    make_input: Callable[[str], Any],
    clients: int = 8,
    timeout: float = 60.0,
    check: Callable[[str, Any, Any], None] | None = None,
) -> tuple[dict[str, Tally], float]:
    """Replay (time, model) arrivals open-loop from `clients` connections; `check(model, x, y)`
    may verify each answer. Returns a tally per model and the wall time."""
    tallies: dict[str, Tally] = {}
    t0 = time.perf_counter()

    async def one(client: AsyncClient, model: str, x: Any) -> None:
        tally = tallies.setdefault(model, Tally())
        t = time.perf_counter()
        try:
            y = await client.infer(model, x, timeout=timeout)
        except ClientError as exc:
            tally.errors[str(exc.code)] = tally.errors.get(str(exc.code), 0) + 1
            return
        tally.latencies_ms.append((time.perf_counter() - t) * 1000)
        if check is not None:
            await asyncio.to_thread(check, model, x, y)

    async def connection(share: list[tuple[float, str]]) -> None:
        async with AsyncClient(address, timeout=timeout) as client:
            pending = []
            for at, model in share:
                delay = at - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                pending.append(asyncio.create_task(one(client, model, make_input(model))))
            await asyncio.gather(*pending)

    await asyncio.gather(*(connection(trace[k::clients]) for k in range(clients)))
    return tallies, time.perf_counter() - t0
