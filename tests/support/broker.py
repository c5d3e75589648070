"""BrokerCore driven in process: a fake clock, peers and clients as plain calls, no sockets.

`Harness` registers peers, deploys through a stand-in partitioner and worker, and returns what
the broker sent for each event (`(destination, address, message)` triples).
"""

from __future__ import annotations

from typing import Any

from broker.core import BACKEND, CLIENT, BrokerConfig, BrokerCore
from flowmesh import protocol as p
from flowmesh.modelio.plan import Plan
from flowmesh.train_spec import TrainConfig

MIB = 1 << 20
CLIENT_A, CLIENT_B = b"client-a", b"client-b"


def plan_of(stage_bytes: list[int], blocks_per_stage: int = 1) -> dict[str, Any]:
    """A valid serving plan of these stage sizes, as data (as `Plan.from_dict` takes it)."""
    return typed_plan(stage_bytes, blocks_per_stage).to_dict()


def typed_plan(stage_bytes: list[int], blocks_per_stage: int = 1) -> Plan:
    """A valid serving plan of these stage sizes."""
    n, k = len(stage_bytes), blocks_per_stage
    return Plan(
        kind="stages",
        spec_digest="test",
        block_names=tuple(f"b{i}" for i in range(n * k)),
        block_bytes=tuple(b if i % k == 0 else 0 for b in stage_bytes for i in range(k)),
        ranges=tuple((i * k, (i + 1) * k) for i in range(n)),
        range_bytes=tuple(stage_bytes),
        objective="bytes",
    )


def received(msg: p.Message) -> Any:
    """`msg` as the codec hands it to the broker: checked against its type on receipt."""
    return p.decode(p.encode(msg))


def ref(*shape: int, dtype: str = "float32") -> p.TensorRef:
    n = 1
    for d in shape:
        n *= d
    return p.TensorRef(dtype, tuple(shape), bytes(n * p.ITEMSIZE[dtype]))


class Harness:
    def __init__(self, **cfg: Any) -> None:
        self.now = 0.0
        self.core = BrokerCore(BrokerConfig(heartbeat_s=1.0, liveness=3, **cfg), now=0.0)
        self.ids = iter(range(1000, 10**6))

    def out(self) -> list[tuple[str, bytes, p.Message]]:
        return self.core.drain()

    def backend(self, addr: bytes, msg: p.Message) -> list[tuple[str, bytes, p.Message]]:
        """`msg` from the peer at `addr`, through the codec. One the codec refuses raises its
        DecodeError, after the broker was told of it as its shell tells it (`on_refused`), so
        that what that did is in `out()`."""
        try:
            msg = received(msg)
        except p.DecodeError as exc:
            if exc.ref is not None and exc.type is not None:
                self.core.answer_refused(addr, exc.ref, str(exc.code), exc.reason, self.now)
            raise
        self.core.on_backend(addr, msg, self.now)
        return self.out()

    def client(self, addr: bytes, msg: p.Message) -> list[tuple[str, bytes, p.Message]]:
        self.core.on_client(addr, received(msg), self.now)
        return self.out()

    def worker(self, name: str, budget: int = 100 * MIB) -> bytes:
        addr = name.encode()
        self.backend(
            addr,
            p.Register(
                id=1, role="worker", name=name, pid=1, device="cpu", kind="cpu", budget_bytes=budget
            ),
        )
        self.backend(addr, p.Heartbeat())
        return addr

    def partitioner(self) -> bytes:
        self.backend(b"part", p.Register(id=1, role="partitioner", name="part", pid=2))
        self.backend(b"part", p.Heartbeat())
        return b"part"

    def deploy(
        self,
        name: str,
        stage_bytes: list[int],
        *,
        replicas: int | None = None,
        max_batch: int = 8,
        inputs: dict[str, Any] | None = None,
    ) -> p.ModelRow:
        spec = {
            "name": name,
            "factory": "flowmesh.examples:mlp",
            "kwargs": {"depth": next(self.ids)},
            "max_batch_size": max_batch,
            "replicas": replicas,
            "seed": 0,
        }
        out = self.client(CLIENT_A, p.Deploy(id=next(self.ids), spec=spec))
        ((_, part, job),) = out
        assert isinstance(job, p.PlanJob)
        plan = plan_of(stage_bytes)
        out = self.backend(
            part,
            p.PlanReply(
                id=job.id, plan=plan, inputs=inputs or {"x": {"dtype": "float32", "shape": [-1, 4]}}
            ),
        )
        deploys = [m for _, _, m in out if isinstance(m, p.DeployStage)]
        assert deploys, out
        final = []
        for dest, addr, m in out:
            assert dest == BACKEND
            final += self.backend(
                addr,
                p.StageReady(
                    id=m.id, model=m.model, stage=m.stage, nbytes=stage_bytes[m.stage], seconds=0.1
                ),
            )
        ((_, _, done),) = [o for o in final if o[0] == CLIENT]
        assert isinstance(done, p.Deployed), done
        return done.model

    def infer(
        self, model: str, client: bytes = CLIENT_A, rows: int = 1, timeout_ms: int | None = None
    ) -> tuple[int, list[tuple[str, bytes, p.Message]]]:
        rid = next(self.ids)
        return rid, self.client(
            client, p.Infer(id=rid, model=model, tensors={"": ref(rows, 4)}, timeout_ms=timeout_ms)
        )

    def loaded(self, addr: bytes, out: list[tuple[str, bytes, p.Message]], nbytes: int) -> None:
        """The worker confirms the load that `out` asked it for."""
        (load,) = only(out, p.Load)
        self.backend(
            addr,
            p.Loaded(id=load.id, model=load.model, stage=load.stage, nbytes=nbytes, seconds=0.1),
        )

    def finish(self, addr: bytes, run: p.Run) -> list[tuple[str, bytes, p.Message]]:
        tensors = [{"": ref(rows, 4)} for _tag, rows in run.parts]
        return self.backend(
            addr,
            p.RunResult(
                id=run.id,
                model=run.model,
                stage=run.stage,
                tensors=tensors,
                info={"compute_s": 0.01},
            ),
        )


def kinds(out: list[tuple[str, bytes, p.Message]]) -> list[tuple[bytes, str]]:
    return [(addr, m.TYPE) for _, addr, m in out]


def only(out: list[tuple[str, bytes, p.Message]], cls: type) -> list[Any]:
    return [m for _, _, m in out if isinstance(m, cls)]


def opened_job(
    name: str,
    *,
    worker: str = "w",
    step: int = 0,
    footprint: int = 0,
    blocks: tuple[tuple[int, int], ...] = ((0, 2),),
    config: TrainConfig | None = None,
) -> p.OpenedJob:
    """What a worker answers a TrainOpen with (`p.JobOpened`), with small figures; `config`:
    what it runs (SGD when not given)."""
    subs = [p.SubModelRow(blocks=[a, b], host_bytes=footprint, task_bytes=0) for a, b in blocks]
    return p.OpenedJob(
        name=name,
        worker=worker,
        step=step,
        sub_models=subs,
        footprint=footprint,
        host_bytes=footprint,
        largest_task=0,
        config=config or TrainConfig(optimizer={"name": "sgd"}),
    )
