"""Exact contiguous partitioning of a chain of blocks: pure functions over integer cost lists.

No torch here: the broker and the tests call these directly. Training chunks are planned here
(a worker cuts its own jobs with them); the partitioner plans pipeline stages on the same
`balance` (`partitioner.stage_planners`).

Every planner returns *bounds*: a fencepost list `[0, b1, ..., n]` with one more entry than there
are parts, so part `i` is `blocks[bounds[i]:bounds[i + 1]]` (`split` does exactly that).

`balance` is the one algorithm: the smallest bottleneck (largest part's cost) is found by bisection
over integers; each probe asks a greedy question, "how few parts are needed if no part may cost more
than B (and hold more than `mem_cap`)?". For contiguous parts with additive non-negative costs the
greedy answer (each part takes as many blocks as fit) is exact, because taking more blocks never
leaves a suffix that is harder to split. Probes use prefix sums and `bisect`, so one costs
O(parts log n) and a 1,000-block plan takes about a millisecond.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from itertools import accumulate, pairwise
from typing import Any, TypeVar

from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.costs import BlockProfile, ModelProfile, human_bytes

T = TypeVar("T")


def _err(reason: str) -> FlowmeshError:
    return FlowmeshError(Code.PLAN_ERROR, reason)


def _block(i: int, names: Sequence[str] | None) -> str:
    return f"block {i} ({names[i]!r})" if names is not None else f"block {i}"


def _check_ints(values: Sequence[Any], what: str) -> list[int]:
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int):
            raise _err(
                f"{what}[{i}] is {v!r}: costs must be integers (convert seconds with seconds_to_ns)"
            )
        if v < 0:
            raise _err(f"{what}[{i}] is {v}: costs must not be negative")
        out.append(v)
    return out


def seconds_to_ns(seconds: float) -> int:
    """Times become integer nanoseconds so the bisection is exact."""
    return max(0, round(seconds * 1e9))


def split(items: Sequence[T], bounds: Sequence[int]) -> list[list[T]]:
    """`split([1, 2, 3, 4, 5, 6], [0, 4, 6]) == [[1, 2, 3, 4], [5, 6]]`."""
    return [list(items[a:b]) for a, b in pairwise(bounds)]


def part_sums(costs: Sequence[int], bounds: Sequence[int]) -> list[int]:
    return [sum(costs[a:b]) for a, b in pairwise(bounds)]


class _Prefix:
    """Prefix sums of costs (and memory) with the greedy step as one bisection each."""

    def __init__(self, costs: list[int], mem: list[int] | None, mem_cap: int | None) -> None:
        self.n = len(costs)
        self.cost = [0, *accumulate(costs)]
        self.mem = [0, *accumulate(mem)] if mem is not None and mem_cap is not None else None
        self.cap = mem_cap

    def reach(self, i: int, limit: int) -> int:
        """The furthest j such that blocks[i:j] costs at most `limit` and fits the memory cap."""
        j = bisect_right(self.cost, self.cost[i] + limit, i, self.n + 1) - 1
        if self.mem is not None:
            assert self.cap is not None
            j = min(j, bisect_right(self.mem, self.mem[i] + self.cap, i, self.n + 1) - 1)
        return j

    def parts_needed(self, limit: int, stop_after: int) -> int:
        """Fewest parts with no part over `limit`; counting stops past `stop_after`."""
        i = count = 0
        while i < self.n:
            j = self.reach(i, limit)
            if j == i:
                return self.n + 1  # one block alone is over the limit
            i, count = j, count + 1
            if count > stop_after:
                return count
        return count


def _validate(
    costs: Sequence[Any],
    mem: Sequence[Any] | None,
    mem_cap: int | None,
    names: Sequence[str] | None,
) -> tuple[list[int], list[int] | None]:
    if not costs:
        raise _err("nothing to partition: the chain has no blocks")
    c = _check_ints(costs, "costs")
    m = None
    if mem is not None:
        if len(mem) != len(c):
            raise _err(f"mem has {len(mem)} entries for {len(c)} blocks")
        m = _check_ints(mem, "mem")
    if mem_cap is not None:
        if isinstance(mem_cap, bool) or not isinstance(mem_cap, int) or mem_cap < 0:
            raise _err(f"mem_cap must be a non-negative integer number of bytes, got {mem_cap!r}")
        if m is None:
            raise _err("mem_cap needs per-block mem")
        for i, v in enumerate(m):
            if v > mem_cap:
                raise _err(
                    f"{_block(i, names)} needs {human_bytes(v)}, over the memory cap of "
                    f"{human_bytes(mem_cap)}: no partition can hold it"
                )
    if names is not None and len(names) != len(c):
        raise _err(f"{len(names)} names for {len(c)} blocks")
    return c, m


def min_parts(mem: Sequence[int], mem_cap: int, *, names: Sequence[str] | None = None) -> int:
    """The fewest contiguous parts whose sums of `mem` each stay within `mem_cap`."""
    m = _validate(mem, mem, mem_cap, names)[0]
    return _Prefix(m, m, mem_cap).parts_needed(sum(m), len(m))


def balance(
    costs: Sequence[int],
    parts: int,
    *,
    mem: Sequence[int] | None = None,
    mem_cap: int | None = None,
    names: Sequence[str] | None = None,
) -> list[int]:
    """Split `costs` into exactly `parts` contiguous non-empty parts, minimising the largest.

    Each part's sum of `mem` must stay within `mem_cap` (when given). Among the optimal splits
    the left-packed one is returned: each part takes as many blocks as it can while leaving at
    least one for every remaining part (the lexicographically largest bounds).
    """
    c, m = _validate(costs, mem, mem_cap, names)
    n = len(c)
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise _err(f"parts must be a positive integer, got {parts!r}")
    if parts > n:
        raise _err(f"cannot split {n} blocks into {parts} non-empty parts")
    if parts == n:  # one block per part: the only split there is (caps were checked above)
        return list(range(n + 1))
    prefix = _Prefix(c, m, mem_cap)
    total = prefix.cost[-1]
    if m is not None and mem_cap is not None:
        needed = prefix.parts_needed(total, n)
        if needed > parts:
            raise _err(
                f"{n} blocks holding {human_bytes(sum(m))} need at least {needed} parts under "
                f"the memory cap of {human_bytes(mem_cap)}, not {parts}"
            )
    # The optimum lies in [lo, hi]: no part is below the largest block or the mean, and filling
    # parts up to the mean overshoots by less than one block. With a memory cap the second bound
    # can fail, so fall back to the total (always feasible once the cap check above passed).
    lo = max(max(c), -(-total // parts))
    hi = min(total, lo + max(c))
    if prefix.parts_needed(hi, parts) > parts:
        hi = total
    while lo < hi:
        mid = (lo + hi) // 2
        if prefix.parts_needed(mid, parts) <= parts:
            hi = mid
        else:
            lo = mid + 1
    bounds, i = [0], 0
    for p in range(parts):
        j = min(prefix.reach(i, lo), n - (parts - p - 1))
        assert j > i, "a feasible bottleneck always lets a part take a block"
        bounds.append(j)
        i = j
    assert i == n, "the left-packed split covers every block at the optimal bottleneck"
    return bounds


def profile_blocks(source: ModelProfile | Sequence[BlockProfile]) -> Sequence[BlockProfile]:
    """The blocks of a profile, or the given blocks."""
    return source.blocks if isinstance(source, ModelProfile) else source


# -- training chunks -------------------------------------------------------------------------

# Without torch (this module is read by processes that have none): the states of the common
# optimizers. Whoever has torch counts any optimizer's with `flowmesh.optimizers.state_count`
# and passes it as `states`, which the planning functions below take in preference.
_OPTIMIZER_STATES = {"sgd": 0, "sgd_momentum": 1, "momentum": 1, "adam": 2, "adamw": 2}


def optimizer_states(optimizer: str | Mapping[str, Any], states: int | None = None) -> int:
    """Tensors the optimizer keeps per parameter: `states` when given (counted by
    `flowmesh.optimizers.state_count`), else sgd 0, sgd with momentum 1, adam/adamw 2.

    `optimizer` is a name or a mapping with "name" (or "type") and the optimizer's options:
    `{"name": "sgd", "momentum": 0.9}` keeps a momentum buffer, adam with `amsgrad` a third state.
    """
    if states is not None:
        if isinstance(states, bool) or not isinstance(states, int) or states < 0:
            raise _err(f"states must be a non-negative integer, got {states!r}")
        return states
    options: Mapping[str, Any] = {}
    if isinstance(optimizer, Mapping):
        options = optimizer
        optimizer = options.get("name", options.get("type", ""))
    if not isinstance(optimizer, str) or optimizer.lower() not in _OPTIMIZER_STATES:
        raise FlowmeshError(
            Code.BAD_REQUEST,
            f"optimizer {optimizer!r}: without torch, only "
            f"{', '.join(sorted(_OPTIMIZER_STATES))} are counted; count its states with "
            "flowmesh.optimizers.state_count",
        )
    name = optimizer.lower()
    count = _OPTIMIZER_STATES[name]
    if name == "sgd" and options.get("momentum"):
        count = 1
    if name in ("adam", "adamw") and options.get("amsgrad"):
        count = 3
    return count


def chunk_footprints(
    blocks: ModelProfile | Sequence[BlockProfile],
    optimizer: str | Mapping[str, Any],
    batch: int,
    states: int | None = None,
) -> tuple[list[int], int]:
    """Per-block training bytes and the per-chunk margin.

    A block in a training sub-model holds its parameters (shared ones too, since the chunk needs
    them even when another chunk owns them), their gradients and k optimizer states, its buffers,
    and the activations autograd saves for backward at the job's batch size:
        (param + shared) x (2 + k) + buffers + saved_per_sample x batch.
    Each chunk also holds the gradient arriving at its output and the one it sends back from its
    input; both are bounded by the model's largest block output, so the margin is
        2 x max(out_bytes_per_sample) x batch,
    the same for every chunk, which keeps footprints additive and the balancer exact.
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise _err(f"batch must be a positive integer, got {batch!r}")
    blocks = profile_blocks(blocks)
    if not blocks:
        raise _err("nothing to partition: the chain has no blocks")
    k = optimizer_states(optimizer, states)
    footprints = [
        (b.param_bytes + b.shared_bytes) * (2 + k)
        + b.buffer_bytes
        + b.saved_bytes_per_sample * batch
        for b in blocks
    ]
    margin = 2 * max(b.out_bytes_per_sample for b in blocks) * batch
    return footprints, margin


def chunks(
    target_bytes: int,
    blocks: ModelProfile | Sequence[BlockProfile],
    optimizer: str | Mapping[str, Any],
    batch: int,
    states: int | None = None,
) -> list[int]:
    """Contiguous training sub-models: the fewest whose footprint (see `chunk_footprints`) stays
    within `target_bytes`, then with the largest one as small as possible."""
    if isinstance(target_bytes, bool) or not isinstance(target_bytes, int) or target_bytes < 1:
        raise _err(f"target_bytes must be a positive integer, got {target_bytes!r}")
    footprints, margin = chunk_footprints(blocks, optimizer, batch, states)
    names = [b.name for b in profile_blocks(blocks)]
    cap = target_bytes - margin
    for i, fp in enumerate(footprints):
        if fp > cap:
            raise _err(
                f"{_block(i, names)} needs {human_bytes(fp + margin)} to train at batch {batch} "
                f"({human_bytes(fp)} for the block, {human_bytes(margin)} for boundary "
                f"gradients), over the target of {human_bytes(target_bytes)}: give the job more "
                "memory, a smaller batch or a finer-grained model"
            )
    parts = min_parts(footprints, cap, names=names)
    return balance(footprints, parts, mem=footprints, mem_cap=cap, names=names)


# -- pipelined training: stages of about even bytes, each resident on its worker


def even_cut(sizes: Sequence[int], stages: int) -> list[tuple[int, int]]:
    """Blocks of `sizes` bytes cut into `stages` contiguous ranges, each holding at least one
    block, whose largest holds the fewest bytes (`balance`): a pipelined job's stages (every
    stage's worker cuts its chain alike, `gpu_worker.pipe_stage.cut_even`, and the broker
    plans with the same cut)."""
    n = len(sizes)
    if not 1 <= stages <= n:
        raise FlowmeshError(
            Code.BAD_REQUEST,
            f"a pipeline of {stages} stages needs at least as many blocks; the model's chain "
            f"has {n}",
        )
    return list(pairwise(balance(list(sizes), stages)))


def stage_footprints(
    blocks: ModelProfile | Sequence[BlockProfile],
    ranges: Sequence[tuple[int, int]],
    optimizer: str | Mapping[str, Any],
    states: int | None = None,
) -> list[int]:
    """The device bytes each pipeline stage holds resident, as its worker counts them: its
    blocks' tensors (a tied tensor another block owns included, once per block: an upper
    bound; buffers outside the state_dict too) and its parameters' gradients and `k`
    optimizer states,
        sum(param + buffer + shared + transient) + sum(param) x (1 + k);
    activations come on top, per micro-batch in flight."""
    blocks = profile_blocks(blocks)
    k = optimizer_states(optimizer, states)
    return [
        sum(b.resident_bytes + b.transient_bytes + b.param_bytes * (1 + k) for b in blocks[a:z])
        for a, z in ranges
    ]


def pipeline_stages(
    blocks: ModelProfile | Sequence[BlockProfile],
    free: Sequence[int],
    optimizer: str | Mapping[str, Any],
    states: int | None = None,
) -> tuple[list[tuple[int, int]], list[int]] | None:
    """The fewest stages whose resident footprints fit workers with `free` training bytes
    (largest first; stage i on the i-th), with their footprints; None when no count of stages
    up to the workers' and the blocks' does. One stage: the job fits one worker whole."""
    blocks = profile_blocks(blocks)
    sizes = [b.resident_bytes for b in blocks]
    free = sorted(free, reverse=True)
    for k in range(1, min(len(free), len(blocks)) + 1):
        ranges = even_cut(sizes, k)
        fps = stage_footprints(blocks, ranges, optimizer, states)
        if all(fp <= cap for fp, cap in zip(fps, free, strict=False)):
            return ranges, fps
    return None
