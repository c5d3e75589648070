"""The training router through BrokerCore: exact messages out for each event in, on a fake clock,
no sockets."""

from __future__ import annotations

import pytest

from broker.core import BACKEND, CLIENT
from flowmesh import metrics
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.train_spec import TrainConfig
from tests.support.broker import Harness, opened_job, ref

KIB = 1 << 10
C = b"client"
SPEC = {"name": "j", "factory": "flowmesh.examples:mlp", "kwargs": {"width": 8}, "seed": 1}
CONFIG = {"optimizer": {"name": "adamw", "lr": 0.01}}
Out = list[tuple[str, bytes, p.Message]]


def trainer(h: Harness, name: str, train_bytes: int) -> bytes:
    addr = name.encode()
    h.backend(
        addr,
        p.Register(
            id=1,
            role="worker",
            name=name,
            pid=1,
            device="cpu",
            kind="cpu",
            budget_bytes=KIB,
            info=p.PeerInfo(train_bytes=train_bytes),
        ),
    )
    h.backend(addr, p.Heartbeat())
    return addr


def only(out: Out) -> tuple[str, bytes, p.Message]:
    assert len(out) == 1, out
    return out[0]


def open_job(h: Harness, job: str, footprint: int = 0, ref_id: int = 1) -> tuple[bytes, int]:
    """Open `job`; returns its worker's address and the broker's open call id."""
    dest, addr, fwd = only(
        h.client(C, p.TrainOpen(id=ref_id, job=job, spec=SPEC, config=CONFIG, batch=4))
    )
    assert dest == BACKEND and isinstance(fwd, p.TrainOpen)
    assert (fwd.job, fwd.spec.factory, fwd.config, fwd.batch) == (
        job,
        SPEC["factory"],
        TrainConfig(**CONFIG),  # checked on receipt, forwarded as it came
        4,
    )
    info = opened_job(job, worker=addr.decode(), footprint=footprint)
    dest, client, opened = only(h.backend(addr, p.JobOpened(id=fwd.id, job=info)))
    assert (dest, client) == (CLIENT, C) and isinstance(opened, p.TrainOpened)
    assert opened.id == ref_id and opened.job.worker == addr.decode()
    assert opened.job.state == "ready" and opened.job.sub_models == info.sub_models
    assert opened.job.footprint == footprint
    return addr, fwd.id


def step(h: Harness, job: str, seq: int, ref_id: int) -> Out:
    tensors = {"inputs": ref(4, 8), "targets": ref(4, dtype="int64")}
    return h.client(C, p.TrainStep(id=ref_id, job=job, seq=seq, tensors=tensors))


def result(call: p.TrainStep, loss: float, step_no: int) -> p.TrainStepResult:
    return p.TrainStepResult(
        id=call.id, job=call.job, seq=call.seq, loss=loss, step=step_no, metrics={"tasks": 6.0}
    )


def tick(h: Harness, now: float, *alive: bytes) -> Out:
    """Move the clock to `now` (the workers `alive` heartbeat just before) and tick."""
    h.now = now
    for addr in alive:
        h.backend(addr, p.Heartbeat())
    h.core.tick(now)
    return [o for o in h.out() if not isinstance(o[2], p.Heartbeat)]


def error_of(out: Out) -> p.Error:
    dest, addr, msg = only(out)
    assert (dest, addr) == (CLIENT, C) and isinstance(msg, p.Error)
    return msg


def test_a_job_goes_to_the_worker_with_most_free_training_bytes() -> None:
    h = Harness()
    h.worker("serve-only")  # no training bytes: never chosen
    trainer(h, "small", 100 * KIB)
    trainer(h, "big", 200 * KIB)
    big, _ = open_job(h, "first", footprint=150 * KIB)
    assert big == b"big"
    small, _ = open_job(h, "second", footprint=10 * KIB, ref_id=2)  # 100 free beats 50
    assert small == b"small"
    third, _ = open_job(h, "third", ref_id=3)  # 90 free beats 50
    assert third == b"small"
    with pytest.raises(FlowmeshError) as info:
        h.client(C, p.TrainOpen(id=4, job="first", spec=SPEC, config=CONFIG, batch=4))
    assert info.value.code == Code.MODEL_EXISTS
    assert [j.name for j in h.core.status(h.now).jobs] == ["first", "second", "third"]


def test_no_training_worker_and_a_factory_off_the_allow_list_are_refused() -> None:
    h = Harness()
    h.worker("serve-only")
    with pytest.raises(FlowmeshError) as info:
        h.client(C, p.TrainOpen(id=1, job="j", spec=SPEC, config=CONFIG, batch=4))
    assert info.value.code == Code.UNAVAILABLE and "--train-bytes" in info.value.reason
    trainer(h, "w", KIB)
    bad = {**SPEC, "factory": "os:system"}
    with pytest.raises(FlowmeshError) as info:
        h.client(C, p.TrainOpen(id=1, job="j", spec=bad, config=CONFIG, batch=4))
    assert info.value.code == Code.NOT_ALLOWED
    assert h.core.training.jobs == {}


def test_steps_are_forwarded_in_order_and_answered_with_their_own_ids() -> None:
    h = Harness()
    w = trainer(h, "w", 100 * KIB)
    open_job(h, "j")
    sent = []
    for seq, rid in ((1, 11), (2, 12), (3, 13)):
        dest, addr, fwd = only(step(h, "j", seq, rid))
        assert (dest, addr) == (BACKEND, w) and isinstance(fwd, p.TrainStep)
        assert fwd.seq == seq and set(fwd.tensors) == {"inputs", "targets"}
        sent.append(fwd)
    assert len({f.id for f in sent}) == 3
    answers = [only(h.backend(w, result(f, 1.0 / f.seq, f.seq))) for f in sent]
    assert [(d, a, m.id, m.seq, m.step, m.loss) for d, a, m in answers] == [  # type: ignore[attr-defined]
        (CLIENT, C, 11, 1, 1, 1.0),
        (CLIENT, C, 12, 2, 2, 0.5),
        (CLIENT, C, 13, 3, 3, 1.0 / 3),
    ]
    (row,) = h.core.status(h.now).jobs
    assert (row.step, row.last_loss, row.pending) == (3, 1.0 / 3, 0)


def test_a_taken_seq_is_never_sent_twice() -> None:
    h = Harness()
    w = trainer(h, "w", 100 * KIB)
    open_job(h, "j")
    _, _, first = only(step(h, "j", 1, 11))
    _, _, second = only(step(h, "j", 2, 12))
    # A retry of a step still running takes over its answer; nothing goes to the worker.
    assert step(h, "j", 2, 22) == []
    assert only(h.backend(w, result(first, 0.9, 1)))[2].id == 11  # type: ignore[attr-defined]
    answered = only(h.backend(w, result(second, 0.8, 2)))[2]
    assert isinstance(answered, p.TrainStepResult) and (answered.id, answered.step) == (22, 2)
    # A retry of a finished step is answered from what was kept.
    replay = only(step(h, "j", 1, 31))[2]
    assert isinstance(replay, p.TrainStepResult) and (replay.id, replay.loss) == (31, 0.9)
    # A failed step's error is kept too.
    _, _, third = only(step(h, "j", 3, 13))
    err = p.Error(id=third.id, code=str(Code.BAD_REQUEST), reason="targets have 3 rows")
    assert error_of(h.backend(w, err)).id == 13
    again = error_of(step(h, "j", 3, 33))
    assert (again.id, again.code, again.reason) == (33, "bad_request", "targets have 3 rows")
    # Gaps are allowed: seq 7 runs after 3; seq 5 then comes too late.
    assert isinstance(only(step(h, "j", 7, 17))[2], p.TrainStep)
    with pytest.raises(FlowmeshError) as info:
        step(h, "j", 5, 15)
    assert info.value.code == Code.BAD_REQUEST and "already taken" in info.value.reason
    (row,) = h.core.status(h.now).jobs
    assert (row.step, row.errors, row.pending) == (2, 1, 1)


def test_every_call_has_a_deadline() -> None:
    h = Harness(default_timeout_s=5.0)
    w = trainer(h, "w", 100 * KIB)
    open_job(h, "j")
    _, _, fwd = only(step(h, "j", 1, 11))
    assert tick(h, 4.9, w) == []
    (timeout,) = [m for _, _, m in tick(h, 5.0, w) if isinstance(m, p.Error)]
    assert (timeout.id, timeout.code) == (11, "timeout") and "seq 1" in timeout.reason
    # The late answer is not sent to anyone, but the step counts: it was applied.
    assert h.backend(w, result(fwd, 0.7, 1)) == []
    assert only(step(h, "j", 1, 21))[2].loss == 0.7  # type: ignore[attr-defined]
    # An open that is not answered in time: the client hears, the half-open job is closed.
    opening = p.TrainOpen(id=2, job="slow", spec=SPEC, config=CONFIG, batch=4, timeout_ms=1000)
    (_, _, fwd_open) = only(h.client(C, opening))
    out = [(d, m) for d, _, m in tick(h, 6.0, w)]
    assert [(d, type(m).__name__) for d, m in out] == [(BACKEND, "TrainClose"), (CLIENT, "Error")]
    assert out[0][1].job == "slow" and out[1][1].code == "timeout"  # type: ignore[attr-defined]
    assert "slow" not in h.core.training.jobs
    # Should it open after all, it is closed again: nobody can reach it.
    late = opened_job("slow")
    ((dest, addr, shut),) = h.backend(w, p.JobOpened(id=fwd_open.id, job=late))
    assert (dest, addr) == (BACKEND, w) and isinstance(shut, p.TrainClose) and shut.job == "slow"


def test_a_lost_worker_fails_its_jobs_steps_naming_the_last_checkpoint() -> None:
    h = Harness()
    a = trainer(h, "a", 200 * KIB)
    b = trainer(h, "b", 100 * KIB)
    assert open_job(h, "on-a", footprint=150 * KIB)[0] == a
    assert open_job(h, "on-b", ref_id=2)[0] == b
    _, _, save = only(h.client(C, p.TrainSave(id=5, job="on-a", path="/ck/a")))
    assert isinstance(save, p.TrainSave)
    saved = only(h.backend(a, p.TrainSaved(id=save.id, job="on-a", path="/ck/a", step=4)))[2]
    assert isinstance(saved, p.TrainSaved) and (saved.id, saved.step) == (5, 4)
    step(h, "on-a", 1, 11)
    step(h, "on-a", 2, 12)
    _, _, other = only(step(h, "on-b", 1, 21))
    errs = [m for _, _, m in tick(h, 3.5, b) if isinstance(m, p.Error)]  # a fell silent
    assert [(e.id, e.code) for e in errs] == [(11, "worker_lost"), (12, "worker_lost")]
    assert "last saved at step 4 to '/ck/a'" in errs[0].reason
    assert [j.name for j in h.core.status(h.now).jobs] == ["on-b"]
    assert only(h.backend(b, result(other, 0.5, 1)))[2].id == 21  # type: ignore[attr-defined]
    # Its client's close after the error (in a `finally`, say) is answered closed, not refused
    # in its turn: nothing is left to close. A job never opened is still refused.
    dest, client, closed = only(h.client(C, p.TrainClose(id=30, job="on-a")))
    assert (dest, client, type(closed), closed.id) == (CLIENT, C, p.TrainClosed, 30)
    with pytest.raises(FlowmeshError) as info:
        h.client(C, p.TrainClose(id=31, job="never"))
    assert info.value.code == Code.MODEL_NOT_FOUND


def test_close_fails_what_is_pending_and_forgets_the_job() -> None:
    h = Harness()
    w = trainer(h, "w", 100 * KIB)
    open_job(h, "j")
    _, _, fwd = only(step(h, "j", 1, 11))
    _, _, close = only(h.client(C, p.TrainClose(id=9, job="j")))
    assert isinstance(close, p.TrainClose)
    with pytest.raises(FlowmeshError) as info:
        step(h, "j", 2, 12)
    assert info.value.code == Code.UNAVAILABLE and "closing" in info.value.reason
    out = h.backend(w, p.TrainClosed(id=close.id, job="j"))
    assert [(type(m).__name__, m.id) for _, _, m in out] == [("Error", 11), ("TrainClosed", 9)]  # type: ignore[attr-defined]
    assert h.backend(w, result(fwd, 1.0, 1)) == []  # late: nobody waits
    assert h.core.status(h.now).jobs == []
    jobs = only(h.client(C, p.Jobs(id=3)))[2]
    assert isinstance(jobs, p.JobsReply) and jobs.jobs == []


def test_a_close_answered_after_it_timed_out_still_closes_the_job() -> None:
    """The client is told its close timed out; the worker's late answer still ends the job on
    the broker (kept, it would count in placement and refuse its name for good). An answer
    to a close of another job of that name does not."""
    h = Harness()
    w = trainer(h, "w", 100 * KIB)
    open_job(h, "j")
    _, _, close = only(h.client(C, p.TrainClose(id=9, job="j", timeout_ms=1000)))
    out = tick(h, 2.0, w)
    assert [(m.id, m.code) for _, _, m in out if isinstance(m, p.Error)] == [(9, "timeout")]
    assert [j.name for j in h.core.status(h.now).jobs] == ["j"]
    assert h.backend(w, p.TrainClosed(id=close.id + 1000, job="j")) == []  # not its close
    assert [j.name for j in h.core.status(h.now).jobs] == ["j"]
    assert h.backend(w, p.TrainClosed(id=close.id, job="j")) == []  # nobody waits now
    assert h.core.status(h.now).jobs == []
    open_job(h, "j", ref_id=2)  # its name is free again
    # The same when the late answer is an error (the worker's close raised: it holds the
    # job no more either way).
    _, _, close = only(h.client(C, p.TrainClose(id=10, job="j", timeout_ms=1000)))
    tick(h, h.now + 2.0, w)
    assert [j.name for j in h.core.status(h.now).jobs] == ["j"]
    h.backend(w, p.Error(id=close.id, code="internal", reason="close failed"))
    assert h.core.status(h.now).jobs == []


def test_a_job_that_ended_keeps_its_final_figures_in_status_and_metrics() -> None:
    h = Harness()
    w = trainer(h, "w", 200 * KIB)
    lost = trainer(h, "x", 100 * KIB)
    assert open_job(h, "j", footprint=150 * KIB)[0] == w
    assert open_job(h, "k", ref_id=2)[0] == lost
    _, _, fwd = only(step(h, "j", 1, 11))
    h.backend(w, result(fwd, 0.75, 1))
    _, _, fwd = only(step(h, "j", 2, 12))
    h.backend(w, p.Error(id=fwd.id, code="model_error", reason="boom"))
    _, _, close = only(h.client(C, p.TrainClose(id=9, job="j")))
    h.backend(w, p.TrainClosed(id=close.id, job="j"))
    tick(h, 3.5, w)  # x fell silent: k is lost with it
    st = h.core.status(h.now)
    assert st.jobs == []
    assert [(j.name, j.state, j.step, j.last_loss, j.errors) for j in st.finished_jobs] == [
        ("j", "closed", 1, 0.75, 1),
        ("k", "lost", 0, None, 0),
    ]
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in metrics.broker_families(st)
        for s in f.samples
    }
    closed = (("state", "closed"), ("train_job", "j"))
    assert got[("flowmesh_broker_train_final_steps", closed)] == 1
    assert got[("flowmesh_broker_train_final_loss", closed)] == 0.75
    assert got[("flowmesh_broker_train_final_errors", closed)] == 1
    assert got[("flowmesh_broker_train_final_steps", (("state", "lost"), ("train_job", "k")))] == 0
    assert not [k for k in got if k[0] == "flowmesh_broker_train_steps_total"]  # no open job
    # Opened again under the same name: one row per name, the latest run's once it ends.
    open_job(h, "j", ref_id=3)
    assert [j.name for j in h.core.status(h.now).finished_jobs] == ["j", "k"]
    _, _, close = only(h.client(C, p.TrainClose(id=10, job="j")))
    h.backend(w, p.TrainClosed(id=close.id, job="j"))
    assert [(j.name, j.step) for j in h.core.status(h.now).finished_jobs] == [("k", 0), ("j", 0)]


def test_only_the_jobs_worker_may_answer_its_calls() -> None:
    h = Harness()
    w = trainer(h, "w", 100 * KIB)
    intruder = trainer(h, "x", 10 * KIB)
    open_job(h, "j")
    _, _, fwd = only(step(h, "j", 1, 11))
    with pytest.raises(FlowmeshError):
        h.backend(intruder, result(fwd, 0.0, 1))
    forged = p.Error(id=fwd.id, code="internal", reason="forged")
    assert all(not isinstance(m, p.Error) or m.id != 11 for _, _, m in h.backend(intruder, forged))
    assert only(h.backend(w, result(fwd, 0.25, 1)))[2].loss == 0.25  # type: ignore[attr-defined]


def test_a_batch_carries_exactly_the_inputs_it_names_and_its_targets() -> None:
    h = Harness()
    trainer(h, "w", 100 * KIB)
    open_job(h, "j")
    x, y = ref(4, 8), ref(4, dtype="int64")
    named = p.TrainStep(
        id=11, job="j", seq=1, inputs=["x", "mask"], tensors={"x": x, "mask": x, "targets": y}
    )
    _, _, fwd = only(h.client(C, named))
    assert isinstance(fwd, p.TrainStep) and fwd.inputs == ["x", "mask"]
    assert set(fwd.tensors) == {"x", "mask", "targets"}
    refused = {
        "missing": (["x", "mask"], {"x": x, "targets": y}, "needs tensors ['mask']"),
        "unnamed": (None, {"inputs": x, "mask": x, "targets": y}, "carries tensors ['mask']"),
        "twice": (["x", "x"], {"x": x, "targets": y}, "names an input twice"),
        "positional": (None, {"x": x, "targets": y}, "needs tensors ['inputs']"),
    }
    for seq, (inputs, tensors, reason) in enumerate(refused.values(), start=2):
        for msg in (
            p.TrainStep(id=20 + seq, job="j", seq=seq, inputs=inputs, tensors=tensors),
            p.TrainEval(id=30 + seq, job="j", inputs=inputs, tensors=tensors),
        ):
            with pytest.raises(FlowmeshError) as info:
                h.client(C, msg)
            assert info.value.code == Code.BAD_REQUEST and reason in info.value.reason, msg


def test_an_eval_is_forwarded_behind_the_steps_and_changes_no_job_figures() -> None:
    h = Harness()
    w = trainer(h, "w", 100 * KIB)
    open_job(h, "j")
    _, _, first = only(step(h, "j", 1, 11))
    tensors = {"inputs": ref(4, 8), "targets": ref(4, dtype="int64")}
    dest, addr, fwd = only(h.client(C, p.TrainEval(id=21, job="j", tensors=tensors)))
    assert (dest, addr) == (BACKEND, w) and isinstance(fwd, p.TrainEval)
    assert fwd.id not in (21, first.id) and set(fwd.tensors) == {"inputs", "targets"}
    _, _, second = only(step(h, "j", 2, 12))  # an eval takes no seq: the next step is 2
    assert isinstance(second, p.TrainStep) and second.seq == 2
    only(h.backend(w, result(first, 0.9, 1)))
    metrics = {"accuracy": 0.5, "nonfinite": 0.0}
    reply = p.TrainEvalResult(id=fwd.id, job="j", loss=0.7, step=1, metrics=metrics)
    dest, addr, answered = only(h.backend(w, reply))
    assert (dest, addr) == (CLIENT, C) and answered == p.TrainEvalResult(
        id=21, job="j", loss=0.7, step=1, metrics=metrics
    )
    (row,) = h.core.status(h.now).jobs
    assert (row.step, row.last_loss, row.pending) == (1, 0.9, 1)
    # A failed eval answers its caller and counts as no step error.
    _, _, again = only(h.client(C, p.TrainEval(id=22, job="j", tensors=tensors)))
    err = p.Error(id=again.id, code=str(Code.MODEL_ERROR), reason="boom")
    assert (error_of(h.backend(w, err)).id, h.core.status(h.now).jobs[0].errors) == (22, 0)
    with pytest.raises(FlowmeshError) as info:
        h.client(C, p.TrainEval(id=23, job="j", tensors={"inputs": ref(4, 8)}))
    assert info.value.code == Code.BAD_REQUEST and "'targets'" in info.value.reason
    with pytest.raises(FlowmeshError) as info:
        h.client(C, p.TrainEval(id=24, job="nope", tensors=tensors))
    assert info.value.code == Code.MODEL_NOT_FOUND


def test_a_job_idle_past_its_idle_close_is_closed_and_a_later_call_is_told_why() -> None:
    h = Harness(default_timeout_s=100.0)
    w = trainer(h, "w", 100 * KIB)
    opening = p.TrainOpen(id=1, job="j", spec=SPEC, config=CONFIG, batch=4, idle_close_s=30.0)
    _, _, fwd = only(h.client(C, opening))
    only(h.backend(w, p.JobOpened(id=fwd.id, job=opened_job("j"))))
    open_job(h, "kept", ref_id=2)  # no idle close: open until closed
    h.now = 20.0
    _, _, sent = only(step(h, "j", 1, 11))  # a call of it: idle counts from here
    # A step in flight keeps it open, however long it takes...
    assert tick(h, 49.0, w) == [] and tick(h, 75.0, w) == []
    h.now = 76.0
    only(h.backend(w, result(sent, 0.5, 1)))  # ... and idle counts from its last tick in flight
    assert tick(h, 104.0, w) == []
    out = tick(h, 105.0, w)
    assert [(d, a, type(m).__name__) for d, a, m in out] == [(BACKEND, w, "TrainClose")]
    close = out[0][2]
    assert isinstance(close, p.TrainClose) and close.job == "j"
    with pytest.raises(FlowmeshError) as closing:
        step(h, "j", 2, 12)  # while its worker closes it
    assert closing.value.code == Code.UNAVAILABLE
    assert h.backend(w, p.TrainClosed(id=close.id, job="j")) == []  # answered to nobody
    with pytest.raises(FlowmeshError) as gone:
        step(h, "j", 2, 13)
    assert gone.value.code == Code.MODEL_NOT_FOUND
    assert "closed by the broker after 30 s without a call" in gone.value.reason
    assert "saved no checkpoint" in gone.value.reason
    assert [j.name for j in h.core.status(h.now).jobs] == ["kept"]
    assert tick(h, 1000.0, w) == []  # the other job stays
    assert h.core.status(h.now).totals.train_idle_closed == 1
    open_job(h, "j", ref_id=3)  # its name free again
