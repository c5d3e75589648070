"""CURVE keys on a real mesh: strangers are refused before the broker reads a message, a worker
key cannot take another worker's name (nor its own while a live worker holds it), and only
operator keys may change what is deployed.

One keyed mesh (`LocalMesh(keys=True)`) serves the module; the processes refused here are started
beside it and stopped by the test that started them.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from client_sdk import errors
from client_sdk.client import AsyncClient, Client
from client_sdk.mesh import LocalMesh
from flowmesh.auth import (
    Identity,
    add_key,
    authorize_client,
    check_registration,
    init_keys,
    read_cert,
)
from flowmesh.errors import Code, FlowmeshError
from flowmesh.reports import PeerRow
from flowmesh.testing import assert_forward_close
from tests.support import training
from tests.support.mesh import FAST, deploy, mlp_spec, reference

WIDTH = 64
SPEC = mlp_spec("auth-mlp", width=WIDTH, depth=2, seed=11)


@pytest.fixture(scope="module")
def keyed_mesh() -> Iterator[LocalMesh]:
    with LocalMesh(cpu_workers=2, memory_budget="8MiB", train_bytes="4MiB", keys=True,
                   **FAST) as m:  # fmt: skip
        with m.client(timeout=30) as c:
            deploy(c, SPEC)
        yield m


@pytest.fixture(scope="module")
def ref() -> torch.nn.Module:
    return reference(SPEC)


def stranger_keys(mesh: LocalMesh, tmp: Path, name: str, role: str) -> Path:
    """A key directory the mesh's broker does not know, holding `name`'s key (and the real
    broker's public key, so only the broker's refusal stands in the way)."""
    d = tmp / "strangers"
    if not d.exists():
        init_keys(d)
        assert mesh.key_dir is not None
        shutil.copy(mesh.key_dir / "broker.key", d / "broker.key")
    return add_key(d, name, role)


def peer_rows(client: Client) -> dict[str, PeerRow]:
    st = client.status(timeout=10)
    return {r.name: r for r in (*st.workers, *st.partitioners)}


def spawn_worker(mesh: LocalMesh, name: str, extra: list[str]) -> str:
    """A worker process beside the mesh (stopped with it, or by the test); its child name."""
    child = f"extra-{name}-{len(mesh.children)}"
    mesh._spawn(
        child,
        "gpu_worker",
        [
            *("--broker", mesh.backend, "--device", "cpu", "--memory-budget", "8MiB"),
            *("--name", name, "--threads", "1", *extra),
        ],
    )
    return child


def wait_log(mesh: LocalMesh, child: str, text: str, timeout: float = 30) -> str:
    def probe() -> str | None:
        log = mesh.child(child).tail(200)
        return log if text in log else None

    return mesh.wait_until(probe, f"{child} to log {text!r}", timeout)


# ---------------------------------------------------------------------------- pure rules


def test_roles_and_names_bind_what_a_key_may_do() -> None:
    ops, app, w0 = Identity("ops", "operator"), Identity("app", "client"), Identity("w0", "worker")
    for call in ("infer", "status", "plan", "jobs"):
        authorize_client(app, call)
        authorize_client(ops, call)
    for call in ("deploy", "undeploy", "train_open", "train_step", "train_close"):
        authorize_client(ops, call)
        with pytest.raises(FlowmeshError, match=f"{call} refused.*operator") as exc:
            authorize_client(app, call)
        assert exc.value.code == Code.FORBIDDEN
    with pytest.raises(FlowmeshError) as exc:
        authorize_client(w0, "infer")  # a worker's key is no client key
    assert exc.value.code == Code.FORBIDDEN
    with pytest.raises(FlowmeshError) as exc:
        authorize_client(None, "infer")
    assert exc.value.code == Code.UNAUTHORIZED
    check_registration(w0, "w0", "worker")
    with pytest.raises(FlowmeshError, match="'w1' refused: this key belongs to worker 'w0'"):
        check_registration(w0, "w1", "worker")
    with pytest.raises(FlowmeshError, match="partitioner 'w0' refused"):
        check_registration(w0, "w0", "partitioner")


def test_certificates_carry_name_and_role(tmp_path: Path) -> None:
    init_keys(tmp_path / "k")
    secret = add_key(tmp_path / "k", "ops", "operator")
    pub, sec, meta = read_cert(secret.with_suffix(".key"))
    assert sec is None and meta == {"name": "ops", "role": "operator"}
    assert read_cert(secret)[:2] == (pub, read_cert(secret)[1]) and read_cert(secret)[1]
    with pytest.raises(FlowmeshError, match="already holds a key named 'ops'"):
        add_key(tmp_path / "k", "ops", "client")
    with pytest.raises(FlowmeshError, match="role 'root'"):
        add_key(tmp_path / "k", "x", "root")


# ---------------------------------------------------------------------------- (a) strangers


async def _refused_call(client: AsyncClient) -> errors.ClientError:
    """The error of a call on a refused connection. A refusal the client missed would end the
    call at its timeout, as Timeout: callers assert UNAUTHORIZED, which only the refusal gives
    (so no clock is read here)."""
    with pytest.raises(errors.ClientError) as exc:
        await client.status(timeout=30)
    return exc.value


async def test_unknown_and_missing_client_keys_are_refused_fast(
    keyed_mesh: LocalMesh, ref: torch.nn.Module, tmp_path: Path
) -> None:
    secret = stranger_keys(keyed_mesh, tmp_path, "eve", "operator")
    async with AsyncClient(keyed_mesh.frontend, timeout=20, keys=keyed_mesh.client_keys) as ok:
        st = await ok.status()
        refused_before, zap_before = st.totals.auth_refused, st.totals.zap_refused
    async with AsyncClient(keyed_mesh.frontend, timeout=30, keys=str(secret)) as eve:
        exc = await _refused_call(eve)
        assert exc.code == Code.UNAUTHORIZED and "refused this key" in exc.reason, exc
        again = await _refused_call(eve)  # the next call tries again, and fails as fast
        assert again.code == Code.UNAUTHORIZED
    async with AsyncClient(keyed_mesh.frontend, timeout=30, keys=False) as anon:
        exc = await _refused_call(anon)
        assert exc.code == Code.UNAUTHORIZED and "requires a CURVE key" in exc.reason, exc
    # A raw socket with a stranger's key gets no answer at all.
    pub, sec, _ = read_cert(secret)
    server = read_cert(secret.parent / "broker.key")[0]
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.linger = 0
    raw.curve_publickey, raw.curve_secretkey, raw.curve_serverkey = pub, sec, server
    try:
        raw.connect(keyed_mesh.frontend)
        raw.send_multipart([b"\x92\xa6status\x01"])  # never even decoded: ZAP refuses first
        assert not raw.poll(1000), "a refused key got an answer"
    finally:
        raw.close(0)
        ctx.term()
    # The mesh keeps serving its own clients.
    async with AsyncClient(keyed_mesh.frontend, timeout=20, keys=keyed_mesh.client_keys) as ok:
        x = torch.randn(3, WIDTH)
        assert_forward_close(await ok.infer(SPEC.name, x), ref(x))
        # Refused by ZAP: not one of these messages reached the broker's logic.
        st = await ok.status()
        assert st.totals.auth_refused == refused_before, st.totals.auth_refused
        assert st.totals.zap_refused >= zap_before + 2, (zap_before, st.totals.zap_refused)


async def test_a_refusal_before_the_client_looks_is_still_seen(keyed_mesh: LocalMesh) -> None:
    """The handshake is refused while the client's event loop is busy elsewhere: the refusal
    must still fail the call at once, not at its timeout. (Without the monitor started before
    the connection, about half of these waited for the timeout.)"""
    for _ in range(4):
        async with AsyncClient(keyed_mesh.frontend, timeout=10, keys=False) as anon:
            sock = anon.connection.connect()
            # The loop does not turn while the refusal comes: this thread waits for its event
            # on a plain shadow of the monitor the client started before connecting (pyzmq
            # keeps it on the socket; asking for one here would start it, hiding a client that
            # did not), and the client's watcher has not run yet.
            monitor = sock._monitor_socket
            assert monitor is not None, "the client started no monitor before connecting"
            assert zmq.Socket.shadow(monitor.underlying).poll(30_000), "no handshake event"
            exc = await _refused_call(anon)
            assert exc.code == Code.UNAUTHORIZED and "requires a CURVE key" in exc.reason, exc


def test_unauthenticated_workers_are_refused_and_the_mesh_keeps_serving(
    keyed_mesh: LocalMesh, ref: torch.nn.Module, tmp_path: Path
) -> None:
    secret = stranger_keys(keyed_mesh, tmp_path, "worker-9", "worker")
    stranger = spawn_worker(keyed_mesh, "worker-9", ["--keys", str(secret.parent)])
    anon = spawn_worker(keyed_mesh, "worker-8", [])
    try:
        wait_log(keyed_mesh, stranger, "the broker refused this key")
        wait_log(keyed_mesh, anon, "the broker requires a CURVE key")
        with keyed_mesh.client(timeout=20) as c:
            rows = peer_rows(c)
            assert "worker-9" not in rows and "worker-8" not in rows, sorted(rows)
            assert {"worker-0", "worker-1", "partitioner-0"} <= set(rows)
            x = torch.randn(2, WIDTH)
            assert_forward_close(c.infer(SPEC.name, x), ref(x))
        for child in (stranger, anon):
            assert keyed_mesh.child(child).proc.poll() is None  # refused, still trying
    finally:
        keyed_mesh.kill(stranger)
        keyed_mesh.kill(anon)


# ---------------------------------------------------------------------------- (b) names


def test_a_worker_key_cannot_register_under_another_workers_name(
    keyed_mesh: LocalMesh, ref: torch.nn.Module
) -> None:
    assert keyed_mesh.key_dir is not None
    secret = keyed_mesh.key_dir / "intruder.key_secret"
    if not secret.exists():
        add_key(keyed_mesh.key_dir, "intruder", "worker")  # an allowed worker key
    with keyed_mesh.client(timeout=20) as c:
        before = peer_rows(c)["worker-0"]
        refused_before = c.status().totals.auth_refused
        intruder = spawn_worker(keyed_mesh, "worker-0", ["--keys", str(secret)])
        try:
            log = wait_log(
                keyed_mesh, intruder, "registration as worker 'worker-0' refused: this key "
            )
            assert "belongs to worker 'intruder'" in log and "forbidden" in log, log
            assert c.status().totals.auth_refused > refused_before
            after = peer_rows(c)["worker-0"]
            assert (after.pid, after.registrations) == (
                before.pid,
                before.registrations,
            ), (before, after)
            assert "intruder" not in peer_rows(c)
            x = torch.randn(2, WIDTH)
            assert_forward_close(c.infer(SPEC.name, x), ref(x))
        finally:
            keyed_mesh.kill(intruder)


def test_a_second_process_with_a_worker_s_own_key_stops_while_that_worker_lives(
    keyed_mesh: LocalMesh, ref: torch.nn.Module
) -> None:
    """The key grants the name, but a live worker holds it: refused (`name_taken`), never the
    two taking turns; the second process stops, saying so."""
    assert keyed_mesh.key_dir is not None
    with keyed_mesh.client(timeout=20) as c:
        before = peer_rows(c)["worker-0"]
        twin = keyed_mesh.child(
            spawn_worker(keyed_mesh, "worker-0", ["--keys", str(keyed_mesh.key_dir)])
        )
        try:
            assert twin.proc.wait(120) == 1, twin.tail()
        finally:
            if twin.proc.poll() is None:
                keyed_mesh.kill(twin.name)
        assert "name_taken" in twin.tail(100), twin.tail()
        assert "name 'worker-0' is held by a live worker of another process" in twin.tail(100)
        after = peer_rows(c)["worker-0"]
        assert (after.pid, after.registrations) == (
            before.pid,
            before.registrations,
        ), (before, after)
        x = torch.randn(2, WIDTH)
        assert_forward_close(c.infer(SPEC.name, x), ref(x))


# ---------------------------------------------------------------------------- (c, d) roles


def test_a_client_key_can_infer_but_not_deploy(keyed_mesh: LocalMesh, ref: torch.nn.Module) -> None:
    assert keyed_mesh.key_dir is not None
    secret = keyed_mesh.key_dir / "app.key_secret"
    if not secret.exists():
        add_key(keyed_mesh.key_dir, "app", "client")
    with Client(keyed_mesh.frontend, timeout=20, keys=str(secret)) as app:
        x = torch.randn(4, WIDTH)
        assert_forward_close(app.infer(SPEC.name, x), ref(x))
        assert app.status().models[0].name == SPEC.name
        other = mlp_spec("auth-denied", width=WIDTH, depth=2, seed=1)
        with pytest.raises(errors.Forbidden, match="deploy refused: key 'app' has role 'client'"):
            deploy(app, other)
        with pytest.raises(errors.Forbidden, match="undeploy refused") as exc:
            app.undeploy(SPEC.name)
        assert exc.value.code == Code.FORBIDDEN
        with pytest.raises(errors.Forbidden, match="train_open refused") as exc:
            app.train_open(
                "auth-job", "flowmesh.examples:mlp", batch_size=2, optimizer={"name": "sgd"}
            )
        assert exc.value.code == Code.FORBIDDEN
        st = app.status()
        assert [m.name for m in st.models] == [SPEC.name] and st.totals.auth_refused >= 3


def test_an_operator_deploys_and_infers_end_to_end(keyed_mesh: LocalMesh) -> None:
    spec = mlp_spec("auth-operator", width=128, depth=3, seed=5)
    model = reference(spec)
    with keyed_mesh.client(timeout=30) as ops:
        deploy(ops, spec, stages=2)
        for _ in range(3):
            x = torch.randn(3, 128)
            assert_forward_close(ops.infer(spec.name, x), model(x))
        ops.undeploy(spec.name)
        assert spec.name not in [m.name for m in ops.status().models]


def test_a_pipelined_job_trains_worker_to_worker_under_keys(keyed_mesh: LocalMesh) -> None:
    """Each stage's worker lets the other stages' keys onto its peer socket while the job is
    open there (`PeerKeys`): activations and gradients go worker to worker, and the losses are
    plain PyTorch's."""
    s = training.spec(21)
    batches = training.data(21, steps=3)
    kw = {k: v for k, v in training.open_kw(s, training.ADAM).items() if k != "chunk_bytes"}
    with keyed_mesh.client(timeout=60) as ops:
        job = ops.train_open("auth-piped", s.factory, pipeline=2, accumulate=2, **kw)
        assert len(set(job.info.pipeline)) == 2  # one stage on each worker
        losses = [job.step(x, y, timeout=60).loss for x, y in batches]
        job.close()
    want, _ = training.plain(s, training.ADAM, batches, accumulate=2)
    training.close(losses, want, "pipelined under keys: per-step losses")
