"""The broker's state store (`broker.store`) alone, then `BrokerCore` restarted on it in-process:
what a restarted broker takes up from the workers' inventories, and what it repairs or drops."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import msgpack
import pytest

from broker.core import CLIENT
from broker.store import FILE, SCHEMA_VERSION, JobRecord, ModelRecord, Store
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.train_spec import TrainConfig
from tests.support.broker import CLIENT_A, MIB, Harness, only, opened_job, received, ref

# ====================================================================== the store alone


def model_record(name: str = "m") -> ModelRecord:
    return ModelRecord(
        name=name,
        spec={"name": name, "factory": "flowmesh.examples:mlp", "kwargs": {"depth": 2}},
        plan={"ranges": [[0, 1], [1, 2]], "range_bytes": [3, 4], "block_names": ["a", "b"]},
        inputs={"x": {"dtype": "float32", "shape": [-1, 4]}},
        stage_bytes=[3, 4],
        desired_replicas=2,
        placement=[["w0", "w1"], ["w1", "w0"]],
    )


def test_the_store_reads_back_what_it_wrote_after_reopening(tmp_path: Path) -> None:
    store = Store(tmp_path / "state").open()
    store.save_model(model_record("m"))
    store.save_model(model_record("gone"))
    store.drop_model("gone")
    job = JobRecord("j", {"name": "j", "factory": "f:g"}, {"optimizer": {"lr": 0.1}}, 8, "w0")
    store.save_job(job)
    store.save_job(JobRecord("k", {"name": "k"}, {}, 1, "w1"))
    store.drop_job("k")
    store.save_allow(("flowmesh.examples", "my_zoo"))
    store.close()

    snap = Store(tmp_path / "state").open().load_all()
    assert snap.models == {"m": model_record("m")}
    assert snap.jobs == {"j": job}
    assert snap.allow == ("flowmesh.examples", "my_zoo")


def test_a_directory_an_older_broker_wrote_is_taken_to_this_schema(tmp_path: Path) -> None:
    """Version 1 (before pipelined jobs were kept): its jobs read back as one-worker jobs, and
    a pipelined one is kept beside them from then on."""
    db = sqlite3.connect(tmp_path / FILE)
    db.executescript(
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value BLOB NOT NULL);"
        "CREATE TABLE jobs (name TEXT PRIMARY KEY, spec BLOB NOT NULL, config BLOB NOT NULL,"
        " batch INTEGER NOT NULL, worker TEXT NOT NULL, saved_step INTEGER, saved_path TEXT);"
    )
    db.execute("INSERT INTO meta VALUES ('schema', ?)", (msgpack.packb(1),))
    db.execute("INSERT INTO jobs VALUES ('old', ?, ?, 4, 'w0', 3, '/ck')",
               (msgpack.packb({"name": "old"}), msgpack.packb({})))  # fmt: skip
    db.commit()
    db.close()
    store = Store(tmp_path).open()
    old = JobRecord("old", {"name": "old"}, {}, 4, "w0", saved_step=3, saved_path="/ck")
    piped = JobRecord("piped", {"name": "piped"}, {}, 2, "w1", workers=["w1", "w0"])
    store.save_job(piped)
    store.close()
    assert Store(tmp_path).open().load_all().jobs == {"old": old, "piped": piped}
    schema = sqlite3.connect(tmp_path / FILE).execute("SELECT value FROM meta WHERE key='schema'")
    assert msgpack.unpackb(schema.fetchone()[0]) == SCHEMA_VERSION == 3


def test_a_version_2_directory_is_taken_to_this_schema(tmp_path: Path) -> None:
    """Version 2 (before jobs closed when idle): its jobs read back with no idle close, and
    one with an idle close is kept beside them from then on."""
    db = sqlite3.connect(tmp_path / FILE)
    db.executescript(
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value BLOB NOT NULL);"
        "CREATE TABLE jobs (name TEXT PRIMARY KEY, spec BLOB NOT NULL, config BLOB NOT NULL,"
        " batch INTEGER NOT NULL, worker TEXT NOT NULL, saved_step INTEGER, saved_path TEXT,"
        " pipeline BLOB);"
    )
    db.execute("INSERT INTO meta VALUES ('schema', ?)", (msgpack.packb(2),))
    db.execute("INSERT INTO jobs VALUES ('old', ?, ?, 4, 'w0', NULL, NULL, NULL)",
               (msgpack.packb({"name": "old"}), msgpack.packb({})))  # fmt: skip
    db.commit()
    db.close()
    store = Store(tmp_path).open()
    idle = JobRecord("idle", {"name": "idle"}, {}, 2, "w1", idle_close_s=90.0)
    store.save_job(idle)
    store.close()
    old = JobRecord("old", {"name": "old"}, {}, 4, "w0")
    assert Store(tmp_path).open().load_all().jobs == {"old": old, "idle": idle}


def test_a_version_1_directory_never_stamped_is_taken_to_this_schema(tmp_path: Path) -> None:
    """A version-1 broker killed between making its tables and stamping their version."""
    db = sqlite3.connect(tmp_path / FILE)
    db.executescript(
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value BLOB NOT NULL);"
        "CREATE TABLE jobs (name TEXT PRIMARY KEY, spec BLOB NOT NULL, config BLOB NOT NULL,"
        " batch INTEGER NOT NULL, worker TEXT NOT NULL, saved_step INTEGER, saved_path TEXT);"
    )
    db.close()
    store = Store(tmp_path).open()
    piped = JobRecord("piped", {"name": "piped"}, {}, 2, "w1", workers=["w1", "w0"])
    store.save_job(piped)
    assert store.load_all().jobs == {"piped": piped}


def test_the_store_runs_in_wal_mode_and_counts_starts(tmp_path: Path) -> None:
    store = Store(tmp_path).open()
    assert store.load_all().allow is None  # never recorded
    assert [store.next_epoch() for _ in range(3)] == [1, 2, 3]
    store.close()
    assert Store(tmp_path).open().next_epoch() == 4
    db = sqlite3.connect(tmp_path / FILE)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_second_broker_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    first = Store(tmp_path).open(lock=True)
    with pytest.raises(OSError, match="another broker uses this state directory"):
        Store(tmp_path).open(lock=True)
    first.close()
    Store(tmp_path).open(lock=True).close()  # free again once the first is gone


def test_a_save_is_on_disk_before_it_returns(tmp_path: Path) -> None:
    """Another connection (a restarted broker) sees each write at once: nothing waits in a
    transaction or a buffer of this one."""
    store = Store(tmp_path).open()
    store.save_model(model_record("m"))
    other = Store(tmp_path).open()
    assert list(other.load_all().models) == ["m"]
    store.drop_model("m")
    assert other.load_all().models == {}


# ====================================================================== a broker that restarts


class Life(Harness):
    """One life of a broker on `state`: a Harness whose BrokerCore keeps its state there. A new
    life ends the one before on the same directory (as a kill would: nothing is written)."""

    lives: dict[Path, Life] = {}

    def __init__(self, state: Path, **cfg: Any) -> None:
        before = Life.lives.pop(state, None)
        if before is not None:
            before.core.close()
        super().__init__(state_dir=str(state), **cfg)
        Life.lives[state] = self

    def register(
        self, name: str, inventory: dict[str, Any] | None = None, pid: int = 1, peer: str = ""
    ) -> Any:
        # Through the codec, as the broker receives it: the inventory is typed on receipt.
        return self.backend(
            name.encode(),
            received(
                p.Register(
                    id=1,
                    role="worker",
                    name=name,
                    pid=pid,
                    device="cpu",
                    kind="cpu",
                    budget_bytes=100 * MIB,
                    info=p.PeerInfo(train_bytes=64 * MIB, peer_endpoint=peer),
                    inventory=inventory or {},
                )
            ),
        )


def held_stages(life: Harness, worker: str, resident: bool = False) -> list[dict[str, Any]]:
    """What `worker` holds in `life`, as its inventory says it."""
    peer = life.core.peers[worker]
    out = []
    for (model, stage), nbytes in peer.hosted.items():
        m = life.core.models[model]
        out.append(
            {
                "model": model,
                "stage": stage,
                "nbytes": nbytes,
                "resident": resident,
                "digest": p.stage_digest(m.spec.to_dict(), m.plan or {}, stage),
            }
        )
    return out


def first_life(state: Path) -> tuple[Life, dict[str, list[dict[str, Any]]]]:
    life = Life(state)
    life.partitioner()
    life.worker("w0")
    life.worker("w1")
    life.deploy("m", [MIB, 2 * MIB], replicas=1)
    inv = {w: held_stages(life, w) for w in ("w0", "w1")}
    return life, inv


def test_a_deployed_model_is_kept_before_the_deploy_is_answered(tmp_path: Path) -> None:
    life, _ = first_life(tmp_path)
    rec = Store(tmp_path).open().load_all().models["m"]
    assert rec.stage_bytes == [MIB, 2 * MIB]
    assert rec.placement == [life.core.models["m"].replicas[0].workers]
    out = life.client(CLIENT_A, p.Undeploy(id=7, model="m"))
    assert only(out, p.Undeployed)
    assert Store(tmp_path).open().load_all().models == {}


def test_a_restarted_broker_takes_the_stages_up_without_deploying_again(tmp_path: Path) -> None:
    _, inv = first_life(tmp_path)
    life = Life(tmp_path)
    model = life.core.models["m"]
    assert model.state.value == "ready" and not model.replicas[0].live
    assert life.core.status(0.0).restoring is True
    # A request that comes before the workers waits for them, rather than failing.
    rid, out = life.infer("m")
    assert out == []
    out = life.register("w0", {"stages": held_stages_with(inv["w0"], resident=True)})
    assert [m.TYPE for _, _, m in out] == ["register_ack"]
    out = life.register("w1", {"stages": inv["w1"]})
    # Nothing is deployed again: the stages are adopted, the one not resident is loaded.
    assert not only(out, p.DeployStage) and not only(out, p.DropStage)
    assert model.replicas[0].live
    assert life.core.status(0.0).restoring is False
    (load,) = only(out, p.Load)
    assert load.id > 1 << 40  # this life's ids are above every id of the one before
    assert [load.stage] == [s["stage"] for s in inv["w1"]]  # w0's is resident already
    (run,) = only(out, p.Run)  # the request that waited runs now (stage 1 waits on its load)
    assert run.stage == 0 and rid


def held_stages_with(items: list[dict[str, Any]], resident: bool) -> list[dict[str, Any]]:
    return [{**item, "resident": resident} for item in items]


def test_a_stage_nobody_asked_for_is_dropped_and_a_missing_one_repaired(tmp_path: Path) -> None:
    _, inv = first_life(tmp_path)
    life = Life(tmp_path)
    stray = {"model": "nobody", "stage": 0, "nbytes": 5, "resident": False, "digest": "x"}
    stale = [{**item, "digest": "other"} for item in inv["w0"]]  # built from another spec
    out = life.register("w0", {"stages": [stray, *stale]})
    drops = sorted((m.model, m.stage) for m in only(out, p.DropStage))
    assert drops == sorted([("nobody", 0), *((s["model"], s["stage"]) for s in stale)])
    # w1 comes back with its stage: every worker named is here, so the restore ends now and
    # the stage w0 lost is deployed there again (a repair that reads its weights).
    out = life.register("w1", {"stages": inv["w1"]})
    deploys = only(out, p.DeployStage)
    assert [(d.model, d.stage) for d in deploys] == [(s["model"], s["stage"]) for s in stale]
    assert [a for _, a, m in out if isinstance(m, p.DeployStage)] == [b"w0"]


def test_a_replica_whose_worker_never_returns_is_placed_anew(tmp_path: Path) -> None:
    _, inv = first_life(tmp_path)
    life = Life(tmp_path)
    life.partitioner()
    life.register("w1", {"stages": inv["w1"]})
    life.register("w2")
    life.now = life.core.restore_grace_s() + 0.1
    for peer in (b"part", b"w1", b"w2"):  # alive all along
        life.backend(peer, p.Heartbeat())
    life.out()
    life.core.tick(life.now)
    out = life.out()
    deploys = [(a, m.stage) for _, a, m in out if isinstance(m, p.DeployStage)]
    assert {a for a, _ in deploys} <= {b"w1", b"w2"} and len(deploys) == 2
    assert [r.workers for r in life.core.models["m"].replicas] == [
        Store(tmp_path).open().load_all().models["m"].placement[0]
    ]


def test_a_bad_inventory_is_refused_before_anything_changes(tmp_path: Path) -> None:
    _, inv = first_life(tmp_path)
    life = Life(tmp_path)
    bad = [{**inv["w0"][0], "nbytes": -1}]
    with pytest.raises(FlowmeshError) as info:
        life.register("w0", {"stages": bad})
    assert info.value.code == Code.BAD_MESSAGE and "nbytes" in info.value.reason
    assert "w0" not in life.core.peers
    with pytest.raises(FlowmeshError):
        life.register("w0", {"jobs": [{"name": "j"}]})


# ====================================================================== training jobs


CONFIG = {"optimizer": {"name": "sgd"}, "loss": "mse"}
# What the worker says it runs: the broker keeps that (a checkpoint's, when resumed).
RUN = TrainConfig(optimizer={"name": "adam", "lr": 0.5}, loss="mse", accumulate=2)


def open_job(life: Harness, worker: bytes, name: str = "j") -> None:
    spec = {"name": name, "factory": "flowmesh.examples:mlp", "seed": 0}
    out = life.client(CLIENT_A, p.TrainOpen(id=50, job=name, spec=spec, config=CONFIG, batch=4))
    ((_, addr, sent),) = out
    assert addr == worker
    info = opened_job(name, footprint=MIB, config=RUN)
    out = life.backend(worker, p.JobOpened(id=sent.id, job=info))
    assert only(out, p.TrainOpened)


def step(life: Harness, seq: int, rid: int) -> list[Any]:
    tensors = {"inputs": ref(4, 4), "targets": ref(4, 4)}
    return life.client(CLIENT_A, p.TrainStep(id=rid, job="j", seq=seq, tensors=tensors))


def test_a_training_job_is_taken_up_and_a_retried_step_is_not_run_twice(tmp_path: Path) -> None:
    life = Life(tmp_path)
    w0 = life.register("w0")
    life.backend(b"w0", p.Heartbeat())
    open_job(life, b"w0")
    assert Store(tmp_path).open().load_all().jobs["j"].config == RUN.to_dict()
    (fwd,) = only(step(life, 1, 60), p.TrainStep)
    life.backend(b"w0", p.TrainStepResult(id=fwd.id, job="j", seq=1, loss=0.5, step=1))
    only(step(life, 2, 61), p.TrainStep)  # then the broker dies, step 2 still running
    only(step(life, 3, 62), p.TrainStep)
    del w0

    life = Life(tmp_path)
    assert life.core.training.jobs["j"].state == "restoring"
    assert life.core.training.jobs["j"].config == RUN  # typed again as the store gives it back
    # The client sends steps 2 and 3 again, and 4: held until the worker is back.
    assert step(life, 2, 70) == [] and step(life, 3, 71) == [] and step(life, 4, 72) == []
    result = {"t": "ok", "seq": 2, "loss": 0.25, "step": 2, "metrics": {}}
    rows = [{"blocks": [0, 2], "host_bytes": MIB, "task_bytes": MIB, "activations": "keep"}]
    job = {"name": "j", "step": 2, "seq": 3, "footprint": MIB, "results": [result],
           "sub_models": rows}  # fmt: skip
    out = life.register("w0", {"jobs": [{**job, "running": [3]}]})
    (kept,) = life.core.training.status(0.0)
    assert [(m.blocks, m.activations) for m in kept.sub_models] == [([0, 2], "keep")]
    # Step 2's answer is replayed; step 3 waits for the worker's answer; step 4 is new.
    (replayed,) = [m for _, a, m in out if isinstance(m, p.TrainStepResult)]
    assert (replayed.id, replayed.seq, replayed.loss) == (70, 2, 0.25)
    (fwd,) = only(out, p.TrainStep)
    assert fwd.seq == 4
    # Step 3's answer comes with the id of the broker before: it answers the retry.
    out = life.backend(b"w0", p.TrainStepResult(id=999, job="j", seq=3, loss=0.125, step=3))
    (res,) = [m for d, _, m in out if d == CLIENT]
    assert (res.id, res.seq, res.loss) == (71, 3, 0.125)


def test_a_training_job_its_worker_lost_fails_the_held_steps(tmp_path: Path) -> None:
    life = Life(tmp_path)
    life.register("w0")
    life.backend(b"w0", p.Heartbeat())
    open_job(life, b"w0")
    life = Life(tmp_path)
    assert step(life, 1, 80) == []
    out = life.register("w0", {"jobs": []}, pid=2)  # it restarted: the job is gone
    (err,) = [m for d, _, m in out if d == CLIENT]
    assert err.id == 80 and err.code == Code.WORKER_LOST and "saved no checkpoint" in err.reason
    assert Store(tmp_path).open().load_all().jobs == {}


def test_a_job_nobody_here_opened_is_closed_on_its_worker() -> None:
    """A broker without a state directory restarted: the jobs a worker brings are closed."""
    life = Harness()
    item = {"name": "x", "step": 3, "seq": 3, "footprint": MIB, "results": [], "running": []}
    out = life.backend(
        b"w0",
        received(
            p.Register(
                id=1, role="worker", name="w0", pid=1, budget_bytes=MIB, inventory={"jobs": [item]}
            )
        ),
    )
    assert [(m.TYPE, getattr(m, "job", None)) for _, _, m in out] == [
        ("register_ack", None),
        ("train_close", "x"),
    ]
    assert life.core.training.jobs == {}


# ====================================================================== pipelined training jobs


def open_pipelined(life: Life) -> list[str]:
    """Job "j" over two workers w0 and w1 (each with a peer endpoint): their stages, in order."""
    for w in ("w0", "w1"):
        life.register(w, peer=f"tcp://127.0.0.1:{7000 + int(w[1])}")
        life.backend(w.encode(), p.Heartbeat())
    spec = {"name": "j", "factory": "flowmesh.examples:mlp", "seed": 0}
    msg = p.TrainOpen(id=50, job="j", spec=spec, config=CONFIG, batch=4, pipeline=2)
    opens = [(a.decode(), m) for _, a, m in life.client(CLIENT_A, msg)]
    assert [type(m) for _, m in opens] == [p.PipeOpen, p.PipeOpen]
    workers = [w for w, _ in sorted(opens, key=lambda o: o[1].stage)]
    for w, m in opens:
        info = opened_job("j", worker=w, footprint=MIB, config=RUN)
        out = life.backend(w.encode(), p.JobOpened(id=m.id, job=info))
    assert only(out, p.TrainOpened)
    return workers


def held(
    step: int, seq: int, results: list[dict[str, Any]], running: list[int], blocks: Any = (0, 1)
) -> dict[str, Any]:
    """A pipelined job "j" as a worker's inventory lists it (its stage's blocks)."""
    row = {"blocks": list(blocks), "host_bytes": 0, "task_bytes": MIB}
    return {"jobs": [{"name": "j", "step": step, "seq": seq, "footprint": MIB,
                      "results": results, "running": running, "sub_models": [row]}]}  # fmt: skip


def test_a_pipelined_job_is_kept_and_taken_up_once_every_stage_is_back(tmp_path: Path) -> None:
    life = Life(tmp_path)
    first, second = open_pipelined(life)
    assert Store(tmp_path).open().load_all().jobs["j"].workers == [first, second]
    assert [a for _, a, _ in step(life, 1, 60)] == [first.encode()]  # its steps go to stage 0
    only(step(life, 2, 61), p.TrainStep)  # then the broker dies, step 2 still running

    life = Life(tmp_path)
    job = life.core.training.jobs["j"]
    assert (job.state, job.workers, job.worker) == ("restoring", [first, second], first)
    assert step(life, 2, 70) == [] and step(life, 3, 71) == []  # held
    # Stage 1's worker comes back first: still waiting for stage 0's.
    out = life.register(second, held(0, 0, [], [], (1, 2)), peer="tcp://127.0.0.1:7001")
    assert [m.TYPE for _, _, m in out] == ["register_ack"] and job.state == "restoring"
    # Stage 0's, where the steps go, brings their figures: step 1 answered, step 2 running.
    result = {"t": "ok", "seq": 1, "loss": 0.5, "step": 1, "metrics": {}}
    out = life.register(first, held(1, 2, [result], [2]), peer="tcp://127.0.0.1:7000")
    assert job.state == "ready" and job.footprint == 2 * MIB
    (fwd,) = only(out, p.TrainStep)  # step 3 is new; step 2 waits for the worker's answer
    assert fwd.seq == 3 and [a for _, a, m in out if m is fwd] == [first.encode()]
    out = life.backend(first.encode(), p.TrainStepResult(id=9, job="j", seq=2, loss=0.25, step=2))
    (res,) = [m for d, _, m in out if d == CLIENT]
    assert (res.id, res.seq, res.loss) == (70, 2, 0.25)
    (row,) = life.core.training.status(0.0)
    assert (row.pipeline, row.step, row.state) == ([first, second], 2, "ready")
    assert [m.blocks for m in row.sub_models] == [[0, 1], [1, 2]]  # its stages, in order


def test_a_pipelined_job_a_stage_came_back_without_is_lost_and_closed(tmp_path: Path) -> None:
    life = Life(tmp_path)
    first, second = open_pipelined(life)
    life = Life(tmp_path)
    assert step(life, 1, 80) == []
    out = life.register(first, held(0, 0, [], []), peer="tcp://127.0.0.1:7000")
    assert [m.TYPE for _, _, m in out] == ["register_ack"]
    out = life.register(second, {"jobs": []}, pid=2, peer="tcp://127.0.0.1:7001")  # restarted
    (err,) = [m for d, _, m in out if d == CLIENT]
    assert err.id == 80 and err.code == Code.WORKER_LOST
    assert f"worker {second} came back without" in err.reason
    # Stage 0's part, back but unreachable now, is closed.
    assert [(a, m.job) for _, a, m in out if isinstance(m, p.TrainClose)] == [(first.encode(), "j")]
    assert Store(tmp_path).open().load_all().jobs == {}


def test_a_pipelined_job_whose_stage_never_returns_is_lost_at_the_grace(tmp_path: Path) -> None:
    life = Life(tmp_path)
    first, second = open_pipelined(life)
    life = Life(tmp_path)
    assert step(life, 1, 90) == []
    life.register(first, held(0, 0, [], []), peer="tcp://127.0.0.1:7000")
    life.now = life.core.restore_grace_s() + 0.1
    life.backend(first.encode(), p.Heartbeat())
    life.out()
    life.core.tick(life.now)
    out = life.out()
    (err,) = [m for d, _, m in out if d == CLIENT]
    assert err.id == 90 and err.code == Code.WORKER_LOST
    assert f"worker(s) {second} did not come back" in err.reason
    assert [(a, m.job) for _, a, m in out if isinstance(m, p.TrainClose)] == [(first.encode(), "j")]
