"""What the broker measures of generation, in process with the room's injected clock: time to
first token and inter-token latency as prometheus histograms (the text /metrics serves, with
exact counts), the quantiles status reads from their buckets, tokens per second, preemptions by
kind, and KV blocks free, in `flowmesh status` and in the metric families."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from broker.lm_files import LmFiles, read_lm_files
from broker.status import TOKEN_BUCKETS, bucket_quantile
from client_sdk import views
from flowmesh import metrics
from flowmesh import protocol as p
from flowmesh.reports import WorkerStats
from tests.support.generation import Gen, run_of
from tests.support.lm import tiny_lm_dir
from tests.support.reports import broker_status, model_row, worker_row


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_lm_dir(tmp_path_factory.mktemp("genm") / "tiny", layers=1, hidden=8)


@pytest.fixture(scope="module")
def files(lm_dir: Path) -> LmFiles:
    return read_lm_files(str(lm_dir))


def scrape(g: Gen) -> dict[str, float]:
    """The broker's /metrics text, as a scrape reads it: {sample line's name and labels: value}."""
    registry = CollectorRegistry()
    core = g.core
    registry.register(
        metrics.Collector(
            lambda: [
                *metrics.broker_families(core.status(g.h.now)),
                *core.serving.timings.collect(),
            ]
        )
    )
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_ttft_and_inter_token_times_are_histograms_status_reads(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files)
    run = g.first(g.generate(1, [[1, 5, 6]], max_tokens=3))  # arrived at 0
    g.h.now = 0.25
    run = run_of(g.step(run, [11]), g.w0)  # first token: 0.25 s
    g.h.now = 0.5
    run = run_of(g.step(run, [12]), g.w0)  # 0.25 s after it
    g.h.now = 1.5
    g.step(run, [13])  # 1.0 s after that; the call ends
    g.answered_once()
    got = scrape(g)
    ttft, itl = (
        "flowmesh_broker_time_to_first_token_seconds",
        "flowmesh_broker_inter_token_latency_seconds",
    )
    assert got[f'{ttft}_count{{model="lm"}}'] == 1 and got[f'{ttft}_sum{{model="lm"}}'] == 0.25
    assert got[f'{ttft}_bucket{{le="0.2",model="lm"}}'] == 0
    assert got[f'{ttft}_bucket{{le="0.5",model="lm"}}'] == 1
    assert got[f'{itl}_count{{model="lm"}}'] == 2 and got[f'{itl}_sum{{model="lm"}}'] == 1.25
    assert got[f'{itl}_bucket{{le="0.5",model="lm"}}'] == 1
    assert got[f'{itl}_bucket{{le="1.0",model="lm"}}'] == 2
    assert got['flowmesh_broker_preemptions_total{kind="recompute",model="lm"}'] == 0
    assert got['flowmesh_broker_preemptions_total{kind="swap",model="lm"}'] == 0
    assert got['flowmesh_broker_preemptions_total{kind="restart",model="lm"}'] == 0
    (row,) = g.core.status(g.h.now).models
    # Interpolated inside the bucket, as histogram_quantile: TTFT's one sample in (0.2, 0.5].
    assert row.ttft_p50_ms == pytest.approx(350.0) and row.ttft_p99_ms == pytest.approx(497.0)
    assert row.itl_p50_ms == pytest.approx(500.0) and row.itl_p99_ms == pytest.approx(990.0)
    # Three tokens at 0.25, 0.5 and 1.5 s, decayed over 10 s, as of the last one.
    rate = (0.1 * math.exp(-0.025) + 0.1) * math.exp(-0.1) + 0.1
    assert row.tokens_per_s == pytest.approx(rate, rel=1e-12)
    assert got['flowmesh_broker_generated_tokens_per_second{model="lm"}'] == pytest.approx(rate)
    line = [
        ln for ln in views.format_status(g.core.status(g.h.now)).splitlines() if "tokens:" in ln
    ]
    assert line == [
        "lm tokens: 0.3/s, first token p50 350.0 ms p99 497.0 ms, between tokens p50 500.0 ms "
        "p99 990.0 ms"
    ]


def test_an_undeployed_model_s_series_go_with_it(lm_dir: Path, files: LmFiles) -> None:
    """A broker lives for weeks while models come and go: the histograms of a model undeployed
    leave /metrics at the next tick, instead of one more set per name ever deployed."""
    g = Gen(lm_dir, files)
    run = g.first(g.generate(1, [[1, 5, 6]], max_tokens=2))
    g.h.now = 0.25
    run = run_of(g.step(run, [11]), g.w0)
    g.h.now = 0.5
    g.step(run, [12])
    g.answered_once()
    g.tick(1.0)
    timed = "flowmesh_broker_time_to_first_token_seconds_count"
    assert scrape(g)[f'{timed}{{model="lm"}}'] == 1  # kept while the model is deployed
    g.client(p.Undeploy(id=8, model="lm", drain_s=0))
    assert g.core.models == {}
    g.tick(2.0)
    left = [k for k in scrape(g) if 'model="lm"' in k]
    assert left == []


def test_bucket_quantiles_follow_histogram_quantile() -> None:
    bounds = (1.0, 2.0, 4.0)
    assert bucket_quantile(0.5, bounds, [0, 0, 0, 0]) == 0.0  # nothing observed
    assert bucket_quantile(0.5, bounds, [2, 2, 4, 4]) == 1.0  # rank 2 at the first bound
    assert bucket_quantile(0.75, bounds, [2, 2, 4, 4]) == 3.0  # halfway into (2, 4]
    assert bucket_quantile(0.25, bounds, [2, 2, 4, 4]) == 0.5  # the first from 0
    assert bucket_quantile(0.99, bounds, [0, 0, 1, 2]) == 4.0  # in +Inf: the last bound
    assert tuple(sorted(TOKEN_BUCKETS)) == TOKEN_BUCKETS


def test_preemptions_by_kind_and_kv_blocks_free_reach_status_and_metrics() -> None:
    llm = model_row(
        "llm",
        tokens_generated=9,
        gen_iterations=4,
        preemptions=3,
        restarts=1,
        swaps=2,
        recomputes=1,
    )
    stats = WorkerStats(kv_bytes=3, kv_blocks=3, kv_seqs=2, kv_limit_bytes=10, kv_blocks_free=7)
    st = broker_status(models=[llm], workers=[worker_row("w0", stats=stats)])
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in metrics.broker_families(st)
        for s in f.samples
    }
    kinds = {k[1][0][1]: v for k, v in got.items() if k[0] == "flowmesh_broker_preemptions_total"}
    assert kinds == {"swap": 2, "recompute": 1, "restart": 1}
    assert got[("flowmesh_broker_worker_kv_blocks_free", (("worker", "w0"),))] == 7
    text = views.format_status(st).splitlines()
    assert "w0 KV cache: 3 B of 10 B (3 blocks, 2 sequences), 7 blocks free" in text
    assert [ln for ln in text if "generation:" in ln] == [
        "llm generation: 0 sequences running, 0 waiting, 9 tokens in 4 iterations, "
        "3 preemptions (2 resumed from parked KV, 1 recomputed), 1 restarts"
    ]
    mine = {s.name: s.value for f in metrics.worker_families("w0", stats) for s in f.samples}
    assert mine["flowmesh_worker_kv_blocks_free"] == 7


def test_tokens_per_second_counts_every_sequence_of_an_iteration(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files, gen_groups=1)
    run = g.first(g.generate(1, [[1, 5], [1, 6]], max_tokens=2))  # both in one Run
    g.h.now = 1.0
    run = run_of(g.step(run, [10, 20]), g.w0)  # two new tokens at 1.0 s
    g.h.now = 2.0
    g.step(run, [11, 21])  # two more at 2.0 s; the call ends
    g.answered_once()
    (row,) = g.core.status(g.h.now).models
    assert row.tokens_generated == 4
    assert row.tokens_per_s == pytest.approx(0.2 * math.exp(-0.1) + 0.2, rel=1e-12)
