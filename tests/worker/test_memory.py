"""The arena allocator: budget, best fit, coalescing, all-or-nothing and stream-ordered reuse."""

import pytest

from gpu_worker.memory import Arena, DeviceMemory, OutOfSpace


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


def test_holds_stack_at_the_top_and_tasks_stay_below_them() -> None:
    """A pipelined stage's range (`DeviceMemory.hold`) is taken at the arena's top, each next
    one just below; training's tasks are given ranges below the holds only, and the room left
    for a task says so. Released, a hold's bytes are given again."""
    m = DeviceMemory(1024, 2048, align=256)  # serving [0, 1024), training [1024, 3072)
    a = m.hold(300)
    assert a is not None and (a.offset, a.size) == (2560, 512)
    b = m.hold(256)
    assert b is not None and (b.offset, b.size) == (2304, 256)
    assert m.held_bytes == 768 and m.task_room() == 2048 - 768
    assert m.stats()["training_held"] == 768 and m.used["training"] == 768
    # Tasks are given what is below the holds, serving's part lent first-fit as before.
    got = [m.alloc_training(256) for _ in range(9)]
    assert all(e is not None and e.offset + e.size <= 2304 for e in got)
    assert m.alloc_training(256) is None  # the top is held: no more room
    with pytest.raises(OutOfSpace):  # never into serving's part
        m.hold(2048)
    m.release(b, [])
    assert m.held_bytes == 512 and m.alloc_training(256) is not None


def test_a_hold_waits_for_the_tasks_in_its_range_and_fences_it_meanwhile() -> None:
    m = DeviceMemory(0, 1024, align=256)
    tasks = [m.alloc_training(256) for _ in range(3)]  # [0, 768) in use
    assert [e.offset for e in tasks if e is not None] == [0, 256, 512]
    assert m.hold(512) is None  # [512, 1024) is partly a task's
    assert m.fence == 512 and m.task_room() == 512
    assert m.alloc_training(256) is None  # [768, 1024) is fenced: not given to a task
    m.free(tasks[2], [], "training")
    held = m.hold(512)
    assert held is not None and held.offset == 512 and m.fence == 0
    m.free(tasks[1], [], "training")
    assert m.alloc_training(256) is not None and m.alloc_training(256) is None
    # A hold that gave up lifts its fence.
    m2 = DeviceMemory(0, 1024, align=256)
    t = m2.alloc_training(1024)
    assert t is not None and m2.hold(256) is None and m2.fence == 256
    m2.unfence()
    assert m2.fence == 0


def test_a_hold_takes_the_hole_a_released_one_left_and_a_training_free_wakes_a_waiting_hold():
    m = DeviceMemory(0, 2048, align=256)
    a, b = m.hold(512), m.hold(256)
    assert a is not None and b is not None and (a.offset, b.offset) == (1536, 1280)
    m.release(a, [])  # the upper one first: a hole above the other
    c = m.hold(512)
    assert c is not None and c.offset == 1536 and m.held_bytes == 768
    woken: list[int] = []
    m.wake_training.append(lambda: woken.append(1))
    t = m.alloc_training(1280)
    assert t is not None and m.hold(256) is None  # waits for the task's range, fenced
    woken.clear()
    m.free(t, [], "training")
    assert woken, "a hold waiting for a task's range was not woken when it was freed"
    assert m.hold(256) is not None
