"""BrokerCore in-process: exact messages out for each event in, on a fake clock, no sockets."""

from __future__ import annotations

import msgspec
import pytest

from broker.core import BACKEND
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from tests.support.broker import CLIENT_A, CLIENT_B, MIB, Harness, kinds, only, plan_of, ref


def test_worker_is_ready_only_after_its_first_heartbeat() -> None:
    h = Harness()
    out = h.backend(
        b"w0",
        p.Register(
            id=7, role="worker", name="w0", pid=1, device="cpu", kind="cpu", budget_bytes=MIB
        ),
    )
    assert kinds(out) == [(b"w0", "register_ack")] and out[0][2].id == 7
    assert h.core.status(0).workers[0].ready is False
    h.backend(b"w0", p.Heartbeat(stats=p.WorkerStats(peak_bytes=5)))
    w = h.core.status(0).workers[0]
    assert w.ready is True and w.peak_bytes == 5


def test_unknown_peer_is_told_to_register() -> None:
    h = Harness()
    out = h.backend(b"stranger", p.Heartbeat())
    assert kinds(out) == [(b"stranger", "disconnect")]


def test_deploy_plans_places_and_answers() -> None:
    h = Harness()
    h.partitioner()
    h.worker("w0")
    h.worker("w1")
    model = h.deploy("m", [10 * MIB], replicas=2)
    assert model.state == "ready"
    assert sorted(r.workers[0] for r in model.replicas) == ["w0", "w1"]


def test_deploy_refuses_factories_outside_the_allow_list() -> None:
    h = Harness()
    h.partitioner()
    h.worker("w0")
    with pytest.raises(FlowmeshError) as info:
        h.client(CLIENT_A, p.Deploy(id=1, spec={"name": "x", "factory": "os:system"}))
    assert info.value.code is Code.NOT_ALLOWED


def test_deploy_refuses_generations_settings_on_a_factory_model() -> None:
    h = Harness()
    h.partitioner()
    h.worker("w0")
    spec = {"name": "x", "factory": "flowmesh.examples:mlp", "max_seqs": 4}
    with pytest.raises(FlowmeshError) as info:
        h.client(CLIENT_A, p.Deploy(id=1, spec=spec))
    assert info.value.code is Code.BAD_REQUEST
    assert info.value.reason.startswith("max_seqs: generation's settings, for a language model")
    assert h.core.models == {}


def test_deploy_refuses_a_stage_larger_than_any_device() -> None:
    h = Harness()
    part = h.partitioner()
    h.worker("w0", budget=10 * MIB)
    out = h.client(
        CLIENT_A,
        p.Deploy(
            id=5, spec={"name": "big", "stages": 1, "seed": 0, "factory": "flowmesh.examples:mlp"}
        ),
    )
    job = only(out, p.PlanJob)[0]
    out = h.backend(
        part,
        p.PlanReply(
            id=job.id,
            plan=plan_of([20 * MIB], blocks_per_stage=2),
        ),
    )
    (err,) = only(out, p.Error)
    assert err.id == 5 and err.code == Code.TOO_BIG and "more stages" in err.reason
    assert "big" not in h.core.models


def test_cold_request_loads_then_runs_and_result_reaches_its_client() -> None:
    h = Harness()
    h.partitioner()
    w0 = h.worker("w0")
    h.deploy("m", [10 * MIB], replicas=1)
    rid, out = h.infer("m")
    assert kinds(out) == [(w0, "load"), (w0, "run")]
    run = only(out, p.Run)[0]
    assert run.parts[0][1] == 1 and [list(part) for part in run.tensors] == [[""]]
    out = h.finish(w0, run)
    (res,) = only(out, p.Result)
    assert out[0][1] == CLIENT_A and res.id == rid and list(res.tensors) == [""]


def test_residency_evicts_least_recently_used_idle_model() -> None:
    h = Harness()
    h.partitioner()
    w0 = h.worker("w0", budget=100 * MIB)
    for name in ("a", "b", "c"):
        h.deploy(name, [40 * MIB], replicas=1)
    for name in ("a", "b"):
        _, out = h.infer(name)
        h.loaded(w0, out, 40 * MIB)
        h.now += 1
        h.finish(w0, only(out, p.Run)[0])
    h.now += 1
    _, out = h.infer("a")  # a is now more recently used than b
    h.finish(w0, only(out, p.Run)[0])
    _, out = h.infer("c")
    (load,) = only(out, p.Evict | p.Load)  # the worker evicts; b is what we expect it to
    assert (load.model, h.core.peers["w0"].leaving) == ("c", {("b", 0): load.id})
    st = h.core.status(h.now)
    assert st.workers[0].resident_bytes <= 100 * MIB
    assert st.workers[0].resident == ["a/0", "c/0"]
    h.backend(w0, p.Resident(stages=[["a", 0, 40 * MIB], ["c", 0, 40 * MIB]], after_load=load.id))
    assert h.core.status(h.now).workers[0].evictions == 1


def test_never_evicts_a_model_with_running_or_queued_work() -> None:
    h = Harness()
    h.partitioner()
    w0 = h.worker("w0", budget=50 * MIB)
    h.deploy("a", [40 * MIB], replicas=1)
    h.deploy("b", [40 * MIB], replicas=1)
    _, out = h.infer("a")
    run_a = only(out, p.Run)[0]
    h.loaded(w0, out, 40 * MIB)
    _, out = h.infer("b")
    assert out == []  # a is running: b waits
    out = h.finish(w0, run_a)
    assert [m.TYPE for m in only(out, p.Evict | p.Load | p.Run)] == ["load", "run"]
    assert list(h.core.peers["w0"].leaving) == [("a", 0)]


def test_queued_requests_for_one_model_run_as_one_batch() -> None:
    h = Harness()
    h.partitioner()
    w0 = h.worker("w0")
    h.deploy("m", [10 * MIB], replicas=1, max_batch=4)
    _, out = h.infer("m")
    first = only(out, p.Run)[0]
    _, out = h.infer("m")  # a pipeline of one stage keeps 2 batches in flight
    second = only(out, p.Run)[0]
    waiting = [h.infer("m", client=CLIENT_B)[0] for _ in range(5)]
    out = h.finish(w0, first)
    (batch,) = only(out, p.Run)
    assert [rows for _, rows in batch.parts] == [1, 1, 1, 1]  # capped by max_batch_size
    assert [list(part) for part in batch.tensors] == [[""]] * 4
    out = h.finish(w0, batch)
    assert sorted(r.id for r in only(out, p.Result)) == waiting[:4]
    assert all(addr == CLIENT_B for _, addr, m in out if isinstance(m, p.Result))
    assert second.parts[0][1] == 1


def test_wrong_inputs_and_unknown_models_are_refused() -> None:
    h = Harness()
    h.partitioner()
    h.worker("w0")
    h.deploy("m", [MIB], replicas=1)
    with pytest.raises(FlowmeshError) as info:
        h.client(CLIENT_A, p.Infer(id=1, model="nope", tensors={"": ref(1, 4)}))
    assert info.value.code is Code.MODEL_NOT_FOUND and "deployed: m" in info.value.reason
    with pytest.raises(FlowmeshError) as info:
        h.client(CLIENT_A, p.Infer(id=2, model="m", tensors={"": ref(1, 5)}))
    assert info.value.code is Code.BAD_REQUEST and "expects Nx4" in info.value.reason
    with pytest.raises(FlowmeshError) as info:
        h.client(CLIENT_A, p.Infer(id=3, model="m", tensors={"": ref(1, 4, dtype="int64")}))
    assert info.value.code is Code.BAD_REQUEST and "float32" in info.value.reason


def test_queued_request_past_its_deadline_gets_timeout() -> None:
    h = Harness()
    h.partitioner()
    w0 = h.worker("w0", budget=50 * MIB)
    h.deploy("a", [40 * MIB], replicas=1)
    h.deploy("b", [40 * MIB], replicas=1)
    _, out = h.infer("a")
    h.loaded(w0, out, 40 * MIB)
    rid, _ = h.infer("b", timeout_ms=500)
    h.now = 0.6
    h.backend(w0, p.Heartbeat())
    h.core.tick(h.now)
    (err,) = only(h.out(), p.Error)
    assert err.id == rid and err.code == Code.TIMEOUT


def test_dead_worker_requests_retry_on_another_replica() -> None:
    h = Harness()
    h.partitioner()
    w0, w1 = h.worker("w0"), h.worker("w1")
    h.deploy("m", [MIB], replicas=2)
    rid, out = h.infer("m")
    (dead,) = [a for _, a, m in out if isinstance(m, p.Run)]
    alive = w1 if dead == w0 else w0
    h.now = 3.5  # the dead one stops beating; the other keeps going
    h.backend(alive, p.Heartbeat())
    h.backend(b"part", p.Heartbeat())
    h.core.tick(h.now)
    out = h.out()
    retried = [(a, m) for _, a, m in out if isinstance(m, p.Run)]
    assert len(retried) == 1 and retried[0][0] == alive
    res = only(h.finish(alive, retried[0][1]), p.Result)
    assert [r.id for r in res] == [rid]


def test_dead_worker_without_another_replica_answers_worker_lost() -> None:
    h = Harness()
    h.partitioner()
    w0 = h.worker("w0")
    h.deploy("m", [MIB], replicas=1)
    rid, _ = h.infer("m")
    h.now = 3.5
    h.backend(b"part", p.Heartbeat())
    h.core.tick(h.now)
    errs = only(h.out(), p.Error)
    assert [(e.id, e.code) for e in errs] == [(rid, Code.WORKER_LOST)]
    assert "w0" in errs[0].reason
    assert w0 not in h.core.by_addr


def test_two_stage_model_relays_activations_between_workers() -> None:
    h = Harness()
    h.partitioner()
    w0, w1 = h.worker("w0"), h.worker("w1")
    h.deploy("m", [MIB, MIB], replicas=1)
    rid, out = h.infer("m")
    loads = [(a, m.stage) for _, a, m in out if isinstance(m, p.Load)]
    assert sorted(loads) == [(w0, 0), (w1, 1)] or sorted(loads) == [(w0, 1), (w1, 0)]
    (run0,) = only(out, p.Run)
    (first,) = [a for _, a, m in out if isinstance(m, p.Run)]
    out = h.finish(first, run0)
    (run1,) = only(out, p.Run)
    assert run1.stage == 1 and out[0][1] != first
    out = h.finish(out[0][1], run1)
    assert [r.id for r in only(out, p.Result)] == [rid]


def test_a_load_the_worker_could_not_place_is_asked_again_with_its_run() -> None:
    h = Harness(prefetch=False)
    h.partitioner()
    w0 = h.worker("w0", budget=100 * MIB)
    h.deploy("a", [30 * MIB], replicas=1)
    h.deploy("b", [30 * MIB], replicas=1)
    h.deploy("c", [30 * MIB], replicas=1)
    for name in ("a", "b"):
        _, out = h.infer(name)
        h.loaded(w0, out, 30 * MIB)
        h.finish(w0, only(out, p.Run)[0])
    _, out = h.infer("c")
    load, run = only(out, p.Load)[0], only(out, p.Run)[0]
    assert only(out, p.Evict) == [] and h.core.peers["w0"].leaving == {}  # 40 MiB free
    # The worker evicted a for it (fragmentation: its choice) and still found no room.
    h.backend(w0, p.Resident(stages=[["b", 0, 30 * MIB]], after_load=load.id))
    h.backend(w0, p.Error(id=load.id, code=str(Code.NO_SPACE), reason="fragmented"))
    out = h.backend(w0, p.Error(id=run.id, code=str(Code.NOT_RESIDENT), reason="not loaded"))
    assert [(m.TYPE, m.model) for m in only(out, p.Evict | p.Load | p.Run)] == [
        ("load", "c"),
        ("run", "c"),
    ]
    assert sorted(h.core.peers["w0"].resident) == [("b", 0), ("c", 0)]


def test_starving_request_may_evict_a_model_with_queued_work() -> None:
    h = Harness(starvation_s=2.0)
    h.partitioner()
    w0 = h.worker("w0", budget=50 * MIB)
    h.deploy("hot", [40 * MIB], replicas=1, max_batch=2)
    h.deploy("cold", [40 * MIB], replicas=1)
    _, out = h.infer("hot")
    h.loaded(w0, out, 40 * MIB)
    runs = only(out, p.Run)
    runs += only(h.infer("hot")[1], p.Run)
    h.now = 0.1
    h.infer("cold")
    h.now = 0.2
    for _ in range(5):  # hot keeps a queue at all times
        h.infer("hot")
    h.now = 2.5
    # Hot is drained (no new batches start) until cold gets its turn.
    out = h.finish(w0, runs[0])
    assert only(out, p.Run) == []
    out = h.finish(w0, runs[1])
    assert [(m.TYPE, m.model) for m in only(out, p.Evict | p.Load | p.Run)] == [
        ("load", "cold"),
        ("run", "cold"),
    ]
    assert list(h.core.peers["w0"].leaving) == [("hot", 0)]


def test_a_failed_load_retried_at_once_keeps_exact_running_counts() -> None:
    # The load fails, the broker loads again at once (a new residency) and only then hears that
    # the first run failed: that failure must not be counted against the new residency, or the
    # stage would look busy forever and never be evicted.
    h = Harness()
    h.partitioner()
    w0 = h.worker("w0", budget=100 * MIB)
    h.deploy("a", [60 * MIB], replicas=1)
    h.deploy("b", [60 * MIB], replicas=1)
    _, out = h.infer("a")
    load, run = only(out, p.Load)[0], only(out, p.Run)[0]
    out = h.backend(w0, p.Error(id=load.id, code=str(Code.NO_SPACE), reason="fragmented"))
    h.infer("a")  # dispatched again: new load, new run
    (res,) = h.core.peers["w0"].resident.values()
    assert res.inflight == 1
    h.backend(w0, p.Error(id=run.id, code=str(Code.NOT_RESIDENT), reason="not loaded"))
    # The late failure left the old residency's count alone; its request runs again here.
    assert res.inflight == 2
    retry_runs = [b for b in h.core.batches.values() if b.model == "a"]
    for b in retry_runs:
        h.finish(
            w0,
            p.Run(
                id=b.run_id,
                model="a",
                stage=0,
                parts=[[r.tag, r.rows] for r in b.requests],
                tensors={},
            ),
        )
    h.backend(
        w0, p.Loaded(id=next(iter(h.core.calls)), model="a", stage=0, nbytes=60 * MIB, seconds=0.1)
    )
    assert res.inflight == 0 and h.core.peers["w0"].inflight_runs == 0
    _, out = h.infer("b")  # a is idle: it must be evictable
    assert [(m.TYPE, m.model) for m in only(out, p.Evict | p.Load)] == [("load", "b")]
    assert list(h.core.peers["w0"].leaving) == [("a", 0)]


# ---------------------------------------------------------------- nothing waits forever


def live_until(h: Harness, until: float) -> list[tuple[str, bytes, p.Message]]:
    """Every registered peer keeps heartbeating while the clock moves on to `until`; the
    broker ticks once a second. Returns everything the broker sent meanwhile."""
    out = []
    while h.now < until:
        h.now = min(until, h.now + 1.0)
        for peer in list(h.core.peers.values()):
            out += h.backend(peer.addr, p.Heartbeat())
        h.core.tick(h.now)
        out += h.out()
    return out


def test_a_lost_run_result_times_out_and_the_replica_is_recreated_elsewhere() -> None:
    h = Harness(run_timeout_s=10.0)
    h.partitioner()
    w0, w1 = h.worker("w0"), h.worker("w1")
    h.deploy("m", [MIB], replicas=1)
    (rep,) = h.core.models["m"].replicas
    hung = rep.workers[0].encode()
    rid, out = h.infer("m", timeout_ms=5000)
    h.loaded(hung, out, MIB)
    out = live_until(h, 5.0)  # the request's own deadline: answered, the batch still pending
    assert [(e.id, e.code) for e in only(out, p.Error)] == [(rid, Code.TIMEOUT)]
    assert "running" in only(out, p.Error)[0].reason
    assert len(h.core.batches) == 1
    out = live_until(h, 11.0)  # the run's deadline: the stage hung
    assert h.core.batches == {} and h.core.totals["hung_runs"] == 1
    assert [(a, m.TYPE) for a, m in [(a, m) for _, a, m in out] if m.TYPE != "heartbeat"] == [
        (hung, "evict"),
        (hung, "drop_stage"),
        (w1 if hung == w0 else w0, "deploy_stage"),
    ]
    peer = h.core.peers[hung.decode()]
    assert peer.inflight_runs == 0 and peer.resident == {} and peer.hosted == {}
    # The new replica lives on the other worker and serves.
    (deploy,) = only(out, p.DeployStage)
    other = w1 if hung == w0 else w0
    h.backend(other, p.StageReady(id=deploy.id, model="m", stage=0, nbytes=MIB, seconds=0.1))
    rid, out = h.infer("m")
    assert [a for _, a, m in out if isinstance(m, p.Run)] == [other]
    (res,) = only(h.finish(other, only(out, p.Run)[0]), p.Result)
    assert res.id == rid
    # The hung worker is avoided for this model while it lives; once it is gone its name goes
    # too (a CPU worker's carries its pid: kept, they would pile up with every restart).
    assert h.core.models["m"].avoid == {hung.decode()}
    while hung.decode() in h.core.peers:
        h.now += 1.0
        for addr in (other, b"part"):
            h.backend(addr, p.Heartbeat())
        h.core.tick(h.now)
    h.core.tick(h.now + 1.0)
    assert h.core.models["m"].avoid == set()


def test_a_late_result_of_a_hung_run_is_dropped() -> None:
    h = Harness(run_timeout_s=10.0)
    h.partitioner()
    w0 = h.worker("w0")
    h.deploy("m", [MIB], replicas=1)
    _, out = h.infer("m", timeout_ms=1000)
    run = only(out, p.Run)[0]
    live_until(h, 11.0)
    assert h.finish(w0, run) == []


def test_a_lost_loaded_drops_the_loading_residency_and_the_next_request_loads_again() -> None:
    h = Harness(load_timeout_s=10.0, run_timeout_s=100.0)
    h.partitioner()
    w0 = h.worker("w0")
    h.deploy("m", [MIB], replicas=1)
    _, out = h.infer("m")
    (load,) = only(out, p.Load)
    h.finish(w0, only(out, p.Run)[0])  # the run itself went through; its Loaded was lost
    assert h.core.peers["w0"].resident[("m", 0)].phase.value == "loading"
    out = live_until(h, 11.0)
    assert [(m.TYPE, m.model) for m in only(out, p.Evict)] == [("evict", "m")]
    assert h.core.peers["w0"].resident == {} and h.core.calls == {}
    # A Loaded that arrives after its call expired changes nothing.
    h.backend(w0, p.Loaded(id=load.id, model="m", stage=0, nbytes=MIB, seconds=0.1))
    assert h.core.peers["w0"].resident == {}
    _, out = h.infer("m")
    assert [m.TYPE for m in only(out, p.Load | p.Run)] == ["load", "run"]


def test_a_lost_stage_ready_fails_the_deploy_at_its_deadline() -> None:
    h = Harness()
    part = h.partitioner()
    h.worker("w0")
    out = h.client(
        CLIENT_A,
        p.Deploy(
            id=9,
            spec={"name": "m", "factory": "flowmesh.examples:mlp", "seed": 0},
            timeout_ms=20_000,
        ),
    )
    job = only(out, p.PlanJob)[0]
    plan = plan_of([MIB])
    out = h.backend(part, p.PlanReply(id=job.id, plan=plan))
    assert len(only(out, p.DeployStage)) == 1  # ...and its StageReady never comes
    out = live_until(h, 21.0)
    errs = only(out, p.Error)
    assert [(e.id, e.code) for e in errs] == [(9, Code.TIMEOUT)]
    assert "m" not in h.core.models and h.core.calls == {}
    assert [m.TYPE for m in only(out, p.DropStage)] == ["drop_stage"]


def test_a_lost_stage_ready_of_a_repair_gives_it_up_and_tries_again_later() -> None:
    h = Harness(deploy_timeout_s=10.0, repair_backoff_s=5.0)
    h.partitioner()
    w0, w1 = h.worker("w0"), h.worker("w1")
    h.deploy("m", [MIB], replicas=2)
    h.worker("w2")
    # w1 dies; its replica is re-created on w2, whose StageReady is lost.
    h.now = 3.5
    for a in (w0, b"part", b"w2"):
        h.backend(a, p.Heartbeat())
    h.core.tick(h.now)
    (first,) = only(h.out(), p.DeployStage)
    assert h.core.calls[first.id].peer == "w2"
    out = live_until(h, 14.0)
    assert [m.TYPE for m in only(out, p.DropStage)] == ["drop_stage"]
    assert len(h.core.models["m"].replicas) == 1
    assert only(out, p.DeployStage) == []  # not again before the back-off
    out = live_until(h, 20.0)
    (again,) = only(out, p.DeployStage)
    assert again.id != first.id
    assert w1 not in h.core.by_addr


def test_a_lost_plan_reply_answers_the_client_and_frees_the_partitioner() -> None:
    h = Harness()
    h.partitioner()
    h.worker("w0")
    spec = {"name": "plan", "factory": "flowmesh.examples:mlp"}
    h.client(CLIENT_A, p.PlanRequest(id=4, spec=spec, timeout_ms=3000))
    assert h.core.peers["part"].inflight_plans == 1
    out = live_until(h, 4.0)
    assert [(e.id, e.code) for e in only(out, p.Error)] == [(4, Code.TIMEOUT)]
    assert h.core.peers["part"].inflight_plans == 0 and h.core.calls == {}


def test_a_plan_given_up_with_its_deploy_is_no_longer_counted_on_its_partitioner() -> None:
    """A deploy undeployed while its plan is computed, and one whose deadline passes first:
    their plans are not counted as in progress on the partitioner for good (the count is in
    status, and chooses the partitioner of the next plan)."""
    h = Harness(deploy_timeout_s=3.0)
    part = h.partitioner()
    h.worker("w0")
    spec = {"name": "early", "factory": "flowmesh.examples:mlp"}
    (job,) = only(h.client(CLIENT_A, p.Deploy(id=1, spec=spec)), p.PlanJob)
    assert h.core.peers["part"].inflight_plans == 1
    h.client(CLIENT_A, p.Undeploy(id=2, model="early"))
    assert h.core.peers["part"].inflight_plans == 0 and h.core.calls == {}
    late = {"name": "late", "factory": "flowmesh.examples:mlp"}
    (job,) = only(h.client(CLIENT_A, p.Deploy(id=3, spec=late)), p.PlanJob)
    out = live_until(h, 4.0)
    assert [(e.id, e.code) for e in only(out, p.Error)] == [(3, Code.TIMEOUT)]
    assert h.core.peers["part"].inflight_plans == 0 and h.core.calls == {}
    answer = p.PlanReply(id=job.id, plan=plan_of([MIB]), inputs={})
    with pytest.raises(FlowmeshError, match="no pending plan call"):
        h.backend(part, answer)  # too late: refused
    assert h.core.peers["part"].inflight_plans == 0


def test_a_malformed_plan_is_refused_on_receipt_and_fails_the_deploy_at_once() -> None:
    h = Harness()
    part = h.partitioner()
    h.worker("w0")
    spec = {"name": "m", "factory": "flowmesh.examples:mlp", "seed": 0}
    job = only(h.client(CLIENT_A, p.Deploy(id=3, spec=spec, timeout_ms=3000)), p.PlanJob)[0]
    # The plan checks itself as the reply is decoded: the broker never takes it, but learns
    # that the answer to its plan job was refused, and fails the deploy without waiting.
    with pytest.raises(p.DecodeError) as info:
        h.backend(part, p.PlanReply(id=job.id, plan={"range_bytes": ["lots"]}))
    assert info.value.code == Code.BAD_REQUEST and "$.plan.range_bytes" in info.value.reason
    (err,) = only(h.out(), p.Error)
    assert err.id == 3 and err.code == Code.BAD_REQUEST
    assert "part's answer was refused" in err.reason and "$.plan.range_bytes" in err.reason
    assert h.core.calls == {} and len(h.core.plan_cache) == 0 and "m" not in h.core.models
    assert only(live_until(h, 4.0), p.Error) == []  # nothing left to time out


def test_a_refused_answer_naming_another_peers_call_changes_nothing() -> None:
    h = Harness()
    part = h.partitioner()
    other = h.worker("w0")
    stranger = b"stranger"  # never registered
    spec = {"name": "m", "factory": "flowmesh.examples:mlp", "seed": 0}
    job = only(h.client(CLIENT_A, p.Deploy(id=3, spec=spec, timeout_ms=3000)), p.PlanJob)[0]
    for addr in (other, stranger):
        with pytest.raises(p.DecodeError):
            h.backend(addr, p.PlanReply(id=job.id, plan={"range_bytes": ["lots"]}))
        assert h.out() == [] and job.id in h.core.calls
    h.backend(part, p.PlanReply(id=job.id, plan=plan_of([MIB])))
    assert job.id not in h.core.calls and "m" in h.core.models


def test_bad_info_in_a_run_result_fails_its_batch_instead_of_orphaning_it() -> None:
    h = Harness()
    h.partitioner()
    w0 = h.worker("w0")
    h.deploy("m", [MIB], replicas=1)
    rid, out = h.infer("m")
    run = only(out, p.Run)[0]
    # The info checks itself as the result is decoded; the refusal fails the batch at once.
    with pytest.raises(p.DecodeError):
        h.backend(
            w0,
            p.RunResult(
                id=run.id, model="m", stage=0, tensors=[{"": ref(1, 4)}], info={"compute_s": "x"}
            ),
        )
    (err,) = only(h.out(), p.Error)
    assert err.id == rid and err.code == Code.BAD_MESSAGE
    assert "w0's answer was refused" in err.reason and "$.info.compute_s" in err.reason
    assert h.core.batches == {} and h.core.peers["w0"].inflight_runs == 0
    assert h.core.models["m"].replicas[0].inflight == 0


def test_results_and_errors_are_accepted_only_from_the_worker_the_run_was_sent_to() -> None:
    h = Harness()
    h.partitioner()
    w0 = h.worker("w0")
    forger = h.worker("forger")
    h.deploy("m", [MIB], replicas=1)
    (rep,) = h.core.models["m"].replicas
    real = rep.workers[0].encode()
    other = forger if real == w0 else w0
    rid, out = h.infer("m")
    run = only(out, p.Run)[0]
    with pytest.raises(FlowmeshError) as info:
        h.finish(other, run)
    assert info.value.code is Code.BAD_REQUEST
    assert h.backend(other, p.Error(id=run.id, code="model_error", reason="forged")) == []
    assert run.id in h.core.batches  # untouched by either
    (res,) = only(h.finish(real, run), p.Result)
    assert res.id == rid


def test_calls_are_answered_only_by_the_peer_they_were_sent_to() -> None:
    h = Harness()
    part = h.partitioner()
    h.backend(b"p2", p.Register(id=1, role="partitioner", name="p2", pid=3))
    h.worker("w0")
    spec = {"name": "m", "factory": "flowmesh.examples:mlp", "seed": 0}
    (job_to,) = [(a, m) for _, a, m in h.client(CLIENT_A, p.Deploy(id=3, spec=spec))]
    addr, job = job_to
    other = b"p2" if addr == part else part
    plan = plan_of([MIB])
    with pytest.raises(FlowmeshError):
        h.backend(other, p.PlanReply(id=job.id, plan=plan))
    assert job.id in h.core.calls
    out = h.backend(addr, p.PlanReply(id=job.id, plan=plan))
    (stage,) = only(out, p.DeployStage)
    with pytest.raises(FlowmeshError):
        h.backend(other, p.StageReady(id=stage.id, model="m", stage=0, nbytes=MIB, seconds=0))
    assert h.core.models["m"].state.value == "deploying"


def test_bad_heartbeat_stats_are_refused_and_status_keeps_working() -> None:
    h = Harness()
    w0 = h.worker("w0")
    h.backend(w0, p.Heartbeat(stats=p.WorkerStats(peak_bytes=7, stages={"m/0": "resident"})))
    for bad in (
        p.WorkerStats(peak_bytes="lots"),  # type: ignore[arg-type]
        p.WorkerStats(host_bytes=-1),
        p.WorkerStats(prefault_s=float("nan")),
        p.WorkerStats(kv_stage_bytes={f"m/{i}": 1 for i in range(5000)}),
    ):
        with pytest.raises(FlowmeshError) as info:  # types and bounds, on receipt
            h.backend(w0, p.decode(p.encode(p.Heartbeat(stats=bad))))
        assert info.value.code == Code.BAD_MESSAGE
    with pytest.raises(FlowmeshError) as info:  # a worker sending a partitioner's figures
        h.backend(w0, p.Heartbeat(stats=p.PartitionerStats(planned=1)))
    assert (info.value.code, info.value.reason) == (
        Code.BAD_REQUEST,
        "heartbeat stats: a worker reports WorkerStats, not PartitionerStats",
    )
    (w,) = h.core.status(h.now).workers
    assert w.peak_bytes == 7 and w.stats.stages == {"m/0": "resident"}


def test_the_same_process_registering_again_keeps_its_state() -> None:
    h = Harness()
    h.partitioner()
    w0 = h.worker("w0")
    h.deploy("m", [MIB], replicas=1)
    rid, out = h.infer("m")
    h.loaded(w0, out, MIB)
    run = only(out, p.Run)[0]
    reg = p.Register(
        id=2, role="worker", name="w0", pid=1, device="cpu", kind="cpu", budget_bytes=100 * MIB
    )
    out = h.backend(w0, reg)
    assert kinds(out) == [(w0, "register_ack")]
    assert out[0][2].kept is True
    assert [e for e in only(out, p.Error)] == []
    st = h.core.status(h.now)
    assert st.workers[0].registrations == 2 and st.workers[0].resident == ["m/0"]
    (res,) = only(h.finish(w0, run), p.Result)
    assert res.id == rid
    # Another process under that name (it restarted): what the old one held is gone.
    rid, out = h.infer("m")
    out = h.backend(w0, msgspec.structs.replace(reg, pid=99))
    assert (rid, Code.WORKER_LOST) in [(e.id, e.code) for e in only(out, p.Error)]
    assert out[-1][2].TYPE == "register_ack" and out[-1][2].kept is False
    assert h.core.status(h.now).workers[0].resident == []


def test_a_bad_registration_changes_nothing() -> None:
    h = Harness()
    h.worker("w0")
    bad = p.Register(
        id=2,
        role="worker",
        name="w0",
        pid=5,
        kind="cpu",
        budget_bytes=MIB,
        info={"compute_lanes": "many"},
    )
    with pytest.raises(FlowmeshError):
        h.backend(b"w0", bad)
    (w,) = h.core.status(h.now).workers
    assert w.pid == 1 and w.ready is True


def test_a_load_that_cannot_be_sent_drops_its_call_and_residency() -> None:
    h = Harness()
    h.partitioner()
    w0 = h.worker("w0")
    h.deploy("m", [MIB], replicas=1)
    _, out = h.infer("m")
    (load,) = only(out, p.Load)
    h.core.send_failed(BACKEND, w0, load, FlowmeshError(Code.OVERLOADED, "full"), h.now)
    assert load.id not in h.core.calls
    assert ("m", 0) not in h.core.peers["w0"].resident
    assert h.core.totals["dropped_sends"] == 1
