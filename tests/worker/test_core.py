"""WorkerCore in-process: exact actions and messages out for each event in, on a clock the
test passes, no sockets, no threads, no executors (the test plays the shell: it reads the work
the core asks for and feeds back what that work ended with)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch

from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.spec import ModelSpec
from flowmesh.steps import StepResult
from flowmesh.train_spec import TrainConfig
from gpu_worker.core import (
    AddStage,
    AllowPeer,
    CloseJob,
    FreeKV,
    LoadStage,
    OpenJob,
    PipeStep,
    PrepareStage,
    ReleasePeers,
    RunChunk,
    RunStage,
    Send,
    SendHop,
    SubmitStep,
    WorkerCore,
)
from gpu_worker.executor import LoadInfo, RunOutput
from tests.support.broker import opened_job, typed_plan

SPEC = ModelSpec(name="m", factory="flowmesh.examples:mlp", kwargs={"width": 4}, seed=0)


def refused(core: WorkerCore, msg: p.Message, now: float = 0.0) -> tuple[str, str]:
    """The (code, reason) `msg` is refused with (the shell answers them to the broker)."""
    with pytest.raises(FlowmeshError) as err:
        core.handle(msg, now)
    return str(err.value.code), err.value.reason


def sent(actions: list[Any]) -> list[p.Message]:
    assert all(isinstance(a, Send) for a in actions), actions
    return [a.msg for a in actions]


def output(*parts: dict[str, torch.Tensor], compute_s: float = 0.5, wait_s: float = 0.25) -> Any:
    rows = sum(int(next(iter(part.values())).shape[0]) for part in parts)
    return RunOutput(list(parts), compute_s, wait_s, rows)


# ------------------------------------------------------------------ runs


def test_a_run_is_cut_into_its_parts_and_answered_with_them() -> None:
    core = WorkerCore("w")
    a, b = torch.zeros(2, 4), torch.ones(1, 4)
    run = p.Run(id=7, model="m", stage=1, parts=[(10, 2), (11, 1)], tensors=[{"x": a}, {"x": b}])
    core.handle(run, 0.0)
    (work,) = core.drain()
    assert isinstance(work, RunStage) and work.msg is run
    assert len(work.parts) == 2 and work.parts[0]["x"] is a and work.parts[1]["x"] is b
    y0, y1 = torch.full((2, 3), 2.0), torch.full((1, 3), 3.0)
    core.finished(work, output({"": y0}, {"": y1}), 1.0)
    (answer,) = sent(core.drain())
    assert isinstance(answer, p.RunResult)
    assert (answer.id, answer.model, answer.stage) == (7, "m", 1)
    assert [list(part) for part in answer.tensors] == [[""], [""]]
    assert answer.tensors[0][""] is y0 and answer.tensors[1][""] is y1
    assert answer.info == p.RunInfo(compute_s=0.5, wait_s=0.25)
    # Answered from its compute lane already: nothing more goes out.
    core.handle(run, 2.0)
    (again,) = core.drain()
    answered = output({"": y0}, {"": y1})
    answered.answered = True
    core.finished(again, answered, 3.0)
    assert core.drain() == []


def test_a_failed_run_and_a_malformed_one_are_answered_with_code_and_reason() -> None:
    core = WorkerCore("w")
    run = p.Run(id=7, model="m", stage=0, parts=[(1, 1)], tensors=[{"x": torch.zeros(1)}])
    core.handle(run, 0.0)
    (work,) = core.drain()
    core.finished(work, FlowmeshError(Code.NOT_RESIDENT, "'m'/0 was evicted"), 1.0)
    assert sent(core.drain()) == [p.Error(id=7, code="not_resident", reason="'m'/0 was evicted")]
    core.handle(run, 2.0)
    (work,) = core.drain()
    core.finished(work, RuntimeError("boom"), 3.0)  # not ours: internal, with its text
    assert sent(core.drain()) == [p.Error(id=7, code="internal", reason="RuntimeError: boom")]
    bad = p.Run(id=8, model="m", stage=0, parts=[(1, 1), (2, 1)], tensors=[{"x": torch.zeros(1)}])
    assert refused(core, bad) == ("bad_request", "a run of 2 parts carries tensors for 1")
    bad = p.Run(
        id=8, model="m", stage=0, parts=[(1, 1), (2, 1)], tensors=[{"x": torch.zeros(1)}, {}]
    )
    assert refused(core, bad) == ("bad_request", "every part of a run needs its tensors")
    assert refused(core, p.Status(id=9)) == ("bad_request", "a worker does not take status")
    assert core.drain() == []


def test_a_load_is_asked_for_and_answered_and_its_id_goes_with_the_next_report() -> None:
    core = WorkerCore("w")
    bad = p.Load(id=3, model="m", stage=0, keep=[("m",)])  # type: ignore[list-item]
    assert refused(core, bad) == ("bad_request", "load keep: expected [model, stage], got ('m',)")
    load = p.Load(id=4, model="m", stage=0, keep=[("n", 1)])
    core.handle(load, 0.0)
    (work,) = core.drain()
    assert isinstance(work, LoadStage) and work.msg is load and work.keep == [("n", 1)]
    assert core.last_load == 4
    core.finished(work, LoadInfo(nbytes=1024, seconds=0.5), 1.0)
    assert sent(core.drain()) == [p.Loaded(id=4, model="m", stage=0, nbytes=1024, seconds=0.5)]
    core.handle(p.Load(id=5, model="m", stage=1), 2.0)
    (work,) = core.drain()
    core.finished(work, FlowmeshError(Code.NO_SPACE, "cannot place 'm'/1"), 3.0)
    assert sent(core.drain()) == [p.Error(id=5, code="no_space", reason="cannot place 'm'/1")]


def test_freed_sequences_go_unanswered_and_parked_ones_are_answered_which_were_kept() -> None:
    core = WorkerCore("w")
    core.handle(p.FreeSeqs(model="lm", stage=1, seqs=[3]), 0.0)
    (work,) = core.drain()
    assert isinstance(work, FreeKV) and not work.msg.park
    core.finished(work, 96, 0.5)
    assert core.drain() == []
    park = p.FreeSeqs(model="lm", stage=1, seqs=[4, 5], park=True)
    core.handle(park, 1.0)
    (work,) = core.drain()
    core.finished(work, ([4], [5]), 1.5)
    answer = p.SeqsParked(model="lm", stage=1, parked=[4], dropped=[5])
    assert sent(core.drain()) == [answer]
    # Parking failed: none of them is kept, and the broker hears so (it recomputes them).
    core.handle(park, 2.0)
    (work,) = core.drain()
    core.finished(work, RuntimeError("copy failed"), 2.5)
    assert sent(core.drain()) == [p.SeqsParked(model="lm", stage=1, parked=[], dropped=[4, 5])]


def test_a_stage_is_prepared_kept_with_its_digest_and_dropped_if_the_broker_forgot_it() -> None:
    core = WorkerCore("w")
    plan = typed_plan([4096])
    deploy = p.DeployStage(id=2, model="m", stage=0, spec=SPEC, plan=plan)
    core.handle(deploy, 10.0)
    (work,) = core.drain()
    assert isinstance(work, PrepareStage) and (work.epoch, work.started) == (0, 10.0)
    blocks, host = ["block"], SimpleNamespace(nbytes=4096)
    core.finished(work, (blocks, host), 12.5)
    add, ready = core.drain()
    assert add == AddStage(("m", 0), blocks, host)
    assert ready == Send(p.StageReady(id=2, model="m", stage=0, nbytes=4096, seconds=2.5))
    assert core.digests == {("m", 0): p.stage_digest(SPEC, plan, 0)}
    # Asked for by a broker that has registered us afresh since: dropped when ready.
    core.handle(p.DeployStage(id=3, model="m", stage=1, spec=SPEC, plan=plan), 13.0)
    (work,) = core.drain()
    core.registered_again()
    core.finished(work, (blocks, host), 14.0)
    assert core.drain() == []
    core.handle(p.DropStage(id=4, model="m", stage=0), 15.0)
    assert [type(a).__name__ for a in core.drain()] == ["DropStage"]
    assert core.digests == {}
    forbidden = msgspec.structs.replace(SPEC, factory="os:system")
    code, reason = refused(core, p.DeployStage(id=5, model="m", stage=0, spec=forbidden, plan=plan))
    assert code == "not_allowed" and reason.startswith("worker w refused factory 'os:system'")


# ------------------------------------------------------------------ training steps


def opened(core: WorkerCore, job: str = "j", open_id: int = 1) -> None:
    msg = p.TrainOpen(id=open_id, job=job, spec=SPEC, config=None, batch=4)
    core.handle(msg, 0.0)
    (work,) = core.drain()
    assert work == OpenJob(msg, core.epoch)
    info = opened_job(job, blocks=((0, 1),))
    core.finished(work, info, 1.0)
    assert sent(core.drain()) == [p.JobOpened(id=open_id, job=info)]


def received(msg: p.Message) -> Any:
    """`msg` as the broker's socket delivers it: its tensors are received frames."""
    return p.decode(p.encode(msg))


def step(core: WorkerCore, seq: int) -> SubmitStep:
    tensors = {"inputs": torch.zeros(2, 4), "targets": torch.zeros(2)}
    core.handle(received(p.TrainStep(id=100 + seq, job="j", seq=seq, tensors=tensors)), 0.0)
    (work,) = core.drain()
    assert isinstance(work, SubmitStep) and work.msg.seq == seq
    return work


def test_steps_run_in_seq_order_with_gaps_and_a_seq_taken_is_never_run_twice() -> None:
    core = WorkerCore("w", train_bytes=1 << 20)
    x = {"inputs": torch.zeros(2, 4), "targets": torch.zeros(2)}
    assert refused(core, p.TrainStep(id=1, job="j", seq=1, tensors=x)) == (
        "model_not_found",
        "no training job 'j' here",
    )
    opened(core)
    s1, s3 = step(core, 1), step(core, 3)  # a gap: seq 2 was never sent, nothing waits for it
    for seq in (3, 2, 1):  # again, below the last, long ago
        assert refused(core, p.TrainStep(id=9, job="j", seq=seq, tensors=x)) == (
            "bad_request",
            f"step seq {seq} of 'j' was already taken (last 3); not run twice",
        )
    ledger = core.jobs["j"]
    assert (ledger.last, ledger.running) == (3, {1, 3})
    # Answers in the order the steps finish; each kept for a broker that restarts (inventory).
    core.finished(s3, StepResult(0.5, 2, {"tasks": 4.0}), 2.0)
    core.finished(s1, FlowmeshError(Code.MODEL_ERROR, "block 0 raised"), 3.0)
    assert sent(core.drain()) == [
        p.TrainStepResult(id=103, job="j", seq=3, loss=0.5, step=2, metrics={"tasks": 4.0}),
        p.Error(id=101, code="model_error", reason="block 0 raised"),
    ]
    assert ledger.running == set()
    assert list(ledger.answers.values()) == [
        p.StepOk(seq=3, loss=0.5, step=2, metrics={"tasks": 4.0}),
        p.StepFailed(seq=1, code="model_error", reason="block 0 raised"),
    ]
    assert ledger.answer(1) == p.StepFailed(seq=1, code="model_error", reason="block 0 raised")
    no_targets = received(p.TrainStep(id=9, job="j", seq=4, tensors={"inputs": x["inputs"]}))
    assert refused(core, no_targets) == ("bad_request", "a training step needs tensors ['targets']")
    assert ledger.last == 4  # taken all the same: a seq is never run twice, even a refused one


def test_only_the_latest_answers_are_kept_and_a_closed_job_s_late_step_stays_its_own() -> None:
    core = WorkerCore("w", train_bytes=1 << 20, keep_results=2)
    opened(core)
    works = [step(core, seq) for seq in (1, 2, 3)]
    for w in works:
        core.finished(w, StepResult(float(w.msg.seq), w.msg.seq), 1.0)
    assert [m.seq for m in sent(core.drain())] == [1, 2, 3]
    assert [a.seq for a in core.jobs["j"].answers.values()] == [2, 3]
    late = step(core, 4)
    core.handle(p.TrainClose(id=50, job="j"), 2.0)
    (close,) = core.drain()
    assert close == CloseJob(p.TrainClose(id=50, job="j"))
    core.finished(close, None, 3.0)
    assert sent(core.drain()) == [p.TrainClosed(id=50, job="j")]
    assert core.jobs == {}
    opened(core, open_id=2)  # the same name again: a job of its own
    core.finished(late, StepResult(4.0, 4), 4.0)
    assert sent(core.drain()) == [p.TrainStepResult(id=104, job="j", seq=4, loss=4.0, step=4)]
    assert (core.jobs["j"].last, list(core.jobs["j"].answers)) == (0, [])


def test_a_pipelined_job_s_steps_are_forgotten_when_they_fail_early_or_their_job_closes() -> None:
    """Steps handed to a pipelined job's runner are counted until it answers them; one that
    fails before the runner took it, or is still there when the job closes, is never answered
    by the runner and must not stay counted for the worker's life."""
    core = WorkerCore("w", train_bytes=1 << 20)
    peers = [p.PipePeer(worker=f"w{i}", endpoint=f"inproc://w{i}") for i in range(2)]
    config = TrainConfig(optimizer={"name": "sgd", "lr": 0.1})
    msg = p.PipeOpen(id=1, job="j", spec=SPEC, config=config, batch=4, stage=0, ticket=1,
                     peers=peers)  # fmt: skip
    core.handle(msg, 0.0)
    (work,) = core.drain()
    core.finished(work, opened_job("j", blocks=((0, 1),)), 1.0)
    core.drain()
    tensors = {"inputs": torch.zeros(2, 4), "targets": torch.zeros(2)}
    works = []
    for seq in (1, 2):
        core.handle(received(p.TrainStep(id=100 + seq, job="j", seq=seq, tensors=tensors)), 0.0)
        (w,) = core.drain()
        assert isinstance(w, PipeStep)
        works.append(w)
    assert set(core.pipe_steps) == {101, 102}
    core.finished(works[0], FlowmeshError(Code.MODEL_NOT_FOUND, "training job 'j' was closed"), 2)
    assert sent(core.drain()) == [
        p.Error(id=101, code="model_not_found", reason="training job 'j' was closed")
    ]
    assert set(core.pipe_steps) == {102} and core.jobs["j"].running == {2}
    core.handle(p.TrainClose(id=50, job="j"), 3.0)
    (close,) = core.drain()
    core.finished(close, None, 4.0)
    assert core.drain() == [ReleasePeers("j#1"), Send(p.TrainClosed(id=50, job="j"))]
    assert core.pipe_steps == {} and core.jobs == {} and core.pipes == {}


def test_a_pipelined_job_s_peer_keys_are_held_by_the_open_that_named_them() -> None:
    """The stages' keys of a pipelined job are allowed on the peer socket on its open's account
    from that open, and released when what it opened closes, when it fails to open, or when it
    opened for a broker that forgot it. Each open of a name is a holder of its own: a second
    open of a name open here fails without releasing the first one's, and the close of an
    open that comes before a new open of the same name (an open retried after a timeout)
    releases only its own."""
    config = TrainConfig(optimizer={"name": "sgd", "lr": 0.1})
    peers = [p.PipePeer(worker=f"w{i}", endpoint=f"inproc://w{i}", key=f"k{i}") for i in range(2)]

    def pipe_open(core: WorkerCore, job: str, id: int) -> Any:
        core.handle(p.PipeOpen(id=id, job=job, spec=SPEC, config=config, batch=4, stage=1,
                               ticket=1, peers=peers), 0.0)  # fmt: skip
        *allowed, work = core.drain()
        assert allowed == [AllowPeer("k0", f"{job}#{id}"), AllowPeer("k1", f"{job}#{id}")]
        return work

    core = WorkerCore("w", train_bytes=1 << 20)
    core.finished(pipe_open(core, "j", 1), opened_job("j", blocks=((0, 1),)), 1.0)
    assert [type(a) for a in core.drain()] == [Send]
    again = pipe_open(core, "j", 2)
    core.finished(again, FlowmeshError(Code.BAD_REQUEST, "job 'j' is open here"), 1.5)
    refusal = p.Error(id=2, code="bad_request", reason="job 'j' is open here")
    assert core.drain() == [ReleasePeers("j#2"), Send(refusal)]
    core.handle(p.TrainClose(id=50, job="j"), 2.0)
    (close,) = core.drain()
    retried = pipe_open(core, "j", 3)  # the broker's retry, behind the close
    core.finished(close, None, 3.0)
    assert core.drain() == [ReleasePeers("j#1"), Send(p.TrainClosed(id=50, job="j"))]
    core.finished(retried, opened_job("j", blocks=((0, 1),)), 3.5)
    assert [type(a) for a in core.drain()] == [Send]  # "j#3" holds its keys
    core.finished(pipe_open(core, "bad", 4), FlowmeshError(Code.BAD_REQUEST, "no"), 4.0)
    assert core.drain()[0] == ReleasePeers("bad#4")
    late = pipe_open(core, "late", 5)
    core.registered_again()
    core.finished(late, opened_job("late", blocks=((0, 1),)), 5.0)
    assert core.drain() == [
        ReleasePeers("late#5"),
        CloseJob(p.TrainClose(id=0, job="late"), answer=False),
    ]


def test_a_job_opened_for_a_broker_that_forgot_it_is_closed_unanswered() -> None:
    core = WorkerCore("w", train_bytes=1 << 20)
    msg = p.TrainOpen(id=1, job="j", spec=SPEC, config=None, batch=4)
    core.handle(msg, 0.0)
    (work,) = core.drain()
    core.registered_again()
    core.finished(work, {"name": "j", "sub_models": []}, 1.0)
    (close,) = core.drain()
    assert close == CloseJob(p.TrainClose(id=0, job="j"), answer=False)
    core.finished(close, None, 2.0)
    assert core.drain() == [] and core.jobs == {}
    no_training = WorkerCore("w")
    assert refused(no_training, p.TrainEval(id=3, job="j")) == (
        "unavailable",
        "worker w takes no training jobs (--train-bytes 0)",
    )


# ------------------------------------------------------------------ direct runs


def test_stage_zero_cuts_a_direct_run_into_micro_batches_and_passes_each_on() -> None:
    core = WorkerCore("w")
    a, b = torch.arange(8.0).reshape(2, 4), torch.arange(8.0, 20.0).reshape(3, 4)
    run = p.Run(
        id=5,
        model="m",
        stage=0,
        parts=[(1, 2), (2, 3)],
        tensors=[{"x": a}, {"x": b}],
        ticket=77,
        next_peer="tcp://next:1",
        chunks=2,
    )
    core.handle(run, 0.0)
    first, second = core.drain()
    assert isinstance(first, RunChunk) and isinstance(second, RunChunk)
    assert (first.chunk, second.chunk) == (0, 1)
    both = torch.cat([a, b])
    # bit-exact: tensor_split moves the inputs' rows, computes nothing
    assert torch.equal(first.tensors["x"], both[:3]) and torch.equal(second.tensors["x"], both[3:])
    y = torch.ones(3, 2)
    core.finished(second, output({"y": y[:2]}), 1.0)
    core.finished(first, output({"y": y}), 2.0)
    hop1, hop0 = core.drain()
    assert isinstance(hop1, SendHop) and isinstance(hop0, SendHop) and hop0.run is hop1.run
    assert (hop1.hop.id, hop1.hop.ticket, hop1.hop.stage, hop1.hop.chunk) == (5, 77, 1, 1)
    assert hop0.hop.chunk == 0 and hop0.hop.tensors["y"] is y  # contiguous already: the same
    core.finished(hop1, None, 3.0)
    assert core.direct.runs.keys() == {5}  # one micro-batch still on its way
    core.finished(hop0, None, 4.0)
    assert core.direct.runs == {} and core.drain() == []  # only the last stage answers
    too_many = p.Run(id=6, model="m", stage=0, parts=[(1, 2)], tensors=[{"x": a}], ticket=1,
                     chunks=3)  # fmt: skip
    assert refused(core, too_many) == ("bad_request", "run 6: 3 chunks of 2 rows")


def last_stage_run(run_id: int = 9) -> p.Run:
    return p.Run(
        id=run_id, model="m", stage=1, parts=[(1, 2), (2, 3)], ticket=77, from_peer=True, chunks=2
    )


def hop(chunk: int, t: torch.Tensor, run_id: int = 9) -> p.Hop:
    return p.Hop(id=run_id, ticket=77, model="m", stage=1, chunk=chunk, tensors={"h": t})


def test_the_last_stage_merges_the_micro_batches_in_order_and_answers_the_whole_batch() -> None:
    core = WorkerCore("w")
    h0, h1 = torch.zeros(3, 4), torch.ones(2, 4)
    core.on_peer(hop(1, h1), "", 0.0)  # before its Run: kept
    assert core.drain() == []
    core.handle(last_stage_run(), 1.0)
    (c1,) = core.drain()
    assert isinstance(c1, RunChunk) and c1.chunk == 1 and c1.tensors["h"] is h1
    core.on_peer(hop(0, h0), "", 2.0)
    (c0,) = core.drain()
    assert c0.chunk == 0 and c0.tensors["h"] is h0
    out = torch.arange(10.0).reshape(5, 2)
    core.finished(c1, output({"y": out[3:]}, compute_s=1.0, wait_s=0.5), 3.0)  # out of order
    assert core.drain() == []
    core.finished(c0, output({"y": out[:3]}, compute_s=2.0, wait_s=0.25), 4.0)
    (answer,) = sent(core.drain())
    assert isinstance(answer, p.RunResult) and (answer.id, answer.stage) == (9, 1)
    assert answer.info == p.RunInfo(compute_s=3.0, wait_s=0.75)
    assert [list(part) for part in answer.tensors] == [["y"], ["y"]]
    # bit-exact: cat then split by the parts' rows moves the outputs' rows, computes nothing
    assert torch.equal(answer.tensors[0]["y"], out[:2])
    assert torch.equal(answer.tensors[1]["y"], out[2:])  # bit-exact: as above
    assert core.direct.runs == {}


def test_a_direct_run_fails_once_and_its_later_work_and_hops_are_dropped() -> None:
    core = WorkerCore("w")
    core.handle(last_stage_run(), 0.0)
    assert core.drain() == []
    core.on_peer(hop(0, torch.zeros(3, 4)), "", 1.0)
    core.on_peer(hop(1, torch.zeros(2, 4)), "", 1.0)
    c0, c1 = core.drain()
    core.finished(c0, FlowmeshError(Code.MODEL_ERROR, "block 1 raised"), 2.0)
    assert sent(core.drain()) == [p.Error(id=9, code="model_error", reason="block 1 raised")]
    core.finished(c1, FlowmeshError(Code.MODEL_ERROR, "block 1 raised"), 3.0)  # one answer
    assert core.drain() == []
    core.on_peer(hop(1, torch.zeros(2, 4)), "", 4.0)  # given up: dropped quietly
    assert core.drain() == [] and core.direct.counters["hops_dropped"] == 1
    assert refused_peer(core, p.Status(id=1)) == (
        "bad_request",
        "a worker's peer socket takes no status",
    )


def test_a_direct_run_whose_outputs_do_not_split_by_its_rows_is_answered_model_error() -> None:
    # A stage that reduces over the batch (one row per micro-batch): the merged outputs cannot
    # be cut into the parts' rows. The run, already let go as finished, used to go unanswered.
    core = WorkerCore("w")
    core.handle(last_stage_run(), 0.0)
    core.on_peer(hop(0, torch.zeros(3, 4)), "", 1.0)
    core.on_peer(hop(1, torch.zeros(2, 4)), "", 1.0)
    c0, c1 = core.drain()
    core.finished(c0, output({"y": torch.zeros(1, 2)}), 2.0)
    core.finished(c1, output({"y": torch.zeros(1, 2)}), 3.0)
    assert sent(core.drain()) == [
        p.Error(
            id=9,
            code="model_error",
            reason="output 'y' has shape (2, 2), not batch-first over 5 rows; deploy this model "
            "with max_batch_size=1",
        )
    ]
    assert core.direct.runs == {}


def test_a_broker_that_forgot_this_worker_takes_its_direct_runs_with_it() -> None:
    # A restarted broker neither waits for nor cancels the runs it announced before (their
    # outputs were held for good), and may number its runs from 1 again.
    core = WorkerCore("w")
    core.handle(last_stage_run(), 0.0)
    core.on_peer(hop(0, torch.zeros(3, 4)), "", 1.0)
    (c0,) = core.drain()
    core.finished(c0, output({"y": torch.zeros(3, 2)}), 2.0)
    assert core.direct.runs.keys() == {9}
    core.on_peer(hop(1, torch.zeros(2, 4)), "", 2.5)
    (c1,) = core.drain()  # the old run's last chunk, still computing
    core.registered_again()
    assert core.direct.runs == {}
    core.handle(last_stage_run(), 3.0)  # the same id, from the new broker: taken
    assert core.direct.runs.keys() == {9} and core.drain() == []
    new = core.direct.runs[9]
    # The old run's chunk ends: it neither answers the new run's id with the old outputs nor
    # takes the new run with it; failing, it fails nothing of the new one either.
    core.finished(c1, output({"y": torch.zeros(2, 2)}), 4.0)
    assert core.drain() == [] and core.direct.runs == {9: new}
    core.finished(c1, FlowmeshError(Code.MODEL_ERROR, "old raised"), 5.0)
    assert core.drain() == [] and core.direct.runs == {9: new}


def refused_peer(core: WorkerCore, msg: p.Message) -> tuple[str, str]:
    with pytest.raises(FlowmeshError) as err:
        core.on_peer(msg, "", 0.0)
    return str(err.value.code), err.value.reason
