"""The worker's KV cache in-process: a tiny Llama saved with save_pretrained, cut in two stages
on an executor over a CPU stand-in; greedy iterations through it equal HF `generate`, its KV
blocks are ranges of the one arena (counted in the serving budget beside the weights), freed
with FreeSeqs and with the stage, and refused NO_SPACE (changing nothing) past the model's
share."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flowmesh.errors import Code, FlowmeshError
from flowmesh.messages import GenStep, Sampling, SeqStep
from flowmesh.spec import ModelSpec
from gpu_worker.executor import Executor
from tests.support.decode_models import (
    hf_greedy,
    prompts,
    saved_spec,
    tiny_lm,
    two_stage_executor,
)
from tests.support.stages import MIB
from tests.support.torch_threads import one_thread  # noqa: F401 (fixture)


async def _executor(spec: ModelSpec, budget: int = 4 * MIB, **options: Any) -> Executor:
    return await two_stage_executor(spec, budget, **options)


async def _iteration(ex: Executor, name: str, steps: list[SeqStep], ids: torch.Tensor):  # type: ignore[no-untyped-def]
    gen = GenStep(seqs=steps)
    hidden = (await ex.run((name, 0), [{"ids": ids}], gen=gen)).parts[0][""]
    return (await ex.run((name, 1), [{"": hidden}], gen=gen)).parts[0]["tokens"]


def _prefill(seq: int, n: int) -> SeqStep:
    return SeqStep(seq=seq, start=0, count=n, sampling=Sampling())


@pytest.fixture
def llama(tmp_path):  # type: ignore[no-untyped-def]
    model = tiny_lm("llama")
    return model, saved_spec(model, tmp_path / "llama", "lm", kv_share=0.25)


async def test_greedy_iterations_through_the_executor_equal_generate(llama) -> None:  # type: ignore[no-untyped-def]
    model, spec = llama
    ex = await _executor(spec)
    ps = prompts([9, 20, 4])
    # Iterations as the broker sends them: the third prompt's prefill joins two decodes.
    out: list[list[int]] = [[] for _ in ps]
    joins = [0, 0, 3]
    it = 0
    while any(len(o) < 6 for o in out):
        steps, ids = [], []
        for i, p in enumerate(ps):
            if joins[i] > it or len(out[i]) >= 6:
                continue
            if out[i]:
                steps.append(
                    SeqStep(seq=i, start=len(p) + len(out[i]) - 1, count=1, sampling=Sampling())
                )
                ids.append(out[i][-1])
            else:
                steps.append(_prefill(i, len(p)))
                ids.extend(p)
        if steps:
            tokens = await _iteration(ex, "lm", steps, torch.tensor(ids))
            for s, t in zip(steps, tokens.tolist(), strict=True):
                out[s.seq].append(t)
        it += 1
    for i, p in enumerate(ps):
        assert out[i] == hf_greedy(model, p, 6)[0], i
    ex.close()


async def test_kv_blocks_count_in_the_budget_and_go_with_free_seqs_and_the_stage(llama) -> None:  # type: ignore[no-untyped-def]
    _, spec = llama
    ex = await _executor(spec, kv_preempt="recompute")  # parking: tests/worker/test_kv_park.py
    weights = ex.memory.used["serving"]
    (p,) = prompts([20])
    await _iteration(ex, "lm", [_prefill(1, 20)], torch.tensor(p))
    kv0, kv1 = ex.stages[("lm", 0)].kv, ex.stages[("lm", 1)].kv
    assert kv0 is not None and kv1 is not None
    # 20 tokens: 2 blocks of 16 on each stage, one arena range each
    block = kv0.block_bytes + kv1.block_bytes
    assert ex.memory.used["serving"] == weights + 2 * block
    stats = ex.stats()
    assert (stats["kv_bytes"], stats["kv_blocks"], stats["kv_seqs"]) == (2 * block, 4, 1)
    assert ex.free_seqs(("lm", 0), [1, 99]) == 2 * kv0.block_bytes  # 99: not held, ignored
    ex.free_seqs(("lm", 1), [1])
    assert ex.memory.used["serving"] == weights
    assert ex.stats()["kv_seqs"] == 0
    # Evicting a stage drops its KV (never parked, by `kv_preempt`); the sequence's next step
    # there fails, naming why.
    await _iteration(ex, "lm", [_prefill(2, 20)], torch.tensor(p))
    ex.evict(("lm", 1))
    assert ex.stages[("lm", 1)].kv is None
    with pytest.raises(FlowmeshError) as err:
        await _iteration(
            ex, "lm", [SeqStep(seq=2, start=20, count=1, sampling=Sampling())], torch.tensor([3])
        )
    assert err.value.code == Code.NOT_RESIDENT
    assert "sequence 2 has no KV cache here" in err.value.reason
    ex.close()


async def test_kv_past_the_models_share_is_refused_no_space_changing_nothing(llama) -> None:  # type: ignore[no-untyped-def]
    _, spec = llama
    ex = await _executor(spec, budget=1 * MIB)
    held = None
    (p,) = prompts([16])
    seq = 0
    # kv_share 0.25 of 1 MiB: 256 KiB for the model's KV here; each sequence takes one block
    # per stage (16 tokens). Fill it.
    while True:
        before = {k: st.kv.nbytes if st.kv else 0 for k, st in ex.stages.items()}
        try:
            await _iteration(ex, "lm", [_prefill(seq, 16)], torch.tensor(p))
        except FlowmeshError as exc:
            assert exc.code == Code.NO_SPACE
            assert "over its share: kv_share 0.25 x serving budget" in exc.reason
            break
        seq += 1
        held = ex.stages[("lm", 0)].kv
    assert held is not None and seq > 1
    # The stage that refused took nothing; the one before it holds the sequence's prefill
    # until the broker frees it (FreeSeqs to every stage) or runs it again.
    assert ex.stages[("lm", 1)].kv.nbytes == before[("lm", 1)]
    assert ex.stages[("lm", 0)].kv.nbytes > before[("lm", 0)]
    ex.free_seqs(("lm", 0), [seq])
    assert ex.stats()["kv_seqs"] == seq
    # Once a sequence leaves, the next one fits.
    ex.free_seqs(("lm", 0), [0])
    ex.free_seqs(("lm", 1), [0])
    await _iteration(ex, "lm", [_prefill(seq, 16)], torch.tensor(p))
    # One sequence alone over the share: TOO_BIG with the numbers.
    (long,) = prompts([127])
    with pytest.raises(FlowmeshError) as err:
        await _iteration(ex, "lm", [_prefill(500, 127)], torch.tensor(long))
    assert err.value.code in (Code.TOO_BIG, Code.NO_SPACE)
    ex.close()


async def test_a_learned_position_table_bounds_each_sequence_not_the_packed_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # GPT-2's 128 positions: two prompts of 70 in one iteration are 140 packed tokens, each
    # within the table. The packed length was once checked as one sequence's, failing every
    # call of such an iteration.
    model = tiny_lm("gpt2")
    ex = await _executor(saved_spec(model, tmp_path / "gpt2", "lm", kv_share=0.5), 8 * MIB)
    a, b = prompts([70, 70])
    tokens = await _iteration(ex, "lm", [_prefill(0, 70), _prefill(1, 70)], torch.tensor(a + b))
    assert tokens.tolist() == [hf_greedy(model, a, 1)[0][0], hf_greedy(model, b, 1)[0][0]]
    # A sequence of its own past the table is refused, named.
    with pytest.raises(FlowmeshError) as err:
        step = SeqStep(seq=0, start=70, count=59, sampling=Sampling())
        await _iteration(ex, "lm", [step], torch.ones(59, dtype=torch.long))
    assert (err.value.code, err.value.reason) == (
        Code.BAD_REQUEST,
        "'lm'/0: sequence 0 would take 129 positions, the model takes at most 128",
    )
    ex.close()
