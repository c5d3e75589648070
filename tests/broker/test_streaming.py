"""A model with more stages than workers: placed on shared workers, run stage by stage, one batch
at a time, with no Load ahead of its runs (the worker brings each stage in: see
tests/worker/test_streaming.py). BrokerCore driven exactly (`tests.support.broker.Harness`)."""

from __future__ import annotations

from broker.policy import place_replicas
from broker.state import Peer
from flowmesh import protocol as p
from tests.support.broker import MIB, Harness, only


def workers(*budgets: int) -> list[Peer]:
    return [Peer(f"w{i}", b"", "worker", 0, budget=b) for i, b in enumerate(budgets)]


def test_more_stages_than_workers_share_them_in_runs_of_consecutive_stages() -> None:
    four = [4 * MIB] * 4
    assert place_replicas(workers(10 * MIB), four, 1) == [["w0"] * 4]
    assert place_replicas(workers(10 * MIB, 10 * MIB), four, 1) == [["w0", "w0", "w1", "w1"]]
    # Enough workers with room: distinct ones, as always (largest stage first, least hosted).
    assert place_replicas(workers(*[10 * MIB] * 4), four, 1) == [["w0", "w1", "w2", "w3"]]
    # Unequal stages: the runs balance bytes (the 5 MiB stage closes w0's half of 12 MiB).
    sizes = [5 * MIB, 1 * MIB, 1 * MIB, 5 * MIB]
    assert place_replicas(workers(10 * MIB, 10 * MIB), sizes, 1) == [["w0", "w0", "w1", "w1"]]
    # A stage no worker holds: no placement, shared or not.
    assert place_replicas(workers(3 * MIB, 3 * MIB), four, 1) == []


def test_a_streamed_replica_is_the_only_one_and_never_added_beside_another() -> None:
    four = [4 * MIB] * 4
    # Asked for two on one worker: one streamed replica (its stages take turns; a second
    # would hold stage i where the first does).
    assert place_replicas(workers(10 * MIB), four, 2) == [["w0"] * 4]
    # A model that has a replica already (`taken`) gets no streamed one beside it.
    taken = {(i, "w0") for i in range(4)}
    assert place_replicas(workers(10 * MIB), four, 1, taken) == []


def test_a_four_stage_model_deploys_onto_one_worker_and_onto_two() -> None:
    h = Harness()
    h.partitioner()
    h.worker("w0", budget=10 * MIB)
    h.deploy("one", [4 * MIB] * 4)
    h.worker("w1", budget=10 * MIB)
    h.deploy("two", [4 * MIB] * 4)
    models = h.core.ctx.models
    assert [r.workers for r in models["one"].replicas] == [["w0"] * 4]
    # w0 hosts "one" already (16 MiB), so "two" begins on w1, the least hosted.
    assert [r.workers for r in models["two"].replicas] == [["w1", "w1", "w0", "w0"]]


def test_a_streamed_replica_runs_stage_by_stage_one_batch_at_a_time() -> None:
    h = Harness()
    h.partitioner()
    w0 = h.worker("w0", budget=10 * MIB)
    # A peer endpoint would make a distinct replica's batch direct; not a streamed one's.
    h.core.ctx.peers["w0"].info.peer_endpoint = "tcp://127.0.0.1:7000"
    h.deploy("big", [4 * MIB] * 4, max_batch=8)
    first, out = h.infer("big")
    # No Load: the run brings its stage in (the worker prefetches the next one meanwhile).
    assert [(a, type(m).__name__) for _, a, m in out] == [(w0, "Run")]
    (run,) = only(out, p.Run)
    assert (run.stage, run.ticket) == (0, 0)
    # Two more requests while the first batch is in its pass: they wait, and then share one.
    second, out = h.infer("big")
    third, more = h.infer("big")
    assert only(out + more, p.Run) == []
    for stage in range(1, 4):
        out = h.finish(w0, run)
        (run,) = only(out, p.Run)
        assert (run.stage, len(run.parts), only(out, p.Load)) == (stage, 1, [])
    out = h.finish(w0, run)
    assert [r.id for r in only(out, p.Result)] == [first]
    (run,) = only(out, p.Run)
    assert (run.stage, len(run.parts)) == (0, 2)  # the next pass carries both
    for _ in range(4):
        out = h.finish(w0, run)
        run = (only(out, p.Run) or [run])[0]
    assert sorted(r.id for r in only(out, p.Result)) == [second, third]
    assert h.core.ctx.totals["direct_batches"] == 0
