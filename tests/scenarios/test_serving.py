"""Serving end to end on an in-process mesh (tests/support/inproc.py): outputs of the direct
forward, oversubscription, concurrency, errors."""

from __future__ import annotations

import asyncio
import threading

import msgspec
import pytest
import torch
from safetensors.torch import save_file

from client_sdk import errors
from flowmesh.modelio.build import build_reference, build_seeded
from flowmesh.spec import ModelSpec, TensorSpec
from flowmesh.testing import assert_forward_close, assert_same_bits
from tests.support.inproc import InProcMesh
from tests.support.mesh import (
    ResidencySampler,
    deploy,
    fresh_stats,
    mlp_spec,
    reference,
    wait_until,
)


def test_infer_matches_a_direct_forward(mesh: InProcMesh) -> None:
    mlp = mlp_spec("exact-mlp", seed=3)
    gpt = ModelSpec(
        name="exact-gpt",
        factory="flowmesh.examples:tiny_gpt",
        seed=4,
        kwargs={"vocab": 256, "d_model": 64, "n_layers": 2, "n_heads": 4},
    )
    with mesh.client() as c:
        deploy(c, mlp)
        deploy(c, gpt)
        for _ in range(3):
            x = torch.randn(2, 256)
            assert_forward_close(c.infer("exact-mlp", x), reference(mlp)(x))
            ids = torch.randint(0, 256, (2, 12))
            assert_forward_close(c.infer("exact-gpt", ids), reference(gpt)(ids))


def test_weights_from_safetensors_are_served(mesh: InProcMesh, tmp_path) -> None:  # type: ignore[no-untyped-def]
    seeded = mlp_spec("from-file", seed=11)
    path = tmp_path / "w.safetensors"
    save_file(build_seeded(seeded).state_dict(), str(path))
    spec = ModelSpec(
        name="from-file", factory=seeded.factory, kwargs=seeded.kwargs, weights=str(path)
    )
    with mesh.client() as c:
        deploy(c, spec)
        x = torch.randn(1, 256)
        from_file = build_reference(spec)  # the whole model as deployed, read from the file
        seeded_state = build_seeded(seeded).state_dict()
        for name, tensor in from_file.state_dict().items():
            assert_same_bits(tensor, seeded_state[name], name)  # bit-exact: weights from a file
        with torch.inference_mode():
            assert_forward_close(c.infer("from-file", x), from_file(x))


def test_weights_missing_a_tensor_is_a_clear_deploy_error(mesh: InProcMesh, tmp_path) -> None:  # type: ignore[no-untyped-def]
    state = build_seeded(mlp_spec("x", seed=1)).state_dict()
    state.pop("2.weight")
    path = tmp_path / "partial.safetensors"
    save_file(state, str(path))
    with mesh.client() as c, pytest.raises(errors.BadRequest, match=r"2\.weight"):
        c.deploy(
            "partial", "flowmesh.examples:mlp", kwargs={"width": 256, "depth": 3}, weights=str(path)
        )
    with mesh.client() as c:
        assert "partial" not in [m.name for m in c.status().models]


def test_models_three_times_the_budget_are_all_served(mesh: InProcMesh) -> None:
    # 8 MiB per worker, 16 MiB in all; twelve models of 2.3 MiB x 2 replicas... and 4.2 MiB each.
    specs = [mlp_spec(f"over-{i}", width=512, depth=3, seed=i) for i in range(12)]
    with mesh.client() as c:
        for s in specs:
            deploy(c, s)
        total = sum(m.bytes for m in c.status().models if m.name.startswith("over-"))
        budget = sum(w.budget_bytes for w in c.status().workers)
        assert total >= 3 * budget
        refs = {s.name: reference(s) for s in specs}
        residency = ResidencySampler()
        evictions_before = {
            w.name: fresh_stats(c, w.name).evictions for w in c.status().workers
        }
        for round_ in range(2):
            for s in specs:
                x = torch.randn(1 + round_, 512)
                assert_forward_close(c.infer(s.name, x), refs[s.name](x), s.name)
                residency.take(c.status())
        st = c.status()
        final = {w.name: fresh_stats(c, w.name) for w in st.workers}

        def views_agree() -> bool:
            # The broker's view of each worker's device is what the worker says it holds
            # (the worker chose its evictions; its reports keep the broker right).
            st = c.status()
            return all(
                sorted(w.resident) == sorted(fresh_stats(c, w.name).resident_stages)
                for w in st.workers
            )

        wait_until(views_agree, "the broker's view of residency to match the workers'", 10)
    models = {m.name: m for m in st.models}
    assert all(models[s.name].loads >= 1 for s in specs)
    assert sum(models[s.name].evictions for s in specs) > 0
    # The workers themselves chose the evictions (the broker sends no Evict to make room), and
    # never held more stage bytes than their budget, neither when sampled nor at any load.
    assert sum(final[n].evictions - evictions_before[n] for n in final) > 0, final
    assert sum(final[n].evictions_chosen for n in final) > 0, final
    residency.check(final, {w.name: w.budget_bytes for w in st.workers})


def test_concurrent_clients_each_get_their_own_answers(mesh: InProcMesh) -> None:
    specs = [mlp_spec(f"conc-{i}", width=128, depth=2, seed=20 + i) for i in range(3)]
    with mesh.client() as c:
        for s in specs:
            deploy(c, s)
    refs = {s.name: reference(s) for s in specs}

    async def client_task(k: int) -> int:
        ok = 0
        async with mesh.async_client(timeout=60) as client:
            for j in range(12):
                spec = specs[(k + j) % len(specs)]
                # Unique per client and call: a swapped answer would be far off.
                x = torch.randn(1, 128, generator=torch.Generator().manual_seed(k * 1000 + j))
                out = await client.infer(spec.name, x)
                # Batched with other clients' rows: the same forward, in another order.
                assert_forward_close(out, refs[spec.name](x))
                ok += 1
        return ok

    async def main() -> list[int]:
        return await asyncio.gather(*(client_task(k) for k in range(10)))

    assert asyncio.run(main()) == [12] * 10


def test_requests_of_a_model_taking_one_per_forward_share_runs_under_load(
    mesh: InProcMesh,
) -> None:
    """A model deployed with max_batch_size 1 under a burst: queued requests travel to the
    worker several to a run (fewer runs than requests), each computed alone, each answer its
    own request's."""
    spec = msgspec.structs.replace(
        mlp_spec("one-per-forward", width=128, depth=4, seed=31), max_batch_size=1
    )
    ref = reference(spec)
    with mesh.client() as c:
        deploy(c, spec, replicas=1)

    async def burst() -> list[tuple[torch.Tensor, torch.Tensor, dict]]:  # type: ignore[type-arg]
        async with mesh.async_client(timeout=60) as client:
            xs = [torch.randn(1 + k % 3, 128) for k in range(48)]
            outs = await asyncio.gather(*(client.infer_with_info(spec.name, x) for x in xs))
            return [(x, out, info) for x, (out, info) in zip(xs, outs, strict=True)]

    answers = asyncio.run(burst())
    for x, out, info in answers:
        assert_forward_close(out, ref(x))
        assert info["batch"] == 1  # no forward shared
    with mesh.client() as c:
        (row,) = [m for m in c.status().models if m.name == spec.name]
    assert row.completed == 48
    assert row.batches < 48, row.batches  # several requests to a run


def test_bad_requests_get_clear_errors_and_nothing_hangs(mesh: InProcMesh) -> None:
    with mesh.client(timeout=20) as c:
        with pytest.raises(errors.NotAllowed, match="allow-list"):
            c.deploy("evil", "os:system", kwargs={"command": "true"})
        with pytest.raises(errors.ModelNotFound, match="no model 'ghost'"):
            c.infer("ghost", torch.randn(1, 4))
        deploy(c, mlp_spec("shape-check", width=64, depth=1))
        with pytest.raises(errors.BadRequest, match="expects Nx64"):
            c.infer("shape-check", torch.randn(2, 65))
        with pytest.raises(errors.BadRequest, match="float32"):
            c.infer("shape-check", torch.randn(2, 64).double())
        with pytest.raises(errors.BadRequest, match="factory"):
            c.deploy("nope", "flowmesh.examples:does_not_exist")
        with pytest.raises(errors.BadRequest, match="width"):
            c.deploy("bad-kwargs", "flowmesh.examples:mlp", kwargs={"width": -3})
        with pytest.raises(errors.ModelExists):
            deploy(c, mlp_spec("shape-check", width=64, depth=1))
        with pytest.raises(errors.TooBig, match="at least 7 parts"):
            c.deploy(
                "huge",
                "flowmesh.examples:mlp",
                kwargs={"width": 1024, "depth": 6},
                seed=0,
                stages=1,
            )
        with pytest.raises(errors.TooBig, match="no partition can hold it"):
            c.deploy("huge", "flowmesh.examples:mlp", kwargs={"width": 2048, "depth": 2}, seed=0)
        # The mesh is still healthy afterwards.
        x = torch.randn(1, 64)
        assert c.infer("shape-check", x).shape == (1, 64)


def test_undeploy_frees_the_model(mesh: InProcMesh) -> None:
    with mesh.client() as c:
        deploy(c, mlp_spec("short-lived", width=64, depth=1))
        c.infer("short-lived", torch.randn(1, 64))
        c.undeploy("short-lived")
        with pytest.raises(errors.ModelNotFound):
            c.infer("short-lived", torch.randn(1, 64))
        st = c.status()
    assert all(not any(r.startswith("short-lived/") for r in w.resident) for w in st.workers)


def test_sync_client_is_safe_across_threads(mesh: InProcMesh) -> None:
    spec = mlp_spec("threads", width=64, depth=1, seed=5)
    ref = reference(spec)
    failures: list[BaseException] = []
    with mesh.client() as c:
        deploy(c, spec)

        def worker(k: int) -> None:
            try:
                for _ in range(5):
                    x = torch.randn(1, 64) + k
                    assert_forward_close(c.infer("threads", x), ref(x))
            except BaseException as exc:  # collected and re-raised in the main thread
                failures.append(exc)

        threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"threads still calling infer after 60 s: {hung}"
    assert not failures, failures


def test_half_precision_deployment_takes_and_returns_its_dtype(mesh: InProcMesh) -> None:
    spec = ModelSpec(
        name="bf16-mlp",
        factory="flowmesh.examples:mlp",
        seed=6,
        dtype="bfloat16",
        kwargs={"width": 128, "depth": 2},
    )
    with mesh.client() as c:
        deploy(c, spec, dtype="bfloat16")
        shown = next(m for m in c.status().models if m.name == "bf16-mlp")
        assert shown.inputs == {"x": TensorSpec(dtype="bfloat16", shape=(-1, 128))}
        x = torch.randn(2, 128).bfloat16()
        out = c.infer("bf16-mlp", x)
        assert out.dtype == torch.bfloat16
        assert_forward_close(out, reference(spec)(x))  # at bfloat16's tolerance
        with pytest.raises(errors.BadRequest, match="bfloat16"):
            c.infer("bf16-mlp", torch.randn(2, 128))
