"""Which stage on a device goes first when room is needed: one order for the broker (its
expectation, `broker.policy.pick_victims`) and the worker (its actual choice,
`gpu_worker.executor.Executor`), so both evict by the same rule."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

StageKey = tuple[str, int]  # (model name, stage index)


class Evictable(Protocol):
    """A stage holding device bytes, as both sides describe it."""

    @property
    def key(self) -> StageKey: ...

    @property
    def last_used(self) -> float: ...


E = TypeVar("E", bound=Evictable)


def eviction_order(stages: Iterable[E], value: Callable[[E], float] | None = None) -> list[E]:
    """`stages`, the one to evict first first: the lowest `value` (`flowmesh.value.stage_value`:
    a hot model is not thrown out for a one-off request), least recently used among equals,
    then by key (so the order never depends on the order given); least recently used alone
    when no `value` is given."""
    if value is None:
        return sorted(stages, key=lambda s: (s.last_used, s.key))
    return sorted(stages, key=lambda s: (value(s), s.last_used, s.key))
