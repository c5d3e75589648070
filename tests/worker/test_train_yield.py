"""Training yields to serving on the CPU stand-in (issue 23 §4, "inference first"): the rule of
`gpu_worker.train_executor.ServingGate` on a clock the test moves, then a real training executor
beside a real `DeviceMemory` whose serving state the test drives, with a real torch job:

- no training task starts while serving is busy, nor for the gate's delay after it went quiet,
  and the steps then finish with the losses of the same job trained alone;
- a task already in the compute lane's queue when serving got busy waits before it starts;
- a task computing waits at its yield points: between two blocks of a forward, and inside the
  backward (a block's gradient not yet computed), and goes on once serving is quiet.

Serving is made busy from inside a task by a forward (or backward) hook on one of the job's
blocks, at a known block boundary; the test then waits, on the condition itself, for the compute
lane to be parked at the gate, and reads which blocks ran. The clock is frozen meanwhile, so the
gate's bound on one task's waits (`max_pause_s`) never runs out unless the test moves it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import torch

from flowmesh.spec import ModelSpec
from gpu_worker.device import CpuStandIn
from gpu_worker.memory import DeviceMemory
from gpu_worker.train_config import TrainConfig
from gpu_worker.train_executor import ServingGate, TrainingExecutor, TrainingJob, open_job
from gpu_worker.train_scheduler import Phase
from tests.support.torch_threads import one_thread  # noqa: F401  (autouse)
from tests.support.waiting import until_blocking

KIB = 1 << 10
SPEC = ModelSpec(
    name="two",
    factory="flowmesh.examples:mlp",
    kwargs={"width": 24, "depth": 4, "in_features": 8, "out_features": 5},
    seed=7,
)
CFG = TrainConfig({"name": "adam", "lr": 0.01}, seed=1)
TARGET = 32 * KIB  # two sub-models of several blocks each
STEPS = 3


class Clock:
    """The executor's clock: stands still unless the test moves it."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def data(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 8, generator=g), torch.randint(0, 5, (8,), generator=g))
        for _ in range(STEPS)
    ]


def solo_losses(name: str, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """The same job trained on a device of its own (no serving, no gate)."""
    dev = CpuStandIn(1 << 20)
    with TrainingExecutor(dev) as ex:
        job = open_job(name, SPEC, CFG, dev, batch=8, target_bytes=TARGET)
        ex.open(job)
        return [f.result(120).loss for f in [ex.submit(name, x, y) for x, y in batches]]


def shared(clock: Clock) -> tuple[CpuStandIn, DeviceMemory, TrainingExecutor]:
    dev = CpuStandIn(1 << 20)
    mem = DeviceMemory(serving_bytes=64 * KIB, train_bytes=256 * KIB)
    return dev, mem, TrainingExecutor(dev, memory=mem, clock=clock)


def _nothing() -> None:
    """A driver event that does nothing: `_call`ed, a round trip through the driver."""


def compute_parked(trainer: TrainingExecutor) -> bool:
    return any(n.startswith("train-compute") for n in list(trainer.gate.waiting))


def count_calls(job: TrainingJob) -> dict[tuple[int, int, str], int]:
    """Forward ("f", with or without grad: "f0" / "f1") and backward ("b") calls of each block
    (sub-model, index in it), counted by hooks that change nothing the block computes."""
    calls: dict[tuple[int, int, str], int] = {}

    def bump(key: tuple[int, int, str]) -> None:
        calls[key] = calls.get(key, 0) + 1

    for sub in job.subs:
        for j, m in enumerate(sub.modules):

            def fwd(_m: Any, _i: Any, _o: Any, s: int = sub.index, j: int = j) -> None:
                bump((s, j, f"f{int(torch.is_grad_enabled())}"))

            m.register_forward_hook(fwd)
    return calls


def hook_once(register: Callable[[Callable[..., None]], Any], act: Callable[[], None]) -> None:
    """`act` the first time the hook `register` installs fires."""
    fired = threading.Event()

    def hook(*_: Any) -> None:
        if not fired.is_set():
            fired.set()
            act()

    register(hook)


# -- the rule alone ----------------------------------------------------------------------------


def test_the_gate_holds_while_serving_is_busy_and_for_its_delay_after() -> None:
    clock = Clock()
    mem = DeviceMemory(serving_bytes=4 * KIB, train_bytes=4 * KIB)
    gate = ServingGate(mem, True, clock, resume_after_s=0.002, max_pause_s=0.1)
    assert gate.held_for() is None
    mem.serving_started()
    assert gate.held_for() == math.inf
    mem.serving_started()
    mem.serving_ended()
    assert gate.held_for() == math.inf, "one of two runs is still in flight"
    clock.now = 200.0
    mem.serving_ended()  # quiet at 200.0: held until 200.0 + 0.002
    held = gate.held_for()
    assert held is not None and math.isclose(held, 0.002)
    clock.now = 200.001
    held = gate.held_for()
    assert held is not None and math.isclose(held, 0.001)
    clock.now = 200.0 + 0.002
    assert gate.held_for() is None
    mem.claim()  # a load waiting for training's memory holds it too
    assert gate.held_for() == math.inf
    mem.unclaim()
    clock.now = 300.0
    assert gate.held_for() is None
    off = ServingGate(mem, False, clock)
    mem.serving_started()
    assert off.held_for() is None, "a gate that is off (a GPU, or no serving) never holds"
    mem.serving_ended()


def test_one_task_s_waits_are_bounded_by_max_pause_s() -> None:
    """A task waiting at the gate has given its memory back already: a serving load placed
    there waits for it. So a task waits at most `max_pause_s` in all, then runs to its end."""
    clock = Clock()
    mem = DeviceMemory(serving_bytes=4 * KIB, train_bytes=4 * KIB)
    gate = ServingGate(mem, True, clock, max_pause_s=0.1, poll_s=0.005)
    pause = gate.task_pauses()
    mem.serving_started()
    passed = threading.Event()

    def lane() -> None:
        pause()
        passed.set()

    t = threading.Thread(target=lane, name="train-compute_test")
    t.start()
    until_blocking(lambda: gate.waiting == ["train-compute_test"], "the lane parked")
    assert not passed.is_set()
    clock.now += 0.2  # past the task's whole budget: it goes on, serving still busy
    t.join(30)
    assert passed.is_set() and gate.counters["pause_budget_spent"] == 1
    assert pause.spent >= 0.1
    pause()  # its budget is spent: no more waits in this task
    assert gate.counters["pauses"] == 1
    fresh = gate.task_pauses()  # the next task has a budget of its own
    done = threading.Thread(target=fresh, name="train-compute_next")
    done.start()
    until_blocking(lambda: gate.waiting == ["train-compute_next"], "the next task parked")
    mem.serving_ended()  # quiet now: held for the delay, which the lane sees on its next look
    clock.now += gate.resume_after_s
    done.join(30)
    assert not done.is_alive() and gate.counters["pauses"] == 2


# -- a real executor, serving driven by the test ---------------------------------------------


def test_no_training_compute_while_serving_is_busy_then_exact_steps() -> None:
    clock = Clock()
    dev, mem, trainer = shared(clock)
    batches = data(3)
    try:
        mem.serving_started()  # a serving run in flight
        job = open_job("two", SPEC, CFG, dev, batch=8, target_bytes=TARGET)
        trainer.open(job)
        futures = [trainer.submit("two", x, y) for x, y in batches]
        until_blocking(lambda: trainer.counters["tasks_admitted"] >= 1, "an admission")
        until_blocking(
            lambda: any(t.phase is Phase.COPIED for t in trainer.sched.chains["two"]),
            "the head's copy",
        )
        trainer._call(_nothing)  # a driver round trip: it pumped after the copy's event
        assert trainer.counters["tasks_started"] == 0, "a task started while serving was busy"
        mem.serving_ended()  # quiet at 100.0: the gate holds until 100.002
        trainer._call(_nothing)
        assert trainer.counters["tasks_started"] == 0, "a task started in the gate's delay"
        clock.now += trainer.gate.resume_after_s
        losses = [f.result(120).loss for f in futures]
    finally:
        trainer.close()
    assert losses == solo_losses("two", batches)


def test_a_task_queued_in_the_lane_when_serving_got_busy_waits_before_it_starts() -> None:
    """Two jobs' heads handed to the compute lane together (`queue_computes` 2); serving gets
    busy during the first one's forward: the second must not start any block until it is quiet."""
    clock = Clock()
    dev, mem, trainer = shared(clock)
    batches = {"a": data(4), "b": data(5)}
    try:
        mem.serving_started()  # held while both heads are admitted and copied
        jobs = {n: open_job(n, SPEC, CFG, dev, batch=8, target_bytes=TARGET) for n in "ab"}
        calls = {n: count_calls(j) for n, j in jobs.items()}
        busy_again = threading.Event()

        def serve(*_: Any) -> None:
            if not busy_again.is_set():  # the first head's forward only
                busy_again.set()
                mem.serving_started()

        for j in jobs.values():  # whichever head runs first makes serving busy at its end
            j.subs[0].modules[-1].register_forward_hook(serve)
        for j in jobs.values():
            trainer.open(j)
        futures = {n: [trainer.submit(n, x, y) for x, y in b] for n, b in batches.items()}

        def heads_copied() -> bool:
            return all(
                ch and ch[0].phase is Phase.COPIED for ch in list(trainer.sched.chains.values())
            )

        until_blocking(heads_copied, "both heads copied")
        trainer._call(_nothing)
        assert trainer.counters["tasks_started"] == 0
        mem.serving_ended()
        clock.now += trainer.gate.resume_after_s
        until_blocking(busy_again.is_set, "serving busy again from the first head's forward")
        until_blocking(lambda: compute_parked(trainer), "the compute lane parked at the gate")
        assert trainer.counters["tasks_started"] == 2, "both heads were in the lane"
        first = next(n for n in "ab" if calls[n])
        other = "b" if first == "a" else "a"
        assert calls[other] == {}, f"job {other}'s task ran {calls[other]} while serving was busy"
        mem.serving_ended()
        clock.now += trainer.gate.resume_after_s
        losses = {n: [f.result(120).loss for f in fs] for n, fs in futures.items()}
    finally:
        trainer.close()
    assert losses == {n: solo_losses(n, b) for n, b in batches.items()}


def test_a_computing_task_waits_between_blocks_of_its_forward() -> None:
    clock = Clock()
    dev, mem, trainer = shared(clock)
    batches = data(6)
    try:
        job = open_job("two", SPEC, CFG, dev, batch=8, target_bytes=TARGET)
        assert len(job.subs) >= 2 and all(len(s.modules) >= 3 for s in job.subs)
        calls = count_calls(job)
        first = job.subs[0].modules[0]  # its first no-grad forward: the FORWARD task of step 1
        hook_once(first.register_forward_hook, mem.serving_started)
        trainer.open(job)
        futures = [trainer.submit("two", x, y) for x, y in batches]
        until_blocking(lambda: compute_parked(trainer), "the compute lane parked mid-forward")
        assert calls == {(0, 0, "f0"): 1}, f"blocks ran past the yield point: {calls}"
        mem.serving_ended()
        clock.now += trainer.gate.resume_after_s
        losses = [f.result(120).loss for f in futures]
    finally:
        trainer.close()
    assert losses == solo_losses("two", batches)


def test_a_computing_task_waits_inside_its_backward() -> None:
    """Serving gets busy as the gradient of sub-model 0's last block is computed (its first
    backward, in the BACKWARD task of step 1): the task waits before the blocks under it."""
    clock = Clock()
    dev, mem, trainer = shared(clock)
    batches = data(7)
    try:
        job = open_job("two", SPEC, CFG, dev, batch=8, target_bytes=TARGET)
        sub = job.subs[0]
        grads: list[int] = []
        for j, m in enumerate(sub.modules):
            # A tensor hook on each block's output, counting the gradients computed (returns
            # None: the gradient is left as it is).
            def count(_m: Any, _i: Any, out: Any, j: int = j) -> None:
                if torch.is_grad_enabled() and out.requires_grad:
                    out.register_hook(lambda _g: grads.append(j))

            m.register_forward_hook(count)
        last = sub.modules[-1]
        armed = threading.Event()

        def busy_on_last_grad(_m: Any, _i: Any, out: Any) -> None:
            if torch.is_grad_enabled() and out.requires_grad and not armed.is_set():
                armed.set()  # the first backward only
                hook_once(out.register_hook, mem.serving_started)

        last.register_forward_hook(busy_on_last_grad)
        trainer.open(job)
        futures = [trainer.submit("two", x, y) for x, y in batches]
        until_blocking(lambda: compute_parked(trainer), "the compute lane parked mid-backward")
        last_j = len(sub.modules) - 1
        assert grads and grads[0] == last_j, grads
        assert len(grads) < len(sub.modules), f"the whole backward ran before waiting: {grads}"
        mem.serving_ended()
        clock.now += trainer.gate.resume_after_s
        losses = [f.result(120).loss for f in futures]
    finally:
        trainer.close()
    assert losses == solo_losses("two", batches)
