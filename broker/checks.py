"""Checks on what peers report that their message types cannot say, before the broker stores it:
how many heartbeat stats there are and the byte counts status reads.

A peer is trusted to be a flowmesh process, not to be bug-free: a bad value is refused on receipt
(BAD_REQUEST naming it) rather than breaking a later status call or placement.
"""

from __future__ import annotations

from broker.context import fail
from flowmesh import protocol as p
from flowmesh.errors import Code

MAX_STATS_ITEMS = 16_384  # a worker lists each stage it holds


def check_stats(stats: p.Stats) -> p.Stats:
    """Heartbeat stats, bounded: their types (plain scalars, lists and maps of them, three
    levels deep, numbers finite) are checked on receipt (`p.Stats`); here, how many values
    there are and the byte counts status reads.

    They are stored and shown by status() to every client, so a bad value is refused on receipt
    rather than breaking every later status call.
    """
    count = 0
    for value in stats.values():
        count += 1
        items = value.values() if isinstance(value, dict) else value
        if isinstance(items, list | type({}.values())):
            for item in items:
                count += 1 + (len(item) if isinstance(item, list | dict) else 0)
    if count > MAX_STATS_ITEMS:
        raise fail(Code.BAD_REQUEST, f"heartbeat stats: more than {MAX_STATS_ITEMS} values")
    counts = ("peak_bytes", "host_bytes", "kv_bytes", "kv_blocks", "kv_seqs", "kv_limit_bytes")
    for key in (*counts, "kv_blocks_free"):
        if not _is_count(stats.get(key, 0)):
            raise fail(Code.BAD_REQUEST, f"heartbeat stats {key}: expected a byte count")
    per_stage = stats.get("kv_stage_bytes", {})
    if not isinstance(per_stage, dict) or not all(_is_count(v) for v in per_stage.values()):
        raise fail(Code.BAD_REQUEST, "heartbeat stats kv_stage_bytes: expected byte counts")
    return stats


def _is_count(v: object) -> bool:
    return not isinstance(v, bool) and isinstance(v, int) and v >= 0
