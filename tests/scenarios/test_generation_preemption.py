"""Preemption and resume in process (tests/support/inproc.py), each worker policy forced in
turn: "swap" (a preempted sequence's KV parked in its workers' host memory and copied back when
it joins again) and "recompute" (dropped, recomputed from its tokens). Greedy tokens equal HF
`generate`'s, in one stage and in two, for a Llama and a GPT-2; status counts each kind, and
nothing stays parked once every sequence ended."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.support.inproc import InProcMesh
from tests.support.lm import hf_generate, tiny_lm_dir
from tests.support.preemption import (
    PREEMPTED,
    PREEMPTED_NEW,
    preempted_reference,
    three_blocks_share,
)
from tests.support.waiting import until, until_blocking


@pytest.mark.parametrize("policy", ["swap", "recompute"])
def test_every_preempted_sequence_resumes_exactly_by_the_policy_forced(
    tmp_path_factory: pytest.TempPathFactory, policy: str
) -> None:
    root: Path = tmp_path_factory.getbasetemp() / "preemption"
    root.mkdir(exist_ok=True)
    mesh = InProcMesh(memory_budget="8MiB", data_roots=[root], kv_preempt=policy)
    with mesh, mesh.client() as c:
        workers = [w.hands.executor for w in mesh.workers]

        def nothing_parked() -> bool:
            return all(ex.stats()["kv_parked_seqs"] == 0 for ex in workers)

        for arch in ("llama", "gpt2"):
            model_dir, expected = preempted_reference(root, arch)
            for stages in (1, 2):
                name = f"{arch}-{stages}"
                share = three_blocks_share(arch, stages, mesh.budget_bytes)
                c.deploy(
                    name, hf=str(model_dir), stages=stages, replicas=1, max_seqs=3, kv_share=share
                )
                outs = c.generate(name, PREEMPTED, max_tokens=PREEMPTED_NEW, ignore_eos=True)
                assert [o.ids for o in outs] == expected, name
                row = next(m for m in c.status().models if m.name == name)
                assert row.preemptions >= 1, name
                if policy == "swap":
                    assert (row.swaps, row.recomputes) == (row.preemptions, 0), name
                else:
                    assert (row.swaps, row.recomputes) == (0, row.preemptions), name
                # Resumed sequences took their KV back; ended ones freed theirs.
                until_blocking(nothing_parked, f"{name}: no parked KV left on any worker")
                c.undeploy(name)
        parked = sum(ex.counters["kv_parked"] for ex in workers)
        restored = sum(ex.counters["kv_restored"] for ex in workers)
        if policy == "swap":
            assert parked >= 1 and restored >= 1
        else:
            assert parked == restored == 0
        dropped = sum(ex.counters["kv_dropped"] for ex in workers)
        assert dropped == 0 if policy == "swap" else dropped >= 1


def test_a_generating_model_gives_way_to_a_starving_one_and_resumes_from_parked_kv(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """One worker whose budget holds one of two language models: `a` generates a long sequence
    while `b`'s call arrives. Past the starvation limit `b`'s load evicts `a`'s stage, live KV
    and all (parked in host memory, by the forced policy), `b` answers, and `a`'s sequence
    goes on when its stage is back: both outputs equal HF `generate`'s."""
    root: Path = tmp_path_factory.getbasetemp() / "starving"
    root.mkdir(exist_ok=True)
    dirs = {
        n: tiny_lm_dir(root / n, "llama", seed=s, max_positions=256)
        for n, s in (("a", 1), ("b", 2))
    }
    weights = max(sum(f.stat().st_size for f in d.glob("*.safetensors")) for d in dirs.values())
    budget = weights + weights // 2  # one model's weights and some KV, never both models
    prompt = [5, 17, 33, 9]
    # a's sequence long enough that b's call comes while it generates, however loaded the
    # machine (at 40 tokens it was once over before b's call reached the broker).
    new = {"a": 120, "b": 40}
    want = {n: hf_generate(d, [prompt], new[n], ignore_eos=True)[0] for n, d in dirs.items()}
    mesh = InProcMesh(
        cpu_workers=1,
        memory_budget=budget,
        data_roots=[root],
        kv_preempt="swap",
        broker={"starvation_s": 0.05},
    )
    with mesh, mesh.client() as c:
        for n, d in dirs.items():
            c.deploy(n, hf=str(d), stages=1, replicas=1, kv_share=0.2)

        async def both() -> list[list[int]]:
            async with mesh.async_client() as ac:
                a = asyncio.create_task(
                    ac.generate("a", ids=prompt, max_tokens=new["a"], ignore_eos=True)
                )

                async def a_generating() -> bool:
                    return any(
                        m.name == "a" and m.tokens_generated for m in (await ac.status()).models
                    )

                await until(a_generating, "a's first token")
                b = await ac.generate("b", ids=prompt, max_tokens=new["b"], ignore_eos=True)
                return [(await a).ids, b.ids]

        got = asyncio.run(both())
        assert got == [want["a"], want["b"]]
        ex = mesh.workers[0].hands.executor
        # a's stage went with live KV, parked, and came back with it.
        assert ex.counters["kv_parked"] >= 1 and ex.counters["kv_restored"] >= 1
        assert ex.counters["kv_dropped"] == 0
