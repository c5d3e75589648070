"""The blocking `Client` mirrors `AsyncClient`: the same methods, signatures and docstrings, built
from the coroutines (`client_sdk.client._blocking`), with the calls' timeouts kept; and the
mirrored methods work end to end, each call through the client's loop thread and the wire codec
to a broker stand-in in this process (what a real mesh does with them the mesh tests check)."""

from __future__ import annotations

import inspect
import pydoc
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from client_sdk.client import AsyncClient, Client
from client_sdk.jobs import AsyncJob, Job
from flowmesh import protocol as p
from flowmesh.reports import SubModelRow
from flowmesh.spec import ModelSpec
from flowmesh.testing import assert_forward_close
from tests.support.broker import typed_plan
from tests.support.mesh import mlp_spec, reference
from tests.support.reports import broker_status, job_row, model_row, stage_row, worker_row

# Coroutine methods whose blocking twin is written by hand, as it does more: `Client.close` also
# stops the client's loop thread. Their signatures must still agree.
HAND_WRITTEN = {"close"}
# The blocking twin of what a coroutine returns, where it differs.
RETURNS = {"AsyncJob": "Job"}


def async_methods() -> list[str]:
    return sorted(
        name
        for name, fn in inspect.getmembers(AsyncClient, inspect.iscoroutinefunction)
        if not name.startswith("_")
    )


def test_the_public_coroutines_are_the_expected_ones() -> None:
    """A guard on the guard: the mirror test below covers the API, not an empty list."""
    assert {"deploy", "infer", "plan", "status", "train_open", "sweep"} <= set(async_methods())


@pytest.mark.parametrize("name", async_methods())
def test_client_mirrors_every_coroutine_of_async_client(name: str) -> None:
    afn = getattr(AsyncClient, name)
    assert hasattr(Client, name), f"AsyncClient.{name} has no blocking twin Client.{name}"
    fn = getattr(Client, name)
    assert not inspect.iscoroutinefunction(fn), f"Client.{name} must block, not be a coroutine"
    asig, sig = inspect.signature(afn), inspect.signature(fn)
    assert list(sig.parameters.values()) == list(asig.parameters.values()), name
    want = asig.return_annotation
    assert sig.return_annotation == RETURNS.get(want, want), name
    if name in HAND_WRITTEN:
        return
    assert afn.__doc__ and afn.__doc__.strip(), f"AsyncClient.{name} needs a docstring"
    assert fn.__doc__ == afn.__doc__, name
    assert fn.__name__ == name and fn.__qualname__ == f"Client.{name}"
    # What help() shows: every parameter, and the documentation.
    text = pydoc.render_doc(fn, renderer=pydoc.plaintext)
    for param in list(asig.parameters)[1:]:
        assert f"{param}:" in text, (name, param)
    assert afn.__doc__.strip().splitlines()[0].strip() in text


def test_deploy_and_plan_show_every_option_and_take_hf() -> None:
    sig = inspect.signature(Client.deploy)
    for opt in ("hf", "stages", "max_batch_size", "replicas", "seed", "slo_ms", "timeout"):
        assert opt in sig.parameters
    assert sig.parameters["factory"].default is None and sig.parameters["hf"].default is None
    assert sig.parameters["timeout"].default == 600.0
    plan = inspect.signature(Client.plan)
    assert {"hf", "kind", "mem_cap", "target_bytes"} <= set(plan.parameters)
    assert plan.parameters["timeout"].default == 120.0


@pytest.fixture
def dry_client() -> Iterator[tuple[Client, list[Any]]]:
    """A client whose calls record the deadline they would wait for instead of running."""
    c = Client("tcp://127.0.0.1:9")
    waits: list[Any] = []

    def run(coro: Any, timeout: float | None) -> Any:
        coro.close()
        waits.append(timeout)
        return AsyncJob(c._async, "dry", {})  # what train_open's result is wrapped from

    def wait(coro: Any) -> Any:
        coro.close()
        waits.append("unbounded")

    c._run = run  # type: ignore[method-assign]
    c._wait = wait  # type: ignore[method-assign]
    try:
        yield c, waits
    finally:
        del c._run, c._wait
        c.close()


def test_each_call_waits_for_its_own_timeout(dry_client: tuple[Client, list[Any]]) -> None:
    """The signature's default when the caller gives none, else the caller's; None (the
    client's timeout) where the coroutine's default is None; no deadline for a sweep."""
    c, waits = dry_client
    x = torch.zeros(1, 4)
    c.deploy("m", "flowmesh.examples:mlp")
    c.deploy("m", "flowmesh.examples:mlp", stages=2, timeout=7.5)
    c.deploy("m", hf="/models/gpt2")
    c.plan("flowmesh.examples:mlp")
    c.plan(hf="/models/gpt2", timeout=3)
    c.status()
    c.jobs()
    c.infer("m", x)
    c.infer("m", x, 2.0)
    c.infer_with_info("m", x, timeout=4.0)
    c.undeploy("m")
    job = c.train_open("j", "flowmesh.examples:mlp", batch_size=4, optimizer={"name": "sgd"})
    assert isinstance(job, Job) and job.client is c
    assert waits == [600.0, 7.5, 600.0, 120.0, 3, None, None, None, 2.0, 4.0, None, 600.0]
    c.sweep(name="s", factory="f:g", space={}, data=None, trials=1, steps=1, eval_every=1)
    assert waits[-1] == "unbounded"
    # A call the signature refuses fails in the caller, as a plain method's would.
    with pytest.raises(TypeError):
        c.deploy()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        c.deploy("m", "f:g", stagse=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        c.train_open("j", "f:g", optimizer={"name": "sgd"})  # type: ignore[call-arg]


async def test_deploy_and_plan_send_hf_and_need_a_model() -> None:
    sent: list[p.Message] = []
    client = AsyncClient("tcp://127.0.0.1:9")

    async def call(msg: p.Message, timeout: float | None) -> p.Message:
        sent.append(msg)
        if isinstance(msg, p.Deploy):
            return p.Deployed(id=msg.id, model=model_row("m"))
        return p.PlanReply(id=msg.id, plan=typed_plan([1]))

    client.connection.call = call  # type: ignore[method-assign]
    await client.deploy("m", hf="/models/gpt2", stages=2)
    await client.deploy("m", "flowmesh.examples:mlp")
    await client.plan(hf="/models/gpt2")
    d_hf, d_factory, p_hf = sent
    assert isinstance(d_hf, p.Deploy) and isinstance(d_factory, p.Deploy)
    assert d_hf.spec["hf"] == "/models/gpt2" and d_hf.spec["factory"] is None
    assert d_hf.spec["stages"] == 2 and d_hf.timeout_ms == 600_000
    # Without hf, the spec is what a broker that knows no "hf" takes.
    assert "hf" not in d_factory.spec and d_factory.spec["factory"] == "flowmesh.examples:mlp"
    assert isinstance(p_hf, p.PlanRequest) and p_hf.spec["hf"] == "/models/gpt2"
    assert p_hf.spec["factory"] is None and p_hf.timeout_ms == 120_000
    with pytest.raises(ValueError, match="factory"):
        await client.deploy("m")
    with pytest.raises(ValueError, match="factory"):
        await client.plan()
    assert len(sent) == 3


def test_neither_factory_nor_hf_fails_in_the_blocking_client_too() -> None:
    with Client("tcp://127.0.0.1:9", timeout=5) as c, pytest.raises(ValueError, match="hf"):
        c.deploy("m", stages=2)


# ------------------------------------------------- every mirrored call, through the real client

KIB = 1 << 10
SERVE = mlp_spec("mirror-mlp", width=64, depth=4, seed=11)
TRAIN = ModelSpec(
    name="mirror-train",
    factory="flowmesh.examples:mlp",
    kwargs={"width": 32, "depth": 4, "in_features": 8, "out_features": 5},
    seed=5,
)
SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}
BATCH = 8


class Broker:
    """The broker's side of the client's calls, in this process: each call's message and its
    answer go through the wire codec (`p.encode`, `p.decode`) as on a socket. It serves
    SERVE's seeded forward; a training step's loss is 1 / its number, its metric the rows."""

    def __init__(self) -> None:
        self.got: list[p.Message] = []
        self.forward = reference(SERVE)
        self.models: list[str] = []
        self.jobs: list[str] = []

    async def call(self, msg: p.Message, timeout: float | None) -> p.Message:
        msg = p.decode(p.encode(msg))
        self.got.append(msg)
        return p.decode(p.encode(self.answer(msg)))

    def answer(self, msg: Any) -> p.Message:
        if isinstance(msg, p.Deploy):
            self.models.append(msg.spec.name)
            stages = [stage_row(i) for i in range(msg.spec.stages or 1)]
            return p.Deployed(id=msg.id, model=model_row(msg.spec.name, stages=stages))
        if isinstance(msg, p.Infer):
            out = self.forward(msg.tensors[""].tensor())
            return p.Result(id=msg.id, tensors={"": out}, info=p.ResultInfo(workers=["w0"]))
        if isinstance(msg, p.PlanRequest):
            n = msg.stages
            return p.PlanReply(id=msg.id, plan=typed_plan([1] * n))
        if isinstance(msg, p.Status):
            status = broker_status(
                models=[model_row(m) for m in self.models],
                workers=[worker_row("w0"), worker_row("w1")],
            )
            return p.StatusReply(id=msg.id, status=status)
        if isinstance(msg, p.TrainOpen):
            self.jobs.append(msg.job)
            subs = [SubModelRow(blocks=[i, i + 1], host_bytes=1, task_bytes=1) for i in (0, 1)]
            return p.TrainOpened(id=msg.id, job=job_row(msg.job, sub_models=subs))
        if isinstance(msg, p.TrainStep):
            rows = len(msg.tensors["targets"].tensor())
            assert len(msg.tensors["inputs"].tensor()) == rows
            return p.TrainStepResult(
                id=msg.id,
                job=msg.job,
                seq=msg.seq,
                loss=1 / msg.seq,
                step=msg.seq,
                metrics={"rows": float(rows)},
            )
        if isinstance(msg, p.Jobs):
            return p.JobsReply(id=msg.id, jobs=[job_row(j) for j in self.jobs])
        if isinstance(msg, p.TrainClose):
            self.jobs.remove(msg.job)
            return p.TrainClosed(id=msg.id, job=msg.job)
        if isinstance(msg, p.Undeploy):
            self.models.remove(msg.model)
            return p.Undeployed(id=msg.id, model=msg.model)
        raise AssertionError(f"no answer for {msg!r}")


def test_the_blocking_client_end_to_end() -> None:
    """Each mirrored call of the blocking `Client`, on its loop thread, sends the message the
    coroutine sends (options included) and gives back what the broker answered, typed."""
    ref = reference(SERVE)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=g)
    batches = [
        (torch.randn(BATCH, 8, generator=g), torch.randint(0, 5, (BATCH,), generator=g))
        for _ in range(3)
    ]
    broker = Broker()
    with Client("tcp://127.0.0.1:9", timeout=60) as c:
        c._async.connection.call = broker.call  # type: ignore[method-assign]
        # Keyword options of the mirrored deploy reach the broker: two stages, seeded weights.
        info = c.deploy(
            SERVE.name,
            SERVE.factory,
            kwargs=SERVE.kwargs,
            seed=SERVE.seed,
            stages=2,
            max_batch_size=4,
            dtype="float32",
        )
        assert info.name == SERVE.name and len(info.stages) == 2, info
        (deploy,) = broker.got
        assert isinstance(deploy, p.Deploy)
        assert {k: getattr(deploy.spec, k) for k in ("factory", "kwargs", "seed", "stages")} == {
            "factory": SERVE.factory,
            "kwargs": SERVE.kwargs,
            "seed": SERVE.seed,
            "stages": 2,
        }
        assert deploy.spec.max_batch_size == 4 and deploy.spec.dtype == "float32"
        out = c.infer(SERVE.name, x)
        assert isinstance(out, torch.Tensor)
        assert_forward_close(out, ref(x), "Client.infer")
        out2, call = c.infer_with_info(SERVE.name, x[:3], timeout=30)
        assert_forward_close(out2, ref(x[:3]), "Client.infer_with_info")  # type: ignore[arg-type]
        assert call["workers"] == ["w0"] and call["batch"] == 1

        plan = c.plan(SERVE.factory, kwargs=SERVE.kwargs, stages=3)
        assert len(plan["ranges"]) == 3, plan
        asked = broker.got[-1]
        assert isinstance(asked, p.PlanRequest) and asked.stages == 3, asked

        st = c.status()
        assert [m.name for m in st.models] == [SERVE.name] and len(st.workers) == 2

        job = c.train_open(
            TRAIN.name,
            TRAIN.factory,
            kwargs=TRAIN.kwargs,
            seed=TRAIN.seed,
            optimizer=SGD,
            batch_size=BATCH,
            chunk_bytes=32 * KIB,
            timeout=60,
        )
        assert isinstance(job, Job) and isinstance(job._job, AsyncJob)
        assert job.name == TRAIN.name and job.info.sub_models, job.info
        results = [job.step(xb, yb) for xb, yb in batches]
        assert [j.name for j in c.jobs()] == [TRAIN.name]
        job.close()
        assert c.jobs() == []
        c.undeploy(SERVE.name)
        assert SERVE.name not in {m.name for m in c.status().models}
    opened = next(m for m in broker.got if isinstance(m, p.TrainOpen))
    assert opened.spec.kwargs == TRAIN.kwargs and opened.spec.seed == TRAIN.seed
    assert opened.config is not None and opened.config.optimizer == SGD
    assert opened.batch == BATCH and opened.chunk_bytes == 32 * KIB
    # The step results as the broker sent them, in order (floats pass through unchanged).
    assert [(r.step, r.loss, r.metrics) for r in results] == [
        (i, 1 / i, {"rows": float(BATCH)}) for i in (1, 2, 3)
    ]
