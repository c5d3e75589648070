"""The worker reports the live KV bytes of each of its stages in its heartbeat stats
(`kv_stage_bytes`, "model/stage" -> bytes, beside `resident_stages`), for the broker's eviction
choice (`broker.serving_router.kv_held`): in process, a tiny Llama saved with save_pretrained,
cut in two stages on an executor over a CPU stand-in, generation iterations run through it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flowmesh import protocol as p
from flowmesh.messages import GenStep, Sampling, SeqStep
from flowmesh.spec import DEFAULT_ALLOW
from gpu_worker.device import CpuStandIn
from gpu_worker.executor import Executor
from gpu_worker.stage_loader import prepare_stage
from partitioner.stage_plans import make_stage_plan
from tests.support.decode_models import prompts, saved_spec, tiny_lm
from tests.support.stages import MIB
from tests.support.torch_threads import one_thread  # noqa: F401 (fixture)


async def _iteration(ex: Executor, name: str, steps: list[SeqStep], ids: torch.Tensor) -> None:
    gen = GenStep(seqs=steps)
    hidden = (await ex.run((name, 0), [{"ids": ids}], gen=gen)).parts[0][""]
    await ex.run((name, 1), [{"": hidden}], gen=gen)


def _prefill(seq: int, n: int) -> SeqStep:
    return SeqStep(seq=seq, start=0, count=n, sampling=Sampling())


@pytest.fixture
async def executor(tmp_path):  # type: ignore[no-untyped-def]
    spec = saved_spec(tiny_lm("llama"), tmp_path / "llama", "lm", kv_share=0.25)
    ex = Executor(CpuStandIn(4 * MIB))
    plan = make_stage_plan(spec, stages=2)
    for i in range(2):
        blocks, host = prepare_stage(spec, plan, i, ex.device, DEFAULT_ALLOW)
        ex.add_stage((spec.name, i), blocks, host, spec.kv_share)
        await ex.load((spec.name, i))
    yield ex
    ex.close()


def _heartbeat(stats: dict[str, Any]) -> p.WorkerStats:
    """`stats` as the broker stores them: typed, through the codec and its checks."""
    msg = p.decode(p.encode(p.Heartbeat(stats=p.WorkerStats(**stats))))
    assert isinstance(msg, p.Heartbeat) and isinstance(msg.stats, p.WorkerStats)
    return msg.stats


async def test_stats_report_each_stage_s_live_kv_bytes(executor: Executor) -> None:
    ex = executor
    assert ex.stats()["kv_stage_bytes"] == {}  # no KV yet: nothing listed
    (prompt,) = prompts([20])
    await _iteration(ex, "lm", [_prefill(1, 20)], torch.tensor(prompt))
    kv0, kv1 = ex.stages[("lm", 0)].kv, ex.stages[("lm", 1)].kv
    assert kv0 is not None and kv1 is not None
    # 20 tokens: 2 blocks of 16 tokens on each stage.
    stats = _heartbeat(ex.stats())
    assert stats.kv_stage_bytes == {"lm/0": 2 * kv0.block_bytes, "lm/1": 2 * kv1.block_bytes}
    assert sum(stats.kv_stage_bytes.values()) == stats.kv_bytes
    assert set(stats.kv_stage_bytes) <= set(stats.resident_stages)
    # A second sequence's 4 tokens: one block more on each stage.
    await _iteration(ex, "lm", [_prefill(2, 4)], torch.tensor(prompt[:4]))
    assert ex.stats()["kv_stage_bytes"] == {
        "lm/0": 3 * kv0.block_bytes,
        "lm/1": 3 * kv1.block_bytes,
    }
    # Freed on one stage: listed for the other only; freed on both, nothing.
    ex.free_seqs(("lm", 0), [1, 2])
    assert ex.stats()["kv_stage_bytes"] == {"lm/1": 3 * kv1.block_bytes}
    ex.free_seqs(("lm", 1), [1, 2])
    assert ex.stats()["kv_stage_bytes"] == {}
    # An evicted stage's KV went with it.
    await _iteration(ex, "lm", [_prefill(3, 20)], torch.tensor(prompt))
    ex.evict(("lm", 1))
    assert ex.stats()["kv_stage_bytes"] == {"lm/0": 2 * kv0.block_bytes}
