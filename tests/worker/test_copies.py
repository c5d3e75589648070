"""plan_copies: how a load's blocks are grouped into host->device copies."""

from gpu_worker.executor import plan_copies
from gpu_worker.host_tier import BlockRegion, Slot
from gpu_worker.memory import Extent


def region(offset: int, size: int, alias: bool = False) -> BlockRegion:
    slot = Slot("w", None, (), 0, 0 if alias else size, alias=(0, 0) if alias else None)  # type: ignore[arg-type]
    return BlockRegion(offset, size, (slot,) if size or alias else ())


def test_contiguous_blocks_share_a_copy_up_to_the_chunk_size() -> None:
    regions = [region(0, 256), region(256, 256), region(512, 256), region(768, 256)]
    extents = [Extent(1024, 256), Extent(1280, 256), Extent(1536, 256), Extent(1792, 256)]
    runs = plan_copies(regions, extents, chunk_bytes=512)
    assert [(r.blocks, r.dst, r.src, r.nbytes) for r in runs] == [
        ([0, 1], 1024, 0, 512),
        ([2, 3], 1536, 512, 512),
    ]


def test_a_gap_in_device_memory_starts_a_new_copy() -> None:
    regions = [region(0, 256), region(256, 256)]
    extents = [Extent(0, 256), Extent(4096, 256)]
    runs = plan_copies(regions, extents, chunk_bytes=1 << 20)
    assert [(r.blocks, r.dst) for r in runs] == [([0], 0), ([1], 4096)]


def test_empty_and_tied_only_blocks_ride_along() -> None:
    regions = [region(0, 256), region(256, 0), region(256, 0, alias=True), region(256, 256)]
    extents = [Extent(0, 256), None, None, Extent(256, 256)]
    (run,) = plan_copies(regions, extents, chunk_bytes=1 << 20)
    assert run.blocks == [0, 2, 3] and run.nbytes == 512  # block 1 has nothing to bind


def test_reuse_markers_of_every_extent_are_kept() -> None:
    a, b = object(), object()
    regions = [region(0, 256), region(256, 256)]
    extents = [Extent(0, 256, [a]), Extent(256, 256, [b])]  # type: ignore[list-item]
    (run,) = plan_copies(regions, extents, chunk_bytes=1 << 20)
    assert run.after == [a, b]
