"""What a sub-model's backward does for its forward's activations, and the autograd hooks that
let a forward's graph outlive the arena range it ran in.

Memory flow runs a sub-model's forward and its backward as two tasks, each with its tensors
bound to wherever the arena had room at the time (`gpu_worker.train_job`). Two ways to give the
backward what it needs (issue 23 §1):

- **recompute** (`RECOMPUTE`): the forward runs without grad and keeps only its input; the
  backward runs it again, with grad, from that input. Costs a second forward.
- **keep** (`KEEP`): the forward runs with grad and its graph is kept until the backward. What
  autograd saves for the backward is packed by `KeptGraph`'s hooks: a view of one of the task's
  bound tensors (a weight, a buffer) as that tensor's name and the view's geometry, so that the
  backward re-views the tensor where its own task bound it; anything else (the activations) is
  stashed like the activations between sub-models are (in the host tier on a GPU; on a CPU
  stand-in it stays where it is). Costs the stash's copies and its host room.

`choose` picks between them by measured cost, as eviction picks its victims: the compute seconds
the sub-model's tasks took under each (the stash's copies included), within the room the host
memory has for the stash (a job's kept graphs take at most as much as its own host tier). Both
policies compute the same values: the kept graph holds the very tensors the recompute would make
again (same input, RNG state and buffers), so the choice changes how long a step takes, never
what it computes.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

RECOMPUTE = "recompute"
KEEP = "keep"
NO_POLICY = "none"  # the last sub-model: its forward and backward are one task


@dataclass(frozen=True)
class BoundView:
    """A saved tensor that is a view of a bound tensor: re-viewed at unpack time."""

    name: str
    offset: int  # elements from the bound tensor's first element
    size: tuple[int, ...]
    stride: tuple[int, ...]


class KeptGraph:
    """The saved-tensor hooks of one kept forward (`torch.autograd.graph.saved_tensors_hooks`).

    `bound` maps each name bound for the forward task to its tensor object (a Parameter or a
    buffer whose `.data` is an arena view while the task runs, and again while the backward
    task runs, perhaps elsewhere). `stash` / `unstash` move an activation to where it waits
    between the tasks and back. `saved_bytes` counts what the stash holds."""

    def __init__(
        self,
        bound: dict[str, torch.Tensor],
        arena: torch.Tensor,
        stash: Callable[[torch.Tensor], torch.Tensor],
        unstash: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self._arena = arena.untyped_storage().data_ptr()
        self._bound = dict(bound)
        self._stash = stash
        self._unstash = unstash
        self.saved_bytes = 0
        # The bound tensors' memory as it is during the forward: [start, end) byte addresses.
        self._ranges: list[tuple[int, int, str, torch.Tensor]] = []
        for name, t in bound.items():
            d = t.data
            if d.numel():
                start = d.data_ptr()
                self._ranges.append((start, start + d.numel() * d.element_size(), name, t))

    def _bound_view(self, t: torch.Tensor) -> BoundView | None:
        ptr = t.data_ptr()
        for start, end, name, owner in self._ranges:
            if start <= ptr < end and t.dtype == owner.dtype:
                offset = t.storage_offset() - owner.data.storage_offset()
                return BoundView(name, offset, tuple(t.shape), tuple(t.stride()))
        return None

    def pack(self, t: torch.Tensor) -> Any:
        if t.numel() and t.untyped_storage().data_ptr() == self._arena:
            view = self._bound_view(t)
            if view is not None:
                return view
            # Arena memory that is no bound tensor's: the range goes to another task after
            # this one, so what the backward needs of it is copied out now.
            t = t.clone()
        self.saved_bytes += t.numel() * t.element_size()
        return self._stash(t)

    def unpack(self, packed: Any) -> torch.Tensor:
        """In the backward task: a bound view is re-viewed where that task bound its tensor
        (the same object, its `.data` rebound), an activation brought back."""
        if isinstance(packed, BoundView):
            d = self._bound[packed.name].data
            return d.as_strided(packed.size, packed.stride, d.storage_offset() + packed.offset)
        return self._unstash(packed)

    def hooks(self) -> AbstractContextManager[None]:
        """Around the forward: what autograd saves goes through `pack`, and comes back through
        `unpack` whenever the backward runs."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def choose(
    recompute_s: float | None, keep_s: float | None, saved_bytes: int | None, room: int | None
) -> str:
    """KEEP or RECOMPUTE for one sub-model, by measured cost: `recompute_s` / `keep_s`, the mean
    compute seconds of its tasks under each policy (None: not measured yet, which the policy
    is then chosen to measure, recompute first); `saved_bytes`, what a kept forward stashed;
    `room`, the host memory the stash may take (None: no limit)."""
    if recompute_s is None:
        return RECOMPUTE
    if saved_bytes is not None and room is not None and saved_bytes > room:
        return RECOMPUTE
    if keep_s is None:
        return KEEP
    return KEEP if keep_s < recompute_s else RECOMPUTE
