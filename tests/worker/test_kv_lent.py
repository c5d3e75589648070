"""KV blocks on a worker that also trains: training fills the free gaps of serving's memory
(`gpu_worker.memory`), and a generation iteration whose blocks find no range there claims them
back as a stage load does. It is answered NO_SPACE at once (its run is placed on the loop and
cannot wait), training gives its borrowed ranges back, and the broker's next try places them; a
claim nobody follows up ends by itself, so training is never held for good. In process: a tiny
Llama on an executor over a CPU stand-in, training's ranges taken straight from the memory and
given back on a claim as the training executor gives them (`TrainingExecutor._reclaim`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gpu_worker.executor as executor_module
from flowmesh.errors import Code, FlowmeshError
from flowmesh.messages import GenStep, Sampling, SeqStep
from flowmesh.spec import DEFAULT_ALLOW
from gpu_worker.device import CpuStandIn
from gpu_worker.executor import Executor
from gpu_worker.memory import DeviceMemory, Extent
from gpu_worker.stage_loader import prepare_stage
from partitioner.stage_plans import make_stage_plan
from tests.support.decode_models import prompts, saved_spec, tiny_lm
from tests.support.stages import MIB
from tests.support.torch_threads import one_thread  # noqa: F401 (fixture)
from tests.support.waiting import until


async def test_kv_blocks_claim_back_what_training_borrowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(executor_module, "KV_CLAIM_S", 0.05)
    spec = saved_spec(tiny_lm("llama"), tmp_path / "llama", "lm", kv_share=0.5)
    memory = DeviceMemory(4 * MIB, 4 * MIB)
    ex = Executor(CpuStandIn(8 * MIB), memory=memory)
    blocks, host = prepare_stage(spec, make_stage_plan(spec, stages=1), 0, ex.device, DEFAULT_ALLOW)
    ex.add_stage(("lm", 0), blocks, host, spec.kv_share)
    await ex.load(("lm", 0))
    borrowed: list[Extent] = []

    def borrow() -> None:  # training's tasks fill every gap, serving's part too
        while (ext := memory.alloc_training(256 * 1024)) is not None:
            borrowed.append(ext)

    def give_back() -> None:  # a claim: the training executor gives back what has not started
        while borrowed:
            memory.free(borrowed.pop(), [], "training", reclaimed=True)

    (prompt,) = prompts([20])
    gen = GenStep(seqs=[SeqStep(seq=1, start=0, count=20, sampling=Sampling())])
    parts = [{"ids": torch.tensor(prompt)}]
    try:
        # A claim nobody follows up (the call gone): it ends by itself, training admits again.
        borrow()
        assert memory.lent > 0
        with pytest.raises(FlowmeshError) as refused:
            await ex.run(("lm", 0), parts, gen=gen)
        assert refused.value.code == Code.NO_SPACE and "claimed back" in refused.value.reason
        assert memory.claims == 1 and memory.alloc_training(1024) is None  # training waits
        await until(lambda: memory.claims == 0, "the claim to end by itself", timeout=30)

        # Followed up: training gives its ranges back on the claim, the next try places.
        memory.on_claim.append(give_back)
        with pytest.raises(FlowmeshError) as again:
            await ex.run(("lm", 0), parts, gen=gen)
        assert again.value.code == Code.NO_SPACE and memory.lent == 0
        out = await ex.run(("lm", 0), parts, gen=gen)
        assert out.parts and memory.claims == 0  # placed: the claim is over at once
        assert ex.stages[("lm", 0)].kv is not None and ex.stages[("lm", 0)].kv.nbytes > 0
    finally:
        give_back()
        ex.close()
