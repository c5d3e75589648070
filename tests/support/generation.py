"""The broker's generation room driven in process (tests/broker/test_generation*.py): `Gen`, a
broker with a two-stage language model on fake workers and a fake clock, and the helpers that
build and read its messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy
import pytest

from broker.core import BACKEND, CLIENT
from broker.lm_files import LmFiles
from flowmesh import protocol as p
from flowmesh.errors import FlowmeshError
from tests.support.broker import CLIENT_A, MIB, Harness, kinds, only, plan_of, ref

Out = list[tuple[str, bytes, p.Message]]
VOCAB = 320  # the tiny tokenizer's (tests.support.lm.build_tokenizer)


def tokens(values: list[int], dtype: str = "int64") -> p.TensorRef:
    """The last stage's answer: one new token per sequence."""
    arr = numpy.asarray(values, dtype=numpy.dtype(dtype).newbyteorder("<"))
    return p.TensorRef(dtype, (len(values),), arr.tobytes())


def ids_of(run: p.Run) -> list[int]:
    """The token ids stage 0 was sent (one part, `ids`, int64)."""
    ((name, t),) = (item for part in run.tensors for item in part.items())
    assert len(run.tensors) == 1 and name == "ids" and t.dtype == "int64"
    assert tuple(t.shape) == (t.shape[0],)
    return numpy.frombuffer(bytes(t.frame), dtype="<i8").tolist()


def steps(run: p.Run) -> list[tuple[int, int, int, int]]:
    """(seq, start, count, drawn) of each sequence of a generation Run."""
    assert run.gen is not None
    return [(s.seq, s.start, s.count, s.drawn) for s in run.gen.seqs]


class Gen:
    """A broker with language model "lm" deployed from `hf` in two stages (w0, w1), its files
    read (unless `files` is None); records every message to a client (the one-answer rule)."""

    def __init__(
        self,
        hf: Path,
        files: LmFiles | None,
        *,
        max_seqs: int = 4,
        max_context: int | None = None,
        replicas: int = 1,
        **cfg: Any,
    ) -> None:
        # One group per stage unless a test says otherwise (the default is one group).
        self.h = Harness(**{"gen_groups": 0, **cfg})
        self.hf = str(hf)
        self.told: list[tuple[bytes, p.Message]] = []
        self.calls: list[tuple[bytes, int]] = []  # the Generates the door took (or held)
        self.h.partitioner()
        workers = [self.h.worker(f"w{i}") for i in range(2 * replicas)]
        self.workers = workers
        self.w0, self.w1 = workers[:2]
        spec: dict[str, Any] = {"name": "lm", "hf": self.hf, "stages": 2, "replicas": replicas}
        spec["max_seqs"] = max_seqs
        if max_context is not None:
            spec["max_context"] = max_context
        ((_, part, job),) = self.h.client(CLIENT_A, p.Deploy(id=1, spec=spec))
        out = self.h.backend(part, p.PlanReply(id=job.id, plan=plan_of([MIB, MIB])))
        for _, addr, m in out:
            self.h.backend(
                addr, p.StageReady(id=m.id, model="lm", stage=m.stage, nbytes=MIB, seconds=0.1)
            )
        if files is not None:
            assert self.read(files) == []

    @property
    def core(self) -> Any:
        return self.h.core

    def keep(self, out: Out) -> Out:
        """`out` without heartbeats (a tick sends them), its client messages recorded."""
        out = [o for o in out if not isinstance(o[2], p.Heartbeat)]
        self.told += [(addr, m) for dest, addr, m in out if dest == CLIENT]
        return out

    def read(self, files: LmFiles) -> Out:
        self.core.files_read("lm", self.hf, files, self.h.now)
        return self.keep(self.h.out())

    def client(self, msg: p.Message, addr: bytes = CLIENT_A) -> Out:
        return self.keep(self.h.client(addr, msg))

    def generate(
        self,
        rid: int,
        prompts: list[list[int]],
        *,
        addr: bytes = CLIENT_A,
        stream: bool = False,
        timeout_ms: int | None = None,
        **sampling: Any,
    ) -> Out:
        sampling.setdefault("ignore_eos", True)
        msg = p.Generate(
            id=rid,
            model="lm",
            prompts=prompts,
            sampling=p.Sampling(**sampling),
            stream=stream,
            timeout_ms=timeout_ms,
        )
        out = self.client(msg, addr)
        self.calls.append((addr, rid))
        return out

    def answered_once(self) -> None:
        """Every Generate taken got exactly one final answer, and none is left open."""
        assert [len(self.finals(rid, addr)) for addr, rid in self.calls] == [1] * len(self.calls)
        assert self.core.generation.calls == {} and self.core.ctx.outstanding == {}

    def first(self, out: Out, on: tuple[bytes, bytes] | None = None) -> p.Run:
        """The replica's first iteration: both stages loaded (confirmed), stage 0's Run (`on`:
        the replica's workers, by default w0 and w1)."""
        w0, w1 = on or (self.w0, self.w1)
        assert kinds(out) == [(w0, "load"), (w1, "load"), (w0, "run")]
        for load in only(out, p.Load):
            w = w0 if load.stage == 0 else w1
            done = p.Loaded(id=load.id, model="lm", stage=load.stage, nbytes=MIB, seconds=0.1)
            assert self.h.backend(w, done) == []
        return run_of(out, w0)

    def firsts(self, out: Out, n: int = 2) -> list[p.Run]:
        """The replica's first iterations, one per group: both stages loaded (confirmed), `n`
        Runs to stage 0 (w0), in group order."""
        assert kinds(out) == [(self.w0, "load"), (self.w1, "load")] + [(self.w0, "run")] * n
        for load in only(out, p.Load):
            w = self.w0 if load.stage == 0 else self.w1
            done = p.Loaded(id=load.id, model="lm", stage=load.stage, nbytes=MIB, seconds=0.1)
            assert self.h.backend(w, done) == []
        return only(out, p.Run)

    def stage0(self, run: p.Run, on: tuple[bytes, bytes] | None = None) -> p.Run:
        """Stage 0 answers `run` (the hidden states of its tokens): stage 1's Run, the same
        iteration."""
        w0, w1 = on or (self.w0, self.w1)
        assert (run.stage, run.gen) != (0, None)
        hidden = [{"h": ref(len(ids_of(run)), 8)}]
        out = self.keep(
            self.h.backend(w0, p.RunResult(id=run.id, model="lm", stage=0, tensors=hidden))
        )
        nxt = run_of(out, w1)
        assert (nxt.stage, nxt.gen, nxt.parts[0][1], [set(part) for part in nxt.tensors]) == (
            1,
            run.gen,
            len(ids_of(run)),
            [{"h"}],
        )
        return nxt

    def last(
        self, run: p.Run, tensors: dict[str, p.TensorRef], on: tuple[bytes, bytes] | None = None
    ) -> Out:
        """Stage 1 answers `run` with `tensors`."""
        msg = p.RunResult(id=run.id, model="lm", stage=1, tensors=tensors)
        return self.keep(self.h.backend((on or (self.w0, self.w1))[1], msg))

    def step(self, run: p.Run, new: list[int], on: tuple[bytes, bytes] | None = None) -> Out:
        """One whole iteration: stage 0 then stage 1, which draws `new` (one per sequence)."""
        return self.last(self.stage0(run, on), [{"tokens": tokens(new)}], on)

    def tick(self, now: float) -> Out:
        self.h.now = now
        self.core.tick(now)
        return self.keep(self.h.out())

    def finals(self, rid: int, addr: bytes = CLIENT_A) -> list[p.Message]:
        """Every final answer (`Generated` or `Error`) `addr` got for call `rid`."""
        return [
            m
            for a, m in self.told
            if a == addr and isinstance(m, p.Generated | p.Error) and m.id == rid
        ]

    def figures(self) -> tuple[int, int, int, int]:
        (row,) = [m for m in self.core.status(self.h.now).models if m.name == "lm"]
        return row.running_seqs, row.waiting_seqs, row.tokens_generated, row.gen_iterations


def run_of(out: Out, worker: bytes) -> p.Run:
    (run,) = [m for _, a, m in out if isinstance(m, p.Run)]
    assert [a for _, a, m in out if isinstance(m, p.Run)] == [worker]
    return run


def freed(*seqs: int) -> list[tuple[str, bytes, p.Message]]:
    """The FreeSeqs every stage's worker gets for `seqs`."""
    return [
        (BACKEND, b"w0", p.FreeSeqs(model="lm", stage=0, seqs=list(seqs))),
        (BACKEND, b"w1", p.FreeSeqs(model="lm", stage=1, seqs=list(seqs))),
    ]


def parked(*seqs: int) -> list[tuple[str, bytes, p.Message]]:
    """The FreeSeqs with park every stage's worker gets for preempted `seqs`."""
    return [
        (BACKEND, b"w0", p.FreeSeqs(model="lm", stage=0, seqs=list(seqs), park=True)),
        (BACKEND, b"w1", p.FreeSeqs(model="lm", stage=1, seqs=list(seqs), park=True)),
    ]


def out_of(
    new: list[int], finish: str, prompt: int, ttft_ms: float = 0.0, gaps: list[float] | None = None
) -> p.GenOutput:
    """A sequence's GenOutput (`gaps`: ms from each token to the next; all 0 by default)."""
    token_ms = [0.0] * (len(new) - 1) if gaps is None else gaps
    return p.GenOutput(
        ids=new, finish=finish, prompt_tokens=prompt, ttft_ms=ttft_ms, token_ms=token_ms
    )


def refused(g: Gen, msg: p.Message) -> FlowmeshError:
    with pytest.raises(FlowmeshError) as info:
        g.client(msg)
    return info.value
