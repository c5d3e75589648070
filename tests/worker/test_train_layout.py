"""The host-tier layout of a training job, exactly (`gpu_worker.train_layout`): who owns a tied
weight, where each tensor sits in its slab and in a task's extent, which host regions a task reads
and writes, and the copies that bring it in. Plain bookkeeping: no job, no device, no compute."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.chain import Block
from gpu_worker.train_layout import (
    BACKWARD,
    FORWARD,
    LAST,
    NORMS,
    UPDATE,
    CopyPlan,
    Layout,
    Region,
    SubModel,
    TensorInfo,
    check_ranges,
    collect,
    lay_out_slab,
    plan_copies,
    regions,
    task_layouts,
)

F32 = torch.float32


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 3)  # 48 bytes
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))  # 8 bytes


def chain() -> list[Block]:
    """Two blocks: an embedding with a buffer, and a head whose weight is the embedding's."""
    first = Embed()
    head = nn.Linear(3, 4)
    head.weight = first.emb.weight  # tied across the two sub-models
    return [
        Block("embed", first, {"emb.weight": "emb.weight", "count": "count"}),
        Block("head", head, {"weight": "emb.weight", "bias": "head.bias"}),
    ]


def laid_out() -> tuple[dict[str, TensorInfo], list[SubModel]]:
    tensors, subs = collect(chain(), [(0, 1), (1, 2)])
    adam = [{"exp_avg": F32, "exp_avg_sq": F32}]
    sizes = [lay_out_slab(subs[0], tensors, adam), lay_out_slab(subs[1], tensors, [{"m": F32}])]
    for sub, size in zip(subs, sizes, strict=True):
        sub.slab = torch.zeros(size, dtype=torch.uint8)
        sub.layouts = task_layouts(sub, tensors, fwd_bytes=100, act_bytes=1000)
    return tensors, subs


def test_the_first_user_owns_a_tied_weight():
    tensors, subs = collect(chain(), [(0, 1), (1, 2)])
    got = {n: (i.owner, i.order, i.is_param, i.trainable) for n, i in tensors.items()}
    assert got == {
        "emb.weight": (0, 0, True, True),
        "count": (0, 1, False, False),
        "head.bias": (1, 2, True, True),
    }
    assert [(s.uses, s.owned, s.borrowed) for s in subs] == [
        (["emb.weight", "count"], ["emb.weight", "count"], []),
        (["emb.weight", "head.bias"], ["head.bias"], ["emb.weight"]),
    ]


def test_ranges_must_cover_the_chain_from_0():
    check_ranges([(0, 1), (1, 2)], 2)
    for ranges in ([(0, 1)], [(1, 2)], [(0, 1), (2, 2)], []):
        with pytest.raises(FlowmeshError) as err:
            check_ranges(ranges, 2)
        assert err.value.code == Code.PLAN_ERROR


def test_slab_sections_and_slots():
    # Tensors 64-aligned, sections 256-aligned: P | B | G | S.
    tensors, subs = laid_out()
    assert [s.sections for s in subs] == [
        {"P": (0, 256), "B": (256, 512), "G": (512, 768), "S": (768, 1024)},
        {"P": (0, 256), "B": (256, 256), "G": (256, 512), "S": (512, 768)},
    ]
    emb = tensors["emb.weight"]
    assert (emb.slot.offset, emb.slot.nbytes) == (0, 48)
    assert emb.grad_slot is not None and emb.grad_slot.offset == 512
    assert {k: (s.offset, s.nbytes) for k, s in emb.state_slots.items()} == {
        "exp_avg": (768, 48),
        "exp_avg_sq": (832, 48),
    }
    assert (tensors["count"].slot.offset, tensors["head.bias"].slot.offset) == (256, 0)


def test_task_extents_put_borrowed_tensors_after_the_prefix():
    _, subs = laid_out()
    assert subs[1].layouts == {
        FORWARD: Layout(256, {"emb.weight": 256}, {}, 100, 512 + 256),
        "grad": Layout(512, {"emb.weight": 512}, {"emb.weight": 576}, 1000, 768 + 1024),
        "grad+update": Layout(768, {"emb.weight": 768}, {"emb.weight": 832}, 1000, 1024 + 1024),
        UPDATE: Layout(768, {}, {}, 0, 768),
    }


def test_regions_a_task_reads_and_writes():
    tensors, subs = laid_out()
    p0, g0, r0, s0 = (Region(k, 0) for k in "PGRS")
    p1, b1, g1, r1, s1 = (Region(k, 1) for k in "PBGRS")
    assert regions(FORWARD, subs[1], tensors, update=False, clip=False) == (
        frozenset({p1, b1, p0}),
        frozenset({b1, r1}),
    )
    # The tied weight's gradient goes back to its owner's home, sub-model 0's G.
    assert regions(LAST, subs[1], tensors, update=True, clip=False) == (
        frozenset({p1, g1, b1, s1, p0, g0}),
        frozenset({g1, b1, p1, s1, g0}),
    )
    assert regions(BACKWARD, subs[0], tensors, update=False, clip=True) == (
        frozenset({p0, g0, r0}),
        frozenset({g0, NORMS}),
    )
    assert regions(UPDATE, subs[0], tensors, update=True, clip=True) == (
        frozenset({p0, g0, s0, NORMS}),
        frozenset({p0, g0, s0}),
    )


def where(plan: CopyPlan, subs: list[SubModel]) -> list[tuple[int, int, int, int]]:
    """Each copy as (arena offset, source sub-model, offset in its slab, bytes)."""
    out = []
    for off, src in plan.copies:
        (owner,) = (
            s.index
            for s in subs
            if src.untyped_storage().data_ptr() == s.slab.untyped_storage().data_ptr()
        )
        out.append((off, owner, src.storage_offset(), src.numel()))
    return out


def test_copies_of_a_first_and_a_later_micro_batch():
    tensors, subs = laid_out()
    valid = {"emb.weight": False, "head.bias": False}
    plan = plan_copies(
        subs, tensors, 1, LAST, False, 4096,
        grad_valid=valid, state_valid=valid, snapshot=None,
    )  # fmt: skip
    # No gradient yet: the gradients' homes are not read, their extent is zero-filled, the
    # sub-model's own G section as one range (padding included).
    assert where(plan, subs) == [(4096, 1, 0, 256), (4096 + 512, 0, 0, 48)]
    assert plan.zero == [(4096 + 256, 256), (4096 + 576, 48)]
    valid = dict.fromkeys(valid, True)
    plan = plan_copies(
        subs, tensors, 1, LAST, False, 4096,
        grad_valid=valid, state_valid=valid, snapshot=None,
    )  # fmt: skip
    # Every gradient held: the G section is one copy, the tied one comes from its owner.
    assert where(plan, subs) == [
        (4096, 1, 0, 256),
        (4096 + 256, 1, 256, 256),
        (4096 + 512, 0, 0, 48),
        (4096 + 576, 0, 512, 48),
    ]
    assert plan.zero == [] and plan.bytes_in == 256 + 256 + 48 + 48


def test_fresh_gradients_leave_the_own_gradients_unread_and_unfilled():
    """`fresh_grads` (the CPU stand-in's): a gradient not held yet is neither read nor zeroed,
    the backward makes it; one held still comes in, and a borrowed one is still zeroed (it is
    accumulated into its view and written back to its owner)."""
    tensors, subs = laid_out()
    valid = {"emb.weight": False, "head.bias": False}
    plan = plan_copies(
        subs, tensors, 1, LAST, False, 4096,
        grad_valid=valid, state_valid=valid, snapshot=None, fresh_grads=True,
    )  # fmt: skip
    assert where(plan, subs) == [(4096, 1, 0, 256), (4096 + 512, 0, 0, 48)]
    assert plan.zero == [(4096 + 576, 48)]
    valid = dict.fromkeys(valid, True)
    plan = plan_copies(
        subs, tensors, 1, LAST, False, 4096,
        grad_valid=valid, state_valid=valid, snapshot=None, fresh_grads=True,
    )  # fmt: skip
    assert (4096 + 256, 1, 256, 256) in where(plan, subs) and plan.zero == []


def test_a_backward_copies_the_buffers_its_forward_saw():
    tensors, subs = laid_out()
    valid = {"emb.weight": True, "head.bias": True}
    snapshot = torch.ones(256, dtype=torch.uint8)
    plan = plan_copies(
        subs, tensors, 0, BACKWARD, True, 0,
        grad_valid=valid, state_valid=valid, snapshot=snapshot,
    )  # fmt: skip
    assert [(off, src.numel()) for off, src in plan.copies] == [
        (0, 256),
        (256, 256),
        (512, 256),
        (768, 256),
    ]
    assert plan.copies[1][1] is snapshot
