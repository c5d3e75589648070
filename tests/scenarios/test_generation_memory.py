"""Generation under memory pressure through an in-process mesh (tests/support/inproc.py): four
tiny language models (two Llamas, two Qwen2s) on two workers whose budgets each hold two models'
weights and a few sequences' KV, many concurrent greedy calls across all four. Every output
equals Hugging Face's own `generate`, no worker's resident bytes (weights and KV) ever exceed
its budget, sequences that outgrow their model's KV share are preempted (counted in status) and
finish all the same, and each worker's KV figures reach status, `flowmesh status` and /metrics:
above 0 while sequences run, 0 once every one ended."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from client_sdk import views
from flowmesh import metrics
from flowmesh.lm_examples import hf_generate, tiny_lm_dir
from flowmesh.modelio.decode import KV_BLOCK
from flowmesh.reports import BrokerStatus, WorkerStats
from gpu_worker.kv_cache import kv_limit_bytes
from tests.support.inproc import InProcMesh
from tests.support.mesh import roots_at
from tests.support.reports import broker_status, worker_row
from tests.support.torch_threads import one_thread  # noqa: F401 (fixture)
from tests.support.waiting import until

ARCHS = ["llama", "qwen2", "llama", "qwen2"]
LAYERS, HIDDEN, KV_HEADS, HEADS = 4, 64, 2, 4  # tiny_lm_dir's heads
# One block of KV: every layer's keys and values for KV_BLOCK tokens, float32.
BLOCK = LAYERS * 2 * KV_HEADS * KV_BLOCK * (HIDDEN // HEADS) * 4
SHARE_BLOCKS = 5  # each model's KV share on a worker: room for one sequence (3 blocks), not two
MAX_SEQS = 4


def sequences(vocab: int) -> list[tuple[str, list[int], int]]:
    """(model, prompt ids, max_tokens): six per model, prompts of 3-14 tokens (one block) and
    18-34 new tokens, so each sequence grows to 2 or 3 blocks as it decodes: four running
    together outgrow the share, and the newest are preempted."""
    rng = random.Random(7)
    out = []
    for k in range(24):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 14))]
        out.append((f"lm{k % 4}", prompt, rng.randint(18, 34)))
    return out


@pytest.fixture(scope="module")
def lms(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[InProcMesh, dict[str, Path], int]]:
    root = tmp_path_factory.mktemp("gen-memory")
    dirs = {
        f"lm{i}": tiny_lm_dir(root / f"lm{i}", arch, seed=20 + i, layers=LAYERS, hidden=HIDDEN)
        for i, arch in enumerate(ARCHS)
    }
    weights = max(sum(f.stat().st_size for f in d.glob("*.safetensors")) for d in dirs.values())
    # Two models' weights and eight blocks of KV; the alignment of each tensor's range besides.
    budget = 2 * weights + 8 * BLOCK + (64 << 10)
    share = (SHARE_BLOCKS * BLOCK + 1) / budget
    # Heartbeats every 50 ms (tests.support.mesh.FAST's are 0.2 s), so that status sees the
    # KV of sequences that run for a second or so.
    beats = {"heartbeat_s": 0.05, "liveness": 100}
    with InProcMesh(cpu_workers=2, memory_budget=budget, **roots_at(root), **beats) as mesh:
        with mesh.client(timeout=120) as c:
            for name, d in dirs.items():
                c.deploy(name, hf=str(d), stages=1, max_seqs=MAX_SEQS, kv_share=share)
        yield mesh, dirs, budget


def over_budget(st: BrokerStatus) -> list[str]:
    """What a status shows of a worker holding more than its budget: its arena's serving bytes
    now and at their peak, and the sum of what its stages and KV count as resident (the
    bookkeeping's own view, which exceeds the budget if a range counts twice or stays counted
    after it went to another)."""
    out = []
    for w in st.workers:
        held = sum(w.stats.resident_stages.values()) + w.kv_bytes
        for what, n in (("resident", w.stats.resident_bytes), ("peak", w.peak_bytes)):
            if n > w.budget_bytes:
                out.append(f"{w.name}: {what} {n} > budget {w.budget_bytes}")
        if held > w.budget_bytes:
            out.append(f"{w.name}: stages + KV {held} > budget {w.budget_bytes}")
    return out


def test_many_sequences_over_four_models_fit_the_budget_and_equal_hf(
    lms: tuple[InProcMesh, dict[str, Path], int],
) -> None:
    mesh, dirs, budget = lms
    vocab = 3 + 200  # ids within every tiny model's vocabulary
    seqs = sequences(vocab)
    expected = {
        name: iter(hf_generate(d, [p for m, p, _ in seqs if m == name], 34, ignore_eos=True))
        for name, d in dirs.items()
    }
    # Hugging Face's tokens for each sequence's own max_tokens (greedy: a prefix of 34's).
    want = [next(expected[m])[:n] for m, _, n in seqs]

    async def main() -> tuple[list[Any], list[BrokerStatus], BrokerStatus]:
        async with mesh.async_client(timeout=300) as c:
            seen: list[BrokerStatus] = []
            done = asyncio.Event()

            async def watch() -> None:
                while not done.is_set():
                    seen.append(await c.status())
                    await asyncio.sleep(0.02)

            watcher = asyncio.create_task(watch())
            calls = [c.generate(m, ids=p, max_tokens=n, ignore_eos=True) for m, p, n in seqs]
            try:
                outs = await asyncio.gather(*calls, return_exceptions=True)
            finally:
                done.set()
                await watcher

            async def kv_freed() -> bool:
                st = await c.status()
                return all(w.kv_bytes == 0 and w.kv_blocks == 0 for w in st.workers)

            # Every sequence ended: the workers' next heartbeats show their KV freed.
            await until(kv_freed, "every worker's KV bytes back to 0")
            return outs, seen, await c.status()

    outs, seen, after = asyncio.run(main())
    # Every call completes: a sequence that finds no KV room beside other models waits for it.
    failed = [f"call {k}: {o!r}" for k, o in enumerate(outs) if isinstance(o, BaseException)]
    assert failed == []
    assert [o.ids for o in outs] == want
    assert all(o.finish_reason == "length" for o in outs)

    # Memory: no status during the run, nor after it, shows a worker over its budget.
    assert seen
    held = {
        w.name: max(
            sum(x.stats.resident_stages.values()) + x.kv_bytes
            for st in seen
            for x in st.workers
            if x.name == w.name
        )
        for w in after.workers
    }
    rows_now = {m.name: m for m in after.models}
    print(  # the figures the closing note gives (`pytest -s`)
        f"\n{len(seqs)} calls over {len(dirs)} models; budget {budget} B a worker; most "
        f"stages + KV seen: {held}; peaks: {[w.peak_bytes for w in after.workers]}; "
        f"preemptions: { {n: rows_now[n].preemptions for n in dirs} }"
    )
    assert [bad for st in [*seen, after] for bad in over_budget(st)] == []
    # The KV figures: held while sequences ran, within each worker's limit, and all freed.
    assert any(w.kv_bytes > 0 and w.kv_blocks > 0 for st in seen for w in st.workers)
    for st in seen:
        for w in st.workers:
            assert w.kv_bytes <= w.kv_limit_bytes <= w.budget_bytes
            assert w.kv_bytes == w.kv_blocks * BLOCK
            if w.stats.kv_blocks_free is not None:  # once a KV cache is made there
                assert w.kv_blocks_free == (w.kv_limit_bytes - w.kv_bytes) // BLOCK
    assert any(w.stats.kv_blocks_free is not None for st in seen for w in st.workers)
    for w in after.workers:
        assert w.budget_bytes == budget and w.kv_limit_bytes > 0 and w.kv_seqs == 0
        assert f"{w.name} KV cache: 0 B of " in views.format_status(after)
    # Sequences outgrew their model's share and were preempted (resumed, their tokens equal).
    rows = {m.name: m for m in after.models}
    assert sum(rows[n].preemptions for n in dirs) >= 1, {n: rows[n].preemptions for n in dirs}
    assert all(rows[n].running_seqs == rows[n].waiting_seqs == 0 for n in dirs)


def test_kv_figures_reach_the_status_line_and_the_metrics() -> None:
    stats = WorkerStats(kv_bytes=3 * BLOCK, kv_blocks=3, kv_seqs=2, kv_limit_bytes=10 * BLOCK)
    st = broker_status(workers=[worker_row("w0", stats=stats), worker_row("w1")])
    text = views.format_status(st)
    assert "w0 KV cache: 48.0 KiB of 160.0 KiB (3 blocks, 2 sequences)" in text
    assert "w1 KV cache" not in text  # no language model's stages there
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in metrics.broker_families(st)
        for s in f.samples
    }
    w0 = (("worker", "w0"),)
    assert got[("flowmesh_broker_worker_kv_bytes", w0)] == 3 * BLOCK
    assert got[("flowmesh_broker_worker_kv_blocks", w0)] == 3
    assert got[("flowmesh_broker_worker_kv_limit_bytes", w0)] == 10 * BLOCK
    assert got[("flowmesh_broker_worker_kv_bytes", (("worker", "w1"),))] == 0
    mine = {s.name: s.value for f in metrics.worker_families("w0", stats) for s in f.samples}
    assert mine["flowmesh_worker_kv_bytes"] == 3 * BLOCK
    assert mine["flowmesh_worker_kv_sequences"] == 2
    assert mine["flowmesh_worker_kv_limit_bytes"] == 10 * BLOCK


def test_the_kv_limit_counts_each_model_s_share_once_within_the_budget() -> None:
    assert kv_limit_bytes([], 1000) == 0
    # Two stages of one model, one of another: 0.25 + 0.5 of the budget.
    assert kv_limit_bytes([("a", 0.25), ("a", 0.25), ("b", 0.5)], 1000) == 750
    assert kv_limit_bytes([("a", 0.75), ("b", 0.5)], 1000) == 1000
