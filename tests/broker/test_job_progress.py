"""A training job's progress as the broker reports it (issue 23 §4): rows trained per second,
what each step copied between the host tier and the device and how long it waited for memory,
and each sub-model's activation policy, in the job's row, in `flowmesh jobs`' table and in the
broker's metrics. Through BrokerCore on a fake clock, no sockets: exact figures."""

from __future__ import annotations

import msgpack
import msgspec
import pytest

from broker.core import BACKEND, CLIENT
from client_sdk.views import format_jobs
from flowmesh import metrics
from flowmesh import protocol as p
from flowmesh.errors import Code
from flowmesh.reports import JobRow
from flowmesh.train_spec import TrainConfig
from tests.support.broker import Harness, ref

KIB = 1 << 10
C = b"client"
SPEC = {"name": "j", "factory": "flowmesh.examples:mlp", "kwargs": {"width": 8}, "seed": 1}
CONFIG = {"optimizer": {"name": "adamw", "lr": 0.01}}
SUBS = [
    p.SubModelRow(blocks=[0, 2], host_bytes=3 * KIB, task_bytes=5 * KIB, activations="recompute"),
    p.SubModelRow(blocks=[2, 3], host_bytes=KIB, task_bytes=2 * KIB, activations="none"),
]


def trainer(h: Harness) -> bytes:
    h.backend(
        b"w",
        p.Register(
            id=1,
            role="worker",
            name="w",
            pid=1,
            device="cpu",
            kind="cpu",
            budget_bytes=KIB,
            info=p.PeerInfo(train_bytes=100 * KIB),
        ),
    )
    h.backend(b"w", p.Heartbeat())
    return b"w"


def opened(h: Harness) -> bytes:
    w = trainer(h)
    (out,) = h.client(C, p.TrainOpen(id=1, job="j", spec=SPEC, config=CONFIG, batch=4))
    job = p.OpenedJob(
        name="j",
        worker="w",
        step=0,
        sub_models=SUBS,
        footprint=4 * KIB,
        host_bytes=4 * KIB,
        largest_task=5 * KIB,
        config=TrainConfig.from_dict(CONFIG),
    )
    ((_, _, answer),) = h.backend(w, p.JobOpened(id=out[2].id, job=job))
    assert isinstance(answer, p.TrainOpened)
    assert [m.activations for m in answer.job.sub_models] == ["recompute", "none"]
    return w


def send(h: Harness, seq: int, rows: int, ref_id: int, tokens: int = 0) -> p.TrainStep:
    """A step of `rows` rows: class targets, or next-token ids of `tokens` per row."""
    targets = ref(rows, tokens, dtype="int64") if tokens else ref(rows, dtype="int64")
    tensors = {"inputs": ref(rows, 8), "targets": targets}
    ((dest, _, fwd),) = h.client(C, p.TrainStep(id=ref_id, job="j", seq=seq, tensors=tensors))
    assert dest == BACKEND and isinstance(fwd, p.TrainStep)
    return fwd


def answer(fwd: p.TrainStep, step: int, bytes_in: int, bytes_out: int, wait: float) -> p.Message:
    return p.TrainStepResult(
        id=fwd.id,
        job="j",
        seq=fwd.seq,
        loss=0.5,
        step=step,
        bytes_in=bytes_in,
        bytes_out=bytes_out,
        memory_wait_s=wait,
    )


def row(h: Harness) -> JobRow:
    (only,) = h.core.status(h.now).jobs
    return only


def trained(h: Harness) -> bytes:
    """Three steps of 4, 2 and 4 rows, answered at t = 1.0, 1.5 and 2.5."""
    w = opened(h)
    sent = [send(h, 1, 4, 11), send(h, 2, 2, 12), send(h, 3, 4, 13)]
    figures = [(1000, 600, 0.25), (1200, 700, 0.0), (1100, 650, 0.125)]
    for i, (fwd, at, (b_in, b_out, wait)) in enumerate(
        zip(sent, (1.0, 1.5, 2.5), figures, strict=True)
    ):
        h.now = at
        ((dest, client, got),) = h.backend(w, answer(fwd, i + 1, b_in, b_out, wait))
        assert (dest, client) == (CLIENT, C) and isinstance(got, p.TrainStepResult)
        # The client's answer carries the worker's figures as they came.
        assert (got.bytes_in, got.bytes_out, got.memory_wait_s) == (b_in, b_out, wait)
    return w


def test_a_jobs_row_has_its_samples_per_second_copies_and_memory_waits() -> None:
    h = Harness()
    trained(h)
    j = row(h)
    # The rows after the first answer over the span since it: (2 + 4) / (2.5 - 1.0).
    assert (j.samples, j.samples_per_s, j.steps_per_s) == (10, 4.0, 1.333)
    assert (j.step_bytes_in, j.step_bytes_out, j.step_memory_wait_s) == (1100, 650, 0.125)
    assert (j.bytes_in, j.bytes_out, j.memory_wait_s) == (3300, 1950, 0.375)
    assert [m.activations for m in j.sub_models] == ["recompute", "none"]
    # The same row reaches a client whole (`flowmesh jobs`).
    ((_, _, reply),) = h.client(C, p.Jobs(id=5))
    assert isinstance(reply, p.JobsReply) and reply.jobs == [j]


def test_a_step_answered_late_counts_its_rows_and_a_failed_one_does_not() -> None:
    h = Harness(default_timeout_s=5.0)
    w = opened(h)
    late = send(h, 1, 4, 11)
    h.now = 6.0
    h.backend(w, p.Heartbeat())
    h.core.tick(h.now)  # its call expires: the client is told
    assert [m.code for _, _, m in h.out() if isinstance(m, p.Error)] == ["timeout"]
    assert h.backend(w, answer(late, 1, 10, 20, 1.5)) == []  # applied all the same
    failed = send(h, 2, 2, 12)
    ((_, _, err),) = h.backend(w, p.Error(id=failed.id, code="model_error", reason="boom"))
    assert isinstance(err, p.Error) and err.id == 12
    h.now = 7.0
    h.backend(w, answer(send(h, 3, 8, 13), 2, 30, 40, 0.5))
    j = row(h)
    assert (j.samples, j.samples_per_s, j.step, j.errors) == (12, 8.0, 2, 1)
    assert (j.bytes_in, j.bytes_out, j.memory_wait_s) == (40, 60, 2.0)
    assert not h.core.training.jobs["j"].rows  # nothing kept for steps that ended


def test_a_retried_step_replays_its_figures_and_counts_nothing_twice() -> None:
    h = Harness()
    w = opened(h)
    fwd = send(h, 1, 4, 11)
    h.now = 1.0
    h.backend(w, answer(fwd, 1, 1000, 600, 0.25))
    tensors = {"inputs": ref(4, 8), "targets": ref(4, dtype="int64")}
    ((_, _, again),) = h.client(C, p.TrainStep(id=21, job="j", seq=1, tensors=tensors))
    assert isinstance(again, p.TrainStepResult) and again.id == 21
    assert (again.bytes_in, again.bytes_out, again.memory_wait_s) == (1000, 600, 0.25)
    j = row(h)
    assert (j.samples, j.bytes_in, j.memory_wait_s) == (4, 1000, 0.25)


@pytest.mark.parametrize(
    ("field", "value"),
    [("bytes_in", -1), ("bytes_out", 1.5), ("memory_wait_s", -0.5), ("memory_wait_s", "soon")],
)
def test_a_step_answer_with_malformed_figures_is_refused_on_receipt(
    field: str, value: object
) -> None:
    good = p.encode(p.TrainStepResult(id=1, job="j", seq=1, loss=0.5, step=1))
    header = msgpack.unpackb(good[0])
    header[field] = value
    with pytest.raises(p.DecodeError) as info:
        p.decode([msgpack.packb(header), *good[1:]])
    assert info.value.code == Code.BAD_MESSAGE and f"$.{field}" in info.value.reason


def test_flowmesh_jobs_shows_the_progress_of_each_job() -> None:
    h = Harness()
    trained(h)
    lines = format_jobs([row(h)]).splitlines()
    cells = [c.strip() for c in lines[0].split("  ") if c.strip()]
    assert cells[5:11] == [
        "steps/s",
        "samples/s",
        "moved/step (in/out)",
        "mem wait/step",
        "sub-models (blocks:host/task bytes activations)",
        "dtype",
    ]
    line = [c.strip() for c in lines[2].split("  ") if c.strip()]
    assert line[:11] == [
        "j",
        "w",
        "ready",
        "3",
        "0.5",
        "1.33",
        "4.0",
        "1.1 KiB/650 B",
        "125.0 ms",
        "0-1:3.0 KiB/5.0 KiB recompute | 2-2:1.0 KiB/2.0 KiB none",
        "float32",
    ]
    # Mixed precision: what its forward computes in, from the job's configuration.
    config = msgspec.structs.replace(row(h).config, compute_dtype="bfloat16")
    mixed = msgspec.structs.replace(row(h), config=config)
    line = [c.strip() for c in format_jobs([mixed]).splitlines()[2].split("  ") if c.strip()]
    assert line[10] == "bfloat16"


def test_the_broker_exports_each_jobs_progress() -> None:
    h = Harness()
    trained(h)
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in metrics.broker_families(h.core.status(h.now))
        for s in f.samples
        if "train_" in s.name and ("train_job", "j") in s.labels.items()
    }
    job = (("train_job", "j"),)
    into, back = (("direction", "in"), *job), (("direction", "out"), *job)
    progress = {k: v for k, v in got.items() if not k[0].startswith(PRIOR)}
    assert progress == {
        ("flowmesh_broker_train_samples_total", job): 10,
        ("flowmesh_broker_train_samples_per_second", job): 4.0,
        ("flowmesh_broker_train_tokens_total", job): 0,  # class targets: not a job on tokens
        ("flowmesh_broker_train_tokens_per_second", job): 0.0,
        ("flowmesh_broker_train_copied_bytes_total", into): 3300,
        ("flowmesh_broker_train_copied_bytes_total", back): 1950,
        ("flowmesh_broker_train_step_copied_bytes", into): 1100,
        ("flowmesh_broker_train_step_copied_bytes", back): 650,
        ("flowmesh_broker_train_memory_wait_seconds_total", job): 0.375,
        ("flowmesh_broker_train_step_memory_wait_seconds", job): 0.125,
        (
            "flowmesh_broker_train_sub_model_activations",
            (("policy", "recompute"), ("sub_model", "0"), *job),
        ): 1,
        (
            "flowmesh_broker_train_sub_model_activations",
            (("policy", "none"), ("sub_model", "1"), *job),
        ): 1,
    }


# The job families that were there before progress was reported.
PRIOR = tuple(
    f"flowmesh_broker_train_{n}"
    for n in ("steps_total", "last_loss", "steps_per_second", "job_errors", "pending_calls")
)


def test_a_language_models_job_counts_its_target_tokens() -> None:
    h = Harness()
    w = opened(h)
    # Next-token targets (rows x 16 ids), answered at t = 1.0 and 3.0; float targets count none.
    first, second = send(h, 1, 4, 11, tokens=16), send(h, 2, 2, 12, tokens=16)
    for fwd, at in ((first, 1.0), (second, 3.0)):
        h.now = at
        h.backend(w, answer(fwd, fwd.seq, 0, 0, 0.0))
    j = row(h)
    assert (j.tokens, j.tokens_per_s, j.samples_per_s) == (96, 16.0, 1.0)
    assert "1.0 (16 tok/s)" in format_jobs([j])
    tensors = {"inputs": ref(2, 8), "targets": ref(2, 3)}  # regression targets: no tokens
    ((_, _, fwd),) = h.client(C, p.TrainStep(id=13, job="j", seq=3, tensors=tensors))
    h.now = 4.0
    h.backend(w, answer(fwd, 3, 0, 0, 0.0))
    assert row(h).tokens == 96


def test_a_pipelined_job_is_listed_on_its_stages_workers() -> None:
    h = Harness()
    trained(h)
    piped = msgspec.structs.replace(row(h), pipeline=["w0", "w1"])
    line = [c.strip() for c in format_jobs([piped]).splitlines()[2].split("  ") if c.strip()]
    assert line[:2] == ["j", "w0+w1"]
