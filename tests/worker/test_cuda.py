"""The executor on a real GPU: pinned host tier, copy stream, events. Skipped without CUDA;
run on a GPU machine with `pytest tests/worker/test_cuda.py`.

The ordering tests keep one stream busy with `torch.cuda._sleep` while the host runs ahead, so
that a missing `wait_event` would let the other stream read or overwrite bytes too early and
corrupt the result: they test GPU event ordering, not host-side waits.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flowmesh.testing import assert_forward_close
from gpu_worker.device import CudaDevice
from gpu_worker.executor import Executor
from gpu_worker.host_tier import HostStage
from tests.support.stages import MIB, mlp, stage_of
from tests.support.waiting import until

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# GPU clock cycles a sleeping kernel spins: about half a second at 2 GHz, ages next to the
# microseconds the host takes to go on, and to copy or compute these small models.
SLEEP_CYCLES = 1_000_000_000


def pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def gpu_reference(ref: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return ref.to("cuda")(x.to("cuda")).cpu()


class SleepOnStream(nn.Module):
    """Identity that queues a long kernel on the current stream and returns at once: the blocks
    after it run on the GPU long after the host has queued them and moved on."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(SLEEP_CYCLES)
        return x


async def test_cuda_load_and_run_match_a_direct_gpu_forward() -> None:
    dev = CudaDevice(0, 64 * MIB)
    assert dev.host_buffer(16).is_pinned()
    dev.arena.fill_(0xFF)  # NaN as float32: a block computed before its bytes landed shows
    torch.cuda.synchronize()  # the fill ran on another stream than the copies will
    ex = Executor(dev, copy_chunk_bytes=1)  # one copy per block: layer-pipelined
    blocks, _, ref = stage_of(mlp("a", depth=6))
    host = HostStage.build([dict(b.state_dict()) for b in ref.children()], allocate=dev.host_buffer)
    ex.add_stage(("a", 0), blocks, host)
    # The copy stream is busy before the load's copies: the run's kernels must wait on each
    # block's event on the GPU (the host sees every copy queued long before it lands).
    with torch.cuda.stream(dev.copy_stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    loading = ex.load(("a", 0))
    x = torch.randn(4, 256)
    out = await ex.run(("a", 0), [{"x": x}])  # issued before the load finished
    await loading
    assert_forward_close(out.parts[0][""], gpu_reference(ref, x))
    ex.close()


async def test_cuda_reuse_of_evicted_memory_waits_for_the_last_run_on_the_gpu() -> None:
    spec_a, spec_b = mlp("a"), mlp("b", seed=1)
    blocks_a, _, ref_a = stage_of(spec_a)
    blocks_b, _, ref_b = stage_of(spec_b)
    children = list(ref_a.children())
    # a = block 0, a sleeper, then the rest: a's weights after the sleeper are read on the GPU
    # long after the host has queued them and recorded the run's marker.
    host_a = HostStage.build(
        [dict(children[0].state_dict()), {}, *[dict(c.state_dict()) for c in children[1:]]],
        allocate=pinned,
    )
    host_b = HostStage.build([dict(c.state_dict()) for c in ref_b.children()], allocate=pinned)
    assert host_a.nbytes == host_b.nbytes
    dev = CudaDevice(0, host_a.nbytes)  # b can only go where a was
    ex = Executor(dev, compute_lanes=2)
    ex.add_stage(("a", 0), [blocks_a[0], SleepOnStream(), *blocks_a[1:]], host_a)
    ex.add_stage(("b", 0), blocks_b, host_b)
    await ex.load(("a", 0))
    x = torch.randn(2, 256)
    running = ex.run(("a", 0), [{"x": x}])
    (a_run,) = ex.stages[("a", 0)].users
    # The run's marker is recorded once its kernels are queued, while the GPU still sleeps.
    await until(a_run._recorded.is_set, "a's run to queue its kernels and record its marker")
    assert not a_run.done(), "the GPU finished a's run already: SLEEP_CYCLES is too short"
    ex.evict(("a", 0))
    loading = ex.load(("b", 0))  # a's bytes: the copy stream must wait on a's run's event
    out = await running
    await loading
    assert_forward_close(out.parts[0][""], gpu_reference(ref_a, x))
    assert_forward_close((await ex.run(("b", 0), [{"x": x}])).parts[0][""], gpu_reference(ref_b, x))
    ex.close()


async def test_cuda_hot_stage_keeps_only_the_markers_that_can_still_matter() -> None:
    dev = CudaDevice(0, 8 * MIB)
    ex = Executor(dev)
    blocks, _, ref = stage_of(mlp("a", width=64, depth=2))
    host = HostStage.build([dict(b.state_dict()) for b in ref.children()], allocate=dev.host_buffer)
    ex.add_stage(("a", 0), blocks, host)
    await ex.load(("a", 0))
    x = torch.randn(1, 64)
    for _ in range(50):
        out = await ex.run(("a", 0), [{"x": x}])
        assert len(ex.stages[("a", 0)].users) <= 1
    assert_forward_close(out.parts[0][""], gpu_reference(ref, x))
    ex.close()


def test_a_marker_set_after_leaving_compute_follows_the_threads_kernels() -> None:
    """`mark_done` in a `finally` after `compute()` (a failed task's, a parked sequence's copy)
    records on the thread's own compute stream: the default stream is not ordered after the
    non-blocking streams torch makes, so an event there would complete while the kernels that
    write the bytes it releases still run."""
    dev = CudaDevice(0, 4 * MIB)
    marker = dev.new_marker()
    with dev.compute():
        torch.cuda._sleep(SLEEP_CYCLES)
    dev.mark_done(marker)
    assert marker.recorded() and not marker.done(), "the marker did not wait for the kernel"
    assert marker.wait(timeout=30) and marker.done()


def test_training_waits_on_blocking_events_return_once_the_kernels_ran() -> None:
    """Training's lanes wait on blocking events (asleep, not spinning a core): a marker made
    `blocking` and `wait_computed` return only once the thread's queued kernels have run."""
    dev = CudaDevice(0, 4 * MIB)
    marker = dev.new_marker(blocking=True)
    with dev.compute():
        torch.cuda._sleep(SLEEP_CYCLES)
        dev.mark_done(marker)
        assert marker.recorded() and not marker.done(), "the marker did not wait for the kernel"
        assert marker.wait(timeout=30) and marker.done()
        torch.cuda._sleep(SLEEP_CYCLES)
        probe = dev.new_marker()
        dev.mark_done(probe)
        assert not probe.done()
        dev.wait_computed()
        assert probe.done(), "wait_computed returned before the thread's kernels ran"


def test_a_pipelined_stage_placed_in_the_gpu_arena_steps_as_one_left_beside_it() -> None:
    """Two pipeline stages built on the host and placed in one GPU arena (`place_later`, as a
    worker opens them) step as the same stages built on the GPU beside it: the same losses and
    weights, the placed ones' parameters and optimizer state inside the arena."""
    from gpu_worker.pipe_stage import PipeStage, job_rng, step_in_process
    from gpu_worker.train_config import TrainConfig
    from tests.support.train_cases import blocks_of, build, close, data_for, even_ranges

    cfg = TrainConfig({"name": "adam", "lr": 0.01}, seed=21)
    dev = CudaDevice(0, 16 * MIB)
    cuda = dev.torch_device

    def stages(placed: bool) -> list[PipeStage]:
        out, base = [], 0
        for s in range(2):
            blocks = blocks_of("mlp", build("mlp"))
            stage = PipeStage(
                "job", blocks, even_ranges(len(blocks), 2), s, cfg, cuda, place_later=placed
            )
            if placed:
                size = stage.lay_out(())
                stage.place(dev.arena, base)
                base += -(-size // 256) * 256
            out.append(stage)
        return out

    results = {}
    for placed in (False, True):
        pipe, rng, losses = stages(placed), job_rng(cfg.seed, cuda=0), []
        for x, y in data_for("mlp"):
            loss, rng, _ = step_in_process(pipe, x.to(cuda), y.to(cuda), rng)
            losses.append(loss)
        results[placed] = (losses, {n: t for s in pipe for n, t in s.state_dict().items()}, pipe)
    close(results[True][0], results[False][0], "losses, placed against beside")
    for name, t in results[False][1].items():
        close(results[True][1][name], t, name)
    lo = dev.arena.data_ptr()
    for stage in results[True][2]:
        for t in stage.in_arena():
            assert t.is_cuda and lo <= t.data_ptr() < lo + dev.arena.numel()


@pytest.mark.parametrize("model", ["mlp", "gpt-dropout"])
def test_memory_flow_on_the_gpu_trains_alike_under_each_activation_policy(model: str) -> None:
    """A job cut into three sub-models, trained by memory flow on the GPU with each activation
    policy forced, with no resident room: a kept graph's and a selective forward's stashes go
    to pinned host memory on the stash lane's stream and come back on the copy lane's ahead
    of the backward, into the activation bytes its extent reserves (or on the compute stream,
    for what was not there yet when its copies ran), the selective recompute takes its
    products back; and with the default room, where every stash stays on the device (issue 23
    §1): all give the recompute policy's losses and weights (the same kernels, the same
    dropout)."""
    from itertools import pairwise

    from flowmesh.modelio.build import build_seeded
    from flowmesh.modelio.chain import chain_of
    from flowmesh.modelio.inputs import declared_inputs, make_inputs
    from gpu_worker.train_config import TrainConfig
    from gpu_worker.train_executor import TrainingExecutor
    from gpu_worker.train_job import TrainingJob
    from tests.support.train_grid import ALLOW, MODELS, RNG_SEED, data_for
    from tests.support.training import close

    data = data_for(model, 4)[:4]
    results = {}
    rooms = (0, None)  # every stash to the host tier; the default room, where they all fit
    for policy, room in [(p, r) for p in ("recompute", "keep", "selective") for r in rooms]:
        cfg = TrainConfig({"name": "adam", "lr": 0.01}, seed=RNG_SEED, activations=policy)
        spec = MODELS[model]
        net = build_seeded(spec, ALLOW)
        inputs = declared_inputs(spec, net)
        blocks = chain_of(net, make_inputs(inputs, 1, 1, "cpu") if inputs is not None else None)
        bounds = [round(i * len(blocks) / 3) for i in range(4)]
        dev = CudaDevice(0, 16 * MIB, resident_bytes=room)
        # Each task reserves 1 MiB of activations: room for its stash to come back into.
        job = TrainingJob(
            model,
            blocks,
            list(pairwise(bounds)),
            cfg,
            dev,
            inputs=inputs,
            allow=ALLOW,
            act_bytes=[MIB] * 3,
            fwd_bytes=[MIB] * 3,
        )
        with TrainingExecutor(dev) as ex:
            ex.open(job)
            losses = [ex.step(model, x, y).loss for x, y in data]
            stats = ex.stats()
        assert job.activation_policy(0) == policy
        if room == 0:
            assert stats["stash_device_kept_bytes"] == 0 and stats["stash_host_bytes"] > 0
            if policy != "recompute":
                assert stats["stash_bytes_prefetched"] >= job.stashed_bytes(0)[policy] > 0
        else:
            assert stats["stash_host_bytes"] == 0 and stats["stash_bytes_prefetched"] == 0
            assert stats["stash_device_kept_bytes"] > 0 and stats["stash_device_bytes"] == 0
        results[policy, room] = (losses, {n: t.clone() for n, t in job.state_dict().items()})
    want = results["recompute", 0]
    for key, (losses, state) in results.items():
        close(losses, want[0], f"{key}: losses")
        for name, t in want[1].items():
            close(state[name], t, f"{key}: {name}")
