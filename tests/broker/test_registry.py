"""Registry alone: peers, the model catalogue, plans, stage placement and replica repair.

No serving router, no sockets: the tests drive the registry with a fake clock (`now` passed in),
record the three callbacks it makes to the other rooms, and assert the exact messages it
queues. Ids are exact too: they come from the one counter in `Context`, which starts at 1.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from broker.config import BrokerConfig
from broker.context import BACKEND, CLIENT, Context, Outgoing
from broker.placement import stored_plan
from broker.registry import Registry
from broker.state import Model, ModelState, Peer, Phase, Replica, Request, Residency
from broker.status import model_status
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.reports import MAX_HELD_ENTRIES, ReplicaRow
from flowmesh.spec import DEFAULT_ALLOW, ModelSpec, TensorSpec
from tests.support.broker import plan_of, received, typed_plan

MIB = 1 << 20
C = b"client"
PART = b"part"


def ack(ref: int, *, kept: bool) -> p.RegisterAck:
    """The broker's answer to a registration: timing, and the mesh's allow-list to apply."""
    return p.RegisterAck(id=ref, heartbeat_s=1.0, liveness=3, kept=kept, allow=list(DEFAULT_ALLOW))


def spec_of(name: str, **extra: Any) -> ModelSpec:
    return ModelSpec(name=name, factory="flowmesh.examples:mlp", seed=0, **extra)


INPUTS = {"x": TensorSpec("float32", (-1, 4))}


def plan_job(cid: int, spec: ModelSpec, mem_cap: int = 100 * MIB) -> Outgoing:
    request = p.PlanAsk(spec=spec, kind="stages", stages=None, mem_cap=mem_cap)
    return (BACKEND, PART, p.PlanJob(id=cid, request=request))


def deploy_stage(cid: int, addr: bytes, spec: ModelSpec, stage_bytes: list[int]) -> Outgoing:
    """The DeployStage of stage 0 of `spec` planned as `typed_plan(stage_bytes)`."""
    plan = typed_plan(stage_bytes)
    return (BACKEND, addr, p.DeployStage(id=cid, model=spec.name, stage=0, spec=spec, plan=plan))


class Rig:
    def __init__(self, **cfg: Any) -> None:
        self.ctx = Context(BrokerConfig(heartbeat_s=1.0, liveness=3, **cfg))
        self.events: list[tuple[Any, ...]] = []
        self.reg = Registry(
            self.ctx,
            on_change=lambda now: self.events.append(("change", now)),
            on_replica_lost=lambda model, rep, lost, now: self.events.append(
                ("replica_lost", model.name, list(rep.workers), lost)
            ),
            on_worker_lost=lambda name: self.events.append(("worker_lost", name)),
        )

    def out(self) -> list[Outgoing]:
        return self.ctx.drain()

    def register(self, name: str, pid: int = 1, budget: int = 100 * MIB, **kw: Any) -> Peer:
        """Register as the broker receives it: through the codec (an `inventory` given as a
        dict is typed on receipt)."""
        role = "partitioner" if name == "part" else "worker"
        msg = p.Register(id=1, role=role, name=name, pid=pid, budget_bytes=budget, **kw)
        self.reg.register(name.encode(), received(msg), 0.0)
        return self.ctx.peers[name]

    def join(self, name: str, budget: int = 100 * MIB, **kw: Any) -> Peer:
        """Register and heartbeat: a ready peer; what that sent and called is forgotten."""
        peer = self.register(name, budget=budget, **kw)
        self.reg.heartbeat(peer, p.Heartbeat(), 0.0)
        self.out()
        self.events.clear()
        return peer

    def peer(self, name: str) -> Peer:
        return self.ctx.peers[name]

    def deploy(self, name: str, stage_bytes: list[int], replicas: int, now: float = 0.0) -> Model:
        """Deploy through the whole path; returns the READY model, with the output forgotten."""
        self.reg.deploy(C, p.Deploy(id=50, spec=spec_of(name, replicas=replicas)), now)
        ((_, _, job),) = self.out()
        reply = p.PlanReply(id=job.id, plan=typed_plan(stage_bytes), inputs=None)
        self.reg.plan_reply(self.peer("part"), reply, now)
        for _, addr, m in self.out():
            ready = p.StageReady(
                id=m.id, model=name, stage=m.stage, nbytes=stage_bytes[m.stage], seconds=0.1
            )
            self.reg.stage_ready(self.peer(addr.decode()), ready, now)
        self.out()
        self.events.clear()
        model = self.ctx.models[name]
        assert model.state is ModelState.READY
        return model


# ====================================================================== peers


def test_a_peer_is_acknowledged_then_ready_on_its_first_heartbeat() -> None:
    rig = Rig()
    peer = rig.register("w0")
    assert rig.out() == [(BACKEND, b"w0", ack(1, kept=False))]
    assert (peer.ready, peer.max_inflight) == (False, 4)  # 2 compute lanes by default
    rig.reg.heartbeat(peer, p.Heartbeat(stats=p.WorkerStats(peak_bytes=5)), 0.5)
    assert peer.ready and peer.stats == p.WorkerStats(peak_bytes=5)
    assert rig.events == [("change", 0.5)]
    rig.reg.heartbeat(peer, p.Heartbeat(), 0.6)
    assert rig.events == [("change", 0.5)]  # ready once


def test_the_same_process_registering_again_keeps_what_it_holds() -> None:
    """On a fresh socket, it proves itself with the secret of its first registration."""
    rig = Rig()
    peer = rig.join("w0", info=p.PeerInfo(session="s3cret"))
    peer.hosted[("m", 0)] = MIB
    msg = p.Register(
        id=9,
        role="worker",
        name="w0",
        pid=1,
        budget_bytes=100 * MIB,
        info=p.PeerInfo(session="s3cret"),
    )
    rig.reg.register(b"w0-new-socket", msg, 1.0)
    assert rig.out() == [(BACKEND, b"w0-new-socket", ack(9, kept=True))]
    assert rig.peer("w0") is peer and peer.hosted == {("m", 0): MIB}
    assert rig.ctx.by_addr == {b"w0-new-socket": "w0"} and peer.registrations == 2
    assert rig.events == []


NAME_HELD = (
    "name 'w0' is held by a live worker of another process (pid 1, heard from 2.0 s ago): "
    "start this one under another --name, or stop that one first"
)


@pytest.mark.parametrize(
    "info",
    [p.PeerInfo(), p.PeerInfo(session="guess")],
    ids=["no-secret", "wrong-secret"],
)
def test_a_name_a_live_peer_holds_is_refused_to_another_connection(info: p.PeerInfo) -> None:
    """Its pid and budget, as status shows them, are not enough: the registration is refused
    while the holder heartbeats, and the holder keeps its name, state and connection."""
    rig = Rig()
    rig.join("part")
    peer = rig.join("w0", info=p.PeerInfo(session="s3cret"))
    rig.deploy("m", [MIB], replicas=1)  # on w0
    forged = p.Register(id=4, role="worker", name="w0", pid=1, budget_bytes=100 * MIB, info=info)
    with pytest.raises(FlowmeshError) as refused:
        rig.reg.register(b"thief", forged, 2.0)
    assert (refused.value.code, refused.value.reason) == (Code.NAME_TAKEN, NAME_HELD)
    assert rig.out() == [] and rig.events == []
    assert rig.peer("w0") is peer and peer.addr == b"w0" and peer.registrations == 1
    assert rig.ctx.by_addr == {b"part": "part", b"w0": "w0"}
    assert rig.ctx.models["m"].state is ModelState.READY and peer.hosted == {("m", 0): MIB}
    assert rig.ctx.totals["names_refused"] == 1


def test_a_restarted_worker_gets_its_name_once_its_predecessor_stopped_heartbeating() -> None:
    rig = Rig()
    rig.join("w0").last_seen = 1.0
    restarted = p.Register(id=1, role="worker", name="w0", pid=2, budget_bytes=100 * MIB)
    with pytest.raises(FlowmeshError) as refused:
        rig.reg.register(b"w0-restarted", restarted, 4.0)  # 3 periods of silence: still live
    assert refused.value.code == Code.NAME_TAKEN
    rig.reg.register(b"w0-restarted", restarted, 4.5)
    assert rig.out() == [(BACKEND, b"w0-restarted", ack(1, kept=False))]
    assert rig.events == [("worker_lost", "w0"), ("change", 4.5)]
    assert rig.peer("w0").pid == 2 and rig.ctx.by_addr == {b"w0-restarted": "w0"}


def test_a_worker_registering_afresh_drops_what_nobody_here_asked_for() -> None:
    """Its inventory names stages of a model this broker does not know (a broker without a
    state directory restarted, say): each is dropped, so its bytes are not lost to the budget."""
    rig = Rig()
    rig.join("part")
    rig.join("w1")
    rig.deploy("m", [MIB], replicas=1)  # on w1
    stages = [
        {"model": "old", "stage": 1, "nbytes": MIB, "resident": True, "digest": "d"},
        # A stage of a model this broker knows, but no replica expects it on w0.
        {"model": "m", "stage": 0, "nbytes": MIB, "resident": False, "digest": "d"},
    ]
    peer = rig.register("w0", inventory={"stages": stages})
    assert rig.out() == [
        (BACKEND, b"w0", ack(1, kept=False)),
        (BACKEND, b"w0", p.DropStage(id=3, model="old", stage=1)),
        (BACKEND, b"w0", p.DropStage(id=4, model="m", stage=0)),
    ]
    assert peer.hosted == {} and peer.resident == {}


HELD = {"model": "m", "stage": 0, "nbytes": 1, "resident": False, "digest": ""}
JOB = {"name": "j", "step": 1, "seq": 1, "footprint": 0, "results": [], "running": []}


@pytest.mark.parametrize(
    ("inventory", "code", "said"),
    [
        ({"stages": [{"model": "m"}]}, Code.BAD_MESSAGE, "at `$.inventory.stages[0]`"),
        (
            {"stages": [{**HELD, "stage": True}]},
            Code.BAD_MESSAGE,
            "Expected `int`, got `bool` - at `$.inventory.stages[0].stage`",
        ),
        (
            {"stages": [{**HELD, "nbytes": -1}]},
            Code.BAD_MESSAGE,
            "at `$.inventory.stages[0].nbytes`",
        ),
        ({"other": []}, Code.BAD_MESSAGE, "unknown field `other` - at `$.inventory`"),
        (
            {"jobs": [{**JOB, "results": [{"seq": 1}]}]},
            Code.BAD_MESSAGE,
            "at `$.inventory.jobs[0].results[0]`",
        ),
        (
            {"jobs": [{**JOB, "results": [{"t": "ok", "seq": 1, "loss": "low"}]}]},
            Code.BAD_MESSAGE,
            "at `$.inventory.jobs[0].results[0].loss`",
        ),
        ({"jobs": [{**JOB, "running": [True]}]}, Code.BAD_MESSAGE, "jobs[0].running[0]"),
        ({"stages": [HELD, HELD]}, Code.BAD_REQUEST, "a stage is listed twice"),
    ],
)
def test_a_malformed_inventory_refuses_the_registration(
    inventory: Any, code: Code, said: str
) -> None:
    rig = Rig()
    with pytest.raises(FlowmeshError) as info:
        rig.register("w0", inventory=inventory)
    assert info.value.code == code and said in info.value.reason, info.value
    assert rig.ctx.peers == {} and rig.out() == []


def test_a_restarted_worker_replaces_its_old_self_and_loses_its_replicas() -> None:
    rig = Rig()
    rig.join("part")
    rig.join("w0")
    rig.deploy("m", [MIB], replicas=1)
    rig.register("w0", pid=2)  # another process under the same name
    assert rig.out() == [(BACKEND, b"w0", ack(1, kept=False))]
    assert rig.events == [
        ("worker_lost", "w0"),
        ("replica_lost", "m", ["w0"], "w0"),
        ("change", 0.0),
    ]
    assert rig.ctx.models["m"].state is ModelState.UNAVAILABLE
    assert rig.peer("w0").pid == 2 and rig.peer("w0").hosted == {}


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"role": "client"}, "unknown role 'client'"),
        ({"budget_bytes": 0}, "a worker must report a positive memory budget"),
        ({"name": ""}, "a peer needs a name"),
    ],
)
def test_bad_registrations_are_refused(fields: dict[str, Any], reason: str) -> None:
    rig = Rig()
    msg = {"id": 1, "role": "worker", "name": "w0", "pid": 1, "budget_bytes": MIB, **fields}
    with pytest.raises(FlowmeshError) as info:
        rig.reg.register(b"w0", p.Register(**msg), 0.0)
    assert (info.value.code, info.value.reason) == (Code.BAD_REQUEST, reason)
    assert rig.ctx.peers == {} and rig.out() == []


@pytest.mark.parametrize(
    ("info", "reason"),
    [
        ({"compute_lanes": "many"}, "Expected `int`, got `str` - at `$.info.compute_lanes`"),
        ({"compute_lanes": 0}, "Expected `int` >= 1 - at `$.info.compute_lanes`"),
        ({"compute_lanes": True}, "Expected `int`, got `bool` - at `$.info.compute_lanes`"),
        ({"session": 7}, "Expected `str`, got `int` - at `$.info.session`"),
        ({"train_bytes": -1}, "Expected `int` >= 0 - at `$.info.train_bytes`"),
        ({"peer_endpoint": None}, "Expected `str`, got `None` - at `$.info.peer_endpoint`"),
        ({"prefault_s": "1"}, "Expected `float | null`, got `str` - at `$.info.prefault_s`"),
        ({"lanes": 2}, "Object contains unknown field `lanes` - at `$.info`"),
    ],
)
def test_a_registration_whose_info_is_mistyped_is_refused_on_receipt(
    info: dict[str, Any], reason: str
) -> None:
    """`Register.info` is a `p.PeerInfo`: a field of the wrong type or value is refused as the
    registration is decoded, with BAD_REQUEST and the field's path, before it reaches the
    registry."""
    head = msgspec.msgpack.decode(p.encode(p.Register(id=1, role="worker", name="w0", pid=1))[0])
    head["info"] = info
    with pytest.raises(p.DecodeError) as refused:
        p.decode([msgspec.msgpack.encode(head)])
    assert refused.value.code is Code.BAD_REQUEST and refused.value.ref == 1
    assert refused.value.reason == f"register: {reason}"


def test_live_peers_get_a_heartbeat_and_silent_ones_are_lost() -> None:
    rig = Rig()
    rig.join("w0")
    rig.join("w1").last_seen = 2.5
    rig.reg.check_hearts(3.0)  # 3 periods of silence: not yet
    assert rig.out() == [
        (BACKEND, b"w0", p.Heartbeat()),
        (BACKEND, b"w1", p.Heartbeat()),
    ]
    rig.reg.check_hearts(3.5)
    assert rig.out() == [(BACKEND, b"w1", p.Heartbeat())]
    assert list(rig.ctx.peers) == ["w1"] and rig.ctx.by_addr == {b"w1": "w1"}
    assert rig.events == [("worker_lost", "w0"), ("change", 3.5)]


# ====================================================================== catalogue


def test_deploy_asks_a_plan_places_every_stage_then_answers() -> None:
    rig = Rig()
    rig.join("part")
    rig.join("w0")
    rig.join("w1", budget=80 * MIB)
    spec = spec_of("m", replicas=2)
    rig.reg.deploy(C, p.Deploy(id=5, spec=spec), 0.0)
    full = spec
    request = p.PlanAsk(spec=spec, kind="stages", stages=None, mem_cap=80 * MIB)
    assert rig.out() == [(BACKEND, PART, p.PlanJob(id=1, request=request))]
    assert rig.peer("part").inflight_plans == 1
    plan = typed_plan([10 * MIB])
    rig.reg.plan_reply(rig.peer("part"), p.PlanReply(id=1, plan=plan, inputs=None), 0.1)
    assert rig.out() == [
        (BACKEND, b"w0", p.DeployStage(id=2, model="m", stage=0, spec=full, plan=plan)),
        (BACKEND, b"w1", p.DeployStage(id=3, model="m", stage=0, spec=full, plan=plan)),
    ]
    model = rig.ctx.models["m"]
    assert model.state is ModelState.DEPLOYING and rig.peer("part").inflight_plans == 0
    assert len(rig.reg.plan_cache) == 1
    rig.reg.stage_ready(rig.peer("w0"), p.StageReady(2, "m", 0, nbytes=9 * MIB, seconds=1), 0.2)
    assert rig.out() == [] and rig.events == [("change", 0.2)]
    rig.reg.stage_ready(rig.peer("w1"), p.StageReady(3, "m", 0, nbytes=9 * MIB, seconds=1), 0.3)
    assert model.state is ModelState.READY
    assert rig.out() == [(CLIENT, C, p.Deployed(id=5, model=model_status(model, rig.ctx.peers)))]
    row = model_status(model, rig.ctx.peers)
    assert (row.state, row.bytes, row.replicas) == (
        "ready",
        10 * MIB,
        [
            ReplicaRow(workers=["w0"], live=True, inflight=0),
            ReplicaRow(workers=["w1"], live=True, inflight=0),
        ],
    )
    assert rig.peer("w0").hosted == {("m", 0): 9 * MIB}  # what the worker measured
    assert rig.events == [("change", 0.2), ("change", 0.3)] and rig.ctx.calls == {}


def test_a_plan_asked_twice_is_answered_from_the_cache() -> None:
    rig = Rig()
    rig.join("part")
    ask = p.PlanRequest(id=7, spec=spec_of("m"), kind="chunks", target_bytes=MIB)
    rig.reg.plan_request(C, ask, 0.0)
    ((_, _, job),) = rig.out()
    assert (job.id, job.request.kind, job.request.mem_cap) == (1, "chunks", None)
    plan = typed_plan([MIB, MIB])
    rig.reg.plan_reply(rig.peer("part"), p.PlanReply(id=1, plan=plan, inputs=INPUTS), 0.1)
    assert rig.out() == [(CLIENT, C, p.PlanReply(id=7, plan=plan, inputs=INPUTS))]
    rig.reg.plan_request(b"other", msgspec.structs.replace(ask, id=8), 0.2)
    assert rig.out() == [(CLIENT, b"other", p.PlanReply(id=8, plan=plan, inputs=INPUTS))]


def test_a_stage_larger_than_any_device_fails_the_deploy() -> None:
    rig = Rig()
    rig.join("part")
    rig.join("w0", budget=10 * MIB)
    rig.reg.deploy(C, p.Deploy(id=5, spec=spec_of("big", stages=1)), 0.0)
    rig.out()
    plan = typed_plan([20 * MIB])
    rig.reg.plan_reply(rig.peer("part"), p.PlanReply(id=1, plan=plan), 0.1)
    reason = (
        "'big' stage 0 needs 20971520 bytes but the largest device budget is 10485760 bytes; "
        "deploy with more stages, or omit stages to choose automatically"
    )
    assert rig.out() == [(CLIENT, C, p.Error(id=5, code="too_big", reason=reason))]
    assert rig.ctx.models == {}


def test_a_deploy_not_done_by_its_deadline_is_failed_and_cleaned_up() -> None:
    rig = Rig()
    rig.join("part")
    rig.join("w0")
    rig.reg.deploy(C, p.Deploy(id=5, spec=spec_of("m", replicas=1), timeout_ms=10_000), 0.0)
    rig.reg.plan_reply(rig.peer("part"), p.PlanReply(id=1, plan=typed_plan([MIB])), 0.1)
    rig.out()
    model = rig.ctx.models["m"]
    rig.reg.deploy_overdue(model, 9.9)
    assert rig.out() == []
    rig.reg.deploy_overdue(model, 10.0)
    assert rig.out() == [
        (CLIENT, C, p.Error(id=5, code="timeout", reason="deploy did not finish in time")),
        (BACKEND, b"w0", p.DropStage(id=3, model="m", stage=0)),
    ]
    assert rig.ctx.models == {} and rig.ctx.calls == {} and rig.peer("w0").hosted == {}


def test_undeploy_fails_queued_requests_and_frees_every_stage() -> None:
    rig = Rig()
    rig.join("part")
    w0 = rig.join("w0")
    model = rig.deploy("m", [MIB], replicas=1)
    w0.resident[("m", 0)] = Residency(("m", 0), MIB, Phase.RESIDENT, 0.0)
    model.queue.append(
        Request(
            tag=100,
            client=b"asker",
            client_id=3,
            model="m",
            tensors={},
            rows=1,
            signature=(),
            arrived=0.0,
            deadline=60.0,
        )
    )
    rig.reg.undeploy(C, p.Undeploy(id=6, model="m"), 1.0)
    assert rig.out() == [
        (CLIENT, b"asker", p.Error(id=3, code="model_not_found", reason="'m' was undeployed")),
        (BACKEND, b"w0", p.Evict(id=3, model="m", stage=0)),
        (BACKEND, b"w0", p.DropStage(id=4, model="m", stage=0)),
        (CLIENT, C, p.Undeployed(id=6, model="m")),
    ]
    assert rig.events == [("change", 1.0)]
    assert rig.ctx.models == {} and w0.resident == {} and w0.hosted == {}
    with pytest.raises(FlowmeshError) as info:
        rig.reg.undeploy(C, p.Undeploy(id=7, model="m"), 1.0)
    assert (info.value.code, info.value.reason) == (Code.MODEL_NOT_FOUND, "no model 'm'")


def test_a_plan_call_without_an_answer_fails_its_client() -> None:
    rig = Rig()
    rig.join("part")
    rig.reg.plan_request(C, p.PlanRequest(id=7, spec=spec_of("m")), 0.0)
    rig.out()
    call = rig.ctx.calls.pop(1)
    assert call.deadline == 600.0  # deploy_timeout_s
    rig.reg.call_expired(call, "timeout", None, 600.0)
    assert rig.out() == [
        (CLIENT, C, p.Error(id=7, code="timeout", reason="partitioner part did not answer in time"))
    ]
    assert rig.peer("part").inflight_plans == 0


# ====================================================================== placement and repair


def test_a_lost_worker_s_replicas_are_recreated_on_live_workers() -> None:
    rig = Rig()
    rig.join("part")
    for w in ("w0", "w1", "w2"):
        rig.join(w)
    model = rig.deploy("m", [2 * MIB, MIB], replicas=1)
    assert [r.workers for r in model.replicas] == [["w0", "w1"]]
    rig.reg.peer_dead(rig.peer("w0"), 5.0, "missed heartbeats")
    full = model.spec
    assert rig.out() == [
        (BACKEND, b"w1", p.DropStage(id=4, model="m", stage=1)),
        (BACKEND, b"w1", p.DeployStage(id=5, model="m", stage=0, spec=full, plan=model.plan)),
        (BACKEND, b"w2", p.DeployStage(id=6, model="m", stage=1, spec=full, plan=model.plan)),
    ]
    assert rig.events == [
        ("worker_lost", "w0"),
        ("replica_lost", "m", ["w0", "w1"], "w0"),
        ("change", 5.0),
    ]
    (rep,) = model.replicas
    assert (rep.workers, rep.ready, model.state) == (["w1", "w2"], [False, False], ModelState.READY)
    assert (rig.ctx.calls[5].kind, rig.ctx.calls[5].deadline) == ("stage", 605.0)


def test_a_replica_given_up_after_a_hung_run_is_recreated_away_from_that_worker() -> None:
    rig = Rig()
    rig.join("part")
    rig.join("w0")
    rig.join("w1")
    model = rig.deploy("m", [MIB], replicas=1)
    (rep,) = model.replicas
    assert rep.workers == ["w0"]
    rig.reg.give_up_replica(model, rep, ["w0"], "hung")
    assert rig.out() == [(BACKEND, b"w0", p.DropStage(id=3, model="m", stage=0))]
    assert (model.avoid, model.state) == ({"w0"}, ModelState.UNAVAILABLE)
    rig.reg.give_up_replica(model, rep, ["w0"], "hung")  # no longer one of its replicas
    assert rig.out() == []
    rig.reg.reconcile(6.0)
    full = model.spec
    assert rig.out() == [
        (BACKEND, b"w1", p.DeployStage(id=4, model="m", stage=0, spec=full, plan=model.plan))
    ]
    rig.reg.stage_ready(rig.peer("w1"), p.StageReady(4, "m", 0, nbytes=MIB, seconds=1), 6.5)
    assert model.state is ModelState.READY and rig.out() == []
    assert rig.events == [("change", 6.5)]


def test_a_replica_given_up_is_not_recreated_streamed_on_the_workers_left_trusted() -> None:
    """Two stages on two workers, one of which hung: the one left could hold both only by
    streaming them through its device (slower, and a generating model could not generate);
    the replica goes back on both workers, each stage on one of its own."""
    rig = Rig()
    rig.join("part")
    rig.join("w0")
    rig.join("w1")
    model = rig.deploy("m", [MIB, MIB], replicas=1)
    (rep,) = model.replicas
    rig.reg.give_up_replica(model, rep, rep.workers[:1], "hung")
    rig.out()
    rig.reg.reconcile(6.0)
    (again,) = model.replicas
    assert sorted(again.workers) == ["w0", "w1"] and not again.streamed


def test_a_failed_repair_waits_before_trying_again() -> None:
    rig = Rig(repair_backoff_s=5.0)
    rig.join("part")
    rig.join("w0")
    model = rig.deploy("m", [MIB], replicas=1)
    rig.reg.give_up_replica(model, model.replicas[0], ["w0"], "hung")
    rig.reg.reconcile(1.0)  # only w0 can hold it: back there, rather than nowhere
    assert [m.TYPE for _, _, m in rig.out()] == ["drop_stage", "deploy_stage"]
    call = rig.ctx.calls.pop(4)
    rig.reg.call_failed(rig.peer("w0"), call, "model_error", "factory raised", 2.0)
    assert rig.out() == [(BACKEND, b"w0", p.DropStage(id=5, model="m", stage=0))]
    assert (model.replicas, model.repair_after) == ([], 7.0)
    rig.reg.reconcile(6.9)
    assert rig.out() == []
    rig.reg.reconcile(7.0)
    assert [(a, m.TYPE, m.id) for _, a, m in rig.out()] == [(b"w0", "deploy_stage", 6)]


def test_a_stage_answered_for_a_replica_gone_meanwhile_is_dropped() -> None:
    rig = Rig()
    rig.join("part")
    w0 = rig.join("w0")
    rig.reg.deploy(C, p.Deploy(id=5, spec=spec_of("m", replicas=1)), 0.0)
    rig.reg.plan_reply(rig.peer("part"), p.PlanReply(id=1, plan=typed_plan([MIB])), 0.1)
    rig.out()
    model = rig.ctx.models["m"]
    model.replicas.clear()  # given up while the worker prepared the stage
    rig.reg.stage_ready(w0, p.StageReady(2, "m", 0, nbytes=MIB, seconds=1), 0.2)
    assert rig.out() == [(BACKEND, b"w0", p.DropStage(id=3, model="m", stage=0))]
    assert w0.hosted == {}
    # Answered again: nothing here runs it, so it is dropped again (a worker drops a stage it
    # no longer holds as nothing); nothing is counted.
    rig.reg.stage_ready(w0, p.StageReady(2, "m", 0, nbytes=MIB, seconds=1), 0.3)
    assert rig.out() == [(BACKEND, b"w0", p.DropStage(id=4, model="m", stage=0))]
    assert w0.hosted == {} and rig.ctx.calls == {}


# ---------------------------------------------------------------- calls given up meanwhile
# A worker prepares a stage on a thread: when the broker gives the call up meanwhile (the
# deploy failed or timed out, the model was undeployed, a repair was given up), its StageReady
# still comes, and the stage it names is held on the worker until the broker says to drop it.


def test_a_stage_prepared_after_its_deploy_timed_out_is_dropped() -> None:
    rig = Rig()
    rig.join("part")
    w0 = rig.join("w0")
    spec = spec_of("m", replicas=1)
    rig.reg.deploy(C, p.Deploy(id=5, spec=spec, timeout_ms=10_000), 0.0)
    rig.reg.plan_reply(rig.peer("part"), p.PlanReply(id=1, plan=typed_plan([MIB])), 0.1)
    assert rig.out() == [plan_job(1, spec), deploy_stage(2, b"w0", spec, [MIB])]
    rig.reg.deploy_overdue(rig.ctx.models["m"], 10.0)
    assert rig.out() == [
        (CLIENT, C, p.Error(id=5, code="timeout", reason="deploy did not finish in time")),
        (BACKEND, b"w0", p.DropStage(id=3, model="m", stage=0)),
    ]
    rig.reg.stage_ready(w0, p.StageReady(2, "m", 0, nbytes=MIB, seconds=12), 12.0)
    assert rig.out() == [(BACKEND, b"w0", p.DropStage(id=4, model="m", stage=0))]
    assert rig.ctx.models == {} and rig.ctx.calls == {} and w0.hosted == {}
    assert rig.events == []


def test_a_stage_prepared_after_its_repair_was_given_up_is_dropped() -> None:
    rig = Rig(repair_backoff_s=5.0)
    rig.join("part")
    w0 = rig.join("w0")
    model = rig.deploy("m", [MIB], replicas=1)
    rig.reg.give_up_replica(model, model.replicas[0], "w0", "hung")
    rig.reg.reconcile(1.0)  # only w0 can hold it: back there
    assert rig.out() == [
        (BACKEND, b"w0", p.DropStage(id=3, model="m", stage=0)),
        deploy_stage(4, b"w0", model.spec, [MIB]),
    ]
    rig.reg.call_expired(rig.ctx.calls.pop(4), "timeout", None, 601.0)
    assert rig.out() == [(BACKEND, b"w0", p.DropStage(id=5, model="m", stage=0))]
    assert model.replicas == []
    rig.reg.stage_ready(w0, p.StageReady(4, "m", 0, nbytes=MIB, seconds=601), 602.0)
    assert rig.out() == [(BACKEND, b"w0", p.DropStage(id=6, model="m", stage=0))]
    assert w0.hosted == {} and model.replicas == [] and rig.events == []


def test_undeploying_a_model_still_planning_answers_its_deploy() -> None:
    rig = Rig()
    rig.join("part")
    rig.join("w0")
    spec = spec_of("m")
    rig.reg.deploy(C, p.Deploy(id=5, spec=spec), 0.0)
    assert rig.out() == [plan_job(1, spec)]
    rig.reg.undeploy(b"other", p.Undeploy(id=6, model="m"), 1.0)
    reason = "'m' was undeployed while deploying"
    assert rig.out() == [
        (CLIENT, C, p.Error(id=5, code="model_not_found", reason=reason)),
        (CLIENT, b"other", p.Undeployed(id=6, model="m")),
    ]
    assert rig.ctx.models == {} and rig.ctx.calls == {} and rig.peer("part").inflight_plans == 0
    with pytest.raises(FlowmeshError, match="no pending plan call 1 for part"):
        rig.reg.plan_reply(rig.peer("part"), p.PlanReply(id=1, plan=typed_plan([MIB])), 2.0)
    assert rig.out() == []  # answered once


def test_undeploying_a_deploying_model_answers_its_deploy_and_drops_its_late_stage() -> None:
    rig = Rig()
    rig.join("part")
    w0 = rig.join("w0")
    spec = spec_of("m", replicas=1)
    rig.reg.deploy(C, p.Deploy(id=5, spec=spec), 0.0)
    rig.reg.plan_reply(rig.peer("part"), p.PlanReply(id=1, plan=typed_plan([MIB])), 0.1)
    assert rig.out() == [plan_job(1, spec), deploy_stage(2, b"w0", spec, [MIB])]
    rig.reg.undeploy(b"other", p.Undeploy(id=6, model="m"), 1.0)
    reason = "'m' was undeployed while deploying"
    assert rig.out() == [
        (CLIENT, C, p.Error(id=5, code="model_not_found", reason=reason)),
        (BACKEND, b"w0", p.DropStage(id=3, model="m", stage=0)),
        (CLIENT, b"other", p.Undeployed(id=6, model="m")),
    ]
    assert rig.events == [("change", 1.0)]
    rig.reg.stage_ready(w0, p.StageReady(2, "m", 0, nbytes=MIB, seconds=2), 2.0)
    assert rig.out() == [(BACKEND, b"w0", p.DropStage(id=4, model="m", stage=0))]
    assert rig.ctx.models == {} and rig.ctx.calls == {} and w0.hosted == {}
    assert rig.events == [("change", 1.0)]


def test_a_stage_ready_nobody_awaits_never_drops_a_stage_a_live_model_counts_on() -> None:
    rig = Rig()
    rig.join("part")
    w0 = rig.join("w0")
    rig.join("w1")
    spec = spec_of("m", replicas=1)
    rig.reg.deploy(C, p.Deploy(id=5, spec=spec, timeout_ms=10_000), 0.0)
    rig.reg.plan_reply(rig.peer("part"), p.PlanReply(id=1, plan=typed_plan([MIB])), 0.1)
    rig.reg.deploy_overdue(rig.ctx.models["m"], 10.0)
    assert rig.out() == [
        plan_job(1, spec),
        deploy_stage(2, b"w0", spec, [MIB]),
        (CLIENT, C, p.Error(id=5, code="timeout", reason="deploy did not finish in time")),
        (BACKEND, b"w0", p.DropStage(id=3, model="m", stage=0)),
    ]
    # Deployed again (its plan from the cache) onto the same worker before the first
    # preparation's StageReady comes: that one must not drop the stage now being prepared.
    rig.reg.deploy(C, p.Deploy(id=7, spec=spec), 11.0)
    assert rig.out() == [deploy_stage(4, b"w0", spec, [MIB])]
    with pytest.raises(FlowmeshError, match="no pending stage call 2 for w0"):
        rig.reg.stage_ready(w0, p.StageReady(2, "m", 0, nbytes=MIB, seconds=12), 12.0)
    assert rig.out() == [] and list(rig.ctx.calls) == [4] and w0.hosted == {("m", 0): MIB}
    rig.reg.stage_ready(w0, p.StageReady(4, "m", 0, nbytes=MIB, seconds=2), 13.0)
    model = rig.ctx.models["m"]
    assert rig.out() == [(CLIENT, C, p.Deployed(id=7, model=model_status(model, rig.ctx.peers)))]
    # Nor one naming that stage, now held; nor one from a peer that holds no stages.
    with pytest.raises(FlowmeshError, match="no pending stage call 99 for w0"):
        rig.reg.stage_ready(w0, p.StageReady(99, "m", 0, nbytes=MIB, seconds=1), 14.0)
    with pytest.raises(FlowmeshError, match="no pending stage call 99 for part"):
        rig.reg.stage_ready(rig.peer("part"), p.StageReady(99, "x", 0, nbytes=1, seconds=1), 14.0)
    assert rig.out() == [] and w0.hosted == {("m", 0): MIB} and model.state is ModelState.READY
    # The same stage answered by a worker that runs none of it: dropped there, and only there.
    rig.reg.stage_ready(rig.peer("w1"), p.StageReady(99, "m", 0, nbytes=MIB, seconds=1), 15.0)
    assert rig.out() == [(BACKEND, b"w1", p.DropStage(id=5, model="m", stage=0))]
    assert w0.hosted == {("m", 0): MIB} and rig.peer("w1").hosted == {}


# ====================================================================== checks on what peers say


def test_checks_refuse_what_would_break_status_or_placement() -> None:
    stats = p.WorkerStats(peak_bytes=1, kv_stage_bytes={"m/0": 2}, prefault_s=0.5)
    assert received(p.Heartbeat(stats=stats)).stats == stats
    # Types, bounds and finite numbers: refused on receipt, naming the field.
    many = {f"m/{i}": 1 for i in range(MAX_HELD_ENTRIES + 1)}
    for bad, where in [
        (p.WorkerStats(prefault_s=float("nan")), "$.stats.prefault_s"),
        (p.WorkerStats(peak_bytes=-1), "$.stats.peak_bytes"),
        (p.WorkerStats(host_bytes="lots"), "$.stats.host_bytes"),  # type: ignore[arg-type]
        (p.WorkerStats(kv_blocks_free=-2), "$.stats.kv_blocks_free"),
        (p.WorkerStats(kv_stage_bytes={"m/0": -1}), "$.stats.kv_stage_bytes[...]"),
        (p.WorkerStats(kv_stage_bytes=[1]), "$.stats.kv_stage_bytes"),  # type: ignore[arg-type]
        (p.WorkerStats(resident_stages=many), "$.stats.resident_stages"),
        (p.WorkerStats(preparing={"m/0": [1, b"x"]}), "$.stats.preparing[...][1]"),  # type: ignore[list-item]
        (p.PartitionerStats(planned=True), "$.stats.planned"),  # type: ignore[arg-type]
    ]:
        with pytest.raises(FlowmeshError) as info:
            received(p.Heartbeat(stats=bad))
        assert info.value.code == Code.BAD_MESSAGE and info.value.reason.endswith(f"`{where}`")
    with pytest.raises(FlowmeshError) as info:  # a figure no peer reports
        received(p.Heartbeat(stats={"role": "worker", "lanes": [1, 2]}))  # type: ignore[arg-type]
    assert info.value.code == Code.BAD_MESSAGE and "lanes" in info.value.reason
    # A stored plan is taken by its own validation (`Plan.from_dict`), whatever its values are.
    assert stored_plan(plan_of([3, 4])).range_bytes == (3, 4)
    for bad, said in [
        ({**plan_of([3, 4]), "range_bytes": [3]}, "range_bytes must be a list of 2 integers"),
        ({**plan_of([3]), "ranges": [[0, 2]]}, "ranges end at block 2, but the model has 1"),
        ({**plan_of([3]), "range_bytes": ["lots"]}, "range_bytes must hold non-negative"),
        ({**plan_of([3]), "block_names": [["b0"]]}, "block_names must be distinct"),
        ({"range_bytes": [3]}, "plan version None is not supported"),
    ]:
        with pytest.raises(FlowmeshError) as info:
            stored_plan(bad)
        assert info.value.code == Code.PLAN_ERROR and said in info.value.reason, info.value


def test_the_rooms_share_the_very_tables() -> None:
    # The rooms share these by reference; a copy would split the state.
    rig = Rig()
    assert rig.reg.peers is rig.ctx.peers and rig.reg.models is rig.ctx.models
    assert rig.reg.calls is rig.ctx.calls and rig.reg.by_addr is rig.ctx.by_addr
    assert Replica(workers=["w0"], ready=[True]).live
