"""Pipeline stages: contiguous parts of a chain for serving, balanced by measured forward time
(or, untimed, by bytes), each within a memory cap. Bounds only; `stage_plans` makes them Plans.

Built on the exact partitioning of `flowmesh.modelio.planners` (`balance`, `min_parts`); no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from flowmesh.modelio.costs import BlockProfile, ModelProfile
from flowmesh.modelio.planners import balance, min_parts, profile_blocks, seconds_to_ns


def stage_costs(
    source: ModelProfile | Sequence[BlockProfile] | Sequence[int],
    *,
    mem: Sequence[int] | None = None,
    names: Sequence[str] | None = None,
) -> tuple[list[int], list[int], list[str] | None, str]:
    """(costs, mem, names, objective) for stage planning.

    From a profile: cost is the measured forward time in ns when every block was timed, else the
    block's bytes; memory is each block's resident bytes (shared tensors included: a conservative
    bound that is exact unless tied blocks land in the same stage). From a plain list of costs:
    memory is `mem` if given, else the costs themselves (they are bytes).
    """
    if isinstance(source, ModelProfile) or (
        len(source) > 0 and isinstance(source[0], BlockProfile)
    ):
        blocks = list(profile_blocks(source))  # type: ignore[arg-type]
        block_mem = [b.resident_bytes for b in blocks]
        block_names = [b.name for b in blocks]
        if blocks and all(b.forward_s is not None for b in blocks):
            return (
                [seconds_to_ns(b.forward_s or 0.0) for b in blocks],
                block_mem,
                block_names,
                "time",
            )
        return block_mem, block_mem, block_names, "bytes"
    costs = list(source)  # type: ignore[arg-type]
    return costs, list(mem) if mem is not None else costs, list(names) if names else None, "bytes"


def stages(
    source: ModelProfile | Sequence[BlockProfile] | Sequence[int],
    parts: int,
    mem_cap: int | None = None,
    *,
    mem: Sequence[int] | None = None,
    names: Sequence[str] | None = None,
) -> list[int]:
    """`parts` pipeline stages minimising the slowest (or, untimed, the largest), each within
    `mem_cap` bytes of parameters and buffers."""
    costs, block_mem, block_names, _ = stage_costs(source, mem=mem, names=names)
    return balance(costs, parts, mem=block_mem, mem_cap=mem_cap, names=block_names)


def auto_stages(
    source: ModelProfile | Sequence[BlockProfile] | Sequence[int],
    mem_cap: int,
    *,
    mem: Sequence[int] | None = None,
    names: Sequence[str] | None = None,
) -> list[int]:
    """The fewest stages that each fit `mem_cap`, then balanced like `stages`."""
    costs, block_mem, block_names, _ = stage_costs(source, mem=mem, names=names)
    parts = min_parts(block_mem, mem_cap, names=block_names)
    return balance(costs, parts, mem=block_mem, mem_cap=mem_cap, names=block_names)
