"""Reading a stage from a safetensors file straight into the host tier (gpu_worker/stage_loader.py
`read_stage`): the same bytes, bit for bit, as materialising the stage on the CPU and copying it in
(the old path, still used for seeded stages), one copy from the file into the host buffer, and
the same outputs through the executor. Cases: float32, a bfloat16 file deployed as float32 (the
cast path) and a model with tied weights (GPT-2's lm_head and wte, stored once)."""

from __future__ import annotations

import ctypes
import itertools
import os
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
from msgspec.structs import replace

import flowmesh.modelio.weights
import gpu_worker.stage_loader as stage_loader
from flowmesh.errors import FlowmeshError
from flowmesh.modelio.build import build_reference, build_seeded
from flowmesh.modelio.plan import Plan
from flowmesh.modelio.stages import materialize_stage
from flowmesh.spec import DEFAULT_ALLOW, ModelSpec
from flowmesh.testing import assert_forward_close, assert_same_bits
from gpu_worker.device import CpuStandIn
from gpu_worker.executor import Executor
from gpu_worker.host_tier import HostStage
from gpu_worker.stage_loader import prepare_stage
from partitioner.stage_plans import make_stage_plan
from tests.support.archs import inputs_of, spec_of

MIB = 1 << 20


def save_whole(model: torch.nn.Module, path: Path, dtype: torch.dtype | None = None) -> str:
    """The state_dict with tied tensors once, under their first name, optionally in `dtype`."""
    seen: set[int] = set()
    tensors = {}
    for name, t in model.state_dict().items():
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            t = t.to(dtype) if dtype is not None and t.is_floating_point() else t
            tensors[name] = t.contiguous()
    safetensors.torch.save_file(tensors, str(path))
    return str(path)


def old_path(spec: ModelSpec, plan: Plan, index: int) -> HostStage:
    """What prepare_stage did before the direct read: materialise on the CPU, then copy in."""
    stage = materialize_stage(spec, plan, index)
    return HostStage.build([dict(b.state_dict(keep_vars=True)) for b in stage.blocks])


def assert_same_host(new: HostStage, old: HostStage) -> None:
    assert new.regions == old.regions  # the same layout, ties included
    for b, region in enumerate(old.regions):
        for k, slot in enumerate(region.slots):
            # bit-exact: bytes read from the file into the host tier against the old path's copy
            assert_same_bits(new.slot_view(b, k), old.slot_view(b, k), f"block {b} {slot.name}")


CASES = {
    # name: (arch, dtype the file is stored in, stage counts)
    "mlp-f32": ("mlp", None, (1, 2)),
    "mlp-bf16-file": ("mlp", torch.bfloat16, (1, 2)),
    "gpt2-tied": ("hf_gpt2", None, (1, 2)),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    arch, file_dtype, parts = CASES[request.param]
    seeded = spec_of(arch)
    where = tmp_path_factory.mktemp(arch) / "m.safetensors"
    path = save_whole(build_seeded(seeded), where, file_dtype)
    spec = replace(seeded, seed=None, weights=path)
    return arch, spec, parts


def stages(spec: ModelSpec, parts: int) -> tuple[Plan, list[tuple[list, HostStage]]]:
    plan = make_stage_plan(spec, parts)
    dev = CpuStandIn(64 * MIB)
    return plan, [prepare_stage(spec, plan, i, dev, DEFAULT_ALLOW) for i in range(plan.parts)]


def test_host_buffers_equal_the_old_paths_bit_for_bit(case) -> None:
    arch, spec, parts_list = case
    for parts in parts_list:
        plan, made = stages(spec, parts)
        for i, (_blocks, host) in enumerate(made):
            assert_same_host(host, old_path(spec, plan, i))
    if arch == "hf_gpt2":  # the one-stage plan holds wte and lm_head: stored once
        plan, [(_blocks, host)] = stages(spec, 1)
        aliases = [s for r in host.regions for s in r.slots if s.alias is not None]
        assert [s.name for s in aliases] == ["lm_head.weight"]  # tied to wte.weight


async def test_outputs_through_the_executor_equal_the_old_paths(case) -> None:
    arch, spec, parts_list = case
    x = inputs_of(arch)
    for parts in parts_list:
        plan, made = stages(spec, parts)
        outs = []
        for which in ("direct", "old"):
            ex = Executor(CpuStandIn(64 * MIB))
            h = x
            for i, (blocks, host) in enumerate(made):
                if which == "old":
                    blocks = list(materialize_stage(spec, plan, i).to("meta").blocks)
                    host = old_path(spec, plan, i)
                ex.add_stage((which, i), blocks, host)
                await ex.load((which, i))
                h = (await ex.run((which, i), [{"x": h}])).parts[0][""]
            ex.close()
            outs.append(h)
        assert_forward_close(outs[0], outs[1], f"{arch} in {parts} stages")
    if arch == "mlp":  # and the deployed model's own forward
        with torch.no_grad():
            assert_forward_close(outs[0], build_reference(spec)(x))


def address(mv: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mv))


def test_one_copy_from_the_file_into_the_host_buffer(monkeypatch, tmp_path) -> None:
    """Same dtype: every byte is read by preadv straight into the host buffer, once; nothing of
    safetensors' own reader, no materialised stage, no temporary tensor, one allocation."""
    seeded = spec_of("hf_gpt2")
    spec = replace(seeded, seed=None, weights=save_whole(build_seeded(seeded), tmp_path / "m.st"))
    plan = make_stage_plan(spec, 1)

    def refuse(*_a, **_k):
        raise AssertionError("the direct path must not take this road")

    for target, attr in [
        (safetensors, "safe_open"),
        (safetensors.torch, "load_file"),
        (flowmesh.modelio.weights, "read_weights"),
        (flowmesh.modelio.weights, "conform"),  # only the cast path converts a temporary
        (stage_loader, "materialize_stage"),
    ]:
        monkeypatch.setattr(target, attr, refuse)
    reads: list[tuple[int, int]] = []
    real_preadv = os.preadv

    def preadv(fd, buffers, offset):
        (mv,) = buffers
        got = real_preadv(fd, buffers, offset)
        reads.append((address(mv), got))
        return got

    monkeypatch.setattr(os, "preadv", preadv)
    allocations: list[torch.Tensor] = []
    dev = CpuStandIn(64 * MIB)
    real_allocate = dev.host_buffer

    def allocate(n: int) -> torch.Tensor:
        allocations.append(real_allocate(n))
        return allocations[-1]

    monkeypatch.setattr(dev, "host_buffer", allocate)
    _blocks, host = prepare_stage(spec, plan, 0, dev, DEFAULT_ALLOW)
    assert len(allocations) == 1 and allocations[0] is host.buffer
    lo = host.buffer.data_ptr()
    hi = lo + host.buffer.numel()
    assert reads and all(lo <= a and a + n <= hi for a, n in reads), "a read landed outside"
    stored = sum(s.nbytes for r in host.regions for s in r.slots if s.alias is None)
    assert sum(n for _a, n in reads) == stored  # each tensor once, the tied one included


def test_a_missing_tensor_or_a_wrong_shape_is_a_clear_error(tmp_path) -> None:
    seeded = spec_of("mlp")
    state = {k: v.contiguous() for k, v in build_seeded(seeded).state_dict().items()}
    first = next(iter(state))
    plan = make_stage_plan(replace(seeded, seed=None, weights=str(tmp_path / "x")), 1)
    for what, tensors in [
        ("is missing", {k: v for k, v in state.items() if k != first}),
        ("has shape", {**state, first: torch.zeros(3, 3)}),
    ]:
        path = tmp_path / f"{what.replace(' ', '_')}.safetensors"
        safetensors.torch.save_file(tensors, str(path))
        spec = replace(seeded, seed=None, weights=str(path))
        plan = make_stage_plan(spec, 1)
        with pytest.raises(FlowmeshError, match=what):
            prepare_stage(spec, plan, 0, CpuStandIn(8 * MIB), DEFAULT_ALLOW)


def test_reading_a_stage_reports_its_progress_up_to_every_byte(case) -> None:
    # What a worker reports while it reads a stage (`flowmesh deploy` shows it): bytes read so
    # far, never going back, ending at every byte of the stage's tensors (ties counted once).
    arch, spec, _ = case
    plan = make_stage_plan(spec, 2)
    for i in range(plan.parts):
        seen: list[tuple[int, int]] = []

        def progress(done: int, total: int, seen: list[tuple[int, int]] = seen) -> None:
            seen.append((done, total))

        _, host = prepare_stage(spec, plan, i, CpuStandIn(64 * MIB), DEFAULT_ALLOW, progress)
        stored = sum(s.nbytes for r in host.regions for s in r.slots if s.alias is None)
        assert seen[0] == (0, stored) and seen[-1] == (stored, stored), (arch, i, seen[-1])
        assert all(a[0] <= b[0] for a, b in itertools.pairwise(seen))
