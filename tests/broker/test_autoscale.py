"""Autoscaling replicas: the pure rule (`policy.scale_step`) and the registry acting on it.

The rooms are driven in-process with a fake clock (`now` passed in) and exact messages out, as
in `test_registry.py` and `test_serving_router.py`: the registry and the serving router are
wired to each other as `BrokerCore` wires them, without the rest of the core.
"""

from __future__ import annotations

from typing import Any

from broker.config import BrokerConfig
from broker.context import BACKEND, Context
from broker.policy import ScaleStep, scale_step
from broker.registry import Registry
from broker.serving_router import ServingRouter
from broker.state import Model, ModelState, Peer, Phase, Replica, Residency
from broker.status import model_status
from flowmesh import protocol as p
from flowmesh.spec import ModelSpec
from tests.support.broker import typed_plan

MIB = 1 << 20
C1 = b"c1"

# ====================================================================== the rule


def step(now: float, **kw: Any) -> ScaleStep:
    """`scale_step` with a quiet one-replica model on two workers, unless told otherwise."""
    figures: dict[str, Any] = {
        "queue": 0,
        "rate": 0.0,
        "inflight": 0.0,
        "service_s": None,
        "live": 1,
        "replicas": 1,
        "floor": 1,
        "workers": 2,
        "room": True,
        "hot_since": None,
        "cool_since": None,
        "last_scaled": float("-inf"),
    }
    figures.update(kw)
    return scale_step(now, **figures)


def test_a_long_queue_must_last_before_a_replica_is_added() -> None:
    assert step(10.0, queue=8) == ScaleStep(0, 10.0, None, "")
    assert step(14.9, queue=9, hot_since=10.0) == ScaleStep(0, 10.0, None, "")
    assert step(15.0, queue=9, hot_since=10.0) == ScaleStep(
        1, None, None, "queue 9 >= 8 x 1 replica(s)"
    )
    # A short queue breaks the run: the wait starts again.
    assert step(15.0, queue=7, hot_since=10.0) == ScaleStep(0, None, None, "")


def test_arrivals_beyond_what_the_replicas_serve_add_one() -> None:
    # 10 requests/s at 0.1 s each is a whole replica busy: over 0.8 of one.
    assert step(5.0, rate=10.0, service_s=0.1, hot_since=0.0) == ScaleStep(
        1, None, None, "load 1.00 > 0.8 x 1 replica(s)"
    )
    # With two live replicas the same load is under 0.8 x 2: not hot, not cool either.
    assert step(5.0, rate=10.0, service_s=0.1, live=2, replicas=2, hot_since=0.0) == ScaleStep(
        0, None, None, ""
    )


def test_never_beyond_the_workers_nor_while_a_replica_deploys_nor_too_soon() -> None:
    hot = {"queue": 50, "hot_since": 0.0}
    assert step(9.0, **hot, live=2, replicas=2) == ScaleStep(0, 0.0, None, "")  # 2 workers
    assert step(9.0, **hot, room=False) == ScaleStep(0, 0.0, None, "")  # no worker holds it
    assert step(9.0, **hot, replicas=2) == ScaleStep(0, 0.0, None, "")  # one still deploying
    assert step(9.0, **hot, last_scaled=-20.0) == ScaleStep(0, 0.0, None, "")  # cooldown 30 s
    assert step(10.0, **hot, last_scaled=-20.0).delta == 1


def test_a_cooled_model_loses_a_replica_down_to_its_floor_only() -> None:
    two = {"live": 2, "replicas": 2}
    assert step(100.0, **two, rate=0.01) == ScaleStep(0, None, 100.0, "")
    assert step(159.0, **two, rate=0.01, cool_since=100.0) == ScaleStep(0, None, 100.0, "")
    assert step(160.0, **two, rate=0.01, cool_since=100.0) == ScaleStep(
        -1, None, None, "rate 0.010/s < 0.05/s"
    )
    # Measured: the load must fit in one replica fewer at 0.4 of it.
    assert step(160.0, **two, rate=3.0, service_s=0.1, cool_since=100.0) == ScaleStep(
        -1, None, None, "load 0.30 < 0.4 x 1 replica(s)"
    )
    assert step(160.0, **two, rate=5.0, service_s=0.1, cool_since=100.0) == ScaleStep(
        0, None, None, ""
    )
    # At the deployed count, or with work queued or running, it stays.
    assert step(160.0, rate=0.0, cool_since=100.0) == ScaleStep(0, None, 100.0, "")
    assert step(160.0, **two, floor=2, cool_since=100.0) == ScaleStep(0, None, 100.0, "")
    assert step(160.0, **two, queue=1, cool_since=100.0) == ScaleStep(0, None, None, "")
    assert step(160.0, **two, inflight=2.0, cool_since=100.0) == ScaleStep(0, None, None, "")


def test_the_band_between_hot_and_cool_keeps_the_count_steady() -> None:
    # Loads from 0.4 to 0.8 of a replica on two: neither rule fires, whatever the marks were.
    for rate in (4.0, 6.0, 8.0, 16.0):
        got = step(500.0, live=2, replicas=2, rate=rate, service_s=0.1, hot_since=0.0)
        assert got == ScaleStep(0, None, None, ""), rate


# ====================================================================== the rooms


class Rig:
    """The registry and the serving router, wired to each other as `BrokerCore` wires them."""

    def __init__(self, **cfg: Any) -> None:
        self.ctx = Context(
            BrokerConfig(**{"heartbeat_s": 1.0, "liveness": 3, "autoscale": True, **cfg})
        )
        self.lost: list[tuple[str, list[str], str]] = []
        self.reg = Registry(
            self.ctx,
            on_change=lambda now: self.router.pump(now),
            on_replica_lost=lambda model, rep, lost, now: self.router.fail_over(
                model, rep, lost, now
            ),
            on_worker_lost=lambda name: None,
        )
        self.router = ServingRouter(self.ctx, self.reg)

    def worker(self, name: str) -> Peer:
        peer = Peer(name=name, addr=name.encode(), role="worker", pid=1, budget=100 * MIB)
        peer.ready = True
        self.ctx.peers[name] = peer
        self.ctx.by_addr[peer.addr] = name
        return peer

    def model(self, name: str, *workers: str) -> Model:
        """A one-stage model deployed with replicas=1 on `workers[0]`, resident there."""
        spec = ModelSpec.from_dict(
            {"name": name, "factory": "flowmesh.examples:mlp", "max_batch_size": 1}
        )
        model = Model(spec=spec, state=ModelState.READY, stage_bytes=[MIB], plan=typed_plan([MIB]))
        model.desired_replicas = model.floor_replicas = 1
        model.replicas.append(Replica(workers=[workers[0]], ready=[True]))
        peer = self.ctx.peers[workers[0]]
        peer.hosted[(name, 0)] = MIB
        peer.resident[(name, 0)] = Residency((name, 0), MIB, Phase.RESIDENT, 0.0)
        self.ctx.models[name] = model
        return model

    def infer(self, client_id: int, now: float) -> None:
        x = p.TensorRef("float32", (1, 4), bytes(16))
        self.router.infer(C1, p.Infer(id=client_id, model="m", tensors={"x": x}), now)

    def answer(self, run: p.Run, worker: str, now: float) -> None:
        y = p.TensorRef("float32", (1, 2), bytes(8))
        tensors = [{"y": y} for _ in run.parts]  # a grouped run: one each
        msg = p.RunResult(id=run.id, model=run.model, stage=run.stage, tensors=tensors)
        self.router.run_result(self.ctx.peers[worker], msg, now)

    def tick(self, now: float) -> None:
        self.reg.autoscale(now, self.router.timings.model_means())
        self.reg.reconcile(now)
        self.router.pump(now)


def kinds(out: list[Any]) -> list[tuple[str, bytes, str]]:
    return [(dest, addr, type(msg).__name__) for dest, addr, msg in out]


class Serve:
    """Workers that answer each run 0.5 s after it was sent, as the clock moves on."""

    def __init__(self, rig: Rig) -> None:
        self.rig, self.running, self.results, self.errors = rig, [], 0, 0

    def take(self, now: float) -> list[Any]:
        other = []
        for dest, addr, msg in self.rig.ctx.drain():
            if isinstance(msg, p.Run):
                self.running.append((now, msg, addr.decode()))
            elif isinstance(msg, p.Result):
                self.results += 1
            elif isinstance(msg, p.Error):
                self.errors += 1
            else:
                other.append((dest, addr, msg))
        return other

    def until(self, now: float) -> list[Any]:
        """Answer every run due by `now`, then tick at `now`; what else was sent."""
        other = self.take(now)
        for sent, run, worker in [r for r in self.running if r[0] + 0.5 <= now]:
            self.running.remove((sent, run, worker))
            self.rig.answer(run, worker, sent + 0.5)
            other += self.take(sent + 0.5)
        self.rig.tick(now)
        return other + self.take(now)


def test_a_hot_model_gains_a_replica_then_loses_it_back_without_failing_a_request() -> None:
    rig = Rig(group_runs=1)  # a run per request: the stand-in worker takes 0.5 s per run
    rig.worker("w0")
    rig.worker("w1")
    model = rig.model("m", "w0", "w1")
    serve = Serve(rig)
    # A burst of 60 requests; w0 runs 4 at a time, 0.5 s each: the queue stays long.
    for i in range(60):
        rig.infer(100 + i, 0.0)
    log: list[tuple[float, str, bytes, Any]] = []
    t = 0.0
    while t < 87.0:
        for _, addr, msg in serve.until(t):
            log.append((t, type(msg).__name__, addr, msg))
            if isinstance(msg, p.DeployStage):  # hot for 5 s: a second replica deploys
                row = model_status(model, rig.ctx.peers)
                assert (row.replicas_live, row.replicas_desired) == (1, 2)
                assert (row.scale_ups, row.replicas[1].workers) == (1, ["w1"])
                ready = p.StageReady(id=msg.id, model="m", stage=0, nbytes=MIB, seconds=0.1)
                rig.reg.stage_ready(rig.ctx.peers["w1"], ready, t)
                log += [(t, type(m).__name__, a, m) for _, a, m in serve.take(t)]
        t += 0.5
    spec = model.spec
    assert log == [
        (
            5.0,
            "DeployStage",
            b"w1",
            p.DeployStage(id=105, model="m", stage=0, spec=spec, plan=model.plan),
        ),
        (5.0, "Load", b"w1", p.Load(id=106, model="m", stage=0)),
    ]
    assert (serve.results, serve.errors, len(model.queue)) == (60, 0, 0)
    # The load (0.79/s x 0.5 s) fell under 0.4 of one replica at 27.5 s: cool since then.
    assert (model.cool_since, model.hot_since, model.scale_downs) == (27.5, None, 0)
    row = model_status(model, rig.ctx.peers)
    assert (row.replicas_live, row.replicas_desired, row.replicas_floor) == (2, 2, 1)
    # Two requests run, one on each replica, when the shrink is decided at 87.5 s.
    rig.infer(200, 87.0)
    rig.infer(201, 87.0)
    assert serve.take(87.0) == []
    assert [(w, run.id) for _, run, w in serve.running] == [("w0", 124), ("w1", 126)]
    rig.tick(87.5)
    assert rig.ctx.drain() == []  # nothing dropped while w1 still runs request 201
    assert [(r.workers, r.draining, r.inflight) for r in model.replicas] == [
        (["w0"], False, 1),
        (["w1"], True, 1),
    ]
    row = model_status(model, rig.ctx.peers)
    assert (row.replicas_live, row.replicas_desired, row.scale_downs) == (1, 1, 1)
    # New work goes to the replica that stays.
    rig.infer(202, 87.6)
    serve.take(87.6)
    assert [w for _, _, w in serve.running] == ["w0", "w1", "w0"]
    # w1 answers; the next tick drops its drained replica: device copy, then the stage.
    assert serve.until(88.0) == [
        (BACKEND, b"w1", p.Evict(id=129, model="m", stage=0)),
        (BACKEND, b"w1", p.DropStage(id=130, model="m", stage=0)),
    ]
    assert [r.workers for r in model.replicas] == [["w0"]]
    assert (rig.ctx.peers["w1"].hosted, rig.ctx.peers["w1"].resident) == ({}, {})
    assert serve.until(88.5) == []
    assert (serve.results, serve.errors, model.completed, model.errors) == (63, 0, 63, 0)
    # No flapping: minutes more at the deployed count, nothing changes.
    for k in range(178, 1200):
        assert serve.until(k / 2) == []
    row = model_status(model, rig.ctx.peers)
    assert (row.replicas_live, row.replicas_desired, row.replicas_floor) == (1, 1, 1)
    assert (row.scale_ups, row.scale_downs) == (1, 1)


def test_a_model_that_stays_hot_grows_no_further_than_its_workers() -> None:
    rig = Rig(group_runs=1)  # a run per request: the stand-in worker takes 0.5 s per run
    rig.worker("w0")
    rig.worker("w1")
    model = rig.model("m", "w0", "w1")
    serve = Serve(rig)
    deploys = []
    for k in range(0, 240):  # 2 minutes of 16 requests/s: more than two replicas serve
        t = k / 2
        for i in range(8):
            rig.infer(1000 + 8 * k + i, t)
        for _, addr, msg in serve.until(t):
            if isinstance(msg, p.DeployStage):
                deploys.append((t, addr))
                ready = p.StageReady(id=msg.id, model="m", stage=0, nbytes=MIB, seconds=0.1)
                rig.reg.stage_ready(rig.ctx.peers[addr.decode()], ready, t)
                serve.take(t)
    assert deploys == [(5.5, b"w1")]  # hot from 0.5 s (8 queued)
    assert (len(model.replicas), model.desired_replicas, model.scale_ups) == (2, 2, 1)
    assert (model.scale_downs, serve.errors) == (0, 0)


def test_autoscale_off_keeps_the_deployed_count() -> None:
    rig = Rig(autoscale=False)
    rig.worker("w0")
    rig.worker("w1")
    model = rig.model("m", "w0", "w1")
    for i in range(60):
        rig.infer(100 + i, 0.0)
    rig.ctx.drain()
    for t in range(0, 60):
        rig.tick(float(t))
    assert rig.ctx.drain() == []
    assert (len(model.replicas), model.scale_ups, model.hot_since) == (1, 0, None)


def test_a_draining_replica_is_kept_when_the_one_it_left_to_is_lost() -> None:
    rig = Rig()
    rig.worker("w0")
    rig.worker("w1")
    model = rig.model("m", "w0", "w1")
    model.replicas.append(Replica(workers=["w1"], ready=[True], draining=True))
    model.desired_replicas, model.scale_ups, model.scale_downs = 1, 1, 1
    rig.ctx.peers["w1"].hosted[("m", 0)] = MIB
    rig.infer(1, 10.0)
    (run,) = [m for _, _, m in rig.ctx.drain() if isinstance(m, p.Run)]
    assert rig.router.batches[run.id].worker == "w0"  # never the draining replica
    rig.reg.peer_dead(rig.ctx.peers["w0"], 11.0, "test")
    rig.ctx.drain()
    assert [r.workers for r in model.replicas] == [["w1"]]
    rig.tick(11.0)
    assert [(r.workers, r.live) for r in model.replicas] == [(["w1"], True)]
    assert model.desired_replicas == 2  # the lost one is re-created where a worker can hold it
    # The request that ran on w0 runs again on w1.
    out = rig.ctx.drain()
    assert [(addr, type(m).__name__) for _, addr, m in out] == [(b"w1", "Load"), (b"w1", "Run")]
    assert model.errors == 0


def test_a_deployed_model_keeps_its_arrival_rate_over_the_configured_window() -> None:
    # `--rate-window`: what lets the end-to-end test (tests/scenarios/test_autoscale.py) see a burst
    # cool in seconds; a model deployed without it would keep the default 30 s.
    rig = Rig(rate_window_s=2.0)
    rig.worker("w0")
    part = Peer(name="part", addr=b"part", role="partitioner", pid=2, budget=0)
    part.ready = True
    rig.ctx.peers["part"], rig.ctx.by_addr[b"part"] = part, "part"
    spec = ModelSpec.from_dict({"name": "m", "factory": "flowmesh.examples:mlp"})
    rig.reg.deploy(C1, p.Deploy(id=1, spec=spec), 0.0)
    rate = rig.ctx.models["m"].rate
    for _ in range(4):
        rate.add(10.0)
    assert rate.at(10.0) == 2.0  # 4 arrivals over a 2 s window
    assert 0.73 < rate.at(12.0) < 0.74  # one window later: 1/e of it
