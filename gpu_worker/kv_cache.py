"""The KV cache of one stage on this worker: each live sequence's keys and values, in blocks.

A block holds `KV_BLOCK` tokens of every attention layer of the stage (`flowmesh.modelio.decode`)
and is one range of the worker's device arena, taken from `DeviceMemory` like a stage's weights:
KV counts in the serving budget beside them, and the worker stays the one owner of its memory.
Sequences of different lengths share the arena without fragmenting it (paged, as vLLM does): a
sequence grows one block at a time and frees all of its blocks at once.

Plain bookkeeping on the event loop (the executor's): `need` says how many blocks an iteration
adds, `grow` takes the ranges the executor placed for them, `free` gives a sequence's ranges
back, ordered after the runs that may still use them (their next owner waits on the markers,
as any reuse of the arena does). The compute lane reads and writes the blocks' tensors only.

A preempted sequence (its model's stage evicted, or the broker's `FreeSeqs` with `park`) may be
*parked* instead of dropped: its blocks' bytes copied to one host buffer (`park`, the copy done
by the executor), its device ranges freed. Its next step, starting right where it stopped (at
its parked token count), takes new ranges and copies the bytes back before it computes
(`grow` returns the copies to make): the sequence goes on exactly where it was. A step from
position 0 starts it afresh, and `free` forgets a parked copy too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from flowmesh.errors import Code, FlowmeshError
from flowmesh.messages import SeqStep
from flowmesh.modelio.decode import KV_BLOCK, KVShape, SeqCache
from gpu_worker.memory import DeviceMemory, Extent


def blocks_for(tokens: int) -> int:
    return -(-tokens // KV_BLOCK)


@dataclass
class SeqKV:
    """One sequence here: its ranges and their tensors, the tokens they are taken for, and (on
    the last stage) its sampling generator and the seed each draw's is derived from
    (`flowmesh.modelio.sampling.at_draw`)."""

    extents: list[Extent] = field(default_factory=list)
    cache: SeqCache = field(default_factory=lambda: SeqCache([]))
    tokens: int = 0
    generator: torch.Generator | None = None
    seed: int = 0
    token: int | None = None  # the last token drawn for it here (`GenStep.follows`)


@dataclass
class ParkedKV:
    """A sequence's KV bytes in host memory: `blocks` blocks of the stage's shape, one after the
    other in `host` (uint8), valid once `copied` (a device marker) is done; its generator kept
    (on the last stage) so that its draws go on as they would have."""

    host: torch.Tensor
    blocks: int
    tokens: int
    copied: Any
    generator: torch.Generator | None = None
    seed: int = 0

    @property
    def nbytes(self) -> int:
        return self.host.numel()


@dataclass
class Restore:
    """A parked sequence's bytes to copy back into its new blocks before an iteration computes
    (after `after`, the park's copy)."""

    blocks: list[torch.Tensor]
    host: torch.Tensor
    after: Any
    block_bytes: int


class StageKV:
    """The KV cache of stage `where` (for messages), of `shape`, in `memory`'s arena
    `arena` (the device's flat uint8 buffer)."""

    def __init__(self, where: str, shape: KVShape, memory: DeviceMemory, arena: torch.Tensor):
        self.where = where
        self.shape = shape
        self.memory = memory
        self.arena = arena
        self.seqs: dict[int, SeqKV] = {}
        self.nbytes = 0  # arena bytes of the blocks held
        self.parked: dict[int, ParkedKV] = {}

    @property
    def block_bytes(self) -> int:
        return self.shape.block_bytes

    @property
    def blocks(self) -> int:
        return sum(len(s.extents) for s in self.seqs.values())

    def need(self, steps: list[SeqStep]) -> int:
        """New blocks this iteration takes (0 for a stage without attention layers). Raises for
        a step that does not follow what is cached: a decode of a sequence held nowhere here
        (NOT_RESIDENT: freed, or its stage was evicted since) or one past its tokens."""
        new = 0
        for step in steps:
            held = self.seqs.get(step.seq)
            parked = self.parked.get(step.seq) if held is None and step.start > 0 else None
            if parked is not None:
                # Parked past `start` (this stage ran a step the others did not, before it was
                # preempted again): the step computes those positions again, over them.
                if step.start > parked.tokens:
                    raise FlowmeshError(
                        Code.BAD_REQUEST,
                        f"{self.where}: sequence {step.seq} is parked with {parked.tokens} "
                        f"tokens, its step starts at position {step.start}",
                    )
            elif step.start > 0:
                if held is None:
                    raise FlowmeshError(
                        Code.NOT_RESIDENT,
                        f"{self.where}: sequence {step.seq} has no KV cache here (freed, or the "
                        f"stage was evicted since), its step starts at position {step.start}",
                    )
                if step.start > held.tokens:
                    raise FlowmeshError(
                        Code.BAD_REQUEST,
                        f"{self.where}: sequence {step.seq}'s step starts at position "
                        f"{step.start}, but only {held.tokens} of its tokens are cached here",
                    )
            have = len(held.extents) if held is not None else 0
            if self.block_bytes:
                new += max(0, blocks_for(step.start + step.count) - have)
        return new

    def grow(
        self, steps: list[SeqStep], extents: list[Extent]
    ) -> tuple[list[SeqKV], list[Restore]]:
        """Take `extents` (`need(steps)` of them, in step order) for the iteration; returns each
        step's sequence and the parked bytes to copy back first. A step at position 0 starts its
        sequence afresh (its generator too, and a parked copy of it is forgotten)."""
        it = iter(extents)
        out, restores = [], []
        for step in steps:
            parked = self.parked.pop(step.seq, None)
            seq = self.seqs.setdefault(step.seq, SeqKV())
            if step.start == 0:
                seq.generator = None
                parked = None
            elif parked is not None:
                seq.generator, seq.seed = parked.generator, parked.seed
            want = blocks_for(step.start + step.count) if self.block_bytes else 0
            while len(seq.extents) < want:
                ext = next(it)
                seq.extents.append(ext)
                seq.cache.blocks.append(self._view(ext))
                self.nbytes += ext.size
            seq.tokens = step.start + step.count
            if parked is not None:
                views = [self.raw(ext) for ext in seq.extents[: parked.blocks]]
                restores.append(Restore(views, parked.host, parked.copied, self.block_bytes))
            out.append(seq)
        assert next(it, None) is None, "more ranges than the iteration needs"
        return out, restores

    def park(self, seq: int, host: torch.Tensor, copied: Any) -> list[torch.Tensor]:
        """Park held sequence `seq` into `host` (`block_bytes` per block it holds), the copy
        to be marked done by `copied`; returns its blocks' bytes, for the executor to copy
        from. Its device ranges are then freed by `free` like any other's."""
        held = self.seqs[seq]
        self.parked[seq] = ParkedKV(
            host, len(held.extents), held.tokens, copied, held.generator, held.seed
        )
        return [self.raw(ext) for ext in held.extents]

    def raw(self, ext: Extent) -> torch.Tensor:
        """A block's bytes in the arena, as uint8 (what parking copies)."""
        return self.arena[ext.offset : ext.offset + self.block_bytes]

    @property
    def parked_bytes(self) -> int:
        return sum(p.nbytes for p in self.parked.values())

    def _view(self, ext: Extent) -> torch.Tensor:
        n = self.block_bytes
        return (
            self.arena[ext.offset : ext.offset + n]
            .view(self.shape.dtype)
            .view(self.shape.block_shape)
        )

    def free(self, seqs: Iterable[int], after: list[Any]) -> int:
        """Forget `seqs` (those held) and give their ranges back, their next owner ordered
        after `after`; returns the bytes freed."""
        freed = 0
        for s in seqs:
            self.parked.pop(s, None)
            seq = self.seqs.pop(s, None)
            if seq is None:
                continue
            for ext in seq.extents:
                freed += ext.size
                self.memory.free(ext, after, "serving")
        self.nbytes -= freed
        return freed

    def free_all(self, after: list[Any]) -> int:
        """Drop every held sequence and every parked copy."""
        self.parked.clear()
        return self.free(list(self.seqs), after)

    def release(self, seqs: Iterable[int], after: list[Any]) -> int:
        """Give the device ranges of held `seqs` back, keeping their parked copies (`park`)."""
        kept = {s: self.parked.pop(s) for s in list(seqs) if s in self.parked}
        freed = self.free(seqs, after)
        self.parked.update(kept)
        return freed


def kv_limit_bytes(shares: Iterable[tuple[str, float]], budget: int) -> int:
    """The most KV bytes the models with stages here may hold together: each model's share of
    the serving budget (`ModelSpec.kv_share`, `shares` as (model, share) per stage, a model
    counted once), at most the budget. What `flowmesh status` shows KV bytes against; the
    weights resident beside them may leave less room than this."""
    per_model = {model: share for model, share in shares}
    return min(budget, sum(int(share * budget) for share in per_model.values()))


def new_blocks_after(extents: list[Extent]) -> list[Any]:
    """The markers new blocks' writes must be ordered after (their ranges' last users)."""
    return [m for ext in extents for m in ext.after]
