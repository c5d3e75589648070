"""`train_open(pipeline="auto")` through BrokerCore, exact messages on a fake clock: the broker
asks a partitioner where the job goes (kind "pipeline", with the free training bytes of the
workers its stages may use), then opens it pipelined over as many workers as the plan has
stages, or on one worker by memory flow when the plan says it fits one, fits no pipeline, or
cannot be had."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from broker.core import BACKEND, CLIENT
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.plan import Plan
from tests.support.broker import Harness, opened_job

KIB = 1 << 10
C = b"client"
SPEC = {"name": "j", "factory": "flowmesh.examples:mlp", "kwargs": {"width": 8}, "seed": 1}
CONFIG = {"optimizer": {"name": "adam", "lr": 0.01}, "accumulate": 2}
Out = list[tuple[str, bytes, p.Message]]


def trainer(h: Harness, name: str, train_bytes: int) -> bytes:
    addr = name.encode()
    info = p.PeerInfo(train_bytes=train_bytes, peer_endpoint=f"tcp://127.0.0.1:{len(name)}")
    h.backend(addr, p.Register(id=1, role="worker", name=name, pid=1, device="cpu", kind="cpu",
                               budget_bytes=KIB, info=info))  # fmt: skip
    h.backend(addr, p.Heartbeat())
    return addr


def mesh(partitioner: bool = True) -> Harness:
    h = Harness()
    if partitioner:
        h.partitioner()
    trainer(h, "w-small", 100 * KIB)
    trainer(h, "w-big", 300 * KIB)
    trainer(h, "w-mid", 200 * KIB)
    return h


def open_auto(h: Harness, ref_id: int = 1, **kw: Any) -> Out:
    msg = p.TrainOpen(id=ref_id, job="j", spec=SPEC, config=CONFIG, batch=4, pipeline="auto",
                      **kw)  # fmt: skip
    return h.client(C, msg)


def pipeline_plan(stages: int, fits: bool = True, stage_bytes: int = 4 * KIB) -> Plan:
    """A plan of kind "pipeline" over 6 blocks (what the partitioner answers)."""
    bounds = [round(i * 6 / stages) for i in range(stages + 1)]
    ranges = tuple(itertools.pairwise(bounds))
    return Plan(kind="pipeline", spec_digest="test", block_names=tuple(f"b{i}" for i in range(6)),
                block_bytes=(KIB,) * 6, ranges=ranges, range_bytes=tuple(KIB for _ in ranges),
                objective="bytes", range_footprint=tuple(stage_bytes for _ in ranges),
                request={"fits": fits})  # fmt: skip


def asked(out: Out) -> p.PlanJob:
    ((dest, addr, job),) = out
    assert (dest, addr) == (BACKEND, b"part") and isinstance(job, p.PlanJob)
    return job


def test_a_job_that_fits_no_worker_is_pipelined_where_the_plan_says() -> None:
    h = mesh()
    job = asked(open_auto(h))
    # What the partitioner is asked: the stages' plan for this model and optimizer, with the
    # free training bytes of the workers that take pipelines, the most first.
    assert job.request.kind == "pipeline" and job.request.spec.name == "j"
    assert job.request.optimizer == CONFIG["optimizer"] and job.request.batch == 2
    assert job.request.worker_bytes == [300 * KIB, 200 * KIB, 100 * KIB]
    (row,) = h.core.training.status(0.0)
    assert (row.name, row.state, row.worker) == ("j", "planning", "")
    # Meanwhile its steps are refused, and its name is taken.
    with pytest.raises(FlowmeshError) as info:
        h.client(C, p.TrainStep(id=7, job="j", seq=1, tensors={}))
    assert info.value.code == Code.UNAVAILABLE and "planning" in info.value.reason
    with pytest.raises(FlowmeshError) as info:
        open_auto(h, ref_id=8)
    assert info.value.code == Code.MODEL_EXISTS

    out = h.backend(b"part", p.PlanReply(id=job.id, plan=pipeline_plan(2)))
    opens = [(a.decode(), m.stage) for _, a, m in out if isinstance(m, p.PipeOpen)]
    assert opens == [("w-big", 0), ("w-mid", 1)]  # the two most free, in that order
    for _, a, m in out:
        info_ = opened_job("j", worker=a.decode(), footprint=4 * KIB)
        done = h.backend(a, p.JobOpened(id=m.id, job=info_))
    ((dest, client, opened),) = done
    assert (dest, client, type(opened)) == (CLIENT, C, p.TrainOpened)
    assert opened.id == 1 and opened.job.pipeline == ["w-big", "w-mid"]


@pytest.mark.parametrize("why", ["fits one", "fits none", "plan failed"])
def test_otherwise_it_goes_to_one_worker_by_memory_flow(why: str) -> None:
    h = mesh()
    job = asked(open_auto(h))
    if why == "plan failed":
        err = p.Error(id=job.id, code=str(Code.MODEL_ERROR), reason="the factory raised")
        out = h.backend(b"part", err)
    else:
        plan = pipeline_plan(1) if why == "fits one" else pipeline_plan(1, fits=False)
        out = h.backend(b"part", p.PlanReply(id=job.id, plan=plan))
    ((dest, addr, fwd),) = out
    assert (dest, addr, type(fwd)) == (BACKEND, b"w-big", p.TrainOpen)
    assert fwd.pipeline == 0  # what the worker sees: a memory-flow job


def test_without_a_partitioner_or_two_workers_no_plan_is_asked() -> None:
    h = mesh(partitioner=False)
    ((dest, addr, fwd),) = open_auto(h)
    assert (dest, addr, type(fwd)) == (BACKEND, b"w-big", p.TrainOpen)
    h = Harness()
    h.partitioner()
    trainer(h, "w-one", 100 * KIB)
    ((dest, addr, fwd),) = open_auto(h)
    assert (dest, addr, type(fwd)) == (BACKEND, b"w-one", p.TrainOpen)


def test_a_job_closed_while_it_is_planned_answers_both_calls() -> None:
    h = mesh()
    job = asked(open_auto(h))
    ((_, _, closed),) = h.client(C, p.TrainClose(id=5, job="j"))
    assert isinstance(closed, p.TrainClosed) and closed.id == 5
    ((_, client, err),) = h.backend(b"part", p.PlanReply(id=job.id, plan=pipeline_plan(2)))
    assert (client, err.id, err.code) == (C, 1, Code.BAD_REQUEST)
    assert "closed before it was placed" in err.reason
    assert h.core.training.jobs == {}


def test_auto_does_not_resume_a_checkpoint() -> None:
    h = mesh()
    with pytest.raises(FlowmeshError) as info:
        open_auto(h, resume="/ck")
    assert info.value.code == Code.BAD_REQUEST and "pipeline=N" in info.value.reason


@pytest.mark.parametrize("code", [Code.TOO_BIG, Code.PLAN_ERROR])
def test_a_stage_that_does_not_open_after_all_sends_the_job_to_one_worker(code: Code) -> None:
    """The plan counted a stage's bytes beforehand; a worker that finds more (a buffer the
    profile does not count, say) refuses it too_big, or the cut splits what the model shares:
    the job is opened by memory flow instead, and the client gets its job, not the refusal."""
    h = mesh()
    job = asked(open_auto(h))
    out = h.backend(b"part", p.PlanReply(id=job.id, plan=pipeline_plan(2)))
    opens = {a: m for _, a, m in out if isinstance(m, p.PipeOpen)}
    refusal = p.Error(id=opens[b"w-mid"].id, code=str(code), reason="stage 1 cannot open")
    out = h.backend(b"w-mid", refusal)
    # Stage 0 is closed on its worker, and the job opened on the most free one as memory flow.
    assert [(a, type(m)) for _, a, m in out] == [(b"w-big", p.TrainClose), (b"w-big", p.TrainOpen)]
    fwd = out[1][2]
    info = opened_job("j", worker="w-big", footprint=4 * KIB)
    ((dest, client, opened),) = h.backend(b"w-big", p.JobOpened(id=fwd.id, job=info))
    assert (dest, client, opened.id, opened.job.pipeline) == (CLIENT, C, 1, [])
    # Stage 0's answer to the pipelined open, come late, is not taken for the new job (the
    # close sent before the memory-flow open ends that stage on its worker), nor closes it.
    assert h.backend(b"w-big", p.JobOpened(id=opens[b"w-big"].id, job=info)) == []
    (row,) = h.core.training.status(0.0)
    assert (row.state, row.worker, row.pipeline) == ("ready", "w-big", [])


def test_a_plan_the_workers_no_longer_allow_sends_the_job_to_one_worker() -> None:
    h = mesh()
    job = asked(open_auto(h))
    # Four stages, and three workers take pipelines (one went while it was planned, say).
    out = h.backend(b"part", p.PlanReply(id=job.id, plan=pipeline_plan(4)))
    ((dest, addr, fwd),) = out
    assert (dest, addr, type(fwd), fwd.pipeline) == (BACKEND, b"w-big", p.TrainOpen, 0)


def test_two_jobs_planned_at_once_do_not_both_take_the_same_free_bytes() -> None:
    """Both are planned on the same free bytes; the first opened counts its stages on their
    workers at once, so the second's plan no longer fits when it comes: memory flow."""
    h = mesh()
    first = asked(open_auto(h))
    msg = p.TrainOpen(id=2, job="k", spec={**SPEC, "name": "k"}, config=CONFIG, batch=4,
                      pipeline="auto")  # fmt: skip
    second = asked(h.client(C, msg))
    assert second.request.worker_bytes == first.request.worker_bytes  # nothing opened yet
    plan = pipeline_plan(2, stage_bytes=150 * KIB)
    out = h.backend(b"part", p.PlanReply(id=first.id, plan=plan))
    assert sorted(a for _, a, m in out if isinstance(m, p.PipeOpen)) == [b"w-big", b"w-mid"]
    assert h.core.training.committed() == {"w-big": 150 * KIB, "w-mid": 150 * KIB}
    ((_, addr, fwd),) = h.backend(b"part", p.PlanReply(id=second.id, plan=plan))
    assert (type(fwd), fwd.job, addr) == (p.TrainOpen, "k", b"w-big")  # 150 KiB free: the most


def tick(h: Harness, now: float) -> Out:
    h.now = now
    for peer in (b"part", b"w-small", b"w-big", b"w-mid"):  # alive all along
        h.backend(peer, p.Heartbeat())
    h.out()
    h.core.tick(now)
    return [o for o in h.out() if not isinstance(o[2], p.Heartbeat)]


def test_the_open_after_the_plan_keeps_the_clients_deadline() -> None:
    """The plan and the open share the client's timeout: a job is never opened past it (its
    client gave up), and a plan that never comes fails the open at it."""
    h = mesh()
    job = asked(open_auto(h, timeout_ms=10_000))
    h.now = 6.0
    out = h.backend(b"part", p.PlanReply(id=job.id, plan=pipeline_plan(1)))
    ((_, addr, fwd),) = out
    assert type(fwd) is p.TrainOpen
    # The worker has not answered by the client's deadline: the open fails there and then,
    # and the job it may still open is closed on its worker.
    out = tick(h, 10.5)
    assert [(type(m), a) for _, a, m in out] == [(p.TrainClose, addr), (p.Error, C)]
    assert out[1][2].code == Code.TIMEOUT

    h = mesh()
    asked(open_auto(h, timeout_ms=10_000))  # no partitioner answers
    out = tick(h, 10.5)
    ((_, client, err),) = [o for o in out if o[0] == CLIENT]
    assert (client, err.code) == (C, Code.TIMEOUT) and "not placed within" in err.reason
    assert not [m for _, _, m in out if isinstance(m, p.TrainOpen)]
    assert h.core.training.jobs == {}
