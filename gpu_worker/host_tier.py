"""The host tier: each stage's tensors in one flat host buffer (pinned on CUDA), block by block.

The buffer comes from `device.host_buffer`: on CUDA a range of the worker's one pinned slab
(gpu_worker/host_slab.py), given back when the buffer's memory is no longer referenced; on the
CPU stand-in plain memory, faulted in as it is made.

A stage is kept as a list of block regions so that a load can copy block by block and a run can
start on block 0 while later blocks are still in flight. Within a region, tensors sit at aligned
offsets, so the device copy of a region is one contiguous copy and every tensor is a view of it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from flowmesh.spec import BLOCK_ALIGN, TENSOR_ALIGN

ALIGN = BLOCK_ALIGN  # every block range starts and ends on this boundary


def _aligned(n: int, to: int = TENSOR_ALIGN) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Slot:
    name: str  # the tensor's name in its block's state_dict
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # within the block region
    nbytes: int
    # A tensor tied to one stored earlier in the stage (GPT-2's lm_head and wte) is not stored
    # twice: it names (block index, slot index) of the first one and shares its bytes.
    alias: tuple[int, int] | None = None


@dataclass(frozen=True)
class BlockRegion:
    offset: int  # within the stage's host buffer
    size: int  # device bytes of the block, a multiple of BLOCK_ALIGN (0 without tensors)
    slots: tuple[Slot, ...]


class HostStage:
    """A stage's tensors in host memory, laid out for block-by-block copies."""

    def __init__(self, buffer: torch.Tensor, regions: list[BlockRegion]) -> None:
        self.buffer = buffer
        self.regions = regions

    @property
    def nbytes(self) -> int:
        """Device bytes the stage takes when resident."""
        return sum(r.size for r in self.regions)

    @classmethod
    def build(
        cls,
        blocks: list[dict[str, torch.Tensor]],
        allocate: Callable[[int], torch.Tensor] | None = None,
    ) -> HostStage:
        """Lay out `blocks` (per block: state_dict name -> CPU tensor) in one host buffer."""
        regions, total = layout(
            [
                [
                    (name, (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype), t)
                    for name, t in tensors.items()
                ]
                for tensors in blocks
            ]
        )
        alloc = allocate or (lambda n: torch.empty(n, dtype=torch.uint8))
        buffer = alloc(max(total, 1))
        for region, tensors in zip(regions, blocks, strict=True):
            for slot in region.slots:
                if slot.alias is None:
                    view_of(buffer, region.offset + slot.offset, slot).copy_(tensors[slot.name])
        return cls(buffer, regions)

    @classmethod
    def allocate_for(
        cls,
        blocks: list[list[tuple[str, Hashable, torch.Tensor]]],
        allocate: Callable[[int], torch.Tensor] | None = None,
    ) -> HostStage:
        """The layout of `blocks` (per block: (state_dict name, identity, tensor), where the
        tensor may be a meta tensor: only its shape and dtype count, and tensors of equal
        identity are one tensor stored once) with its buffer allocated but not filled: the
        caller writes each slot's bytes in place (`slot_view`), e.g. straight from a file."""
        regions, total = layout(blocks)
        alloc = allocate or (lambda n: torch.empty(n, dtype=torch.uint8))
        return cls(alloc(max(total, 1)), regions)

    def slot_view(self, block: int, index: int) -> torch.Tensor:
        """Slot `index` of block `block` as a view of the buffer (an alias: the tensor it names)."""
        region = self.regions[block]
        slot = region.slots[index]
        if slot.alias is not None:
            return self.slot_view(*slot.alias)
        return view_of(self.buffer, region.offset + slot.offset, slot)


def layout(
    blocks: list[list[tuple[str, Hashable, torch.Tensor]]],
) -> tuple[list[BlockRegion], int]:
    """Block regions for `blocks` (per block: (name, identity, tensor)) and their total size.

    Only each tensor's shape and dtype are read, so meta tensors do. A tensor whose identity was
    seen earlier in the stage (a tie) is not stored again: its slot aliases the first one.
    """
    regions: list[BlockRegion] = []
    offset = 0
    seen: dict[Hashable, tuple[int, int]] = {}
    for b, tensors in enumerate(blocks):
        slots: list[Slot] = []
        inner = 0
        for name, key, t in tensors:
            nbytes = t.numel() * t.element_size()
            if nbytes and key in seen:
                slots.append(Slot(name, t.dtype, tuple(t.shape), 0, 0, alias=seen[key]))
                continue
            if nbytes:
                seen[key] = (b, len(slots))
            slots.append(Slot(name, t.dtype, tuple(t.shape), inner, nbytes))
            inner += _aligned(nbytes)
        inner = _aligned(inner, BLOCK_ALIGN)
        regions.append(BlockRegion(offset, inner, tuple(slots)))
        offset += inner
    return regions, offset


def view_of(buffer: torch.Tensor, offset: int, slot: Slot) -> torch.Tensor:
    """The tensor `slot` describes, as a view of a flat uint8 buffer at `offset`."""
    raw = buffer[offset : offset + slot.nbytes]
    if slot.nbytes == 0:
        return torch.empty(slot.shape, dtype=slot.dtype, device=buffer.device)
    return raw.view(slot.dtype).reshape(slot.shape)
