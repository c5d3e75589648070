"""Checks on what peers report, before the broker stores it: heartbeat stats and plans.

A peer is trusted to be a flowmesh process, not to be bug-free: a bad value is refused on receipt
(BAD_REQUEST or PLAN_ERROR naming it) rather than breaking a later status call or placement.
"""

from __future__ import annotations

from typing import Any

from broker.context import fail
from flowmesh.errors import Code

MAX_STATS_ITEMS = 16_384  # a worker lists each stage it holds
MAX_STATS_DEPTH = 3


def check_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """Heartbeat stats as a peer may report them: plain scalars, lists and maps of them, bounded.

    They are stored and shown by status() to every client, so a bad value is refused on receipt
    rather than breaking every later status call.
    """
    count = 0

    def walk(value: Any, where: str, depth: int) -> None:
        nonlocal count
        count += 1
        if count > MAX_STATS_ITEMS:
            raise fail(Code.BAD_REQUEST, f"heartbeat stats: more than {MAX_STATS_ITEMS} values")
        if value is None or isinstance(value, bool | str):
            return
        if isinstance(value, int | float):
            if value != value or value in (float("inf"), float("-inf")):
                raise fail(Code.BAD_REQUEST, f"heartbeat stats {where}: not a finite number")
            return
        if depth >= MAX_STATS_DEPTH or not isinstance(value, list | dict):
            raise fail(
                Code.BAD_REQUEST,
                f"heartbeat stats {where}: {type(value).__name__} is not allowed here",
            )
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            walk(v, f"{where}.{k}", depth + 1)

    for key, value in stats.items():
        walk(value, key, 1)
    for key in ("peak_bytes", "host_bytes"):
        v = stats.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise fail(Code.BAD_REQUEST, f"heartbeat stats {key}: expected a byte count")
    return stats


def check_plan(plan: dict[str, Any]) -> list[int]:
    """The stage sizes of a partitioner's plan, or BAD_REQUEST naming what is wrong with it."""
    sizes = plan.get("range_bytes")
    ranges = plan.get("ranges", [])
    if (
        not isinstance(sizes, list)
        or not sizes
        or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in sizes)
    ):
        raise fail(Code.PLAN_ERROR, "plan: range_bytes must be a non-empty list of byte counts")
    if not isinstance(ranges, list) or (ranges and len(ranges) != len(sizes)):
        raise fail(Code.PLAN_ERROR, "plan: ranges must give one [first, end) per stage")
    return [int(b) for b in sizes]


def check_seconds(info: dict[str, Any], key: str) -> float:
    """A duration a worker reports in a run_result's info: finite, not negative."""
    v = info.get(key, 0.0)
    if isinstance(v, bool) or not isinstance(v, int | float) or not (0 <= v < float("inf")):
        raise fail(Code.BAD_REQUEST, f"run_result info {key}: expected seconds, got {v!r}")
    return float(v)
