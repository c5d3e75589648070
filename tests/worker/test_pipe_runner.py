"""Pipelined training's message logic (`gpu_worker.pipe_runner`) in process: the stages'
runners joined by a bus that delivers their hops in a seeded random order (each sender's hops
to one receiver in the order sent, as one ZeroMQ connection keeps them), every step submitted
at once to the coordinator. Losses and final parameters equal plain PyTorch's within the
tolerance rule, with dropout (forwards one after the other), without it (forwards overlapping
after the first step, as many micro-batches in flight as there are stages), a tied weight, a
clip and accumulation; a failing step is answered
with its error and applied nowhere; a checkpoint resumes the run cut into another number of
stages."""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import pytest
import torch

from flowmesh import protocol as p
from flowmesh.errors import Code
from gpu_worker.pipe_checkpoint import load_stage, read_pipe_meta
from gpu_worker.pipe_runner import PipeRunner
from gpu_worker.pipe_stage import PipeStage
from gpu_worker.train_config import TrainConfig
from tests.support.torch_threads import one_thread  # noqa: F401 (fixture)
from tests.support.train_cases import (
    boom_net,
    build,
    close,
    data_for,
    pipe_stages,
    plain_step_loop,
    seeded,
)


class Bus:
    """Runners of one job and the hops between them, delivered in a seeded random order."""

    def __init__(self, stages: list[PipeStage], seed: int, batch: int | None = None) -> None:
        self.rand = random.Random(seed)
        self.lanes: dict[tuple[int, int], deque[p.PipeHop]] = {}
        self.answers: list[p.Message] = []
        self.runners = [
            PipeRunner(s, 7, self._sender(s.stage), self.answers.append, batch=batch)
            for s in stages
        ]

    def _sender(self, frm: int) -> Any:
        def send(to: int, hop: p.PipeHop) -> None:
            assert hop.stage == frm and to != frm
            self.lanes.setdefault((frm, to), deque()).append(hop)

        return send

    def run(self) -> None:
        for _ in range(1_000_000):
            busy = [k for k, q in self.lanes.items() if q]
            if not busy:
                return
            frm, to = self.rand.choice(busy)
            self.runners[to].on_hop(self.lanes[(frm, to)].popleft())
        raise AssertionError("the hops never settled")

    def steps(self, data: list[tuple[Any, torch.Tensor]]) -> list[p.Message]:
        for seq, (x, y) in enumerate(data, 1):
            msg = p.TrainStep(id=100 + seq, job="job", seq=seq)
            self.runners[0].on_step(msg, x, y)
        self.run()
        return self.answers


CASES = [
    # model, optimizer, stages, clip, accumulate
    ("mlp", {"name": "adam", "lr": 0.01}, 3, 0.3, 4),
    ("mlp", {"name": "sgd", "lr": 0.05}, 2, None, 8),  # many more micro-batches than stages
    ("dropout", {"name": "sgd", "lr": 0.05, "momentum": 0.9}, 2, 0.3, 2),
    ("mixed", {"name": "adam", "lr": 0.01}, 3, None, 2),
    # The tied embedding's gradient is summed as one process sums it: Adam turns a difference of
    # float noise into whole steps on parameters whose true gradient is zero (the attention's
    # key bias), so this case fails unless the order is the same.
    ("gpt2", {"name": "adam", "lr": 0.01}, 3, 0.3, 2),
    ("gpt2", {"name": "sgd", "lr": 0.1, "momentum": 0.9}, 2, None, 2),
    ("resnet", {"name": "sgd", "lr": 0.05, "momentum": 0.9}, 2, None, 2),
]


@pytest.mark.parametrize(
    ("kind", "optimizer", "stages", "clip", "accumulate"),
    CASES,
    ids=[f"{c[0]}-p{c[2]}-clip{c[3]}-acc{c[4]}" for c in CASES],
)
@pytest.mark.parametrize("order", [1, 2])
def test_pipelined_steps_through_messages_match_plain_pytorch(
    kind: str, optimizer: dict[str, Any], stages: int, clip: float | None, accumulate: int,
    order: int,
) -> None:  # fmt: skip
    cfg = TrainConfig(optimizer, clip_grad_norm=clip, accumulate=accumulate, seed=21)
    data = data_for(kind, steps=8)
    bus = Bus(pipe_stages(kind, cfg, stages), seed=order)
    answers = bus.steps(data)
    assert [type(a) for a in answers] == [p.TrainStepResult] * len(data), answers
    assert [(a.id, a.seq, a.step) for a in answers] == [(100 + i, i, i) for i in range(1, 9)]
    expected = plain_step_loop(build(kind), cfg, data)
    close([a.loss for a in answers], expected, "per-step losses")
    reference = build(kind)
    plain_step_loop(reference, cfg, data)
    got: dict[str, torch.Tensor] = {}
    for r in bus.runners:
        got.update(r.stage.state_dict())
    for n, t in reference.state_dict().items():
        if n in got:
            close(got[n], t, f"tensor {n}")
    # Dropout draws: its forwards stay one after the other; the others overlap after step 1.
    serial = [a.metrics["serial_forwards"] for a in answers]
    draws = kind in ("dropout", "mixed", "gpt2")  # GPT-2: its dropout of 0.1
    assert serial == [1.0] * 8 if draws else serial == [1.0] + [0.0] * 7
    # Stage 0 keeps at most as many micro-batches in flight as there are stages (1F1B's
    # bound), not the step's every micro-batch (GPipe's); overlapping, exactly that many.
    held = [a.metrics["held_micro_batches"] for a in answers]
    for h, one_by_one in zip(held, serial, strict=True):
        assert h <= stages if one_by_one else h == min(accumulate, stages), held


def test_a_failing_step_is_answered_and_applied_nowhere() -> None:
    """Step 4 fails in stage 0's model code, step 6 in the last stage's loss on its second
    micro-batch, after the first's backward ran on every stage: each is answered with its
    error and leaves nothing behind (gradients, graphs), so the others train as without it."""
    cfg = TrainConfig({"name": "adam", "lr": 0.01}, clip_grad_norm=0.3, accumulate=2, seed=21)
    data = data_for("mlp", steps=8)
    boom_x = data[3][0].clone()
    boom_x[0, 0] = 12345.0  # Boom raises on it
    bad_y = data[5][1].clone()
    bad_y[-1] = 99  # no such class: the loss of the second micro-batch fails
    steps = [*data[:3], (boom_x, data[3][1]), data[4], (data[5][0], bad_y), *data[6:]]

    def make() -> torch.nn.Module:
        return seeded(boom_net, 14)

    bus = Bus(pipe_stages("boom", cfg, 3, make), seed=3)
    answers = bus.steps(steps)
    kinds = [type(a).__name__ for a in answers]
    assert (
        kinds
        == ["TrainStepResult"] * 3 + ["Error", "TrainStepResult", "Error"] + ["TrainStepResult"] * 2
    )
    boom, loss = answers[3], answers[5]
    assert isinstance(boom, p.Error) and boom.id == 104 and boom.code == str(Code.MODEL_ERROR)
    assert "boom: the model's own code failed" in boom.reason
    assert isinstance(loss, p.Error) and loss.id == 106 and loss.code == str(Code.BAD_REQUEST)
    assert "the loss failed" in loss.reason
    done = [a for a in answers if isinstance(a, p.TrainStepResult)]
    assert [a.step for a in done] == [1, 2, 3, 4, 5, 6]
    good = [*data[:3], data[4], *data[6:]]
    close([a.loss for a in done], plain_step_loop(make(), cfg, good), "losses")


@pytest.mark.parametrize(("kind", "saved_as", "resumed_as"), [("dropout", 3, 2), ("gpt2", 2, 3)])
def test_a_checkpoint_resumes_the_same_run_cut_another_way(
    tmp_path: Any, kind: str, saved_as: int, resumed_as: int
) -> None:
    """Four steps, a save, four more; the same job resumed from the save with another stage
    count takes the last four steps to the same losses and weights."""
    cfg = TrainConfig({"name": "adam", "lr": 0.01}, accumulate=2, seed=21)
    data = data_for(kind, steps=8)
    bus = Bus(pipe_stages(kind, cfg, saved_as), seed=5)
    for seq, (x, y) in enumerate(data[:4], 1):
        bus.runners[0].on_step(p.TrainStep(id=seq, job="job", seq=seq), x, y)
    bus.runners[0].on_save(50, str(tmp_path / "ck"))
    for seq, (x, y) in enumerate(data[4:], 5):
        bus.runners[0].on_step(p.TrainStep(id=seq, job="job", seq=seq), x, y)
    bus.run()
    saved = bus.answers[4]
    assert saved == p.TrainSaved(id=50, job="job", path=str(tmp_path / "ck"), step=4)
    whole = [a.loss for a in bus.answers if isinstance(a, p.TrainStepResult)]
    assert len(whole) == 8
    assert read_pipe_meta(tmp_path / "ck")["stages"] == saved_as

    again = Bus(pipe_stages(kind, cfg, resumed_as), seed=6)
    for r in again.runners:
        r.step_count, r.rng = load_stage(r.stage, tmp_path / "ck")
    answers = again.steps(data[4:])
    assert [a.step for a in answers] == [5, 6, 7, 8]
    close([a.loss for a in answers], whole[4:], "losses after the resume")
    got: dict[str, torch.Tensor] = {}
    for r in again.runners:
        got.update(r.stage.state_dict())
    for r in bus.runners:
        for n, t in r.stage.state_dict().items():
            close(got[n], t, f"tensor {n}")


def equals_plain_eval(
    ev: p.TrainEvalResult,
    kind: str,
    cfg: TrainConfig,
    trained: list[tuple[Any, torch.Tensor]],
    held_x: torch.Tensor,
    held_y: torch.Tensor,
) -> None:
    """`ev`'s loss and accuracy are those of the plain model trained on `trained`, in eval mode."""
    reference = build(kind)
    plain_step_loop(reference, cfg, trained)
    reference.eval()
    with torch.no_grad():
        out = reference(held_x)
        want = torch.nn.functional.cross_entropy(out, held_y)
    close(ev.loss, float(want), "the evaluation's loss")
    assert ev.metrics["accuracy"] == int((out.argmax(-1) == held_y).sum()) / len(held_y)


def test_an_evaluation_equals_plain_eval_and_changes_nothing() -> None:
    """Between steps, an evaluation of a model with dropout, BatchNorm and a running scale: its
    loss and accuracy are the plain model's in eval mode at that point, and the steps after it
    take the losses they take without it (its random state and statistics untouched)."""
    cfg = TrainConfig({"name": "adam", "lr": 0.01}, accumulate=2, seed=21)
    data = data_for("mixed", steps=6)
    held_x, held_y = data_for("mixed", steps=1, batch=10, seed=9)[0]  # 10 rows: 5 + 5
    bus = Bus(pipe_stages("mixed", cfg, 3), seed=4)
    for seq, (x, y) in enumerate(data, 1):
        bus.runners[0].on_step(p.TrainStep(id=seq, job="job", seq=seq), x, y)
        if seq == 3:
            bus.runners[0].on_eval(p.TrainEval(id=70, job="job"), held_x, held_y)
    bus.run()
    kinds = [type(a).__name__ for a in bus.answers]
    assert kinds == ["TrainStepResult"] * 3 + ["TrainEvalResult"] + ["TrainStepResult"] * 3
    ev = bus.answers[3]
    assert isinstance(ev, p.TrainEvalResult) and ev.id == 70 and ev.step == 3

    equals_plain_eval(ev, "mixed", cfg, data[:3], held_x, held_y)
    steps = [a.loss for a in bus.answers if isinstance(a, p.TrainStepResult)]
    close(steps, plain_step_loop(build("mixed"), cfg, data), "the steps around it")


def test_a_step_whose_hop_is_lost_fails_at_its_deadline_and_the_rest_go_on() -> None:
    """Step 2's first gradient never reaches stage 0 (its worker alive, the hop lost): the
    coordinator waits, then at the step's deadline fails it everywhere (TIMEOUT), and the steps
    queued behind it run as if it had never been sent."""
    cfg = TrainConfig({"name": "adam", "lr": 0.01}, clip_grad_norm=0.3, accumulate=2, seed=21)
    data = data_for("mlp", steps=5)
    now = [0.0]
    bus = Bus(pipe_stages("mlp", cfg, 3), seed=8)
    for r in bus.runners:
        r.clock = lambda: now[0]
    lost: list[p.PipeHop] = []
    send = bus.runners[1]._send

    def lossy(to: int, hop: p.PipeHop) -> None:
        if hop.seq == 2 and hop.kind == "grad" and not lost:
            lost.append(hop)  # dropped on the way
            return
        send(to, hop)

    bus.runners[1]._send = lossy
    for seq, (x, y) in enumerate(data, 1):
        msg = p.TrainStep(id=seq, job="job", seq=seq, timeout_ms=30_000)
        bus.runners[0].on_step(msg, x, y)
    bus.run()
    assert [a.id for a in bus.answers] == [1] and lost  # step 2 waits, the rest behind it
    now[0] = 29.0
    bus.runners[0].on_tick()
    assert len(bus.answers) == 1  # not yet
    now[0] = 31.0
    bus.runners[0].on_tick()
    bus.run()
    kinds = [type(a).__name__ for a in bus.answers]
    assert kinds == ["TrainStepResult", "Error", "TrainStepResult", "TrainStepResult",
                     "TrainStepResult"]  # fmt: skip
    err = bus.answers[1]
    assert isinstance(err, p.Error) and err.code == str(Code.TIMEOUT)
    assert "step seq 2 did not end within its time" in err.reason
    assert "it was applied on none" in err.reason
    done = [a for a in bus.answers if isinstance(a, p.TrainStepResult)]
    assert [a.step for a in done] == [1, 2, 3, 4]
    good = [data[0], *data[2:]]
    close([a.loss for a in done], plain_step_loop(build("mlp"), cfg, good), "losses")


def test_an_evaluation_or_a_save_whose_hop_is_lost_fails_at_its_deadline(tmp_path: Any) -> None:
    """An evaluation's activation lost between stages 1 and 2, then a save's answer from stage
    2 lost (the workers alive): each is answered TIMEOUT at its deadline, and the steps queued
    behind them run, where they waited for ever. The lost answer, come late while the next save
    is under way, is not counted for that one."""
    cfg = TrainConfig({"name": "adam", "lr": 0.01}, accumulate=2, seed=21)
    data = data_for("mlp", steps=3)
    held_x, held_y = data_for("mlp", steps=1, batch=8, seed=9)[0]
    now = [0.0]
    bus = Bus(pipe_stages("mlp", cfg, 3), seed=8)
    for r in bus.runners:
        r.clock = lambda: now[0]
    lost: list[tuple[int, p.PipeHop]] = []
    act_send, saved_send = bus.runners[1]._send, bus.runners[2]._send

    def lossy_act(to: int, hop: p.PipeHop) -> None:
        if hop.evaluating and hop.kind == "act" and not lost:
            lost.append((to, hop))
            return
        act_send(to, hop)

    def lossy_saved(to: int, hop: p.PipeHop) -> None:
        if hop.kind == "saved" and len(lost) in (1, 2):  # held back: each save's first
            lost.append((to, hop))
            return
        saved_send(to, hop)

    bus.runners[1]._send, bus.runners[2]._send = lossy_act, lossy_saved
    r0 = bus.runners[0]
    r0.on_step(p.TrainStep(id=1, job="job", seq=1, timeout_ms=30_000), *data[0])
    r0.on_eval(p.TrainEval(id=50, job="job", timeout_ms=30_000), held_x, held_y)
    r0.on_step(p.TrainStep(id=2, job="job", seq=2, timeout_ms=30_000), *data[1])
    bus.run()
    assert [a.id for a in bus.answers] == [1] and r0.under_way and len(lost) == 1
    now[0] = 29.0
    r0.on_tick()
    assert len(bus.answers) == 1  # not yet
    now[0] = 31.0
    r0.on_tick()
    bus.run()
    assert [(type(a).__name__, a.id) for a in bus.answers] == [
        ("TrainStepResult", 1), ("Error", 50), ("TrainStepResult", 2)]  # fmt: skip
    err = bus.answers[1]
    assert isinstance(err, p.Error) and err.code == str(Code.TIMEOUT)
    assert "an evaluation did not end within its time" in err.reason
    assert not r0.under_way

    path = str(tmp_path / "ck")
    r0.on_save(60, path, 10_000)
    r0.on_step(p.TrainStep(id=3, job="job", seq=3, timeout_ms=30_000), *data[2])
    bus.run()
    assert len(bus.answers) == 3 and len(lost) == 2  # the save waits, the step behind it
    now[0] = 31.0 + 11.0
    r0.on_tick()
    bus.run()
    assert [(type(a).__name__, a.id) for a in bus.answers[3:]] == [
        ("Error", 60), ("TrainStepResult", 3)]  # fmt: skip
    late = bus.answers[3]
    assert isinstance(late, p.Error) and late.code == str(Code.TIMEOUT)
    assert "it may be incomplete there; save again" in late.reason

    # The next save, the lost answer of the last one come late: counted for nothing, so the
    # new one is not answered while stage 2's own answer is still on its way.
    r0.on_save(61, path, 10_000)
    to, hop = lost[1]
    assert to == 0
    r0.on_hop(hop)
    bus.run()
    assert len(bus.answers) == 5 and len(lost) == 3
    to, hop = lost[2]
    r0.on_hop(hop)
    saved = bus.answers[5:]
    assert [(type(a).__name__, a.id) for a in saved] == [("TrainSaved", 61)], saved
    meta = read_pipe_meta(path)
    assert meta["step"] == 3
    # Every stage's file carries the id the coordinator drew for the save (pipe_checkpoint).
    assert len(meta["save"]) == 16 and int(meta["save"], 16) >= 0


def test_an_evaluation_over_the_jobs_batch_runs_in_micro_batches_of_a_steps_rows() -> None:
    """A job opened for 8 rows a step in 2 micro-batches: its stages' memory was planned for
    forwards of 4 rows. An evaluation of 40 rows runs as forwards of at most 4 rows (not 2 of
    20), and its loss and accuracy are the plain model's."""
    cfg = TrainConfig({"name": "sgd", "lr": 0.05}, accumulate=2, seed=21)
    data = data_for("mlp", steps=2)
    held_x, held_y = data_for("mlp", steps=1, batch=40, seed=9)[0]
    bus = Bus(pipe_stages("mlp", cfg, 2), seed=3, batch=8)
    seen: list[int] = []
    for r in bus.runners:
        evaluate = r.stage.evaluate

        def counted(x: Any, rng: Any, evaluate: Any = evaluate) -> Any:
            seen.append(int(x.shape[0]))
            return evaluate(x, rng)

        r.stage.evaluate = counted  # type: ignore[method-assign]
    for seq, (x, y) in enumerate(data, 1):
        bus.runners[0].on_step(p.TrainStep(id=seq, job="job", seq=seq), x, y)
    bus.runners[0].on_eval(p.TrainEval(id=70, job="job"), held_x, held_y)
    bus.run()
    ev = bus.answers[-1]
    assert isinstance(ev, p.TrainEvalResult) and ev.id == 70
    assert seen and max(seen) == 4 and sum(seen) == 2 * 40, seen  # both stages, every row
    equals_plain_eval(ev, "mlp", cfg, data, held_x, held_y)
