"""An iteration of generation that follows another (`GenStep.follows`), in process: a tiny Llama
saved with save_pretrained on an executor over a CPU stand-in. Sent while the one it follows is
still queued, it takes in the tokens that one draws and runs right after it on the same compute
lane; a greedy generation of such iterations gives Hugging Face's tokens. One that cannot
follow (the iteration named did not run here, failed, or is not the stage's latest; a stage
that does not draw tokens) is refused and changes nothing. And no sequence's sampling fails an
iteration it shares with others: a temperature too small to divide by draws the greedy token."""

from __future__ import annotations

import asyncio

import pytest
import torch

from flowmesh.errors import Code, FlowmeshError
from flowmesh.messages import GenStep, Sampling, SeqStep
from flowmesh.modelio.sampling import GREEDY_BELOW, new_generator, sample
from gpu_worker.executor import Executor, FollowedFailed
from tests.support.decode_models import (
    hf_greedy,
    prompts,
    saved_spec,
    staged_executor,
    tiny_lm,
    two_stage_executor,
)
from tests.support.stages import MIB
from tests.support.torch_threads import one_thread  # noqa: F401 (fixture)

KEY = ("lm", 0)
GREEDY = Sampling()


@pytest.fixture
def llama(tmp_path):  # type: ignore[no-untyped-def]
    model = tiny_lm("llama")
    return model, saved_spec(model, tmp_path / "llama", "lm", kv_share=0.5)


def _run(ex: Executor, run_id: int, steps: list[SeqStep], ids: list[int], follows: int = 0):  # type: ignore[no-untyped-def]
    gen = GenStep(seqs=steps, follows=follows)
    return ex.run(KEY, [{"ids": torch.tensor(ids, dtype=torch.int64)}], gen=gen, run_id=run_id)


async def test_iterations_that_follow_take_in_the_tokens_drawn_before_them(llama) -> None:  # type: ignore[no-untyped-def]
    model, spec = llama
    ex = await staged_executor(spec, 8 * MIB, 1)
    a, b = prompts([12, 5])
    # Both prefills, then 19 iterations each following the one before, all sent at once (none
    # has run yet): each runs right after the one it follows; their KV crosses a block.
    prefill = [
        SeqStep(seq=1, start=0, count=len(a), sampling=GREEDY),
        SeqStep(seq=2, start=0, count=len(b), sampling=GREEDY),
    ]
    futs = [_run(ex, 100, prefill, a + b)]
    for i in range(1, 20):
        steps = [
            SeqStep(seq=1, start=len(a) + i - 1, count=1, sampling=GREEDY, drawn=i),
            SeqStep(seq=2, start=len(b) + i - 1, count=1, sampling=GREEDY, drawn=i),
        ]
        futs.append(_run(ex, 100 + i, steps, [0, 0], follows=99 + i))
    outs = [(await f).parts[0]["tokens"].tolist() for f in futs]
    assert [o[0] for o in outs] == hf_greedy(model, a, 20)[0]
    assert [o[1] for o in outs] == hf_greedy(model, b, 20)[0]
    ex.close()


async def test_a_follower_of_an_iteration_that_did_not_run_changes_nothing(llama) -> None:  # type: ignore[no-untyped-def]
    model, spec = llama
    ex = await staged_executor(spec, 8 * MIB, 1)
    (a,) = prompts([9])
    first = await _run(ex, 1, [SeqStep(seq=1, start=0, count=9, sampling=GREEDY)], a)
    out = [int(first.parts[0]["tokens"][0])]
    # Iteration 2 is refused as it is placed (a step past the cached tokens) ...
    with pytest.raises(FlowmeshError) as err:
        _run(ex, 2, [SeqStep(seq=1, start=11, count=1, sampling=GREEDY, drawn=1)], [out[-1]])
    assert err.value.code == Code.BAD_REQUEST
    # ... so the one sent to follow it is refused too, as is one naming another iteration (the
    # stage's latest is 1).
    for follows in (2, 7):
        with pytest.raises(FollowedFailed) as failed:
            _run(ex, 3, [SeqStep(seq=1, start=9, count=1, sampling=GREEDY, drawn=1)], [0], follows)
        assert failed.value.code == Code.NOT_RESIDENT
        assert f"iteration {follows}, which this one follows, did not run here" in str(failed.value)
    # Nothing changed: the sequence goes on exactly.
    for i in range(1, 6):
        step = SeqStep(seq=1, start=8 + i, count=1, sampling=GREEDY, drawn=i)
        out.append(int((await _run(ex, 10 + i, [step], [out[-1]])).parts[0]["tokens"][0]))
    assert out == hf_greedy(model, a, 6)[0]
    ex.close()


async def test_a_follower_of_an_iteration_that_failed_on_its_lane_fails_too(llama) -> None:  # type: ignore[no-untyped-def]
    _, spec = llama
    ex = await staged_executor(spec, 8 * MIB, 1)
    (a,) = prompts([9])
    await _run(ex, 1, [SeqStep(seq=1, start=0, count=9, sampling=GREEDY)], a)
    # A projection of the wrong shape: iteration 2 fails as it computes, on its lane; iteration
    # 3, sent to follow it, fails having computed nothing: as it comes to run when it was placed
    # before iteration 2 ran, or at once when iteration 2 had failed by then (the lane may be
    # that quick).
    attn = ex.stages[KEY].blocks[1].layer.self_attn
    attn.q_proj, q_proj = torch.nn.Linear(3, 3), attn.q_proj
    failing = _run(ex, 2, [SeqStep(seq=1, start=9, count=1, sampling=GREEDY, drawn=1)], [5])
    try:
        follower = _run(ex, 3, [SeqStep(seq=1, start=10, count=1, sampling=GREEDY, drawn=2)],
                        [0], 2)  # fmt: skip
    except FollowedFailed as exc:
        results = [*(await asyncio.gather(failing, return_exceptions=True)), exc]
    else:
        results = await asyncio.gather(failing, follower, return_exceptions=True)
    attn.q_proj = q_proj
    assert isinstance(results[0], FlowmeshError) and results[0].code == Code.MODEL_ERROR
    assert isinstance(results[1], FollowedFailed), results
    assert "iteration 2, which this one follows, failed" in str(results[1])
    ex.close()


async def test_only_a_stage_that_draws_the_tokens_runs_a_follower(llama) -> None:  # type: ignore[no-untyped-def]
    _, spec = llama
    ex = await two_stage_executor(spec, 8 * MIB)
    (a,) = prompts([4])
    with pytest.raises(FlowmeshError) as err:
        _run(ex, 2, [SeqStep(seq=1, start=0, count=4, sampling=GREEDY)], a, follows=1)
    assert err.value.code == Code.BAD_REQUEST
    assert "only a stage that takes token ids and draws the next ones" in err.value.reason
    ex.close()


async def test_a_tiny_temperature_draws_greedily_and_fails_nobody_batched_with_it(llama) -> None:  # type: ignore[no-untyped-def]
    model, spec = llama
    ex = await two_stage_executor(spec, 4 * MIB)
    a, b = prompts([9, 5])
    # A valid Sampling whose temperature overflows logits / temperature (to inf, then NaN).
    tiny = Sampling(temperature=1e-40, seed=1)

    async def iteration(steps: list[SeqStep], ids: list[int]) -> list[int]:
        gen = GenStep(seqs=steps)
        h = (await ex.run(("lm", 0), [{"ids": torch.tensor(ids)}], gen=gen)).parts[0][""]
        return (await ex.run(("lm", 1), [{"": h}], gen=gen)).parts[0]["tokens"].tolist()

    got_a = await iteration([SeqStep(seq=1, start=0, count=9, sampling=GREEDY)], a)
    got = await iteration(
        [
            SeqStep(seq=1, start=9, count=1, sampling=GREEDY, drawn=1),
            SeqStep(seq=2, start=0, count=5, sampling=tiny),
        ],
        got_a + b,
    )
    got_a, got_b = got_a + got[:1], got[1:]
    for i in range(1, 3):
        got = await iteration(
            [
                SeqStep(seq=1, start=8 + len(got_a), count=1, sampling=GREEDY, drawn=len(got_a)),
                SeqStep(seq=2, start=4 + len(got_b), count=1, sampling=tiny, drawn=i),
            ],
            [got_a[-1], got_b[-1]],
        )
        got_a, got_b = got_a + got[:1], got_b + got[1:]
    assert got_a == hf_greedy(model, a, 4)[0]
    assert got_b == hf_greedy(model, b, 3)[0]
    ex.close()


def test_no_temperature_overflows_the_draw() -> None:
    rows = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    for scale, temperature in (
        (1.0, 1e-40),
        (1.0, 5e-324),
        (1.0, GREEDY_BELOW / 2),
        # Logits large enough that dividing them by the temperature overflows float32.
        (1e37, GREEDY_BELOW * 2),
        (1e37, 0.01),
    ):
        logits = rows * scale
        s = Sampling(temperature=temperature, seed=2)
        gens = [new_generator(s, logits.device) for _ in range(len(logits))]
        got = sample(logits, [s] * len(logits), gens)
        assert got.tolist() == logits.argmax(-1).tolist(), (scale, temperature)
