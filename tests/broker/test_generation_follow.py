"""A language model of one stage in the broker's generation room, in process: each iteration is
followed by the next one, sent at once to the same worker (`GenStep.follows`), so that no round
trip to the broker comes between two tokens. Every message out asserted exactly: the Runs and
their steps, the chunks and answers, when KV is freed or parked, and what happens when the
iteration in flight, or its follower, fails or answers out of order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy
import pytest

from broker.core import BACKEND, CLIENT
from broker.lm_files import LmFiles, read_lm_files
from flowmesh import protocol as p
from flowmesh.errors import Code
from tests.support.broker import CLIENT_A, CLIENT_B, MIB, Harness, kinds, only, plan_of
from tests.support.generation import Gen, Out, ids_of, out_of, steps, tokens
from tests.support.lm import tiny_lm_dir


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_lm_dir(tmp_path_factory.mktemp("follow") / "tiny", layers=1, hidden=8)


@pytest.fixture(scope="module")
def files(lm_dir: Path) -> LmFiles:
    return read_lm_files(str(lm_dir))


class OneStage(Gen):
    """`Gen`'s broker with "lm" deployed in one stage, on worker w0."""

    def __init__(self, hf: Path, files: LmFiles, *, max_seqs: int = 4, **cfg: Any) -> None:
        self.h = Harness(**cfg)
        self.hf = str(hf)
        self.told: list[tuple[bytes, p.Message]] = []
        self.calls: list[tuple[bytes, int]] = []
        self.h.partitioner()
        self.w0 = self.h.worker("w0")
        spec = {"name": "lm", "hf": self.hf, "stages": 1, "replicas": 1, "max_seqs": max_seqs}
        ((_, part, job),) = self.h.client(CLIENT_A, p.Deploy(id=1, spec=spec))
        out = self.h.backend(part, p.PlanReply(id=job.id, plan=plan_of([MIB])))
        for _, addr, m in out:
            self.h.backend(
                addr, p.StageReady(id=m.id, model="lm", stage=m.stage, nbytes=MIB, seconds=0.1)
            )
        assert self.read(files) == []

    def started(self, out: Out) -> tuple[p.Run, p.Run]:
        """The first iteration (the stage loaded, confirmed) and the one that follows it."""
        assert kinds(out) == [(self.w0, "load"), (self.w0, "run"), (self.w0, "run")]
        (load,) = only(out, p.Load)
        done = p.Loaded(id=load.id, model="lm", stage=0, nbytes=MIB, seconds=0.1)
        assert self.h.backend(self.w0, done) == []
        first, second = only(out, p.Run)
        return first, second

    def answer(self, run: p.Run, new: list[int]) -> Out:
        msg = p.RunResult(id=run.id, model="lm", stage=0, tensors=[{"tokens": tokens(new)}])
        return self.keep(self.h.backend(self.w0, msg))

    def fail(self, run: p.Run, code: Code, reason: str = "refused") -> Out:
        return self.keep(self.h.backend(self.w0, p.Error(id=run.id, code=str(code), reason=reason)))


def runs(out: Out) -> list[p.Run]:
    """The Runs in `out`, every one of them to w0."""
    assert {a for _, a, m in out if isinstance(m, p.Run)} <= {b"w0"}
    return only(out, p.Run)


def follows(run: p.Run) -> int:
    assert run.gen is not None
    return run.gen.follows


def freed0(*seqs: int, park: bool = False) -> tuple[str, bytes, p.Message]:
    return (BACKEND, b"w0", p.FreeSeqs(model="lm", stage=0, seqs=list(seqs), park=park))


def chunk(rid: int, ids: list[int], finish: str | None = None) -> tuple[str, bytes, p.Message]:
    return (CLIENT, CLIENT_A, p.GenChunk(id=rid, index=0, ids=ids, finish=finish))


def test_each_iteration_is_followed_by_the_next_sent_at_once(lm_dir: Path, files: LmFiles) -> None:
    g = OneStage(lm_dir, files)
    first, second = g.started(g.generate(1, [[1, 5, 6]], max_tokens=4, stream=True))
    ((a, *_),) = steps(first)
    assert (steps(first), follows(first)) == ([(a, 0, 3, 0)], 0)
    # The next token's iteration: one token at position 3, the second draw; its ids are zeros,
    # the worker takes the token the first one draws.
    assert (steps(second), follows(second), ids_of(second)) == ([(a, 3, 1, 1)], first.id, [0])
    out = g.answer(first, [10])
    (third,) = runs(out)
    assert out == [chunk(1, [10]), (BACKEND, g.w0, third)]
    assert (steps(third), follows(third)) == ([(a, 4, 1, 2)], second.id)
    out = g.answer(second, [11])
    (fourth,) = runs(out)
    assert out == [chunk(1, [11]), (BACKEND, g.w0, fourth)]
    assert (steps(fourth), follows(fourth)) == ([(a, 5, 1, 3)], third.id)
    # The fourth draws the last token (max_tokens 4): nothing follows it.
    assert g.answer(third, [12]) == [chunk(1, [12])]
    out = g.answer(fourth, [13])
    assert out[:2] == [chunk(1, [13], "length"), freed0(a)]
    assert [m.outputs for m in only(out, p.Generated)] == [[out_of([10, 11, 12, 13], "length", 3)]]
    assert g.figures() == (0, 0, 4, 4)
    assert g.core.generation.by_model["lm"].follows == 3
    g.answered_once()


def test_no_iteration_follows_with_overlap_off(lm_dir: Path, files: LmFiles) -> None:
    g = OneStage(lm_dir, files, gen_overlap=False)
    out = g.generate(1, [[1, 5]], max_tokens=3)
    assert kinds(out) == [(g.w0, "load"), (g.w0, "run")]
    g.h.loaded(g.w0, out, MIB)
    (run,) = runs(out)
    (nxt,) = runs(g.answer(run, [10]))
    assert follows(nxt) == 0 and ids_of(nxt) == [10]


def test_a_stop_token_drawn_in_flight_frees_the_sequence_once_its_follower_is_back(
    lm_dir: Path, files: LmFiles
) -> None:
    g = OneStage(lm_dir, files)
    first, second = g.started(g.generate(1, [[1, 5]], max_tokens=8, stop_ids=[99], stream=True))
    ((a, *_),) = steps(first)
    # 99 stops it: answered at once, but `second` still holds its KV on the worker.
    out = g.answer(first, [99])
    assert out[0] == chunk(1, [99], "stop")
    assert [m.outputs for m in only(out, p.Generated)] == [[out_of([99], "stop", 2)]]
    assert not [m for _, _, m in out if isinstance(m, p.FreeSeqs | p.Run)]
    # The follower's token is never taken; now the KV goes, and nothing more runs.
    assert g.answer(second, [7]) == [freed0(a)]
    assert g.figures() == (0, 0, 1, 2)
    g.answered_once()


def test_a_sequence_waiting_to_join_stops_the_following(lm_dir: Path, files: LmFiles) -> None:
    g = OneStage(lm_dir, files)
    first, second = g.started(g.generate(1, [[1, 5]], max_tokens=8))
    ((a, *_),) = steps(first)
    assert g.generate(2, [[1, 6, 7]], max_tokens=8, addr=CLIENT_B) == []  # the group is busy
    # b waits with room for it: nothing follows `second`, so that b joins the next iteration.
    assert g.answer(first, [10]) == []
    out = g.answer(second, [11])
    regular, after = runs(out)
    b = steps(regular)[1][0]
    assert (steps(regular), follows(regular), ids_of(regular)) == (
        [(a, 3, 1, 2), (b, 0, 3, 0)],
        0,
        [11, 1, 6, 7],
    )
    assert (steps(after), follows(after)) == ([(a, 4, 1, 3), (b, 3, 1, 1)], regular.id)


def test_a_decode_that_fails_with_its_follower_in_flight_is_dealt_with_once_that_is_back(
    lm_dir: Path, files: LmFiles
) -> None:
    g = OneStage(lm_dir, files)
    first, second = g.started(g.generate(1, [[1, 5]], max_tokens=8))
    ((a, *_),) = steps(first)
    (third,) = runs(g.answer(first, [10]))
    # `second` (a decode) finds its stage evicted: nothing is parked or sent while `third`,
    # which follows it, is still queued on the worker ...
    assert g.fail(second, Code.NOT_RESIDENT, "evicted") == []
    # ... which fails in turn (it had nothing to follow). Now a is preempted, parked, and runs
    # again (through a Load) from its parked KV once the worker says it kept it.
    out = g.fail(third, Code.NOT_RESIDENT, f"iteration {second.id} failed")
    assert out[0] == freed0(a, park=True) and kinds(out)[1:] == [(g.w0, "load")]
    row = g.core.status(g.h.now).models[0]
    assert (row.preemptions, row.errors) == (1, 0)
    answer = p.SeqsParked(model="lm", stage=0, parked=[a], dropped=[])
    resumed, follower = runs(g.keep(g.h.backend(g.w0, answer)))  # sent to the loading stage
    # From its parked KV: its last drawn token at position 2, then the next.
    assert steps(resumed) == [(a, 2, 1, 1)] and ids_of(resumed) == [10]
    assert (steps(follower), follows(follower)) == ([(a, 3, 1, 2)], resumed.id)


def test_a_follower_refused_before_the_iteration_it_follows_answered_is_dropped(
    lm_dir: Path, files: LmFiles
) -> None:
    g = OneStage(lm_dir, files)
    first, second = g.started(g.generate(1, [[1, 5]], max_tokens=8))
    ((a, *_),) = steps(first)
    # No room for the block `second` needs: its NO_SPACE comes first, and changes nothing.
    assert g.fail(second, Code.NO_SPACE, "no free KV blocks") == []
    # `first` answers: its token taken, the next iteration sent as without a follower (its
    # own follower with it).
    regular, after = runs(g.answer(first, [10]))
    assert (steps(regular), follows(regular), ids_of(regular)) == ([(a, 2, 1, 1)], 0, [10])
    assert follows(after) == regular.id
    assert g.core.status(g.h.now).models[0].errors == 0


def test_a_follower_answered_before_the_iteration_it_follows_is_not_taken(
    lm_dir: Path, files: LmFiles
) -> None:
    g = OneStage(lm_dir, files)
    first, second = g.started(g.generate(1, [[1, 5]], max_tokens=8, stream=True))
    ((a, *_),) = steps(first)
    assert g.answer(second, [11]) == []
    out = g.answer(first, [10])
    regular, _ = runs(out)
    assert out[0] == chunk(1, [10])
    # Its token is drawn again, over the same positions of the KV.
    assert (steps(regular), follows(regular), ids_of(regular)) == ([(a, 2, 1, 1)], 0, [10])


def test_a_failure_of_the_iteration_in_flight_fails_the_call_once_its_follower_is_back(
    lm_dir: Path, files: LmFiles
) -> None:
    g = OneStage(lm_dir, files)
    first, second = g.started(g.generate(1, [[1, 5]], max_tokens=8))
    ((a, *_),) = steps(first)
    assert g.fail(first, Code.MODEL_ERROR, "block 1 raised") == []
    out = g.fail(second, Code.NOT_RESIDENT, f"iteration {first.id} failed")
    assert out == [
        freed0(a),
        (CLIENT, CLIENT_A, p.Error(id=1, code=str(Code.MODEL_ERROR), reason="block 1 raised")),
    ]
    g.answered_once()


def test_the_worker_lost_under_two_iterations_fails_or_restarts_once(
    lm_dir: Path, files: LmFiles
) -> None:
    g = OneStage(lm_dir, files)
    first, second = g.started(g.generate(1, [[1, 5]], max_tokens=8))
    g.h.now += 100.0  # past the worker's liveness: both iterations go with it
    g.tick(g.h.now)
    finals = g.finals(1)
    assert [(type(m).__name__, getattr(m, "code", None)) for m in finals] == [
        ("Error", str(Code.WORKER_LOST))
    ]
    g.answered_once()
    # Late answers for either are for nobody (the lost worker is told to register first).
    for run in (first, second):
        assert kinds(g.answer(run, [10])) == [(g.w0, "disconnect")]
    assert len(g.finals(1)) == 1


def test_zeros_stand_for_the_followers_token_ids(lm_dir: Path, files: LmFiles) -> None:
    g = OneStage(lm_dir, files, max_seqs=4)
    first, second = g.started(g.generate(1, [[1, 5], [2, 3, 4], [7]], max_tokens=2))
    # Each of the three gets a follower step (max_tokens 2: its second and last token).
    assert [s[1:] for s in steps(second)] == [(2, 1, 1), (3, 1, 1), (1, 1, 1)]
    ref = second.tensors[0]["ids"]
    assert (ref.dtype, tuple(ref.shape)) == ("int64", (3,))
    assert numpy.frombuffer(bytes(ref.frame), dtype="<i8").tolist() == [0, 0, 0]
    # And nothing follows `second`: every sequence's last token is in it.
    assert g.answer(first, [10, 11, 12]) == []
