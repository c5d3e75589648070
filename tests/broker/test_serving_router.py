"""ServingRouter alone: queues, batching, residency, runs and failover, on plain state.

No registry, no sockets: the tests lay out peers, models and replicas as plain data, drive the
router with a fake clock (`now` passed in), and assert the exact messages it queues. Ids are
exact too: they come from the one counter in `Context`, which starts at 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from broker.config import BrokerConfig
from broker.context import BACKEND, CLIENT, Context, Outgoing
from broker.serving_router import ServingRouter
from broker.state import Model, ModelState, Peer, Phase, Replica, Residency
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.spec import ModelSpec

MIB = 1 << 20
C1, C2 = b"c1", b"c2"


def ref(rows: int, cols: int = 4) -> p.TensorRef:
    return p.TensorRef("float32", (rows, cols), bytes(rows * cols * 4))


class Keeper:
    """Stands in for the registry: records the replicas given up."""

    def __init__(self) -> None:
        self.given_up: list[tuple[str, list[str], list[str], str]] = []

    def give_up_replica(
        self, model: Model, rep: Replica, suspects: Sequence[str], reason: str
    ) -> None:
        self.given_up.append((model.name, rep.workers, list(suspects), reason))
        model.replicas.remove(rep)


class Rig:
    def __init__(self, **cfg: Any) -> None:
        self.ctx = Context(BrokerConfig(**cfg))
        self.keeper = Keeper()
        self.router = ServingRouter(self.ctx, self.keeper)

    def worker(self, name: str, budget: int = 100 * MIB, max_inflight: int = 4) -> Peer:
        peer = Peer(
            name=name,
            addr=name.encode(),
            role="worker",
            pid=1,
            budget=budget,
            ready=True,
            max_inflight=max_inflight,
        )
        self.ctx.peers[name] = peer
        self.ctx.by_addr[peer.addr] = name
        return peer

    def model(
        self,
        name: str,
        stage_bytes: list[int],
        *placements: list[str],
        max_batch: int = 8,
        slo_ms: float | None = None,
    ) -> Model:
        """A deployed model: every stage of every replica hosted on its worker, none resident."""
        spec = ModelSpec.from_dict(
            {
                "name": name,
                "factory": "flowmesh.examples:mlp",
                "max_batch_size": max_batch,
                "slo_ms": slo_ms,
            }
        )
        model = Model(spec=spec, state=ModelState.READY, stage_bytes=list(stage_bytes))
        for workers in placements:
            model.replicas.append(Replica(workers=list(workers), ready=[True] * len(workers)))
            for stage, w in enumerate(workers):
                self.ctx.peers[w].hosted[(name, stage)] = stage_bytes[stage]
        self.ctx.models[name] = model
        return model

    def resident(self, worker: str, key: tuple[str, int], nbytes: int, last_used: float) -> None:
        peer = self.ctx.peers[worker]
        peer.resident[key] = Residency(key, nbytes, Phase.RESIDENT, last_used)

    def infer(
        self, model: str, client_id: int, now: float, client: bytes = C1, rows: int = 1
    ) -> tuple[p.TensorRef, list[Outgoing]]:
        """Send one request; returns its input tensor and what the router queued."""
        tensors = {"x": ref(rows)}
        self.router.infer(client, p.Infer(id=client_id, model=model, tensors=tensors), now)
        return tensors["x"], self.ctx.drain()

    def result(self, worker: str, run: p.Run, now: float, **info: float) -> list[Outgoing]:
        tensors = [{"y": ref(rows, 2)} for _tag, rows in run.parts]
        msg = p.RunResult(
            id=run.id, model=run.model, stage=run.stage, tensors=tensors, info=p.RunInfo(**info)
        )
        self.router.run_result(self.ctx.peers[worker], msg, now)
        return self.ctx.drain()


def test_a_cold_request_loads_its_stage_and_runs_at_once() -> None:
    rig = Rig()
    rig.worker("w0")
    rig.model("m", [10 * MIB], ["w0"])
    x, out = rig.infer("m", client_id=7, now=0.0)
    # ids: 1 is the request's tag, 2 the load call, 3 the run.
    assert out == [
        (BACKEND, b"w0", p.Load(id=2, model="m", stage=0)),
        (BACKEND, b"w0", p.Run(id=3, model="m", stage=0, parts=[[1, 1]], tensors=[{"x": x}])),
    ]
    assert rig.ctx.calls[2].kind == "load" and rig.ctx.calls[2].deadline == 120.0
    res = rig.ctx.peers["w0"].resident[("m", 0)]
    assert (res.phase, res.nbytes, res.inflight) == (Phase.LOADING, 10 * MIB, 1)


def test_the_last_stage_answers_each_client_with_its_own_rows_and_timings() -> None:
    rig = Rig()
    rig.worker("w0")
    rig.model("m", [10 * MIB], ["w0"])
    _, out = rig.infer("m", client_id=7, now=0.0)
    rig.router.loaded(
        rig.ctx.peers["w0"], p.Loaded(id=2, model="m", stage=0, nbytes=9 * MIB, seconds=0.1), 0.1
    )
    assert rig.ctx.drain() == []  # the run was already sent: nothing more to start
    run = out[1][2]
    out = rig.result("w0", run, 0.25, compute_s=0.125, wait_s=0.0625)
    (dest, addr, result) = out[0]
    assert (dest, addr, len(out)) == (CLIENT, C1, 1)
    assert result.id == 7 and list(result.tensors) == ["y"]
    assert result.info == p.ResultInfo(
        latency_ms=250.0,
        batch=1,
        queue_ms=0.0,
        run_ms=250.0,
        compute_ms=125.0,
        load_wait_ms=62.5,
        workers=["w0"],
    )
    # The same figures, as status reads them back from the /metrics histograms.
    assert rig.router.timings.model_means() == {
        "m": {
            "answered": 1.0,
            "queue_wait_ms": 0.0,
            "load_wait_ms": 62.5,
            "run_ms": 250.0,
            "mean_batch": 1.0,
        }
    }
    assert rig.router.timings.worker_loads() == {
        "w0": {"timed_loads": 1.0, "mean_load_ms": 100.0, "load_bytes": 9.0 * MIB}
    }
    model = rig.ctx.models["m"]
    assert (model.completed, model.loads, list(model.latency_ms)) == (1, 1, [250.0])
    assert rig.ctx.peers["w0"].resident[("m", 0)].nbytes == 9 * MIB
    assert rig.router.batches == {} and rig.ctx.peers["w0"].inflight_runs == 0


def test_requests_queued_behind_a_full_pipeline_run_as_one_batch() -> None:
    rig = Rig()
    rig.worker("w0")
    rig.resident("w0", ("m", 0), 10 * MIB, 0.0)
    rig.model("m", [10 * MIB], ["w0"], max_batch=3)
    # One stage keeps 2 batches in flight; the rest wait here so that they can batch.
    _, out1 = rig.infer("m", 1, 0.0)
    _, out2 = rig.infer("m", 2, 0.0)
    x3, out3 = rig.infer("m", 3, 0.1, client=C2, rows=2)
    x4, out4 = rig.infer("m", 4, 0.2)
    _, out5 = rig.infer("m", 5, 0.3)
    assert [m.id for _, _, m in out1 + out2] == [2, 4] and out3 == out4 == out5 == []
    out = rig.result("w0", out1[0][2], 0.5)
    # 3 (2 rows) and 4 (1 row) fill max_batch_size 3; 5 waits for the next batch.
    assert out[1:] == [
        (
            BACKEND,
            b"w0",
            p.Run(
                id=8,
                model="m",
                stage=0,
                parts=[[5, 2], [6, 1]],
                tensors=[{"x": x3}, {"x": x4}],
            ),
        )
    ]
    assert [r.client_id for r in rig.ctx.models["m"].queue] == [5]


def test_a_request_with_other_shapes_is_not_batched_with_the_head() -> None:
    rig = Rig()
    rig.worker("w0", max_inflight=1)
    rig.resident("w0", ("m", 0), MIB, 0.0)
    rig.model("m", [MIB], ["w0"])
    _, out = rig.infer("m", 1, 0.0)
    rig.router.infer(C1, p.Infer(id=2, model="m", tensors={"x": ref(1, 8)}), 0.0)
    _, _ = rig.infer("m", 3, 0.0)
    out = rig.result("w0", out[0][2], 0.1)
    (run,) = [m for _, _, m in out if isinstance(m, p.Run)]
    assert run.parts == [[3, 1]]  # request 2's tag is 3: alone, its inner shape differs
    assert [r.client_id for r in rig.ctx.models["m"].queue] == [3]


def three_idle_stages_and_a_fourth() -> tuple[Rig, Peer]:
    """A worker holding a, b, c (30 MiB each; b least recently used) and d deployed, not held."""
    rig = Rig()
    peer = rig.worker("w0", budget=100 * MIB)
    for name, used in (("a", 3.0), ("b", 1.0), ("c", 2.0)):
        rig.model(name, [30 * MIB], ["w0"])
        rig.resident("w0", (name, 0), 30 * MIB, used)
    rig.model("d", [30 * MIB], ["w0"])
    return rig, peer


def test_loading_expects_the_least_recently_used_idle_stage_to_go_the_worker_evicts() -> None:
    rig, peer = three_idle_stages_and_a_fourth()
    x, out = rig.infer("d", 9, 5.0)
    # No Evict: the worker makes the room; the broker only expects b to go (its bytes count as
    # the load's) and names what must stay (nothing here: every stage is idle).
    assert out == [
        (BACKEND, b"w0", p.Load(id=2, model="d", stage=0, keep=[])),
        (BACKEND, b"w0", p.Run(id=3, model="d", stage=0, parts=[[1, 1]], tensors=[{"x": x}])),
    ]
    assert sorted(peer.resident) == [("a", 0), ("c", 0), ("d", 0)]
    assert peer.leaving == {("b", 0): 2} and peer.evictions == 0
    # The worker evicted b, as expected: its report settles it.
    report = [["a", 0, 30 * MIB], ["c", 0, 30 * MIB], ["d", 0, 30 * MIB]]
    rig.router.resident_report(peer, p.Resident(stages=report, after_load=2), 5.1)
    assert peer.leaving == {} and sorted(peer.resident) == [("a", 0), ("c", 0), ("d", 0)]
    assert (peer.evictions, rig.ctx.models["b"].evictions) == (1, 1)


def test_the_worker_s_own_choice_of_victim_is_what_the_broker_counts() -> None:
    rig, peer = three_idle_stages_and_a_fourth()
    rig.infer("d", 9, 5.0)
    assert peer.leaving == {("b", 0): 2}
    # A report made before the worker handled load 2 (after_load=0) settles nothing expected.
    old = [["a", 0, 30 * MIB], ["b", 0, 30 * MIB], ["c", 0, 30 * MIB]]
    rig.router.resident_report(peer, p.Resident(stages=old, after_load=0), 5.05)
    assert peer.leaving == {("b", 0): 2} and ("b", 0) not in peer.resident
    # The worker kept b and evicted c instead (it knows what it ran): b counts again, c not.
    new = [["a", 0, 30 * MIB], ["b", 0, 30 * MIB], ["d", 0, 30 * MIB]]
    rig.router.resident_report(peer, p.Resident(stages=new, after_load=2), 5.1)
    assert peer.leaving == {}
    assert {k: r.phase for k, r in peer.resident.items()} == {
        ("a", 0): Phase.RESIDENT,
        ("b", 0): Phase.RESIDENT,
        ("d", 0): Phase.LOADING,  # still answered by its Loaded, not by the report
    }
    assert (peer.evictions, rig.ctx.models["c"].evictions, rig.ctx.models["b"].evictions) == (
        1,
        1,
        0,
    )
    # A stage the worker brought back by itself (a run asked for it) counts as resident.
    rig.router.resident_report(peer, p.Resident(stages=[*new, ["c", 0, 30 * MIB]], after_load=2), 6)
    assert peer.resident[("c", 0)].phase is Phase.RESIDENT
    with pytest.raises(FlowmeshError) as err:
        rig.router.resident_report(peer, p.Resident(stages=[["c", -1, 0]], after_load=2), 6)
    assert err.value.code is Code.BAD_REQUEST


def test_a_load_names_the_stages_with_work_the_worker_must_keep() -> None:
    rig = Rig(prefetch=False)
    peer = rig.worker("w0", budget=100 * MIB)
    for name in ("busy", "idle"):
        rig.model(name, [40 * MIB], ["w0"])
        rig.resident("w0", (name, 0), 40 * MIB, 0.0)
    rig.model("new", [40 * MIB], ["w0"])
    _, out = rig.infer("busy", 1, 1.0)  # runs on busy: it has work in flight
    assert [m.TYPE for _, _, m in out] == ["run"]
    _, out = rig.infer("new", 2, 2.0)
    load = out[0][2]
    assert load == p.Load(id=4, model="new", stage=0, keep=[["busy", 0]])
    assert peer.leaving == {("idle", 0): 4}


def test_a_cold_model_waits_while_the_resident_one_is_busy_then_evicts_it() -> None:
    rig = Rig(starvation_s=2.0)
    rig.worker("w0", budget=50 * MIB, max_inflight=1)
    rig.model("a", [40 * MIB], ["w0"])
    rig.model("b", [40 * MIB], ["w0"])
    rig.resident("w0", ("a", 0), 40 * MIB, 0.0)
    _, out = rig.infer("a", 1, 0.0)  # runs; fills the worker's one lane
    _, queued_a = rig.infer("a", 2, 0.0)
    _, cold_b = rig.infer("b", 3, 0.5)
    assert queued_a == cold_b == []
    out = rig.result("w0", out[0][2], 1.0)
    # a's next batch starts at once; b would need a's bytes, and a has work: b waits.
    assert [m.TYPE for _, _, m in out] == ["result", "run"]
    run_a = out[1][2]
    out = rig.result("w0", run_a, 3.0)
    # b has waited 2.5 s (starving) and a is idle now: load b (the worker evicts a), run b.
    assert [(m.TYPE, getattr(m, "model", None)) for _, _, m in out] == [
        ("result", None),
        ("load", "b"),
        ("run", "b"),
    ]
    assert list(rig.ctx.peers["w0"].leaving) == [("a", 0)]


def test_a_starving_model_reserves_the_workers_it_needs() -> None:
    rig = Rig(starvation_s=1.0)
    rig.worker("w0", budget=50 * MIB, max_inflight=2)
    rig.model("a", [40 * MIB], ["w0"], max_batch=1)
    rig.model("b", [40 * MIB], ["w0"])
    rig.resident("w0", ("a", 0), 40 * MIB, 0.0)
    _, out = rig.infer("a", 1, 0.0)
    _, _ = rig.infer("b", 2, 0.0)
    _, _ = rig.infer("a", 3, 1.5)
    # b starved (1.5 s) and cannot evict a (running): w0 is reserved for b, so a's second
    # request, able to run now, waits instead of keeping b out forever.
    assert rig.ctx.peers["w0"].reserved_for == "b"
    assert [r.client_id for r in rig.ctx.models["a"].queue] == [3]
    out = rig.result("w0", out[0][2], 2.0)
    assert [(m.TYPE, getattr(m, "model", None)) for _, _, m in out] == [
        ("result", None),
        ("load", "b"),
        ("run", "b"),
    ]
    # Starving, b may take a's bytes although a has a request queued: nothing is kept.
    assert out[1][2].keep == [] and list(rig.ctx.peers["w0"].leaving) == [("a", 0)]
    assert rig.ctx.peers["w0"].reserved_for is None


def test_a_batch_travels_stage_by_stage_with_its_activations() -> None:
    rig = Rig()
    rig.worker("w0")
    rig.worker("w1")
    rig.model("m", [MIB, MIB], ["w0", "w1"])
    rig.resident("w0", ("m", 0), MIB, 0.0)
    rig.resident("w1", ("m", 1), MIB, 0.0)
    _, out = rig.infer("m", 1, 0.0)
    (first,) = [m for _, _, m in out]
    assert (first.id, first.stage) == (2, 0)
    acts = [{"h": ref(1, 16)}]
    rig.router.run_result(
        rig.ctx.peers["w0"],
        p.RunResult(id=2, model="m", stage=0, tensors=acts, info=p.RunInfo(compute_s=0.5)),
        0.5,
    )
    assert rig.ctx.drain() == [
        (BACKEND, b"w1", p.Run(id=3, model="m", stage=1, parts=[[1, 1]], tensors=acts))
    ]
    (batch,) = rig.router.batches.values()
    assert (batch.worker, batch.info, batch.deadline) == (
        "w1",
        {"compute_s": 0.5, "wait_s": 0.0},
        120.5,
    )
    assert rig.ctx.totals["activation_bytes_relayed"] == 16 * 4  # counted: it went through us


def direct_rig(**cfg: Any) -> Rig:
    """Three workers with peer endpoints, a three-stage model resident on them."""
    rig = Rig(**cfg)
    for i in range(3):
        rig.worker(f"w{i}").info.peer_endpoint = f"tcp://127.0.0.1:{7000 + i}"
    rig.model("m", [MIB] * 3, ["w0", "w1", "w2"], max_batch=8)
    for i in range(3):
        rig.resident(f"w{i}", ("m", i), MIB, 0.0)
    return rig


def test_a_batch_over_workers_with_peer_endpoints_is_announced_to_every_stage_at_once() -> None:
    rig = direct_rig(micro_batch_rows=1)  # 5 rows over 3 stages: 3 micro-batches
    x, out = rig.infer("m", 1, 0.0, rows=5)
    runs = [m for _, _, m in out]
    ticket = runs[0].ticket
    assert ticket > 0
    common = {"id": 2, "model": "m", "parts": [[1, 5]], "ticket": ticket, "chunks": 3}
    assert out == [
        (
            BACKEND,
            b"w0",
            p.Run(stage=0, tensors=[{"x": x}], next_peer="tcp://127.0.0.1:7001", **common),
        ),
        (
            BACKEND,
            b"w1",
            p.Run(stage=1, from_peer=True, next_peer="tcp://127.0.0.1:7002", **common),
        ),
        (BACKEND, b"w2", p.Run(stage=2, from_peer=True, **common)),
    ]
    # Counted as running on every stage, answered by the last one alone.
    assert [rig.ctx.peers[f"w{i}"].inflight_runs for i in range(3)] == [1, 1, 1]
    with pytest.raises(FlowmeshError):
        rig.result("w1", runs[1], 0.5)
    out = rig.result("w2", runs[2], 0.6, compute_s=0.2)
    assert [m.TYPE for _, _, m in out] == ["result"]
    assert [rig.ctx.peers[f"w{i}"].inflight_runs for i in range(3)] == [0, 0, 0]
    assert rig.ctx.totals["activation_bytes_relayed"] == 0
    assert rig.ctx.totals["direct_batches"] == 1


def test_a_direct_batch_failing_at_a_middle_stage_is_cancelled_on_the_others() -> None:
    rig = direct_rig()
    _, out = rig.infer("m", 1, 0.0, rows=100)
    assert out[0][2].chunks == 1  # 100 rows: under two micro-batches of 64, so whole
    error = p.Error(id=2, code="model_error", reason="block 0 raised")
    assert rig.router.run_error(rig.ctx.peers["w1"], error, 0.5)
    assert rig.ctx.drain() == [
        (BACKEND, b"w0", p.CancelRun(id=2)),
        (BACKEND, b"w2", p.CancelRun(id=2)),
        (CLIENT, C1, p.Error(id=1, code="model_error", reason="block 0 raised")),
    ]
    assert [rig.ctx.peers[f"w{i}"].inflight_runs for i in range(3)] == [0, 0, 0]


def test_a_direct_run_that_hangs_suspects_every_worker_of_its_replica() -> None:
    # Its stages hand activations on among themselves and only the last answers: where it
    # hung is not known, so it is not blamed on the last stage's worker (the healthy one when
    # the first hangs), nor that one alone avoided when the replica is made again.
    rig = direct_rig(run_timeout_s=10.0)
    _, out = rig.infer("m", 1, 0.0)
    assert [m.TYPE for _, _, m in out] == ["run"] * 3
    rig.router.expire_running(60.0)
    reason = (
        "the direct run of 'm' over workers w0, w1, w2 (stage to stage) did not finish within "
        "10 s; its replica is being re-created"
    )
    assert rig.ctx.drain() == [
        (CLIENT, C1, p.Error(id=1, code="timeout", reason="not served within 60.0 s (running)")),
        (BACKEND, b"w0", p.CancelRun(id=2)),
        (BACKEND, b"w1", p.CancelRun(id=2)),
        (BACKEND, b"w2", p.CancelRun(id=2)),
    ]
    assert rig.keeper.given_up == [("m", ["w0", "w1", "w2"], ["w0", "w1", "w2"], reason)]


def test_without_peer_endpoints_or_with_direct_off_activations_are_relayed() -> None:
    rig = direct_rig(direct=False)
    _, out = rig.infer("m", 1, 0.0, rows=2)
    assert [(a, m.ticket) for _, a, m in out] == [(b"w0", 0)]
    rig = direct_rig()
    rig.ctx.peers["w1"].info.peer_endpoint = ""
    _, out = rig.infer("m", 1, 0.0, rows=2)
    assert [(a, m.ticket) for _, a, m in out] == [(b"w0", 0)]


def test_an_answer_from_the_wrong_worker_is_refused_and_the_batch_untouched() -> None:
    rig = Rig()
    rig.worker("w0")
    rig.worker("w1")
    rig.model("m", [MIB], ["w0"])
    _, out = rig.infer("m", 1, 0.0)
    run = out[1][2]
    with pytest.raises(FlowmeshError) as info:
        rig.result("w1", run, 0.1)
    assert (info.value.code, info.value.reason) == (
        Code.BAD_REQUEST,
        "run 3 (m/0) was not sent to w1",
    )
    assert list(rig.router.batches) == [3]


def test_a_lost_replica_fails_over_once_then_answers_worker_lost() -> None:
    rig = Rig(max_retries=1)
    rig.worker("w0")
    rig.worker("w1")
    model = rig.model("m", [MIB], ["w0"], ["w1"])
    rig.resident("w0", ("m", 0), MIB, 0.0)
    x, out = rig.infer("m", 1, 0.0)
    assert out == [
        (BACKEND, b"w0", p.Run(id=2, model="m", stage=0, parts=[[1, 1]], tensors=[{"x": x}]))
    ]
    lost = model.replicas.pop(0)
    rig.ctx.peers.pop("w0")
    rig.router.fail_over(model, lost, "w0", 1.0)
    rig.router.pump(1.0)
    assert rig.ctx.drain() == [
        (BACKEND, b"w1", p.Load(id=3, model="m", stage=0)),
        (BACKEND, b"w1", p.Run(id=4, model="m", stage=0, parts=[[1, 1]], tensors=[{"x": x}])),
    ]
    assert rig.ctx.totals["retried"] == 1
    # The second replica is lost too: the request had its one retry.
    rig.router.fail_over(model, model.replicas.pop(0), "w1", 2.0)
    assert rig.ctx.drain() == [
        (
            CLIENT,
            C1,
            p.Error(
                id=1, code="worker_lost", reason="worker w1 was lost while running this request"
            ),
        )
    ]


def test_a_run_past_its_deadline_has_hung_its_replica_is_given_up() -> None:
    rig = Rig(run_timeout_s=10.0)
    rig.worker("w0")
    rig.model("m", [MIB], ["w0"])
    rig.resident("w0", ("m", 0), MIB, 0.0)
    rig.infer("m", 1, 0.0)  # its own deadline: 60 s (default_timeout_s)
    rig.router.expire_running(59.0)
    assert rig.ctx.drain() == []
    # The batch's deadline is the later of the run timeout and its requests' deadlines, so
    # the request is answered as timed out (running) first, then the run found hung.
    rig.router.expire_running(60.0)
    assert rig.ctx.drain() == [
        (CLIENT, C1, p.Error(id=1, code="timeout", reason="not served within 60.0 s (running)"))
    ]
    reason = "worker w0 did not finish stage 0 of 'm' within 10 s; its replica is being re-created"
    assert rig.keeper.given_up == [("m", ["w0"], ["w0"], reason)]
    assert rig.router.batches == {} and rig.ctx.totals["hung_runs"] == 1
    assert rig.ctx.peers["w0"].inflight_runs == 0


def test_a_request_still_queued_past_its_deadline_gets_timeout() -> None:
    rig = Rig()
    rig.worker("w0", max_inflight=1)
    rig.model("m", [MIB], ["w0"])
    rig.resident("w0", ("m", 0), MIB, 0.0)
    rig.router.infer(C1, p.Infer(id=1, model="m", tensors={"x": ref(1)}, timeout_ms=5000), 0.0)
    rig.router.infer(C2, p.Infer(id=2, model="m", tensors={"x": ref(1)}, timeout_ms=500), 0.0)
    rig.ctx.drain()
    rig.router.expire_queued(rig.ctx.models["m"], 0.5)
    assert rig.ctx.drain() == [
        (CLIENT, C2, p.Error(id=2, code="timeout", reason="not served within 0.5 s (queued)"))
    ]
    assert len(rig.ctx.models["m"].queue) == 0


def test_a_failed_load_is_asked_again_and_the_run_is_retried() -> None:
    rig = Rig()
    peer = rig.worker("w0", budget=50 * MIB)
    rig.model("a", [20 * MIB], ["w0"])
    rig.model("m", [20 * MIB], ["w0"])
    rig.resident("w0", ("a", 0), 20 * MIB, 0.0)
    x, out = rig.infer("m", 1, 1.0)
    assert [m.TYPE for _, _, m in out] == ["load", "run"]  # fits in free bytes: no eviction
    call = rig.ctx.calls.pop(2)
    rig.router.load_failed(peer, call, p.Error(id=2, code="no_space", reason="busy"), 1.1)
    assert ("m", 0) not in peer.resident and rig.ctx.drain() == []
    # The worker refuses the run (its stage never arrived): not the client's fault, run again.
    assert rig.router.run_error(peer, p.Error(id=3, code="not_resident", reason="no"), 1.2)
    assert rig.ctx.drain() == [
        (BACKEND, b"w0", p.Load(id=4, model="m", stage=0, keep=[])),
        (BACKEND, b"w0", p.Run(id=5, model="m", stage=0, parts=[[1, 1]], tensors=[{"x": x}])),
    ]


def test_a_run_the_worker_could_not_bring_back_stops_counting_its_stage_resident() -> None:
    rig = Rig()
    peer = rig.worker("w0", budget=50 * MIB)
    rig.model("m", [20 * MIB], ["w0"])
    rig.resident("w0", ("m", 0), 20 * MIB, 0.0)
    _, out = rig.infer("m", 1, 1.0)
    assert [m.TYPE for _, _, m in out] == ["run"]
    # The worker had evicted it and found no room to bring it back: load it again here.
    assert rig.router.run_error(peer, p.Error(id=2, code="not_resident", reason="no room"), 1.2)
    assert [m.TYPE for _, _, m in rig.ctx.drain()] == ["load", "run"]
    assert peer.resident[("m", 0)].phase is Phase.LOADING


def test_a_batch_that_breaks_the_model_is_split_to_find_the_culprit() -> None:
    rig = Rig()
    peer = rig.worker("w0", max_inflight=1)
    rig.model("m", [MIB], ["w0"])
    rig.resident("w0", ("m", 0), MIB, 0.0)
    _, out = rig.infer("m", 1, 0.0)
    rig.infer("m", 2, 0.0)
    rig.infer("m", 3, 0.0)
    out = rig.result("w0", out[0][2], 0.1)
    (batch,) = [m for _, _, m in out if isinstance(m, p.Run)]
    assert batch.parts == [[3, 1], [4, 1]]
    rig.router.run_error(peer, p.Error(id=batch.id, code="model_error", reason="nan"), 0.2)
    (solo,) = [m for _, _, m in rig.ctx.drain()]
    assert solo.parts == [[3, 1]]  # each of the two runs alone now
    rig.router.run_error(peer, p.Error(id=solo.id, code="model_error", reason="nan"), 0.3)
    out = rig.ctx.drain()
    assert out[0] == (CLIENT, C1, p.Error(id=2, code="model_error", reason="nan"))
    assert [m.parts for _, _, m in out[1:]] == [[[4, 1]]]


def test_requests_of_a_model_taking_one_per_forward_share_a_run_each_computed_alone() -> None:
    rig = Rig(group_runs=4)
    peer = rig.worker("w0", max_inflight=2)
    rig.model("m", [MIB], ["w0"], max_batch=1)
    rig.resident("w0", ("m", 0), MIB, 0.0)
    # An idle worker: the first two go at once, a run each (a short queue uses every lane).
    first = [rig.infer("m", i, 0.0)[1][-1][2] for i in (1, 2)]
    assert [(r.parts, r.separate) for r in first] == [([[1, 1]], False), ([[3, 1]], False)]
    for i in range(3, 9):  # the worker is full: these six wait (tags 5 to 10)
        assert rig.infer("m", i, 0.0, rows=1 + i % 2)[1] == []
    # One place frees: four of the six (group_runs) go in one run, each computed on its own.
    out = rig.result("w0", first[0], 0.1)
    (grouped,) = [m for _, _, m in out if isinstance(m, p.Run)]
    assert (grouped.parts, grouped.separate) == ([[5, 2], [6, 1], [7, 2], [8, 1]], True)
    assert [list(part) for part in grouped.tensors] == [["x"]] * 4
    # Its answer: one Result per request (none shared a forward), and the last two go together.
    out = rig.result("w0", grouped, 0.3)
    answers = [m for _, _, m in out if isinstance(m, p.Result)]
    assert [a.id for a in answers] == [3, 4, 5, 6]
    assert {a.info.batch for a in answers} == {1}
    (rest,) = [m for _, _, m in out if isinstance(m, p.Run)]
    assert (rest.parts, rest.separate) == ([[9, 2], [10, 1]], True)
    # A grouped run that breaks the model: each of its requests runs alone, to find the culprit.
    rig.router.run_error(peer, p.Error(id=rest.id, code="model_error", reason="nan"), 0.5)
    (solo,) = [m for _, _, m in rig.ctx.drain()]
    assert (solo.parts, solo.separate) == ([[9, 2]], False)
    (solo,) = [m for _, _, m in rig.result("w0", first[1], 0.6) if isinstance(m, p.Run)]
    assert (solo.parts, solo.separate) == ([[10, 1]], False)
    assert rig.ctx.totals["batches"] == 6 and rig.ctx.totals["completed"] == 6


def test_a_run_that_cannot_be_sent_fails_its_requests_overloaded() -> None:
    rig = Rig()
    rig.worker("w0")
    rig.model("m", [MIB], ["w0"])
    rig.resident("w0", ("m", 0), MIB, 0.0)
    rig.infer("m", 1, 0.0)
    assert not rig.router.run_undelivered(99, "full", 0.1)
    assert rig.router.run_undelivered(2, "could not reach 'w0': full", 0.1)
    assert rig.ctx.drain() == [
        (CLIENT, C1, p.Error(id=1, code="overloaded", reason="could not reach 'w0': full"))
    ]
    assert rig.ctx.totals["errors"] == 1 and rig.ctx.models["m"].errors == 1


def test_one_client_cannot_hold_more_than_its_share_of_requests() -> None:
    rig = Rig(max_client_inflight=2, group_runs=1)  # queued requests stay queued, one per run
    rig.worker("w0", max_inflight=1)
    rig.model("m", [10 * MIB], ["w0"], max_batch=1)
    _, out = rig.infer("m", client_id=1, now=0.0)
    run = out[-1][2]
    assert isinstance(run, p.Run)
    rig.infer("m", client_id=2, now=0.0)  # queued behind the first
    with pytest.raises(FlowmeshError) as err:
        rig.infer("m", client_id=3, now=0.0)
    assert err.value.code == Code.OVERLOADED
    assert err.value.reason == (
        "this client has 2 requests queued or running (limit 2 per client); "
        "wait for answers, then retry"
    )
    assert rig.router.refused == {("m", "overloaded"): 1}
    # Another client is not held back by the first one's share.
    _, out = rig.infer("m", client_id=9, now=0.0, client=C2)
    assert out == []  # queued (the worker takes one run at a time)
    assert rig.ctx.outstanding == {C1: 2, C2: 1}
    # An answer frees a place in the first client's share.
    rig.result("w0", run, 0.1)
    assert rig.ctx.outstanding == {C1: 1, C2: 1}
    rig.infer("m", client_id=4, now=0.2)
    assert rig.ctx.outstanding == {C1: 2, C2: 1}
    # Errors free places too: every queued request times out.
    for model in rig.ctx.models.values():
        rig.router.expire_queued(model, 1000.0)
    rig.ctx.drain()
    assert C2 not in rig.ctx.outstanding


def test_eviction_keeps_a_hot_model_over_a_one_off_used_more_recently() -> None:
    rig = Rig(prefetch=False)
    rig.worker("w0", budget=70 * MIB)
    hot = rig.model("hot", [30 * MIB], ["w0"])
    rig.model("once", [30 * MIB], ["w0"])
    rig.model("new", [30 * MIB], ["w0"])
    for t in range(10):  # hot: ten requests over the last seconds
        hot.rate.add(float(t))
    rig.ctx.models["once"].rate.add(9.5)  # once: one request, after hot's last
    rig.resident("w0", ("hot", 0), 30 * MIB, 9.0)
    rig.resident("w0", ("once", 0), 30 * MIB, 9.5)
    x, out = rig.infer("new", 1, 10.0)
    # Least recently used alone would evict hot (used at 9.0); its value (rate x reload time)
    # is ten times once's: once goes.
    assert out == [
        (BACKEND, b"w0", p.Load(id=2, model="new", stage=0, keep=[])),
        (BACKEND, b"w0", p.Run(id=3, model="new", stage=0, parts=[[1, 1]], tensors=[{"x": x}])),
    ]
    assert rig.ctx.peers["w0"].leaving == {("once", 0): 2}


def test_a_model_asked_for_before_is_prefetched_into_free_bytes_only() -> None:
    rig = Rig()
    rig.worker("w0", budget=100 * MIB, max_inflight=1)
    rig.model("a", [40 * MIB], ["w0"])
    rig.model("big", [100 * MIB], ["w0"])
    rig.model("c", [40 * MIB], ["w0"])

    def loaded(out: list[Outgoing], now: float) -> None:
        for _, _, m in out:
            if isinstance(m, p.Load):
                nbytes = rig.ctx.models[m.model].stage_bytes[m.stage]
                msg = p.Loaded(id=m.id, model=m.model, stage=m.stage, nbytes=nbytes, seconds=0.1)
                rig.router.loaded(rig.ctx.peers["w0"], msg, now)
        rig.ctx.drain()

    _, out = rig.infer("a", 1, 0.0)
    loaded(out, 0.05)
    out = rig.result("w0", out[-1][2], 0.1)
    _, out = rig.infer("big", 2, 1.0)  # evicts a
    assert [(m.TYPE, m.model) for _, _, m in out] == [("load", "big"), ("run", "big")]
    assert list(rig.ctx.peers["w0"].leaving) == [("a", 0)]
    # While big holds the whole worker, nothing is prefetched (no free bytes; never evict).
    loaded(out, 1.05)
    out = rig.result("w0", out[-1][2], 1.1)
    assert [m.TYPE for _, _, m in out] == ["result"]
    _, out = rig.infer("c", 3, 2.0)  # evicts big: 60 MiB stay free, and a fits there
    assert [(m.TYPE, m.model) for _, _, m in out] == [
        ("load", "c"),
        ("run", "c"),
        ("load", "a"),  # a prefetch: no request of a is waiting
    ]
    # A prefetch never evicts: the worker must keep everything it holds.
    assert out[-1][2].keep == [["c", 0]]
    assert rig.ctx.models["a"].prefetches == 1 and rig.ctx.models["big"].prefetches == 0


def test_the_earliest_deadline_starts_first_across_models() -> None:
    rig = Rig(prefetch=False)
    rig.worker("w0", budget=100 * MIB, max_inflight=1)
    for name, slo in (("x", None), ("a", None), ("b", 100.0)):
        rig.model(name, [10 * MIB], ["w0"], slo_ms=slo)
        rig.resident("w0", (name, 0), 10 * MIB, 0.0)
    _, out = rig.infer("x", 1, 0.0)  # takes the worker's one lane
    assert rig.infer("a", 2, 0.1)[1] == []  # deadline 10.1 s (no objective)
    assert rig.infer("b", 3, 0.2)[1] == []  # deadline 0.3 s: its slo_ms
    out = rig.result("w0", out[-1][2], 0.25)
    assert [(m.TYPE, getattr(m, "model", None)) for _, _, m in out] == [
        ("result", None),
        ("run", "b"),  # oldest-first would start a
    ]
    out = rig.result("w0", out[-1][2], 0.5)  # b answered 0.3 s after it arrived: over 100 ms
    b = rig.ctx.models["b"]
    assert (b.completed, b.within_slo) == (1, 0)


def test_ablation_policies_lru_by_bytes_and_count_based() -> None:
    # The serving benchmark's ablations: least recently used alone (hot goes though it is
    # worth more), and Computron's count-based LRU (evicts by count although bytes fit).
    def rig_with(eviction: str) -> Rig:
        rig = Rig(prefetch=False, eviction=eviction)
        rig.worker("w0", budget=100 * MIB)
        hot = rig.model("hot", [30 * MIB], ["w0"])
        rig.model("once", [30 * MIB], ["w0"])
        rig.model("new", [30 * MIB], ["w0"])
        for t in range(10):
            hot.rate.add(float(t))
        rig.ctx.models["once"].rate.add(9.5)
        rig.resident("w0", ("hot", 0), 30 * MIB, 9.0)
        rig.resident("w0", ("once", 0), 30 * MIB, 9.5)
        return rig

    rig = rig_with("value")
    rig.infer("new", 1, 10.0)
    assert rig.ctx.peers["w0"].leaving == {}  # 40 MiB free: nothing needs to go
    rig = rig_with("lru")
    rig.ctx.peers["w0"].budget = 70 * MIB
    rig.infer("new", 1, 10.0)
    assert list(rig.ctx.peers["w0"].leaving) == [("hot", 0)]  # recency alone
    rig = rig_with("count")  # 100 MiB // 30 MiB: three stages at most, the new one included
    for name in ("c", "d"):
        rig.model(name, [10 * MIB], ["w0"])
    rig.resident("w0", ("c", 0), 10 * MIB, 9.7)
    _, out = rig.infer("new", 1, 10.0)
    assert [(m.TYPE, m.model) for _, _, m in out] == [
        ("evict", "hot"),  # by count, sent by the broker: the worker's bytes would fit
        ("load", "new"),
        ("run", "new"),
    ]


class CountingModels(dict[str, Model]):
    """The models table, counting how often something walks it whole."""

    walks = 0

    def values(self) -> Any:
        self.walks += 1
        return super().values()

    def __iter__(self) -> Any:
        self.walks += 1
        return super().__iter__()


def test_a_request_costs_the_same_whatever_the_size_of_the_catalogue() -> None:
    rig = Rig()
    rig.ctx.models = rig.router.models = models = CountingModels()
    rig.worker("w0", budget=1000 * MIB)
    for i in range(300):
        rig.model(f"idle{i}", [MIB], ["w0"])
    rig.model("hot", [MIB], ["w0"])
    _, out = rig.infer("hot", 1, 0.0)
    rig.router.loaded(
        rig.ctx.peers["w0"], p.Loaded(id=3, model="hot", stage=0, nbytes=MIB, seconds=0.01), 0.0
    )
    rig.result("w0", out[-1][2], 0.001)
    walks = models.walks
    for i in range(100):  # 100 requests within 20 ms: served without walking the catalogue
        now = 0.002 + i * 0.0002
        _, out = rig.infer("hot", 10 + i, now)
        assert [m.TYPE for _, _, m in out] == ["run"]
        assert [m.TYPE for _, _, m in rig.result("w0", out[-1][2], now)] == ["result"]
    assert models.walks == walks
    rig.infer("hot", 999, 1.0)  # later, the prefetch looks at the catalogue again: once
    assert models.walks == walks + 1


def test_the_tick_finds_a_queued_request_that_no_pump_knew_of() -> None:
    rig = Rig()
    peer = rig.worker("w0", max_inflight=0)  # takes no run for now: requests queue
    model = rig.model("m", [MIB], ["w0"])
    rig.resident("w0", ("m", 0), MIB, 0.0)
    rig.infer("m", 1, 0.0)
    assert len(model.queue) == 1 and list(rig.router.queued) == ["m"]
    rig.router.queued.clear()  # as if a path queued it without saying so
    peer.max_inflight = 4
    rig.router.pump(0.1)
    assert len(model.queue) == 1 and rig.ctx.drain() == []  # no pump knows of it
    rig.router.expire_queued(model, 0.2)  # every tick, for every model
    rig.router.pump(0.2)
    assert not model.queue and [m.TYPE for _, _, m in rig.ctx.drain()] == ["run"]
    rig.router.pump(0.3)
    assert list(rig.router.queued) == []  # an empty queue is dropped
