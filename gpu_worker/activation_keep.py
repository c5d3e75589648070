"""What a sub-model's backward does for its forward's activations, and the autograd hooks that
let a forward's graph outlive the arena range it ran in.

Memory flow runs a sub-model's forward and its backward as two tasks, each with its tensors
bound to wherever the arena had room at the time (`gpu_worker.train_job`). Three ways to give
the backward what it needs (issue 23 §1):

- **recompute** (`RECOMPUTE`): the forward runs without grad and keeps only its input; the
  backward runs it again, with grad, from that input. Costs a second forward.
- **keep** (`KEEP`): the forward runs with grad and its graph is kept until the backward. What
  autograd saves for the backward is packed by `KeptGraph`'s hooks: a view of one of the task's
  bound tensors (a weight, a buffer) as that tensor's name and the view's geometry, so that the
  backward re-views the tensor where its own task bound it; anything else (the activations) is
  stashed like the activations between sub-models are (in the host tier on a GPU, or on the
  device while the worker's resident room has space for it, `gpu_worker.resident_room`; on a
  CPU stand-in it stays where it is). Costs the stash's copies and its host room.
- **selective** (`SELECTIVE`): torch's selective activation checkpointing. The forward runs with
  grad under `torch.utils.checkpoint` (non-reentrant), keeping only the outputs of its matrix
  products and convolutions (`SAVED_OPS`, stashed like a kept graph's activations) and its
  input; the backward runs the forward again from that input, each kept product's output
  taken back in place of computing it again, the rest recomputed (activations and norms,
  elementwise or nearly, and the fused attention kernels). Costs that recompute, and a stash
  of half a kept graph's or less for a block of a linear layer and its activation (its output
  kept; its input and the activation's output made again).

`choose` picks among them by measured cost, as eviction picks its victims: the compute seconds
the sub-model's tasks took under each (the stash's copies included), within the room the host
memory has for the stash (a job's kept graphs take at most as much as its own host tier). All
policies compute the same values: the kept graph holds the very tensors the recompute would make
again (same input, RNG state and buffers), and a selective forward's recompute runs the same
operations on the same values, so the choice changes how long a step takes, never what it
computes.
"""

from __future__ import annotations

import collections
import itertools
import weakref
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

RECOMPUTE = "recompute"
KEEP = "keep"
SELECTIVE = "selective"
POLICIES = (RECOMPUTE, KEEP, SELECTIVE)  # the order `choose` measures them in
NO_POLICY = "none"  # the last sub-model: its forward and backward are one task


class Stash:
    """A tensor waiting in the host tier between a job's tasks: an activation between sub-models,
    an incoming gradient, what a kept or selective forward saved (`TrainingJob._stash`).

    `host` is its host copy (on the CPU stand-in the tensor itself) and `landed` the marker set
    once the copy to the host is in (made on the stash lane: the compute goes on meanwhile).
    `brought` is (its device copy, the marker set once that copy is there, the admission it was
    brought for) once the copy lane started bringing it back into the extent of the task that
    reads it (`TrainingJob.prefetch`), else None: the task brings it back itself. The task takes
    it only if it is its own admission's: a copy in another admission's extent (one serving
    took back before it ran) is not. One attribute, set in one assignment, so that the copy
    lane and the compute lane never see half of it.

    `resident`: the stash stayed on the device, in the room the worker keeps for that
    (`gpu_worker.resident_room`); `host` is then the device tensor itself, `landed` its lease
    on the room (done: nothing to wait for), and nothing is copied either way."""

    __slots__ = ("__weakref__", "brought", "host", "landed", "resident")

    def __init__(self, host: torch.Tensor, landed: Any, resident: bool = False) -> None:
        self.host = host
        self.landed = landed
        self.resident = resident
        self.brought: tuple[torch.Tensor, Any, object] | None = None

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()


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
        stash: Callable[[torch.Tensor], Stash],
        unstash: Callable[[Stash], torch.Tensor],
    ) -> None:
        self._arena = arena.untyped_storage().data_ptr()
        self._bound = dict(bound)
        self._stash = stash
        self._unstash = unstash
        self.saved_bytes = 0
        self._stashes: list[Stash] = []
        # What was stashed, weakly, with its version then and its stash (`mark_changed`); the
        # stashes of those the forward changed after, and what each was.
        self._versions: list[tuple[weakref.ref[torch.Tensor], int, Stash]] = []
        self._changed: dict[Stash, str] = {}
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
            watched = False
        else:
            watched = True
        self.saved_bytes += t.numel() * t.element_size()
        kept = self._stash(t)
        self._stashes.append(kept)
        if watched:
            self._versions.append((weakref.ref(t), t._version, kept))
        return kept

    def mark_changed(self) -> None:
        """After the forward: note what it changed in place after autograd saved it, for
        `unpack` to refuse. Plain autograd refuses such a tensor in the backward (its version
        moved); with these hooks it cannot see it, and the stash may hold either value (the
        tensor itself on a CPU stand-in; on a GPU, whatever the stash lane's copy found). Only
        what the backward unpacks is refused, as plain autograd does: a saved tensor no
        gradient flows through may change."""
        for ref, version, kept in self._versions:
            t = ref()
            if t is not None and t._version != version:
                self._changed[kept] = f"a {tuple(t.shape)} {t.dtype} tensor"
        self._versions = []

    def to_bring(self, unread: Mapping[Any, int]) -> list[Stash]:
        """What the backward will unpack, for the copy lane to bring back ahead of it: all of
        it, the last saved first (autograd unpacks as the backward reaches each node, from the
        output back)."""
        return self._stashes[::-1]

    def unpack(self, packed: Any) -> torch.Tensor:
        """In the backward task: a bound view is re-viewed where that task bound its tensor
        (the same object, its `.data` rebound), an activation brought back."""
        if isinstance(packed, BoundView):
            d = self._bound[packed.name].data
            return d.as_strided(packed.size, packed.stride, d.storage_offset() + packed.offset)
        what = self._changed.get(packed)
        if what is not None:
            raise ChangedInPlace(
                f"its forward changed {what} in place after autograd saved it for the backward"
            )
        return self._unstash(packed)

    def hooks(self) -> AbstractContextManager[None]:
        """Around the forward: what autograd saves goes through `pack`, and comes back through
        `unpack` whenever the backward runs."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


# The operations whose outputs a selective forward keeps: matrix products and convolutions,
# what costs most to compute again (as torch's own selective checkpointing examples choose).
# Not the fused attention kernels: with dropout they draw from the generator, which a recompute
# that skipped them would leave behind, so that every later random draw of the sub-model (its
# dropout masks) would differ from the forward's; they are computed again.
_aten = torch.ops.aten
SAVED_OPS = frozenset(
    (
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
        _aten.convolution.default,
    )
)


class SelectiveForward:
    """One selective forward's kept outputs (of `SAVED_OPS`), in the order it made them, with the
    two dispatch modes `torch.utils.checkpoint` takes as `context_fn`: the first, around the
    forward, stashes each kept output (`stash`); the second, around the recompute in the
    backward, hands them back (`unstash`) in place of running those operations again.
    `saved_bytes` counts what the stash holds."""

    def __init__(
        self,
        stash: Callable[[torch.Tensor], Stash],
        unstash: Callable[[Stash], torch.Tensor],
    ) -> None:
        self._stash = stash
        self._unstash = unstash
        self.kept: dict[Any, collections.deque[Any]] = {}
        self.saved_bytes = 0

    def contexts(self) -> tuple[TorchDispatchMode, TorchDispatchMode]:
        return _Keeping(self), _Replaying(self)

    def keep(self, op: Any, out: Any) -> None:
        def one(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            self.saved_bytes += t.numel() * t.element_size()
            # A copy, on the compute stream: the forward may go on to change the output in
            # place (ReLU(inplace=True)), before a GPU's stash lane copied it to the host.
            return self._stash(t.detach().clone())

        self.kept.setdefault(op, collections.deque()).append(tree_map(one, out))

    def unread(self) -> dict[Any, int]:
        """After the backward: per operation, how many of its kept outputs the recompute did not
        take back. torch.utils.checkpoint stops its recompute once it made everything the
        backward needs, so a sub-model's last products (a final linear layer's output, which
        no backward reads) are never asked for."""
        return {op: len(outs) for op, outs in self.kept.items() if outs}

    def to_bring(self, unread: Mapping[Any, int]) -> list[Stash]:
        """What the recompute will take back, for the copy lane to bring back ahead of it: each
        operation's kept outputs but the last `unread[op]` (what the same sub-model's last
        backward left, `unread`; if this one takes more, those come back when taken)."""
        out: list[Stash] = []
        for op, outs in self.kept.items():
            for item in itertools.islice(outs, max(len(outs) - unread.get(op, 0), 0)):
                out.extend(t for t in tree_leaves(item) if isinstance(t, Stash))
        return out

    def take(self, op: Any) -> Any:
        outs = self.kept.get(op)
        if not outs:
            raise NotRepeated(f"its recompute ran {op} more often than the forward did")
        return tree_map(
            lambda t: self._unstash(t).detach() if isinstance(t, Stash) else t,
            outs.popleft(),
        )


class ChangedInPlace(RuntimeError):
    """A kept forward changed a tensor in place after autograd saved it for the backward."""


class NotRepeated(RuntimeError):
    """A selective forward's recompute did not run what its forward ran (a forward whose
    operations depend on something besides its input, parameters, buffers and the RNG)."""


class _Keeping(TorchDispatchMode):
    def __init__(self, store: SelectiveForward) -> None:
        super().__init__()
        self.store = store

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in SAVED_OPS:
            self.store.keep(func, out)
        return out


class _Replaying(TorchDispatchMode):
    def __init__(self, store: SelectiveForward) -> None:
        super().__init__()
        self.store = store

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in SAVED_OPS:
            return self.store.take(func)
        return func(*args, **(kwargs or {}))


def choose(
    costs: dict[str, float | None], saved: dict[str, int | None], room: int | None
) -> str:
    """The policy for one sub-model, by measured cost: `costs`, the mean compute seconds of its
    tasks under each policy (None or absent: not measured yet, which the policy is then chosen
    to measure, in `POLICIES`' order, recompute first); `saved`, what a kept or selective
    forward stashed; `room`, the host memory the stash may take (None: no limit). A policy
    whose stash is over the room is never taken (recompute stashes nothing)."""

    def fits(policy: str) -> bool:
        nbytes = saved.get(policy)
        return policy == RECOMPUTE or room is None or nbytes is None or nbytes <= room

    for policy in POLICIES:
        if costs.get(policy) is None and fits(policy):
            return policy
    measured = [p for p in POLICIES if costs.get(p) is not None and fits(p)]
    return min(measured, key=lambda p: costs[p])  # type: ignore[return-value, arg-type]
