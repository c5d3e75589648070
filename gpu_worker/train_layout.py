"""Where a training job's tensors live, and the copies that bring a task's data in: plain
bookkeeping over the tensors' shapes, dtypes and owners (the compute is `gpu_worker.train_job`).

The model is a chain of blocks cut into contiguous sub-models (a chunk plan). The host tier keeps,
per sub-model, one flat host slab laid out in four sections

    [ P: parameters | B: buffers | G: gradients' home | S: optimizer state ]

holding the tensors that sub-model *owns* (the lowest-indexed sub-model that uses a tensor owns
it, so a weight tied across sub-models has one home, one gradient and one optimizer state). A task
takes one arena extent whose prefix mirrors the slab's offsets, so bringing a section in is one
contiguous copy; tensors a sub-model borrows from an earlier one's slab, the activation
reservation and nothing else follow the prefix (`Layout`).

Which host regions a task reads and writes (`Region`) is what keeps a prefetched task from
copying in a stale section (`gpu_worker.train_scheduler`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.chain import Block
from flowmesh.spec import BLOCK_ALIGN, TENSOR_ALIGN
from gpu_worker.host_tier import Slot

# Task kinds.
FORWARD, LAST, BACKWARD, UPDATE, SAVE = "forward", "last", "backward", "update", "save"
EVAL = "eval"


class Region(NamedTuple):
    """A host region of a job that a task reads or writes (a scheduler key)."""

    # "P", "B", "G", "S": that section of sub-model `sub`'s slab; "R": the buffers as `sub`'s
    # forward saw them (the backward's replay); "N": the step's gradient norms (job-wide).
    section: str
    sub: int | None = None


NORMS = Region("N")


@dataclass
class CopyPlan:
    """The host->arena copies of one task, decided when it is admitted (on the driver thread)."""

    copies: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # arena offset, bytes
    zero: list[tuple[int, int]] = field(default_factory=list)  # arena offset, size: zero-filled

    @property
    def bytes_in(self) -> int:
        return sum(src.numel() for _, src in self.copies)


@dataclass
class TensorInfo:
    name: str  # the original model's state_dict name (or block-qualified if not in it)
    tensor: torch.Tensor  # the module's own Parameter or buffer object
    is_param: bool
    trainable: bool
    owner: int  # index of the sub-model whose slab holds it
    order: int  # first appearance in the chain (gradient-norm order, like model.parameters())
    slot: Slot = field(init=False)  # within the owner's slab
    home: torch.Tensor = field(init=False)
    grad_slot: Slot | None = None
    grad_home: torch.Tensor | None = None
    state_slots: dict[str, Slot] = field(default_factory=dict)
    state_homes: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Layout:
    """Where a task's tensors sit in its extent (offsets relative to the extent's start)."""

    prefix: int  # the slab sections mirrored at the start
    borrowed: dict[str, int]
    borrowed_grads: dict[str, int]
    reserve: int  # activation bytes accounted for this task
    total: int


@dataclass
class SubModel:
    index: int
    start: int
    stop: int
    modules: list[nn.Module]
    uses: list[str]  # every tensor its blocks hold, first appearance first
    owned: list[str]
    borrowed: list[str]
    slab: torch.Tensor = field(init=False)
    sections: dict[str, tuple[int, int]] = field(default_factory=dict)  # "P","B","G","S"
    optimizer: torch.optim.Optimizer | None = None
    layouts: dict[str, Layout] = field(default_factory=dict)


def aligned(n: int, to: int) -> int:
    return -(-n // to) * to


def slot_of(name: str, t: torch.Tensor, offset: int) -> Slot:
    return Slot(name, t.dtype, tuple(t.shape), offset, t.numel() * t.element_size())


# -- sub-models and their tensors ----------------------------------------------------------------


def check_ranges(ranges: Sequence[tuple[int, int]], n: int) -> None:
    """Sub-model block ranges must cover the `n` blocks, contiguous from 0."""
    expect = 0
    for a, b in ranges:
        if a != expect or b <= a:
            raise FlowmeshError(
                Code.PLAN_ERROR, f"sub-model ranges {ranges} are not contiguous from 0"
            )
        expect = b
    if expect != n or not ranges:
        raise FlowmeshError(
            Code.PLAN_ERROR, f"sub-model ranges {ranges} do not cover the {n} blocks"
        )


def collect(
    blocks: Sequence[Block], ranges: Sequence[tuple[int, int]]
) -> tuple[dict[str, TensorInfo], list[SubModel]]:
    """Every tensor of the chain, owned by the first sub-model that uses it, and the sub-models
    with what each uses, owns and borrows."""
    tensors: dict[str, TensorInfo] = {}
    subs: list[SubModel] = []
    by_id: dict[int, str] = {}
    for index, (a, b) in enumerate(ranges):
        uses: list[str] = []
        for block in blocks[a:b]:
            named = [
                *((n, t, True) for n, t in block.module.named_parameters(remove_duplicate=False)),
                *((n, t, False) for n, t in block.module.named_buffers(remove_duplicate=False)),
            ]
            for local, t, is_param in named:
                name = by_id.get(id(t))
                if name is None:
                    name = block.tensor_names.get(local, f"{block.name}:{local}")
                    by_id[id(t)] = name
                    tensors[name] = TensorInfo(
                        name, t, is_param, is_param and t.requires_grad, index, len(tensors)
                    )
                if name not in uses:
                    uses.append(name)
        owned = [n for n in uses if tensors[n].owner == index]
        borrowed = [n for n in uses if tensors[n].owner != index]
        for n in borrowed:
            if not tensors[n].is_param:
                raise FlowmeshError(
                    Code.PLAN_ERROR,
                    f"buffer {n!r} is shared by sub-models {tensors[n].owner} and "
                    f"{index}: keep the blocks that share a buffer in one sub-model",
                )
        mods = [blk.module for blk in blocks[a:b]]
        subs.append(SubModel(index, a, b, mods, uses, owned, borrowed))
    return tensors, subs


class SlotPacker:
    """Tensors' slots laid one after another in a buffer, each on a TENSOR_ALIGN boundary, in
    sections that end on a BLOCK_ALIGN one."""

    def __init__(self) -> None:
        self.offset = 0

    def place(self, name: str, like: torch.Tensor) -> Slot:
        slot = slot_of(name, like, self.offset)
        self.offset += aligned(slot.nbytes, TENSOR_ALIGN)
        return slot

    def state(self, info: TensorInfo, key: str, dtype: torch.dtype) -> Slot:
        """The slot of optimizer state `key` of `info`'s parameter (shaped like it)."""
        like = torch.empty(info.tensor.shape, dtype=dtype, device="meta")
        return self.place(f"{info.name}.{key}", like)

    def end_section(self) -> int:
        self.offset = aligned(self.offset, BLOCK_ALIGN)
        return self.offset


def lay_out_slab(
    sub: SubModel,
    tensors: Mapping[str, TensorInfo],
    states: Sequence[Mapping[str, torch.dtype]],
) -> int:
    """Place the tensors `sub` owns in its slab (their slots, the slab's sections); returns the
    slab's size. `states` are the optimizer state tensors of each trainable parameter, in order
    (`gpu_worker.train_config.optimizer_states`)."""
    infos = [tensors[n] for n in sub.owned]
    params = [i for i in infos if i.is_param]
    buffers = [i for i in infos if not i.is_param]
    trainable = [i for i in params if i.trainable]
    pack = SlotPacker()
    sections: dict[str, tuple[int, int]] = {}
    start = 0
    for info in params:
        info.slot = pack.place(info.name, info.tensor)
    sections["P"] = (start, start := pack.end_section())
    for info in buffers:
        info.slot = pack.place(info.name, info.tensor)
    sections["B"] = (start, start := pack.end_section())
    for info in trainable:
        info.grad_slot = pack.place(info.name, info.tensor)
    sections["G"] = (start, start := pack.end_section())
    for info, dtypes in zip(trainable, states, strict=True):
        for key, dtype in dtypes.items():
            info.state_slots[key] = pack.state(info, key, dtype)
    sections["S"] = (start, pack.end_section())
    sub.sections = sections
    return pack.offset


# -- a task's extent -----------------------------------------------------------------------------


def task_layouts(
    sub: SubModel, tensors: Mapping[str, TensorInfo], fwd_bytes: int, act_bytes: int
) -> dict[str, Layout]:
    """The extent of each kind of task of `sub`: a forward's, a backward's (with or without the
    update) and an update's, each reserving its activation bytes."""
    align = BLOCK_ALIGN
    ends = {k: v[1] for k, v in sub.sections.items()}
    kinds = {
        FORWARD: (ends["B"], False, fwd_bytes),
        "grad": (ends["G"], True, act_bytes),
        "grad+update": (ends["S"], True, act_bytes),
        UPDATE: (ends["S"], None, 0),
    }
    layouts = {}
    for kind, (prefix, grads, reserve) in kinds.items():
        offset = aligned(prefix, align)
        borrowed: dict[str, int] = {}
        borrowed_grads: dict[str, int] = {}
        if grads is not None:
            for n in sub.borrowed:
                borrowed[n] = offset
                offset += aligned(tensors[n].slot.nbytes, TENSOR_ALIGN)
            if grads:
                for n in sub.borrowed:
                    if tensors[n].trainable:
                        borrowed_grads[n] = offset
                        offset += aligned(tensors[n].slot.nbytes, TENSOR_ALIGN)
            offset = aligned(offset, align)
        total = offset + aligned(reserve, align)
        layouts[kind] = Layout(prefix, borrowed, borrowed_grads, reserve, total)
    return layouts


def layout_for(sub: SubModel, kind: str, update: bool) -> Layout:
    """The extent layout of a task of `kind` (with the update, for a backward)."""
    if kind in (FORWARD, EVAL):
        return sub.layouts[FORWARD]
    if kind == UPDATE:
        return sub.layouts[UPDATE]
    return sub.layouts["grad+update" if update else "grad"]


def regions(
    kind: str, sub: SubModel, tensors: Mapping[str, TensorInfo], update: bool, clip: bool
) -> tuple[frozenset[Region], frozenset[Region]]:
    """The host regions a task of `kind` on `sub` reads and writes back."""
    i = sub.index
    owners = {tensors[n].owner for n in sub.borrowed}
    p, b, g, s, r = (Region(k, i) for k in "PBGSR")
    if kind == FORWARD:
        reads = {p, b, *(Region("P", o) for o in owners)}
        writes = {b, r}
    elif kind == EVAL:  # writes nothing back: its extent is dropped when it ends
        reads = {p, b, *(Region("P", o) for o in owners)}
        writes = set()
    elif kind == UPDATE:
        reads = {p, g, s, NORMS}
        writes = {p, g, s}
    else:
        reads = {p, g, *(Region("P", o) for o in owners), *(Region("G", o) for o in owners)}
        reads.add(b if kind == LAST else r)
        writes = {g, *(Region("G", o) for o in owners)}
        if kind == LAST:
            writes.add(b)
        if update:
            reads.add(s)
            writes |= {p, s}
        if clip:
            writes.add(NORMS)
    return frozenset(reads), frozenset(writes)


# -- copies (driver thread) ----------------------------------------------------------------------


def plan_copies(
    subs: Sequence[SubModel],
    tensors: Mapping[str, TensorInfo],
    index: int,
    kind: str,
    update: bool,
    base: int,
    *,
    grad_valid: Mapping[str, bool],
    state_valid: Mapping[str, bool],
    snapshot: torch.Tensor | None,
    fresh_grads: bool = False,
) -> CopyPlan:
    """Copies that bring a task's data from the host tier into its extent at `base`: sub-model
    `index`'s sections (the gradients and optimizer state only where their homes hold something,
    `grad_valid` / `state_valid`), the tensors it borrows, and for a backward the buffers as its
    forward saw them (`snapshot`)."""
    plan = CopyPlan()
    sub = subs[index]
    layout = layout_for(sub, kind, update)
    (p0, p1), (b0, b1), (g0, g1), (s0, s1) = (sub.sections[k] for k in "PBGS")
    if p1 > p0:
        plan.copies.append((base + p0, sub.slab[p0:p1]))
    if b1 > b0 and kind in (FORWARD, LAST, EVAL):
        plan.copies.append((base + b0, sub.slab[b0:b1]))
    if b1 > b0 and kind == BACKWARD:
        assert snapshot is not None
        plan.copies.append((base + b0, snapshot))
    owned_trainable = [tensors[n] for n in sub.owned if tensors[n].trainable]
    if kind not in (FORWARD, EVAL) and g1 > g0:
        zero = not fresh_grads
        _plan_section(plan, sub, base, (g0, g1), owned_trainable, grad_valid, grads=True, zero=zero)
    if update and s1 > s0:
        _plan_section(plan, sub, base, (s0, s1), owned_trainable, state_valid, grads=False)
    for n, off in layout.borrowed.items():
        info = tensors[n]
        owner = subs[info.owner].slab
        plan.copies.append(
            (base + off, owner[info.slot.offset : info.slot.offset + info.slot.nbytes])
        )
    for n, off in layout.borrowed_grads.items():
        info = tensors[n]
        assert info.grad_slot is not None
        if grad_valid[n]:
            owner = subs[info.owner].slab
            gs = info.grad_slot
            plan.copies.append((base + off, owner[gs.offset : gs.offset + gs.nbytes]))
        else:
            plan.zero.append((base + off, info.grad_slot.nbytes))
    return plan


def _plan_section(
    plan: CopyPlan,
    sub: SubModel,
    base: int,
    section: tuple[int, int],
    infos: list[TensorInfo],
    valid: Mapping[str, bool],
    *,
    grads: bool,
    zero: bool = True,
) -> None:
    lo, hi = section
    if infos and all(valid[i.name] for i in infos):
        plan.copies.append((base + lo, sub.slab[lo:hi]))  # one contiguous copy
        return
    zero = zero and grads
    if not zero and grads and not any(valid[i.name] for i in infos):
        return  # no gradient yet, and the backward makes fresh ones (`fresh_grads`)
    if zero and infos and not any(valid[i.name] for i in infos):
        plan.zero.append((base + lo, hi - lo))  # no gradient yet: the section zeroed at once
        return
    for info in infos:
        slots = [info.grad_slot] if grads else list(info.state_slots.values())
        for s in slots:
            assert s is not None
            if valid[info.name]:
                plan.copies.append((base + s.offset, sub.slab[s.offset : s.offset + s.nbytes]))
            elif zero:  # no gradient yet: accumulate from zero
                plan.zero.append((base + s.offset, s.nbytes))
