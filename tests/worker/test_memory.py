"""The arena allocator: budget, best fit, coalescing, all-or-nothing and stream-ordered reuse."""

import pytest

from gpu_worker.memory import Arena, OutOfSpace


class Flag:
    def __init__(self, done: bool = False) -> None:
        self._done = done

    def done(self) -> bool:
        return self._done


def test_alloc_rounds_and_tracks_peak() -> None:
    a = Arena(1024, align=256)
    x = a.alloc(1)
    y = a.alloc(300)
    assert (x.offset, x.size) == (0, 256)
    assert (y.offset, y.size) == (256, 512)
    assert a.in_use == 768 and a.peak == 768
    a.free(x, [])
    assert a.in_use == 512 and a.peak == 768


def test_never_exceeds_capacity() -> None:
    a = Arena(1024, align=256)
    a.alloc(512)
    a.alloc(512)
    with pytest.raises(OutOfSpace):
        a.alloc(1)
    assert a.peak == 1024


def test_free_coalesces_neighbours() -> None:
    a = Arena(1024, align=256)
    xs = [a.alloc(256) for _ in range(4)]
    a.free(xs[0], [])
    a.free(xs[2], [])
    assert a.free_extents() == [(0, 256), (512, 256)]
    a.free(xs[1], [])
    assert a.free_extents() == [(0, 768)]
    a.free(xs[3], [])
    assert a.free_extents() == [(0, 1024)]


def test_best_fit_prefers_the_smallest_range() -> None:
    a = Arena(2048, align=256)
    xs = [a.alloc(256) for _ in range(8)]
    a.free(xs[0], [])  # 256 at 0
    a.free(xs[2], [])
    a.free(xs[3], [])  # 512 at 512
    got = a.alloc(256)
    assert got.offset == 0


def test_fragmentation_is_reported_not_hidden() -> None:
    a = Arena(1024, align=256)
    xs = [a.alloc(256) for _ in range(4)]
    a.free(xs[0], [])
    a.free(xs[2], [])
    with pytest.raises(OutOfSpace) as info:
        a.alloc(512)
    assert info.value.free == 512 and info.value.largest == 256


def test_alloc_many_is_all_or_nothing() -> None:
    a = Arena(1024, align=256)
    with pytest.raises(OutOfSpace):
        a.alloc_many([512, 512, 256])
    assert a.in_use == 0 and a.free_extents() == [(0, 1024)]


def test_double_free_is_refused() -> None:
    a = Arena(1024, align=256)
    x = a.alloc(256)
    a.free(x, [])
    with pytest.raises(ValueError):
        a.free(x, [])


def test_reuse_is_ordered_after_the_last_users() -> None:
    a = Arena(1024, align=256)
    x = a.alloc(1024)
    pending, finished = Flag(False), Flag(True)
    a.free(x, [pending, finished])
    y = a.alloc(256)
    # The new owner must wait for the pending user; finished markers are dropped.
    assert y.after == [pending]
    z = a.alloc(256)
    assert z.after == [pending]
    pending._done = True
    a.free(y, [])
    assert a.alloc(256).after == []
