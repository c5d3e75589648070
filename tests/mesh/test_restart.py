"""The broker killed (SIGKILL) during mixed inference and training traffic, and started again on
the same `--state-dir`: nothing it promised is lost (issue 9 section 3).

- every client call completes, or fails with a clear error within its timeout;
- no model is deployed again: a deploy of the same name is refused as existing, and inference
  gives the right outputs at once;
- no stage is prepared again (no weight file read again): each worker's `stages_prepared`
  counter, reported in its heartbeats, is what it was before the restart;
- the training job goes on, step after step, with the losses of an uninterrupted run.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from client_sdk import errors
from client_sdk.client import AsyncClient
from client_sdk.connection import PendingCall
from client_sdk.mesh import LocalMesh
from flowmesh import protocol as p
from flowmesh.modelio.build import build_seeded
from flowmesh.spec import ModelSpec
from flowmesh.testing import assert_forward_close
from tests.support.mesh import FAST, deploy, fresh_stats, mlp_spec, reference, roots_at
from tests.support.training import ADAM, ALLOW, TRAIN_BYTES, close, data, open_kw, plain, spec
from tests.support.waiting import until

INFER_TIMEOUT = 20.0
STEP_TIMEOUT = 30.0
STEPS = 16
# What a call may fail with when the broker dies under it; anything else is a bug.
CLEAR = (errors.Unavailable, errors.Timeout, errors.WorkerLost)


def prepared(mesh: LocalMesh, c: Any) -> dict[str, int]:
    return {
        f"worker-{i}": fresh_stats(c, f"worker-{i}").stages_prepared
        for i in range(mesh.n_workers)
    }


def answered(call: PendingCall) -> bool:
    return call.fut.done() and not call.fut.cancelled() and call.fut.exception() is None


def test_the_broker_restarts_without_losing_anything(tmp_path: Path) -> None:
    seeded = mlp_spec("restart-seeded", width=256, depth=4, seed=71)
    from_file = mlp_spec("restart-weights", width=192, depth=3, seed=72)
    weights = tmp_path / "w.safetensors"
    save_file(build_seeded(from_file).state_dict(), str(weights))
    on_disk = ModelSpec(
        name=from_file.name,
        factory=from_file.factory,
        kwargs=from_file.kwargs,
        weights=str(weights),
    )
    refs = {seeded.name: reference(seeded), on_disk.name: reference(from_file)}
    widths = {seeded.name: 256, on_disk.name: 192}
    job_spec, batches = spec(5), data(5, STEPS)
    expected, _ = plain(job_spec, ADAM, batches)

    with LocalMesh(
        cpu_workers=2,
        memory_budget="16MiB",
        train_bytes=TRAIN_BYTES,
        broker_args=[*ALLOW, "--state-dir", str(tmp_path / "state")],
        worker_args=ALLOW,
        run_dir=tmp_path / "run",
        **roots_at(tmp_path),
        **FAST,
    ) as mesh:
        with mesh.client(timeout=60) as c:
            for s in (seeded, on_disk):
                deploy(c, s)
                x = torch.randn(2, widths[s.name])
                assert_forward_close(c.infer(s.name, x), refs[s.name](x))
            before = prepared(mesh, c)
        assert sum(before.values()) >= 2

        outcomes: list[tuple[str, str, float]] = []  # (phase, outcome, seconds)
        losses: list[float] = []
        restarted = asyncio.Event()
        gave_up = asyncio.Event()  # the killer failed: the traffic stops, the failure is raised
        clients: list[AsyncClient] = []
        training_started = asyncio.Event()
        probes: list[asyncio.Future[p.BrokerStatus]] = []
        in_flight: list[PendingCall] = []  # the calls sent and not answered at the kill

        async def infer_traffic(k: int) -> None:
            async with AsyncClient(mesh.frontend, timeout=INFER_TIMEOUT) as client:
                clients.append(client)
                j, after = 0, 0
                while after < 15 and not gave_up.is_set():
                    after += restarted.is_set()
                    name = [seeded.name, on_disk.name][(k + j) % 2]
                    j += 1
                    x = torch.randn(1, widths[name])
                    phase = "after" if restarted.is_set() else "around"
                    t0 = time.monotonic()
                    try:
                        out = await client.infer(name, x)
                    except CLEAR as exc:
                        outcomes.append((phase, f"{exc.code}: {exc.reason}", time.monotonic() - t0))
                        continue
                    assert_forward_close(out, refs[name](x))
                    outcomes.append((phase, "ok", time.monotonic() - t0))

        async def training() -> None:
            async with AsyncClient(mesh.frontend, timeout=STEP_TIMEOUT) as client:
                clients.append(client)
                job = await client.train_open(
                    "restart-job", job_spec.factory, **open_kw(job_spec, ADAM)
                )
                for i, (x, y) in enumerate(batches):
                    if i == 3:
                        training_started.set()
                    r = await job.step(x, y, timeout=STEP_TIMEOUT)
                    assert r.step == i + 1
                    losses.append(r.loss)
                await job.close()

        async def killer() -> None:
            await asyncio.wait_for(training_started.wait(), 60)
            await until(lambda: len(outcomes) >= 20, "20 calls answered before the kill")
            # Frozen first, so that every client has a call in flight when it dies. A call
            # pending at the freeze may still be answered (its answer may have left the broker
            # before it froze, to be read after the connection is lost), but a call made after
            # the freeze cannot be: one status call from each client is in flight for sure.
            mesh.child("broker").proc.send_signal(signal.SIGSTOP)
            probes.extend(asyncio.ensure_future(cl.status()) for cl in clients)
            await until(
                lambda: all(
                    any(c.held is None for c in cl.connection._pending.values()) for cl in clients
                ),
                "a call in flight from every client at the frozen broker",
            )
            in_flight.extend(
                c for cl in clients for c in cl.connection._pending.values() if c.held is None
            )
            await asyncio.to_thread(mesh.restart_broker, wait=False)
            restarted.set()

        async def main() -> None:
            # Every task to its end, then the first failure: a task cancelled under its client
            # (what gather does to the others on a failure) is not what this test is about.
            async def kill_or_give_up() -> None:
                try:
                    await killer()
                except BaseException:
                    gave_up.set()
                    raise

            done = await asyncio.gather(
                kill_or_give_up(),
                training(),
                *(infer_traffic(k) for k in range(3)),
                return_exceptions=True,
            )
            done += await asyncio.gather(*probes, return_exceptions=True)
            for outcome in done:
                if isinstance(outcome, BaseException):
                    raise outcome

        asyncio.run(main())

        # Every call in flight at the kill ended with the answer the old broker had sent before
        # it froze, or was sent again once its client had reconnected: none was lost. Each
        # client's status call, made at the frozen broker, was answered by the new one: sent
        # again by its client, or (on a loaded machine) delivered by ZeroMQ from its own queue
        # when the kill came before its I/O thread had written it; the resend ran at least once.
        lost = [c.kind for c in in_flight if not (c.retried or answered(c))]
        assert not lost, lost
        assert any(cl.resent >= 1 for cl in clients), [cl.resent for cl in clients]
        assert all(isinstance(pr.result(), p.BrokerStatus) for pr in probes)
        # Every call ended within its timeout (and the client's grace); every failure says why.
        slow = [o for o in outcomes if o[2] > INFER_TIMEOUT + 2.5]
        assert not slow, slow
        failed = [o for o in outcomes if o[1] != "ok"]
        assert len(failed) <= 3, failed  # in flight calls are sent again: few, if any, fail
        assert sum(1 for o in outcomes if o[0] == "after" and o[1] == "ok") >= 30
        # The training job went on as if nothing happened.
        close(losses, expected, "per-step losses across the broker's restart")

        with mesh.client(timeout=60) as c:
            st = mesh.wait_ready()
            assert {m.name: m.state for m in st.models} == {
                seeded.name: "ready",
                on_disk.name: "ready",
            }
            with pytest.raises(errors.ModelExists):
                deploy(c, seeded)
            for s in (seeded, on_disk):
                x = torch.randn(3, widths[s.name])
                assert_forward_close(c.infer(s.name, x), refs[s.name](x))
            # Not one stage was prepared again: no weight file was read after the restart.
            assert prepared(mesh, c) == before
        assert "state from" in (tmp_path / "run" / "broker.log").read_text()
