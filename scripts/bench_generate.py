"""Generation benchmark: a bursty multi-model trace over language models whose weights do not
all fit, against what a user writes by hand with Hugging Face `generate`.

`--models` tiny random language models (Llama and Qwen2 in turn, `--hidden` x `--layers`) are
written by `flowmesh.lm_examples` as Hugging Face directories into a temporary directory. A
seeded trace: Gamma inter-arrivals (mean rate `--rate`, coefficient of variation `--cv`), Zipf
popularity (`--zipf`), prompts of random token ids (`--prompt` range) and a number of new tokens
per request (`--new` range, `ignore_eos` so that every output has its length). Each
configuration replays it open loop: a request counts from its trace time whatever the earlier
ones are doing. Configurations, one after the other in the same run, same trace, same files:

1. `flowmesh`: `LocalMesh` of `--workers` CPU workers whose combined budget holds the weights of
   `--fit` models (plus their KV share), every model deployed from its directory in `--stages`
   pipeline stages (with `--gen-groups` iterations in flight per replica); each request a
   `generate_stream` call from its own task; time to first token and the gaps between tokens
   are the client's.
2. `hf-lru`: one process, the requests in arrival order one at a time, `generate` on a model
   loaded with `from_pretrained` on a miss and at most `--fit` models loaded (least recently used
   dropped): what a user does by hand on the same memory.
3. `hf-resident`: the same with every model loaded before the trace (no loads at all).

Every flowmesh output is checked against `hf-resident`'s tokens for the same request (greedy:
the same tokens, float32). Then, one request alone of `--single-new` tokens on one model:
flowmesh's inter-token latency against `generate` in this process (the mesh's own cost per
token), `--single-rounds` times in turn, their medians compared. Prints the table and the
ratios, writes `generate.json` under `--out`.

    python scripts/bench_generate.py [--models 4] [--fit 2] [--requests 64] [--rate 16] \
        [--cv 2] [--zipf 1.1] [--seed 0] [--out bench-out]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from client_sdk.client import AsyncClient  # noqa: E402
from client_sdk.loadgen import arrival_times, zipf_choices  # noqa: E402
from client_sdk.mesh import LocalMesh  # noqa: E402
from flowmesh.lm_examples import tiny_lm_dir  # noqa: E402

ARCHS = ("llama", "qwen2")
TIE = 1e-4  # two logits closer than this are a tie in float32 (of order 1 here)


@dataclass(frozen=True)
class Request:
    at: float  # seconds from the trace's start
    model: str
    ids: list[int]
    new: int


@dataclass
class Outcome:
    """One request's result in one configuration."""

    ids: list[int] = field(default_factory=list)
    ttft_s: float = 0.0  # from its trace time to its first token
    gaps_s: list[float] = field(default_factory=list)  # between its tokens
    done_s: float = 0.0  # its last token, from the trace's start
    error: str = ""


def make_trace(args: argparse.Namespace, models: list[str], vocab: int) -> list[Request]:
    rng = random.Random(args.seed)
    times = arrival_times(args.requests, args.rate, args.cv, rng)
    names = zipf_choices(models, args.requests, args.zipf, rng)
    lo, hi = args.prompt
    nlo, nhi = args.new
    return [
        Request(t, m, [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))],
                rng.randint(nlo, nhi))
        for t, m in zip(times, names, strict=True)
    ]  # fmt: skip


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def summary(outcomes: list[Outcome]) -> dict[str, Any]:
    good = [o for o in outcomes if not o.error]
    tokens = sum(len(o.ids) for o in good)
    span = max((o.done_s for o in good), default=0.0)
    gaps = [g for o in good for g in o.gaps_s]
    ttft = [o.ttft_s for o in good]
    return {
        "completed": len(good),
        "errors": len(outcomes) - len(good),
        "tokens": tokens,
        "tokens_per_s": tokens / span if span else 0.0,
        "ttft_p50_ms": percentile(ttft, 50) * 1000,
        "ttft_p99_ms": percentile(ttft, 99) * 1000,
        "itl_p50_ms": percentile(gaps, 50) * 1000,
        "itl_p99_ms": percentile(gaps, 99) * 1000,
    }


# -- flowmesh ----------------------------------------------------------------------------------


async def flowmesh_trace(address: str, trace: list[Request]) -> list[Outcome]:
    outcomes = [Outcome() for _ in trace]
    async with AsyncClient(address, timeout=600) as c:
        t0 = time.perf_counter() + 0.5  # every task started before the first arrival

        async def one(k: int, r: Request) -> None:
            await asyncio.sleep(max(0.0, t0 + r.at - time.perf_counter()))
            o, last = outcomes[k], None
            try:
                stream = c.generate_stream(r.model, ids=r.ids, max_tokens=r.new, ignore_eos=True)
                async with stream:
                    async for chunk in stream:
                        now = time.perf_counter()
                        if last is None:
                            o.ttft_s = now - (t0 + r.at)
                        else:
                            o.gaps_s.append(now - last)
                        last = now
                        o.ids.extend(chunk.ids)
                o.done_s = time.perf_counter() - t0
            except Exception as exc:  # counted, never raised: the others run on
                o.error = f"{type(exc).__name__}: {exc}"

        await asyncio.gather(*(one(k, r) for k, r in enumerate(trace)))
    return outcomes


async def flowmesh_single(address: str, r: Request) -> Outcome:
    return (await flowmesh_trace(address, [Request(0.0, r.model, r.ids, r.new)]))[0]


# -- Hugging Face by hand ----------------------------------------------------------------------


class Timing:
    """A `generate` streamer that notes when each new token comes (the first put is the
    prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt = True

    def put(self, value: torch.Tensor) -> None:
        if self._prompt:
            self._prompt = False
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


# Where the Hugging Face baselines run: the first GPU with `--gpus`, as flowmesh's workers do.
HF_DEVICE = torch.device("cpu")


def load(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model = model.to(HF_DEVICE)
    # No eos, as the mesh's ignore_eos: an eos of None in a call's config is filled in from
    # the model's own, so clear that one.
    model.generation_config.eos_token_id = None
    return model


def hf_one(model: Any, r: Request, t_arrival: float) -> Outcome:
    from transformers import GenerationConfig

    timing = Timing()
    # No eos (as the mesh's ignore_eos): exactly `r.new` tokens, whatever they are.
    config = GenerationConfig(
        do_sample=False, max_new_tokens=r.new, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        out = model.generate(
            torch.tensor([r.ids], device=HF_DEVICE),
            attention_mask=torch.ones(1, len(r.ids), dtype=torch.long, device=HF_DEVICE),
            generation_config=config,
            streamer=timing,
        )
    ts = timing.times
    return Outcome(
        ids=out[0, len(r.ids) :].tolist(),
        ttft_s=ts[0] - t_arrival,
        gaps_s=[b - a for a, b in itertools.pairwise(ts)],
    )


def hf_trace(dirs: dict[str, Path], trace: list[Request], fit: int | None) -> list[Outcome]:
    """The requests in arrival order, one at a time; `fit` models loaded at most (None: all,
    loaded first)."""
    loaded: OrderedDict[str, Any] = OrderedDict()
    if fit is None:
        for name, path in dirs.items():
            loaded[name] = load(path)
    outcomes = []
    t0 = time.perf_counter()
    for r in trace:
        wait = t0 + r.at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        if r.model in loaded:
            loaded.move_to_end(r.model)
        else:
            if fit is not None and len(loaded) >= fit:
                loaded.popitem(last=False)
            loaded[r.model] = load(dirs[r.model])
        o = hf_one(loaded[r.model], r, t0 + r.at)
        o.done_s = time.perf_counter() - t0
        outcomes.append(o)
    return outcomes


def near_ties(
    dirs: dict[str, Path], trace: list[Request], got: list[Outcome], wrong: list[int]
) -> dict[int, float]:
    """For each differing request: at its first differing token, how far apart generate's two
    best logits were."""
    from flowmesh.lm_examples import hf_generate_logits

    gaps = {}
    for k in wrong:
        r = trace[k]
        [(ids, logits)] = hf_generate_logits(dirs[r.model], [r.ids], r.new, ignore_eos=True)
        j = next((i for i, (a, b) in enumerate(zip(ids, got[k].ids, strict=False)) if a != b), -1)
        if j < 0:  # one is a prefix of the other: tokens lost or added, never a tie
            print(f"request {k}: {len(got[k].ids)} tokens, generate's {len(ids)}")
            gaps[k] = float("inf")
            continue
        top = logits[j].topk(2).values
        gaps[k] = float(top[0] - top[1])
    return gaps


# -- the run -----------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--fit", type=int, default=2, help="models whose weights the budget holds")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--gpus", type=int, default=0, help="CUDA workers, one per device (0: CPU stand-ins)"
    )
    ap.add_argument("--stages", type=int, default=1, help="pipeline stages of each model")
    ap.add_argument(
        "--gen-groups", type=int, default=1, help="the broker's --gen-groups (0: one per stage)"
    )
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rate", type=float, default=16.0)
    ap.add_argument("--cv", type=float, default=2.0)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--prompt", type=int, nargs=2, default=[8, 32], metavar=("MIN", "MAX"))
    ap.add_argument("--new", type=int, nargs=2, default=[8, 32], metavar=("MIN", "MAX"))
    ap.add_argument("--single-new", type=int, default=48)
    ap.add_argument("--single-rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the HF baselines")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    if args.gpus:  # one worker per device 0..N-1; the baselines on the first
        args.workers = args.gpus
        global HF_DEVICE
        HF_DEVICE = torch.device("cuda:0")
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    names = [f"lm{i}" for i in range(args.models)]
    dirs = {
        n: tiny_lm_dir(tmp / n, ARCHS[i % len(ARCHS)], seed=i, layers=args.layers,
                       hidden=args.hidden, max_positions=128)
        for i, n in enumerate(names)
    }  # fmt: skip
    weights = max(sum(f.stat().st_size for f in d.glob("*.safetensors")) for d in dirs.values())
    # The combined budget holds `fit` models' weights; each worker's half again for its KV.
    budget = int(weights * args.fit / args.workers * 1.5) + (1 << 20)
    from flowmesh.modelio.tokenizer import read_tokenizer

    vocab = len(json.loads(read_tokenizer(dirs[names[0]]).tokenizer_json)["model"]["vocab"])
    trace = make_trace(args, names, vocab)
    tokens = sum(r.new for r in trace)
    print(
        f"{args.models} models of {weights / 2**20:.1f} MiB ({', '.join(ARCHS)}), budget "
        f"{budget / 2**20:.1f} MiB x {args.workers} workers (weights of {args.fit} models + KV); "
        f"{len(trace)} requests, {tokens} tokens, over {trace[-1].at:.1f} s",
        flush=True,
    )
    results: dict[str, list[Outcome]] = {}
    # Warm-up, not timed: the first generate of a process pays transformers' one-time costs.
    hf_one(load(dirs[names[0]]), Request(0.0, names[0], trace[0].ids, 4), time.perf_counter())
    t = time.perf_counter()
    results["hf-resident"] = hf_trace(dirs, trace, None)
    print(f"hf-resident done in {time.perf_counter() - t:.0f} s", flush=True)
    t = time.perf_counter()
    results["hf-lru"] = hf_trace(dirs, trace, args.fit)
    print(f"hf-lru done in {time.perf_counter() - t:.0f} s", flush=True)
    single = max(trace, key=lambda r: len(r.ids))
    single = Request(0.0, single.model, single.ids, args.single_new)
    single_model = load(dirs[single.model])
    with LocalMesh(
        cpu_workers=args.workers,
        memory_budget=str(budget),
        gpus=list(range(args.gpus)) or None,
        gpu_budget=str(budget) if args.gpus else None,
        data_roots=[str(tmp)],
        threads_per_worker=max(1, args.threads // args.workers),
        heartbeat_s=0.5,
        broker_args=["--gen-groups", str(args.gen_groups)],
    ) as mesh:
        with mesh.client(timeout=600) as c:
            for n, d in dirs.items():
                c.deploy(n, hf=str(d), stages=args.stages, max_seqs=16)
        asyncio.run(flowmesh_single(mesh.frontend, Request(0.0, names[0], trace[0].ids, 4)))
        t = time.perf_counter()
        results["flowmesh"] = asyncio.run(flowmesh_trace(mesh.frontend, trace))
        print(f"flowmesh done in {time.perf_counter() - t:.0f} s", flush=True)
        # One sequence alone, `--single-rounds` times, the mesh and generate in turn (the same
        # machine state for both): one round's figure moves with the machine, their median less.
        fm_singles, hf_singles = [], []
        for _ in range(args.single_rounds):
            fm_singles.append(asyncio.run(flowmesh_single(mesh.frontend, single)))
            hf_singles.append(hf_one(single_model, single, time.perf_counter()))
        with mesh.client() as c:
            status = c.status()
    wrong = [
        k
        for k, (a, b) in enumerate(zip(results["flowmesh"], results["hf-resident"], strict=True))
        if not a.error and a.ids != b.ids
    ]
    ties = near_ties(dirs, trace, results["flowmesh"], wrong)
    table = {name: summary(o) for name, o in results.items()}
    cols = ["completed", "errors", "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
            "itl_p99_ms"]  # fmt: skip
    print("\n" + " | ".join(["config", *cols]))
    for name, row in table.items():
        cells = [f"{row[c]:.1f}" if isinstance(row[c], float) else str(row[c]) for c in cols]
        print(" | ".join([name, *cells]))
    fm, lru = table["flowmesh"], table["hf-lru"]
    # From the first token to the last, per token: chunks read together have tiny gaps between
    # them, but the time a sequence takes per token is the same however they are read.
    fm_itls = [statistics.fmean(o.gaps_s) if o.gaps_s else float("nan") for o in fm_singles]
    hf_itls = [statistics.fmean(o.gaps_s) for o in hf_singles]
    itl_fm, itl_hf = statistics.median(fm_itls), statistics.median(hf_itls)
    ratios = {
        "tokens_per_s_vs_hf_lru": fm["tokens_per_s"] / lru["tokens_per_s"],
        "tokens_per_s_vs_hf_resident": fm["tokens_per_s"] / table["hf-resident"]["tokens_per_s"],
        "ttft_p99_vs_hf_lru": fm["ttft_p99_ms"] / lru["ttft_p99_ms"],
        "single_itl_vs_hf_generate": itl_fm / itl_hf,
    }
    print(
        f"\nflowmesh / hf-lru: tokens/s {ratios['tokens_per_s_vs_hf_lru']:.2f}x, TTFT p99 "
        f"{ratios['ttft_p99_vs_hf_lru']:.2f}x; flowmesh / hf-resident tokens/s "
        f"{ratios['tokens_per_s_vs_hf_resident']:.2f}x\none sequence alone, median of "
        f"{args.single_rounds} rounds: inter-token latency {itl_fm * 1000:.1f} ms through the "
        f"mesh against {itl_hf * 1000:.1f} ms for generate in-process "
        f"({ratios['single_itl_vs_hf_generate']:.2f}x; rounds, ms: mesh "
        f"{', '.join(f'{v * 1000:.1f}' for v in fm_itls)}; generate "
        f"{', '.join(f'{v * 1000:.1f}' for v in hf_itls)})"
    )
    print(
        f"outputs checked against hf-resident's: {len(wrong)} of {len(trace)} differ; at the first "
        f"differing step, the gap between generate's two best logits: "
        f"{', '.join(f'request {k}: {g:.2e}' for k, g in ties.items()) or '-'}"
    )
    errors = [o.error for o in results["flowmesh"] if o.error]
    if errors:
        print(f"flowmesh errors: {errors[:3]}")
    loads = {m.name: (m.loads, m.evictions) for m in status.models}
    print(f"flowmesh loads/evictions per model: {loads}")
    kinds = {"preempted": sum(m.preemptions for m in status.models)}
    for m in status.models:
        for kind, n in m.preemptions_by_kind.items():
            kinds[kind] = kinds.get(kind, 0) + n
    kv = {
        w.name: {
            "parked": w.stats.kv_parked,
            "dropped": w.stats.kv_dropped,
            "restored": w.stats.kv_restored,
            "implicit_loads": w.stats.implicit_loads,
        }
        for w in status.workers
    }
    print(
        f"flowmesh preemptions: {kinds['preempted']} (resumed from parked KV {kinds['swap']}, "
        f"recomputed {kinds['recompute']}; restarted {kinds['restart']}); the workers' KV "
        f"(their own evictions too) and the stages runs brought back: {kv}"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "generate.json").write_text(
        json.dumps(
            {
                "args": vars(args),
                "budget_bytes": budget,
                "weights_bytes": weights,
                "table": table,
                "ratios": ratios,
                "wrong": wrong,
                "near_tie_gaps": ties,
                "preemptions": kinds,
                "workers_kv": kv,
                "single": {
                    "flowmesh": [asdict(o) for o in fm_singles],
                    "hf": [asdict(o) for o in hf_singles],
                },
            },
            indent=2,
        )
    )
    # A difference counts as a failure unless generate's own two best candidates at that step
    # were within float32 noise of each other (then either token is the greedy one).
    return 1 if errors or any(g > TIE for g in ties.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
