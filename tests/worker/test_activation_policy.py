"""What a sub-model's backward does for its forward's activations (issue 23 §1,
`gpu_worker.activation_keep`): recompute the forward, or keep its graph. In-process on a CPU
stand-in with real torch.

Each policy forced in turn gives plain PyTorch's losses and tensors (`torch.testing.assert_close`,
rtol 1e-5 / atol 1e-6) on the grid's models with dropout, BatchNorm and tied weights, cut into
three sub-models, with accumulation and clipping; "auto" measures both and keeps the graph where
that costs less, as status reports. The hooks themselves are checked on a module whose
parameters are bound elsewhere in the arena for the backward than for the forward, the
forward's range overwritten in between.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import gc
import math
import threading
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from client_sdk import views
from flowmesh import metrics
from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.chain import chain_of
from flowmesh.reference import train
from flowmesh.reports import WorkerStats
from flowmesh.train_spec import TrainConfig
from flowmesh.units import fmt_bytes
from gpu_worker import train_job
from gpu_worker.activation_keep import (
    KEEP,
    POLICIES,
    RECOMPUTE,
    SELECTIVE,
    KeptGraph,
    SelectiveForward,
    Stash,
    choose,
)
from gpu_worker.device import CpuMarker, CpuStandIn
from gpu_worker.memory import DeviceMemory
from gpu_worker.resident_room import NO_ROOM
from gpu_worker.train_executor import TrainingExecutor
from gpu_worker.train_job import TrainingJob
from gpu_worker.train_scheduler import Task
from tests.support.reports import broker_status, worker_row
from tests.support.torch_threads import one_thread  # noqa: F401 (fixture)
from tests.support.train_grid import MODELS, RNG_SEED, data_for
from tests.support.training import close, job_of, plain
from tests.support.waiting import until_blocking

ADAM = {"name": "adam", "lr": 0.01}
STEPS = 6
CASES = [
    # model, clip, accumulate
    ("mlp", None, 1),
    ("gpt-dropout", 0.3, 2),
    ("hf-gpt2-tied", None, 1),
    ("resnet-bn", 0.5, 2),
]


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh-grads", "arena-grads"])
@pytest.mark.parametrize("policy", [RECOMPUTE, KEEP, SELECTIVE])
@pytest.mark.parametrize(
    ("model", "clip", "accumulate"), CASES, ids=[f"{m}-clip{c}-acc{a}" for m, c, a in CASES]
)
def test_each_policy_forced_equals_plain_pytorch(
    policy: str, model: str, clip: float | None, accumulate: int, fresh: bool
) -> None:
    cfg = TrainConfig(
        ADAM, clip_grad_norm=clip, accumulate=accumulate, seed=RNG_SEED, activations=policy
    )
    data = data_for(model, STEPS)
    job = job_of(model, cfg)
    job.fresh_grads = fresh  # the gradients as the CPU stand-in makes them, or as a device
    with TrainingExecutor(job.device) as ex:
        ex.open(job)
        results = [f.result(timeout=120) for f in [ex.submit(model, x, y) for x, y in data]]
    assert [job.activation_policy(i) for i in range(job.parts)] == [policy, policy, "none"]
    losses, state = plain(
        MODELS[model], cfg.optimizer, data, clip=clip, accumulate=accumulate, rng_seed=cfg.seed
    )
    close([r.loss for r in results], losses, f"{model} {policy}: per-step losses")
    for name, t in job.state_dict().items():
        close(t, state[name], f"{model} {policy}: {name}")


def _two_jobs_through(
    model: str, cfg: TrainConfig, data: Any, resident_bytes: int
) -> tuple[list[TrainingJob], list[list[Any]], dict[str, Any]]:
    """Two jobs side by side on a stand-in that copies stashes as a device does, but for
    `resident_bytes` of them at once, which stay where they are (a device's resident room);
    every step sent at once. The jobs, each step's results, the executor's stats at the end."""
    reserve = 96 << 10
    budget = job_of(model, cfg, act_bytes=reserve).largest_task() * 3 // 2
    device = CpuStandIn(budget, stash_copies=True, resident_bytes=resident_bytes)
    jobs = [job_of(model, cfg, act_bytes=reserve, name=n, device=device) for n in "ab"]
    with TrainingExecutor(device) as ex:
        for job in jobs:
            ex.open(job)
        sent = [[ex.submit(job.name, x, y) for job in jobs] for x, y in data]
        results = [[f.result(timeout=120) for f in step] for step in sent]
        return jobs, results, ex.stats()


@pytest.mark.parametrize("policy", [RECOMPUTE, KEEP, SELECTIVE])
@pytest.mark.parametrize(
    ("model", "clip", "accumulate"), CASES, ids=[f"{m}-clip{c}-acc{a}" for m, c, a in CASES]
)
def test_stashes_copied_out_and_brought_back_into_the_arena_train_as_plain_pytorch(
    policy: str, model: str, clip: float | None, accumulate: int
) -> None:
    """The device's path for stashes, on the stand-in: each copied to host memory, and brought
    back by the copy lane into the activation bytes of the extent of the task that reads it,
    which is another task's once that one ran (its version counter its own: autograd saves
    some of them). Two jobs side by side, all steps sent at once, in memory for one and a
    half of their largest tasks: a job's next task is often admitted only once the one
    before it computed, so that its input is there to bring too."""
    cfg = TrainConfig(
        ADAM, clip_grad_norm=clip, accumulate=accumulate, seed=RNG_SEED, activations=policy
    )
    data = data_for(model, STEPS)
    jobs, results, stats = _two_jobs_through(model, cfg, data, resident_bytes=0)
    assert stats["stash_bytes_prefetched"] > 0
    losses, state = plain(
        MODELS[model], cfg.optimizer, data, clip=clip, accumulate=accumulate, rng_seed=cfg.seed
    )
    for i, job in enumerate(jobs):
        close([r[i].loss for r in results], losses, f"{job.name} {policy}: per-step losses")
        for name, t in job.state_dict().items():
            close(t, state[name], f"{job.name} {policy}: {name}")


@pytest.mark.parametrize("policy", [RECOMPUTE, KEEP, SELECTIVE])
@pytest.mark.parametrize("model", ["mlp", "gpt-dropout"])
def test_stashes_kept_on_the_device_while_its_room_lasts_train_as_plain_pytorch(
    policy: str, model: str
) -> None:
    """Issue 23 §1, kept resident where it fits: with room for every stash, none is copied to
    the host or brought back; with room for half of them at most, the rest go to the host tier
    and come back; the room is never overrun and is all given back once the steps are done;
    plain PyTorch's losses and tensors either way."""
    clip, accumulate = 0.3, 2
    cfg = TrainConfig(
        ADAM, clip_grad_norm=clip, accumulate=accumulate, seed=RNG_SEED, activations=policy
    )
    data = data_for(model, 4)
    losses, state = plain(
        MODELS[model], cfg.optimizer, data, clip=clip, accumulate=accumulate, rng_seed=cfg.seed
    )
    every = 1 << 30
    jobs, results, stats = _two_jobs_through(model, cfg, data, every)
    assert stats["stash_host_bytes"] == 0 and stats["stash_bytes_prefetched"] == 0, stats
    peak = stats["stash_device_peak"]
    assert 0 < peak <= stats["stash_device_kept_bytes"], stats
    runs = [(jobs, results, stats)]
    runs.append(_two_jobs_through(model, cfg, data, peak // 2))
    half = runs[1][2]
    assert half["stash_device_kept_bytes"] > 0 and half["stash_host_bytes"] > 0, half
    assert half["stash_device_peak"] <= peak // 2, half
    # What status and the metrics show of it (the worker's heartbeat names for these figures).
    fig = {f"train_{k}": half[k] for k in NO_ROOM}
    st = broker_status(workers=[worker_row("w0", stats=WorkerStats(train_budget_bytes=1, **fig))])
    assert (
        f"stashes on the device 0 B (peak {fmt_bytes(half['stash_device_peak'])}) of "
        f"{fmt_bytes(peak // 2)}, {fmt_bytes(half['stash_host_bytes'])} to the host tier"
    ) in views.format_status(st)
    got = {s.name: s.value for f in metrics.worker_families("w0", st.workers[0].stats)
           for s in f.samples}  # fmt: skip
    assert got["flowmesh_worker_train_stash_host_bytes_total"] == half["stash_host_bytes"]
    assert got["flowmesh_worker_train_stash_device_limit_bytes"] == peak // 2
    for jobs, results, stats in runs:
        assert stats["stash_device_bytes"] == 0, stats  # every stash dropped, its room back
        for i, job in enumerate(jobs):
            close([r[i].loss for r in results], losses, f"{job.name} {policy}: per-step losses")
            for name, t in job.state_dict().items():
                close(t, state[name], f"{job.name} {policy}: {name}")


@pytest.mark.parametrize("policy", [RECOMPUTE, KEEP, SELECTIVE])
def test_a_failed_step_and_a_closed_job_give_their_stashes_room_back(policy: str) -> None:
    """A step whose loss is not finite fails with its kept graphs never run backward (what
    autograd saved may carry the node that saved it: a cycle the stash must not join); a job
    closed with steps in flight is dropped whole, its modules and host tier too. Either way
    the room its stashes took on the device is free again, while the executor goes on (idle:
    nothing more comes to its driver). So do a job left open with steps in flight when the
    executor closes, and the executor itself, off the memory it shared with serving."""
    cfg = TrainConfig(ADAM, seed=RNG_SEED, activations=policy)
    (x, y), *more = data_for("mlp", 4)
    reserve = 96 << 10
    budget = job_of("mlp", cfg, act_bytes=reserve).largest_task() * 3 // 2
    device = CpuStandIn(2 * budget, stash_copies=True, resident_bytes=1 << 30)
    room = device.resident_room
    assert room is not None
    memory = DeviceMemory(budget, budget)  # a worker's: serving's and training's
    listeners = (list(memory.on_claim), list(memory.wake_training))

    def let_go(ref: weakref.ref[Any]) -> bool:
        """Whether `ref`'s object is gone once the lanes are done with it (a bounded wait)."""
        until_blocking(lambda: gc.collect() >= 0 and ref() is None, "an object let go of", 10.0)
        return True

    ex = TrainingExecutor(device, memory=memory)
    job = job_of("mlp", cfg, act_bytes=reserve, device=device)
    ex.open(job)
    ex.step("mlp", x, y)
    with pytest.raises(FlowmeshError, match="loss is nan"):
        ex.step("mlp", torch.full_like(x, math.nan), y)
    assert room.kept_bytes > 0 and room.used == 0, room.stats()
    # The close comes before any of these steps can end: the driver (one thread, taking its
    # events in order) is held while they are sent and the close is queued behind them; a step
    # ends only on events its lanes post later. (Sent unheld, a step could end first.)
    held = threading.Event()
    ex._post(lambda: held.wait(60))
    sent = [ex.submit("mlp", x, y) for x, y in more]
    ex._post(functools.partial(ex._close_job, "mlp"))
    held.set()
    for future in sent:
        with pytest.raises(FlowmeshError, match="was closed"):
            future.result(timeout=60)
    closed = weakref.ref(job)
    del job
    assert let_go(closed) and room.used == 0, room.stats()
    job = job_of("mlp", cfg, act_bytes=reserve, name="left-open", device=device)
    ex.open(job)
    sent = [ex.submit("left-open", x, y) for x, y in more]
    left_open, gone = weakref.ref(job), weakref.ref(ex)
    del job
    ex.close()
    for future in sent:
        with contextlib.suppress(FlowmeshError):
            future.result(timeout=60)
    del ex, sent
    assert let_go(left_open) and let_go(gone) and room.used == 0, room.stats()
    assert (memory.on_claim, memory.wake_training) == listeners


@pytest.mark.parametrize("together", [False, True], ids=["one-at-a-time", "all-in-flight"])
def test_auto_measures_each_policy_then_takes_the_cheapest(together: bool) -> None:
    """A job's first step recomputes, its second keeps, its third is selective (each measured
    on the way), with the same losses as plain PyTorch, whether each step is sent after the
    last one's answer or all are sent at once (a policy is chosen when the step's forward of
    its sub-model runs, not when the step was sent); later steps take the cheapest by the
    costs observed."""
    cfg = TrainConfig(ADAM, seed=RNG_SEED)
    assert cfg.activations == "auto"
    data = data_for("mlp", 4)[:4]
    job = job_of("mlp", cfg)
    with TrainingExecutor(job.device) as ex:
        ex.open(job)
        if together:
            results = [f.result(timeout=120) for f in [ex.submit("mlp", x, y) for x, y in data]]
        else:
            results = [ex.step("mlp", x, y) for x, y in data]
    # Each sub-model measured in turn; then each takes its own cheapest.
    assert [r.activations for r in results[:3]] == [[p, p, "none"] for p in POLICIES]
    assert set(results[3].activations[:2]) <= set(POLICIES)
    close(
        [r.loss for r in results],
        plain(MODELS["mlp"], cfg.optimizer, data, rng_seed=cfg.seed)[0],
        "auto",
    )
    # The choice from observed costs (the executor's clock, here given): the cheapest wins.
    cases = ((0.5, 0.7, KEEP), (3.0, 0.9, SELECTIVE), (3.0, 2.0, RECOMPUTE))
    for keep_s, selective_s, want in cases:
        job = job_of("mlp", cfg)
        for policy, seconds in ((RECOMPUTE, 1.0), (KEEP, keep_s), (SELECTIVE, selective_s)):
            for sub in (0, 1):
                job.observe(Task("mlp", 0, "forward", 0, frozenset(), frozenset(), sub=sub,
                                 payload={"policy": policy}), seconds)  # fmt: skip
        with TrainingExecutor(job.device) as ex:
            ex.open(job)
            assert ex.step("mlp", *data[0]).activations == [want, want, "none"]


def test_auto_measures_every_policy_again_every_so_many_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(train_job, "REMEASURE_EVERY", 5)
    cfg = TrainConfig(ADAM, seed=RNG_SEED)
    data = data_for("mlp", 9)[:9]
    job = job_of("mlp", cfg)
    with TrainingExecutor(job.device) as ex:
        ex.open(job)
        seen = [ex.step("mlp", x, y).activations[0] for x, y in data]
    # Measured on steps 1-3, the cheapest on step 4, measured again on steps 5-7.
    assert seen[:3] == seen[4:7] == [RECOMPUTE, KEEP, SELECTIVE], seen


def test_the_job_stashes_of_its_sub_models_together_stay_within_its_room() -> None:
    """Keeping is the cheapest for both sub-models that choose, but the job's room is one byte
    short of both kept graphs: one keeps, the other stashes selectively (its kept graph would
    fit the room alone, not beside the other's)."""
    cfg = TrainConfig(ADAM, seed=RNG_SEED)
    data = data_for("mlp", 5)[:5]
    job = job_of("mlp", cfg)
    for policy, seconds in ((RECOMPUTE, 1.0), (KEEP, 0.1), (SELECTIVE, 0.5)):
        for sub in (0, 1):
            job.observe(Task("mlp", 0, "forward", 0, frozenset(), frozenset(), sub=sub,
                             payload={"policy": policy}), seconds)  # fmt: skip
    with TrainingExecutor(job.device) as ex:
        ex.open(job)
        assert ex.step("mlp", *data[0]).activations == [KEEP, KEEP, "none"]  # room enough
        kept = [job.stashed_bytes(i)[KEEP] for i in (0, 1)]
        room = sum(kept) - 1
        assert max(kept) <= room
        job.host_bytes = lambda: room  # type: ignore[method-assign]
        seen = [ex.step("mlp", x, y).activations for x, y in data[1:]]
    assert sorted(seen[-1][:2]) == [KEEP, SELECTIVE], seen
    held = sum(job.stashed_bytes(i)[p] for i, p in enumerate(seen[-1][:2]))
    assert held <= room


@pytest.mark.parametrize("policy", [KEEP, SELECTIVE])
def test_the_copy_lane_brings_a_kept_forwards_stash_back_ahead_of_its_backward(
    policy: str,
) -> None:
    """A backward's copies start while the task before it computes (the executor's look-ahead);
    what its sub-model's forward stashed was there long before, and comes back with them, into
    the activation bytes its extent reserves, not when the backward reads it (on a GPU: under
    the compute before, on the copy lane). Where those bytes are too few, it is not."""
    cfg = TrainConfig(ADAM, seed=RNG_SEED, activations=policy)
    prefetched = {}
    for act_bytes in (0, 64 << 10):
        job = job_of("mlp", cfg, act_bytes=act_bytes)
        with TrainingExecutor(job.device) as ex:
            ex.open(job)
            result = ex.step("mlp", *data_for("mlp", 1)[0])
            prefetched[act_bytes] = ex.stats()["stash_bytes_prefetched"]
        assert result.activations == [policy, policy, "none"]
    stashed = sum(job.stashed_bytes(i)[policy] for i in (0, 1))
    assert prefetched[0] == 0 and 0 < stashed <= prefetched[64 << 10], (stashed, prefetched)
    # The first sub-model ends in a linear layer, whose output its backward never reads: a
    # selective one's next stash is brought back without it.
    unread = {torch.ops.aten.addmm.default: 1} if policy == SELECTIVE else {}
    assert job._unread == [unread, {}, {}]


def test_choose_by_measured_cost() -> None:
    r, k, s = RECOMPUTE, KEEP, SELECTIVE
    assert choose({}, {}, None) == r  # measure the recompute first
    assert choose({r: 1.0}, {}, 100) == k  # then the keep
    assert choose({r: 1.0, k: 0.5}, {k: 10}, 100) == s  # then the selective
    assert choose({r: 1.0, k: 0.5, s: 0.6}, {k: 10, s: 5}, 100) == k  # the cheapest
    assert choose({r: 1.0, k: 1.5, s: 0.9}, {k: 10, s: 5}, 100) == s
    assert choose({r: 1.0, k: 1.5, s: 1.2}, {k: 10, s: 5}, 100) == r
    # A stash over the room is never taken: the selective one, half the size, may fit.
    assert choose({r: 1.0, k: 0.5}, {k: 200}, 100) == s
    assert choose({r: 1.0, k: 0.5, s: 0.6}, {k: 200, s: 80}, 100) == s
    assert choose({r: 1.0, k: 0.5, s: 0.6}, {k: 200, s: 150}, 100) == r
    assert choose({r: 1.0, k: 0.5, s: 0.6}, {k: 200, s: 150}, None) == k  # no room limit


class Counting(TorchDispatchMode):
    """The aten operations run under it, counted."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[Any] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def here(t: torch.Tensor) -> Stash:
    """A stash kept where it is, as a CPU stand-in's is."""
    return Stash(t, CpuMarker(done=True))


def there(s: Stash) -> torch.Tensor:
    return s.host


def test_a_selective_forward_keeps_its_products_and_computes_the_rest_again() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4), nn.Tanh())
    ref = copy.deepcopy(net)
    x = torch.randn(5, 8)
    ref(x).square().sum().backward()
    stashed: list[torch.Tensor] = []
    store = SelectiveForward(lambda t: stashed.append(t) or here(t), there)
    out = checkpoint(net, x, use_reentrant=False, context_fn=store.contexts)
    addmm = torch.ops.aten.addmm.default
    assert list(store.kept) == [addmm] and [t.shape for t in stashed] == [(5, 16), (5, 4)]
    assert store.saved_bytes == (5 * 16 + 5 * 4) * 4
    with Counting() as seen:
        out.square().sum().backward()
    # The products were taken back, not computed again; the activations were.
    assert seen.counts[addmm] == 0
    assert seen.counts[torch.ops.aten.gelu.default] == 1
    assert seen.counts[torch.ops.aten.tanh.default] == 1
    for n, t in net.named_parameters():
        torch.testing.assert_close(t.grad, dict(ref.named_parameters())[n].grad, msg=n)


def test_what_a_selective_recompute_left_unread_is_not_brought_back_next_time() -> None:
    """checkpoint stops its recompute once it made what the backward needs: a block ending in a
    linear layer never asks for that layer's output. The store says so after the backward, and
    the next forward's stash is brought back without it (and all of it while not known)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    addmm = torch.ops.aten.addmm.default
    first = SelectiveForward(here, there)
    out = checkpoint(net, x, use_reentrant=False, context_fn=first.contexts)
    assert [s.host.shape for s in first.to_bring({})] == [(5, 16), (5, 4)]
    out.square().sum().backward()
    assert first.unread() == {addmm: 1}
    second = SelectiveForward(here, there)
    checkpoint(net, x, use_reentrant=False, context_fn=second.contexts)
    assert [s.host.shape for s in second.to_bring(first.unread())] == [(5, 16)]


class ScaledInPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2.0).add_(1.0)


def test_a_selective_forward_keeps_its_products_as_they_were_made() -> None:
    """Outputs changed in place after they were kept (a ReLU(inplace=True) after a linear
    layer, an in-place scale): the backward gets them as the product made them."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), ScaledInPlace(), nn.ReLU(inplace=True), nn.Linear(16, 4))
    ref = copy.deepcopy(net)
    x = torch.randn(5, 8)
    ref(x).square().sum().backward()
    store = SelectiveForward(here, there)  # kept where it is, as on a CPU
    checkpoint(net, x, use_reentrant=False, context_fn=store.contexts).square().sum().backward()
    for n, t in net.named_parameters():
        torch.testing.assert_close(t.grad, dict(ref.named_parameters())[n].grad, msg=n)


class ClampsItsInput(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp_(-1.0, 1.0)


class CallCounted(nn.Module):
    """A block whose forward runs its layer once more on every other call: not the same
    computation when run again."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 16)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.layer(self.layer(x)) if self.calls % 2 else self.layer(x)


def selective_job(net: nn.Module, name: str, ranges: list[tuple[int, int]]) -> TrainingJob:
    cfg = TrainConfig(ADAM, seed=RNG_SEED, activations=SELECTIVE)
    return TrainingJob(name, chain_of(net), ranges, cfg, CpuStandIn(1 << 20))


def test_a_selective_forward_that_changes_its_input_in_place_trains_as_plain_pytorch() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(ClampsItsInput(), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16),
                        nn.ReLU(), nn.Linear(16, 5))  # fmt: skip
    ref = copy.deepcopy(net)
    g = torch.Generator().manual_seed(3)
    data = [(3 * torch.randn(4, 8, generator=g), torch.randint(0, 5, (4,), generator=g))
            for _ in range(4)]  # fmt: skip
    job = selective_job(net, "clamps", [(0, 2), (2, 4), (4, 6)])  # the clamp in the first
    with TrainingExecutor(job.device) as ex:
        ex.open(job)
        losses = [ex.step("clamps", x.clone(), y).loss for x, y in data]
    expected = train(ref, ADAM, [(x.clone(), y) for x, y in data], rng_seed=RNG_SEED)
    close(losses, expected, "losses")
    for name, t in ref.state_dict().items():
        close(job.state_dict()[name], t, name)


def test_a_forward_that_does_not_repeat_fails_its_step_saying_so() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), CallCounted(), nn.ReLU(), nn.Linear(16, 5))
    job = selective_job(net, "counted", [(0, 1), (1, 3), (3, 4)])
    with TrainingExecutor(job.device) as ex, pytest.raises(FlowmeshError) as failed:
        ex.open(job)
        ex.step("counted", torch.randn(4, 8), torch.randint(0, 5, (4,)))
    assert failed.value.code == Code.MODEL_ERROR
    assert "did not repeat under the selective activation policy" in failed.value.reason
    assert "activations='keep'" in failed.value.reason


class BumpsWhatItSaved(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.exp()  # autograd saves the result for exp's backward
        return y.add_(1.0)


def test_a_kept_forward_that_changes_what_it_saved_fails_its_step_saying_so() -> None:
    """Plain autograd refuses such a backward (a saved tensor's version moved); a kept graph's
    hooks hide that from it, and its stash would hold either value: the step fails instead,
    naming the in-place change."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), BumpsWhatItSaved(), nn.Linear(16, 5))
    x, y = torch.randn(4, 8), torch.randint(0, 5, (4,))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        nn.functional.cross_entropy(copy.deepcopy(net)(x), y).backward()
    cfg = TrainConfig(ADAM, seed=RNG_SEED, activations=KEEP)
    job = TrainingJob("bumps", chain_of(net), [(0, 1), (1, 2), (2, 3)], cfg, CpuStandIn(1 << 20))
    with TrainingExecutor(job.device) as ex, pytest.raises(FlowmeshError) as failed:
        ex.open(job)
        ex.step("bumps", x, y)
    assert failed.value.code == Code.MODEL_ERROR
    assert "in place after autograd saved it" in failed.value.reason


class BumpsWhatNoGradientNeeds(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        aux = x.exp()  # saved for a backward no gradient flows through
        aux.add_(1.0)
        return x * 2.0


def test_a_kept_forward_that_changes_what_no_gradient_reads_trains_as_plain_pytorch() -> None:
    """What plain autograd lets pass, a kept graph does too: a saved tensor its backward never
    unpacks may change."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), BumpsWhatNoGradientNeeds(), nn.Linear(16, 5))
    ref = copy.deepcopy(net)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(4, 8, generator=g), torch.randint(0, 5, (4,), generator=g))
            for _ in range(3)]  # fmt: skip
    cfg = TrainConfig(ADAM, seed=RNG_SEED, activations=KEEP)
    job = TrainingJob("aux", chain_of(net), [(0, 1), (1, 2), (2, 3)], cfg, CpuStandIn(1 << 20))
    with TrainingExecutor(job.device) as ex:
        ex.open(job)
        losses = [ex.step("aux", x, y).loss for x, y in data]
    close(losses, train(ref, ADAM, data, rng_seed=RNG_SEED), "losses")
    for name, t in ref.state_dict().items():
        close(job.state_dict()[name], t, name)


def test_a_selective_forward_stashes_at_most_half_what_a_kept_one_does() -> None:
    """The grid's MLP (blocks of a linear layer and GELU): a kept graph stashes what autograd
    saves (each layer's input, the GELU's input); a selective forward only the linear layers'
    outputs."""
    stashed = {}
    for policy in (KEEP, SELECTIVE):
        cfg = TrainConfig(ADAM, seed=RNG_SEED, activations=policy)
        job = job_of("mlp", cfg)
        with TrainingExecutor(job.device) as ex:
            ex.open(job)
            ex.step("mlp", *data_for("mlp", 1)[0])
        stashed[policy] = job.stashed_bytes(1)[policy]
    assert 0 < stashed[SELECTIVE] <= stashed[KEEP] / 2, stashed


def test_a_kept_graph_follows_its_tensors_to_where_the_backward_binds_them() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
    ref = copy.deepcopy(net)
    x = torch.randn(5, 8)
    ref(x).square().sum().backward()
    arena = torch.zeros(1 << 14, dtype=torch.uint8)
    params = dict(net.named_parameters())
    homes = {n: t.detach().clone() for n, t in params.items()}

    def bind(base: int) -> None:
        for n, t in params.items():
            view = arena[base : base + t.numel() * 4].view(torch.float32).view(t.shape)
            view.copy_(homes[n])
            t.data = view
            base += t.numel() * 4

    bind(64)
    kept = KeptGraph(params, arena, here, there)
    with kept.hooks():
        out = net(x)
    assert 0 < kept.saved_bytes < sum(t.numel() * 4 for t in homes.values()) + 4096
    arena.fill_(0xFF)  # the forward's range, taken by another task meanwhile
    bind(8192)
    out.square().sum().backward()
    for n, t in params.items():
        torch.testing.assert_close(t.grad, dict(ref.named_parameters())[n].grad, msg=n)
