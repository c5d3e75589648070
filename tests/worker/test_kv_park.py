"""Preempting a sequence without losing it, in process: a tiny Llama saved with save_pretrained,
cut in two stages on an executor over a CPU stand-in. A parked sequence's KV goes to host
memory and its device blocks back to the budget; its next step, from where it stopped, copies
the KV back bit for bit and generates exactly what an uninterrupted run does (greedy and seeded
sampling); a stage evicted under live sequences parks them and its next decode brings both
back. What is parked and what is dropped follows `kv_preempt` and, for "auto", the costs the
executor measured (given here, not timed)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flowmesh.errors import Code, FlowmeshError
from flowmesh.messages import GenStep, Sampling, SeqStep
from flowmesh.modelio.decode import KV_BLOCK
from flowmesh.spec import DEFAULT_ALLOW, ModelSpec
from gpu_worker.device import CpuStandIn
from gpu_worker.executor import Executor
from gpu_worker.stage_loader import prepare_stage
from partitioner.stage_plans import make_stage_plan
from tests.support.decode_models import (
    hf_greedy,
    prompts,
    saved_spec,
    tiny_lm,
    two_stage_executor,
)
from tests.support.stages import MIB
from tests.support.torch_threads import one_thread  # noqa: F401 (fixture)

STAGES = [("lm", 0), ("lm", 1)]


async def _executor(spec: ModelSpec, **options: Any) -> Executor:
    return await two_stage_executor(spec, 4 * MIB, **options)


async def _step(ex: Executor, step: SeqStep, ids: list[int]) -> int:
    gen = GenStep(seqs=[step])
    hidden = (await ex.run(("lm", 0), [{"ids": torch.tensor(ids)}], gen=gen)).parts[0][""]
    return int((await ex.run(("lm", 1), [{"": hidden}], gen=gen)).parts[0]["tokens"][0])


async def _generate(
    ex: Executor, seq: int, prompt: list[int], new: int, sampling: Sampling, out: list[int]
) -> None:
    """Extend `out` (what `seq` drew so far) to `new` tokens, one iteration at a time."""
    while len(out) < new:
        if out:
            start = len(prompt) + len(out) - 1
            step = SeqStep(seq=seq, start=start, count=1, sampling=sampling, drawn=len(out))
            out.append(await _step(ex, step, [out[-1]]))
        else:
            step = SeqStep(seq=seq, start=0, count=len(prompt), sampling=sampling)
            out.append(await _step(ex, step, prompt))


def _kv_bytes(ex: Executor, seq: int) -> list[torch.Tensor]:
    """Each stage's KV of `seq` for its tokens so far (positions past them are not compared)."""
    out = []
    for key in STAGES:
        kv = ex.stages[key].kv
        assert kv is not None
        held = kv.seqs[seq]
        for i, block in enumerate(held.cache.blocks):
            valid = min(KV_BLOCK, held.tokens - i * KV_BLOCK)
            out.append(block[:, :, :, :valid].clone())
    return out


@pytest.fixture
def llama(tmp_path):  # type: ignore[no-untyped-def]
    model = tiny_lm("llama")
    return model, saved_spec(model, tmp_path / "llama", "lm", kv_share=0.25)


async def test_a_parked_sequence_resumes_where_it_stopped_bit_for_bit(llama) -> None:  # type: ignore[no-untyped-def]
    model, spec = llama
    ex = await _executor(spec, kv_preempt="swap")
    weights = ex.memory.used["serving"]
    (p,) = prompts([20])
    out: list[int] = []
    await _generate(ex, 1, p, 4, Sampling(), out)
    before = _kv_bytes(ex, 1)
    tokens = ex.stages[("lm", 0)].kv.seqs[1].tokens  # type: ignore[union-attr]
    assert tokens == len(p) + len(out) - 1
    for key in STAGES:
        assert ex.park_seqs(key, [1, 99]) == ([1], [99])  # 99: held nowhere, nothing parked
    # Its device blocks are back in the budget; its KV is in host memory.
    assert ex.memory.used["serving"] == weights
    stats = ex.stats()
    assert (stats["kv_seqs"], stats["kv_parked_seqs"], stats["kv_parked"]) == (0, 1, 2)
    block = sum(ex.stages[k].kv.block_bytes for k in STAGES)  # type: ignore[union-attr]
    assert stats["kv_parked_bytes"] == 2 * block  # 23 tokens: 2 blocks a stage
    # A step from anywhere but where it stopped is refused, changing nothing.
    with pytest.raises(FlowmeshError) as err:
        await _step(ex, SeqStep(seq=1, start=tokens + 1, count=1, sampling=Sampling()), [5])
    assert err.value.code == Code.BAD_REQUEST and "parked with 23 tokens" in err.value.reason
    # Another sequence takes the freed ranges and writes its own KV there, then ends.
    (other,) = prompts([40], seed=5)
    await _generate(ex, 2, other, 2, Sampling(), [])
    for key in STAGES:
        ex.free_seqs(key, [2])
    # The next decode brings the KV back exactly as it was, then goes on.
    await _generate(ex, 1, p, 5, Sampling(), out)
    after = _kv_bytes(ex, 1)
    # bit-exact: KV bytes copied to host memory and back (data movement)
    assert all(torch.equal(a[..., : b.shape[3], :], b) for a, b in zip(after, before, strict=True))
    assert ex.stats()["kv_restored"] == 2 and ex.stats()["kv_parked_seqs"] == 0
    await _generate(ex, 1, p, 9, Sampling(), out)
    assert out == hf_greedy(model, p, 9)[0]
    ex.close()


async def test_a_step_from_before_the_parked_tokens_computes_them_again(llama) -> None:  # type: ignore[no-untyped-def]
    """One stage ran a step the other did not before both were preempted again (its parked
    copy holds a token more): the broker's step from the fewer tokens computes that position
    again over the parked one, and the sequence goes on exactly."""
    model, spec = llama
    ex = await _executor(spec, kv_preempt="swap")
    (p,) = prompts([15])
    out: list[int] = []
    await _generate(ex, 1, p, 4, Sampling(), out)
    for key in STAGES:
        assert ex.park_seqs(key, [1]) == ([1], [])
    tokens = len(p) + len(out) - 1  # parked on both stages
    step = SeqStep(seq=1, start=tokens - 1, count=2, sampling=Sampling(), drawn=len(out))
    out.append(await _step(ex, step, out[-2:]))
    await _generate(ex, 1, p, 8, Sampling(), out)
    assert out == hf_greedy(model, p, 8)[0]
    ex.close()


async def test_a_seeded_draw_goes_on_across_a_park_as_if_never_preempted(llama) -> None:  # type: ignore[no-untyped-def]
    _, spec = llama
    sampling = Sampling(temperature=1.0, seed=11, max_tokens=10)
    (p,) = prompts([9])
    ex = await _executor(spec, kv_preempt="swap")
    alone: list[int] = []
    await _generate(ex, 1, p, 10, sampling, alone)
    parked: list[int] = []
    await _generate(ex, 2, p, 4, sampling, parked)
    for key in STAGES:
        assert ex.park_seqs(key, [2]) == ([2], [])
    await _generate(ex, 2, p, 10, sampling, parked)
    assert parked == alone
    ex.close()


async def test_evicting_a_stage_under_live_sequences_parks_them(llama) -> None:  # type: ignore[no-untyped-def]
    model, spec = llama
    ex = await _executor(spec, kv_preempt="swap")
    ps = prompts([12, 30])
    outs: list[list[int]] = [[], []]
    for i, p in enumerate(ps):
        await _generate(ex, i, p, 3, Sampling(), outs[i])
    # Stage 1 goes (the broker's starving model needs the room): its sequences are parked.
    ex.evict(("lm", 1))
    kv = ex.stages[("lm", 1)].kv
    assert kv is not None and sorted(kv.parked) == [0, 1] and not kv.seqs
    assert ex.stats()["resident_stages"] == {"lm/0": ex.stages[("lm", 0)].host.nbytes}
    # Their next decodes load it back (a run brings an evicted stage back) and their KV too.
    for i, p in enumerate(ps):
        await _generate(ex, i, p, 8, Sampling(), outs[i])
        assert outs[i] == hf_greedy(model, p, 8)[0], i
    # (Brought back by stage 0's run, which prefetches the stage after it, or by its own.)
    assert ex.counters["prefetches"] + ex.counters["implicit_loads"] == 1
    assert ex.counters["kv_restored"] == 2
    # Dropped for good (undeployed), a stage keeps nothing parked.
    ex.evict(("lm", 1))
    assert ex.stats()["kv_parked_seqs"] == 2
    ex.drop_stage(("lm", 1))
    assert ex.stats()["kv_parked_seqs"] == 0 and ex.stats()["kv_parked_bytes"] == 0
    ex.close()


async def test_a_starved_models_kv_may_evict_another_models_live_stage(llama, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Room for a prefill's KV blocks comes from idle stages of other models; from stages that
    hold other models' live sequences only with `evict_live` (the broker's starved model):
    their sequences are parked (resumed as in the test above)."""
    model, spec = llama
    other = saved_spec(model, tmp_path / "b", "b", kv_share=0.25)
    plan = make_stage_plan(other, stages=2)
    weights = sum(
        prepare_stage(other, plan, i, CpuStandIn(MIB), DEFAULT_ALLOW)[1].nbytes for i in (0, 1)
    )
    # Both models' weights, b's sequence of 40 tokens (3 blocks a stage: 12 KiB on stage 0,
    # 6 KiB on stage 1) and 8 KiB more: two blocks of stage 0, not three.
    ex = await two_stage_executor(spec, 2 * weights + 26 * 1024, kv_preempt="swap")
    for i in (0, 1):
        blocks, host = prepare_stage(other, plan, i, ex.device, DEFAULT_ALLOW)
        ex.add_stage(("b", i), blocks, host, other.kv_share)
        await ex.load(("b", i))
    (pb,) = prompts([40], seed=3)
    gb = GenStep(seqs=[SeqStep(seq=7, start=0, count=40, sampling=Sampling())])
    hidden = (await ex.run(("b", 0), [{"ids": torch.tensor(pb)}], gen=gb)).parts[0][""]
    await ex.run(("b", 1), [{"": hidden}], gen=gb)
    assert ex.stages[("b", 0)].kv.block_bytes == 4096  # type: ignore[union-attr]
    assert ex.memory.serving_bytes - ex.memory.used["serving"] == 8192
    (pa,) = prompts([40])
    step = SeqStep(seq=1, start=0, count=40, sampling=Sampling())
    with pytest.raises(FlowmeshError) as err:
        await ex.run(("lm", 0), [{"ids": torch.tensor(pa)}], gen=GenStep(seqs=[step]))
    assert err.value.code == Code.NO_SPACE and "do not fit" in err.value.reason
    assert [ex.stages[("b", i)].state.name for i in (0, 1)] == ["RESIDENT", "RESIDENT"]
    starved = GenStep(seqs=[step], evict_live=True)
    hidden = (await ex.run(("lm", 0), [{"ids": torch.tensor(pa)}], gen=starved)).parts[0][""]
    (gone,) = [k for k in [("b", 0), ("b", 1)] if ex.stages[k].state.name == "HOST"]
    assert sorted(ex.stages[gone].kv.parked) == [7]  # type: ignore[union-attr]
    out = [int((await ex.run(("lm", 1), [{"": hidden}], gen=starved)).parts[0]["tokens"][0])]
    await _generate(ex, 1, pa, 4, Sampling(), out)
    assert out == hf_greedy(model, pa, 4)[0]
    ex.close()


async def test_auto_parks_what_costs_less_to_copy_than_to_recompute(llama) -> None:  # type: ignore[no-untyped-def]
    _, spec = llama
    ex = await _executor(spec)  # kv_preempt="auto"
    (p,) = prompts([20])
    for seq in (1, 2, 3):
        await _generate(ex, seq, p, 2, Sampling(), [])
    kv = ex.stages[("lm", 0)].kv
    st = ex.stages[("lm", 0)]
    assert kv is not None
    nbytes = 2 * kv.block_bytes  # 21 tokens: 2 blocks
    # Given costs: recomputing 21 tokens takes 21 x row_s; copying out and back 2 x bytes / bw.
    ex.bandwidth = 1e9
    st.row_s = 2 * nbytes / 1e9 / 21 * 2  # recomputing: twice the copy's time
    assert ex.park_seqs(("lm", 0), [1]) == ([1], [])
    st.row_s = 2 * nbytes / 1e9 / 21 / 2  # recomputing: half of it
    assert ex.park_seqs(("lm", 0), [2]) == ([], [2])
    # No room left for parked KV in host memory: dropped, whatever the costs.
    st.row_s, ex.park_bytes = 1.0, kv.parked_bytes
    assert ex.park_seqs(("lm", 0), [3]) == ([], [3])
    assert (ex.counters["kv_parked"], ex.counters["kv_dropped"]) == (1, 2)
    # A dropped sequence's next step finds no KV here: the broker recomputes it from its tokens.
    with pytest.raises(FlowmeshError) as err:
        await _step(ex, SeqStep(seq=2, start=21, count=1, sampling=Sampling()), [5])
    assert err.value.code == Code.NOT_RESIDENT
    ex.close()


async def test_recompute_never_parks_and_free_forgets_a_parked_copy(llama) -> None:  # type: ignore[no-untyped-def]
    model, spec = llama
    (p,) = prompts([20])
    never = await _executor(spec, kv_preempt="recompute")
    await _generate(never, 1, p, 2, Sampling(), [])
    for key in STAGES:
        assert never.park_seqs(key, [1]) == ([], [1])
    assert never.stats()["kv_parked_bytes"] == 0 and never.stats()["kv_seqs"] == 0
    never.close()
    ex = await _executor(spec, kv_preempt="swap")
    await _generate(ex, 1, p, 2, Sampling(), [])
    await _generate(ex, 2, p, 2, Sampling(), [])
    for key in STAGES:
        ex.park_seqs(key, [1, 2])
    # The broker drops 1 (it ended while waiting); 2 starts afresh from position 0 (recomputed
    # elsewhere in the broker's eyes): both parked copies are forgotten.
    for key in STAGES:
        ex.free_seqs(key, [1])
    out: list[int] = []
    await _generate(ex, 2, p, 6, Sampling(), out)
    assert out == hf_greedy(model, p, 6)[0]
    assert ex.stats()["kv_parked_seqs"] == 0 and ex.stats()["kv_parked_bytes"] == 0
    ex.close()


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_preempt 'sometimes': expected one of auto, swap"):
        Executor(CpuStandIn(MIB), kv_preempt="sometimes")
